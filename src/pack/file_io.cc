#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <utility>

#include "core/file_read.h"

namespace kvring::pack_internal {

std::string errno_text(int err) { return std::strerror(err); }

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status inject(const IoOptions& io, IoStep step, const std::string& path) {
  if (!io.fault) return Status::Ok();
  const Status s = io.fault(step, path);
  if (s.ok()) return s;
  Error e = s.error();
  e.message = std::string(io_step_name(step)) + " of " + path + " failed: " + e.message;
  return e;
}

Status pread_all(int fd, std::uint8_t* dst, std::int64_t n, std::int64_t offset,
                 const std::string& path) {
  std::int64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, dst + done, static_cast<std::size_t>(n - done), offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error("reading " + path + " at byte " + std::to_string(offset + done) + ": " +
                      errno_text(errno));
    }
    if (r == 0)
      return corruption(path + ": ends at byte " + std::to_string(offset + done) + ", needed " +
                        std::to_string(n - done) + " more bytes");
    done += r;
  }
  return Status::Ok();
}

Status pwrite_all(int fd, const std::uint8_t* src, std::int64_t n, std::int64_t offset,
                  const std::string& path) {
  std::int64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pwrite(fd, src + done, static_cast<std::size_t>(n - done), offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return io_error("writing " + path + ": " + errno_text(errno) + " (wrote " +
                      std::to_string(done) + " of " + std::to_string(n) + " bytes at offset " +
                      std::to_string(offset) + ")");
    }
    // A zero-byte write of a non-empty range would loop forever; treat it as
    // the device refusing more data.
    if (r == 0)
      return io_error("writing " + path + ": no progress (wrote " + std::to_string(done) +
                      " of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                      ")");
    done += r;
  }
  return Status::Ok();
}

bool range_in_hole(int fd, std::int64_t offset, std::int64_t n) {
  if (offset < 0 || n <= 0 || offset > std::numeric_limits<std::int64_t>::max() - n) return false;
  const off_t data = ::lseek(fd, static_cast<off_t>(offset), SEEK_DATA);
  if (data >= 0) return data >= offset + n;
  struct stat st {};
  return errno == ENXIO && ::fstat(fd, &st) == 0 && st.st_size >= offset + n;
}

Status fsync_dir(const std::string& dir, const IoOptions& io) {
  KVRING_RETURN_IF_ERROR(inject(io, IoStep::kFsyncDir, dir));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("opening directory " + dir + " to sync it: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return io_error("syncing directory " + dir + ": " + errno_text(err));
  return Status::Ok();
}

namespace {

// A temporary name no other writer (thread or process) uses at the same
// time (the pid, a counter and a clock make it so). It keeps at most the
// first 100 bytes of the file's name, so that a name the file system takes
// (up to 255 bytes) leaves room for the rest.
std::string temp_name_for(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  const auto slash = path.find_last_of('/');
  const std::string base = (slash == std::string::npos ? path : path.substr(slash + 1)).substr(0, 100);
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const auto ticks = static_cast<std::uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  return dir + ".tmp-" + base + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + "-" + std::to_string(ticks % 1000000007u);
}

// The live temporaries' names, readable from a signal handler: a slot's
// name is written while its state is kWriting, after its generation moved
// on; the handler reads the generation, then the state (kLive), copies the
// name and uses it only if both are unchanged (a slot freed, or freed and
// taken again, meanwhile is skipped).
// A slot's `text`, where `holds` is set, is what the file must hold to be
// removed (track_file_holding).
constexpr std::size_t kTrackedPathBytes = 4096;
enum : int { kFree = 0, kWriting = 1, kLive = 2 };
struct TrackedTemporary {
  std::atomic<int> state{kFree};
  std::atomic<std::uint64_t> generation{0};
  char path[kTrackedPathBytes] = {};
  bool holds = false;
  std::size_t text_bytes = 0;
  char text[kTrackedTextBytes] = {};
};
TrackedTemporary g_tracked[kTrackedTemporaries];

int track(const std::string& path, const std::string_view* text) {
  if (path.size() >= kTrackedPathBytes || (text != nullptr && text->size() > kTrackedTextBytes)) return -1;
  for (int i = 0; i < kTrackedTemporaries; ++i) {
    TrackedTemporary& t = g_tracked[i];
    int expected = kFree;
    if (!t.state.compare_exchange_strong(expected, kWriting, std::memory_order_acq_rel)) continue;
    t.generation.fetch_add(1, std::memory_order_relaxed);
    // The new generation is seen before any byte written below (a reader
    // that copies them sees the generation moved on).
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(t.path, path.c_str(), path.size() + 1);
    t.holds = text != nullptr;
    t.text_bytes = text != nullptr ? text->size() : 0;
    if (text != nullptr) std::memcpy(t.text, text->data(), text->size());
    t.state.store(kLive, std::memory_order_release);
    return i;
  }
  return -1;
}

// Whether the file at `path` holds exactly `text`: open, read and close
// only (async-signal-safe); a link is not followed.
bool file_holds(const char* path, const char* text, std::size_t bytes) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  char got[kTrackedTextBytes + 1];
  std::size_t n = 0;
  while (n < sizeof got) {
    const ssize_t r = ::read(fd, got + n, sizeof got - n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    n += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return n == bytes && std::memcmp(got, text, bytes) == 0;
}

}  // namespace

int track_temporary(const std::string& temp) { return track(temp, nullptr); }

int track_file_holding(const std::string& path, std::string_view text) { return track(path, &text); }

void untrack_temporary(int slot) {
  if (slot >= 0) g_tracked[slot].state.store(kFree, std::memory_order_release);
}

void remove_file_holding(const std::string& path, std::string_view text) {
  if (text.size() <= kTrackedTextBytes && file_holds(path.c_str(), text.data(), text.size()))
    ::unlink(path.c_str());
}

void remove_live_temporaries() noexcept {
  const int saved_errno = errno;
  char path[kTrackedPathBytes];
  char text[kTrackedTextBytes];
  for (TrackedTemporary& t : g_tracked) {
    const std::uint64_t g = t.generation.load(std::memory_order_acquire);
    if (t.state.load(std::memory_order_acquire) != kLive) continue;
    std::memcpy(path, t.path, sizeof path);
    path[sizeof path - 1] = '\0';
    const bool holds = t.holds;
    const std::size_t text_bytes = std::min(t.text_bytes, sizeof text);
    std::memcpy(text, t.text, sizeof text);
    // The copy's reads complete before the state and generation are read
    // again.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (t.state.load(std::memory_order_acquire) != kLive || t.generation.load(std::memory_order_acquire) != g)
      continue;
    if (!holds || file_holds(path, text, text_bytes)) ::unlink(path);
  }
  errno = saved_errno;
}

Result<std::unique_ptr<AtomicFile>> AtomicFile::create(const std::string& path,
                                                       const IoOptions& io) {
  // Renaming over a device or a directory would replace it (and /dev is
  // writable by root): only a regular file, or nothing, may be replaced.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return invalid_argument("refusing to write " + path + ": it is " + file_internal::file_type_name(st.st_mode) +
                            ", not a regular file");
  // A name its directory cannot hold fails here, not at the rename after a
  // whole file was written under the (shorter) temporary name.
  const auto slash = path.find_last_of('/');
  const std::size_t name_bytes = slash == std::string::npos ? path.size() : path.size() - slash - 1;
  const long name_max = ::pathconf(parent_dir(path).c_str(), _PC_NAME_MAX);
  const std::size_t most = name_max > 0 ? static_cast<std::size_t>(name_max) : 255;
  if (name_bytes == 0)
    return invalid_argument("refusing to write '" + path + "': it names no file");
  if (name_bytes > most)
    return invalid_argument("refusing to write " + path + ": its name is " + std::to_string(name_bytes) +
                            " bytes, more than the " + std::to_string(most) + " its directory takes");
  const std::string temp = temp_name_for(path);
  KVRING_RETURN_IF_ERROR(inject(io, IoStep::kOpen, temp));
  // Listed before it exists and until after it is gone, so a signal
  // between never leaves it.
  const int tracked = track_temporary(temp);
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    untrack_temporary(tracked);
    return io_error("creating " + temp + " (for " + path + "): " + errno_text(err));
  }
  std::unique_ptr<AtomicFile> f(new AtomicFile(path, temp, fd, io));
  f->tracked_ = tracked;
  return f;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
  untrack_temporary(tracked_);
}

Status AtomicFile::write_at(std::int64_t offset, std::span<const std::uint8_t> bytes) const {
  KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kWrite, temp_));
  return pwrite_all(fd_, bytes.data(), static_cast<std::int64_t>(bytes.size()), offset, temp_);
}

Status AtomicFile::commit(bool sync_dir) {
  KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kFsync, temp_));
  if (::fsync(fd_) != 0) return io_error("syncing " + temp_ + ": " + errno_text(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return io_error("closing " + temp_ + ": " + errno_text(errno));
  KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kRename, path_));
  if (::rename(temp_.c_str(), path_.c_str()) != 0)
    return io_error("renaming " + temp_ + " to " + path_ + ": " + errno_text(errno));
  committed_ = true;
  untrack_temporary(std::exchange(tracked_, -1));
  if (sync_dir) return fsync_dir(parent_dir(path_), io_);
  return Status::Ok();
}

}  // namespace kvring::pack_internal
