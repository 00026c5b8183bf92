// The directory chunk store: chunk N is the file ROOT/<hex(N)>, written under
// a ".tmp-" name, fsynced and renamed into place, so a crash mid-write leaves
// a complete chunk or a temporary file no reader looks at.
//
// Nothing under a chunk's name is trusted: it is examined with lstat and
// opened with O_NOFOLLOW | O_NONBLOCK (a symlink is never followed, a FIFO
// never blocks), and whatever is not the chunk is replaced on the next put.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/file_read.h"
#include "cpu/parallel.h"
#include "file_io.h"
#include "kvring/chunk_store.h"
#include "pack_common.h"

namespace kvring {

namespace {

using namespace pack_internal;
using file_internal::file_type_name;

constexpr const char* kTempPrefix = ".tmp-";
constexpr const char* kQuarantinePrefix = ".quarantine-";
constexpr const char* kProbeName = "probe";
// The longest name a put creates in the root (unique_name's): the longer
// prefix, a chunk's 64-digit name, then '-' and the pid, counter and clock
// at their widest (10, 20 and 10 digits).
constexpr std::size_t kLongestOwnName = std::char_traits<char>::length(kQuarantinePrefix) + 64 + 3 + 10 + 20 + 10;

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// True for the names unique_name(root, prefix, what) makes, `what` a chunk's
// name or (with `probe_too`) the write probe's: prefix, what, then the
// pid, the counter and the clock, each decimal after a '-'. Nothing else in
// a store's directory is the store's own to remove.
bool is_unique_name(std::string_view name, std::string_view prefix, bool probe_too) {
  if (!name.starts_with(prefix)) return false;
  name.remove_prefix(prefix.size());
  const std::size_t dash = name.find('-');
  if (dash == std::string_view::npos) return false;
  const std::string_view what = name.substr(0, dash);
  if (!is_chunk_name(what) && !(probe_too && what == kProbeName)) return false;
  name.remove_prefix(dash + 1);
  for (int field = 0; field < 3; ++field) {
    const std::size_t end = field < 2 ? name.find('-') : name.size();
    if (end == std::string_view::npos || !all_digits(name.substr(0, end))) return false;
    name.remove_prefix(field < 2 ? end + 1 : end);
  }
  return true;
}

// A name in the store's directory no other writer (thread or process) uses
// at the same time: `prefix`, the chunk's name, the pid, a counter, a clock.
std::string unique_name(const std::string& root, const char* prefix, const std::string& what) {
  static std::atomic<std::uint64_t> counter{0};
  const auto ticks = static_cast<std::uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  return root + "/" + prefix + what + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + "-" + std::to_string(ticks % 1000000007u);
}

// Indexes of `chunks` with distinct names (a pack may hold equal chunks).
std::vector<std::size_t> distinct(std::span<const ChunkData> chunks) {
  std::vector<std::size_t> order(chunks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return chunks[a].name < chunks[b].name; });
  order.erase(std::unique(order.begin(), order.end(),
                          [&](std::size_t a, std::size_t b) { return chunks[a].name == chunks[b].name; }),
              order.end());
  return order;
}

class DirStore final : public ChunkStore {
 public:
  DirStore(std::string root, IoOptions io) : root_(std::move(root)), io_(std::move(io)) {}

  std::string spec() const override { return "dir:" + root_; }

  Status put(std::span<const ChunkData> chunks) override {
    const std::vector<std::size_t> todo = distinct(chunks);
    std::vector<Status> status(todo.size());
    std::int64_t bytes = 0;
    for (std::size_t i : todo) bytes += static_cast<std::int64_t>(chunks[i].size());
    cpu::parallel_for(static_cast<std::int64_t>(todo.size()), bytes, [&](std::int64_t t) {
      const ChunkData& c = chunks[todo[static_cast<std::size_t>(t)]];
      const std::string path = path_of(c.name);
      // Already stored only if the name holds a regular file of bytes that
      // hash to the name: a damaged or planted file of the right size must
      // not stop the true bytes from being written. Anything else is replaced.
      struct stat st {};
      if (::lstat(path.c_str(), &st) == 0) {
        if (S_ISREG(st.st_mode) && static_cast<std::size_t>(st.st_size) == c.size() &&
            holds(c.name, c.size()))
          return;
        if (Status s = clear_name(path, st); !s.ok()) {
          status[static_cast<std::size_t>(t)] = s;
          return;
        }
      }
      status[static_cast<std::size_t>(t)] = write_chunk(path, c);
    });
    KVRING_RETURN_IF_ERROR(first_error(status));
    // One directory sync makes every rename above, and any earlier put's
    // that a crash cut short, durable.
    return fsync_dir(root_, io_);
  }

  // True when the file stored under `name` has `size` bytes hashing to it.
  bool holds(const Digest& name, std::size_t size) const {
    std::vector<std::uint8_t> bytes(size);
    return read_raw(name, bytes).ok() && sha256(bytes.data(), bytes.size()) == name;
  }

  // False only when nothing has the name. Only a regular file is a chunk:
  // anything else under the name (a symlink, a directory, a FIFO) is
  // kCorruption, named, as read_raw names it.
  Result<bool> contains(const Digest& name) const override {
    struct stat st {};
    if (::lstat(path_of(name).c_str(), &st) == 0) {
      if (S_ISREG(st.st_mode)) return true;
      return corruption(spec() + ": chunk " + to_hex(name) + " is " + file_type_name(st.st_mode) +
                        ", not a chunk file");
    }
    if (errno == ENOENT) return false;
    return io_error(spec() + ": checking chunk " + to_hex(name) + ": " + errno_text(errno));
  }

  // A file with holes (fewer blocks on disk than its size) costs whoever
  // planted it nothing for the bytes it claims, and a reader sizes its rows
  // by this answer: such a file is hashed here, through a bounded buffer,
  // and answers kCorruption unless its bytes are the chunk. A file wholly a
  // hole reads as zeros and is not read: its bytes hash to the SHA-256 of
  // that many zeros (zeros_digest). (A filesystem that compresses may show
  // chunk files so too; they are then read twice.)
  Status check_stored(const Digest& name, std::int64_t bytes) const override {
    struct stat st {};
    if (::lstat(path_of(name).c_str(), &st) != 0) {
      if (errno == ENOENT) return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
      return io_error(spec() + ": checking chunk " + to_hex(name) + ": " + errno_text(errno));
    }
    KVRING_RETURN_IF_ERROR(check_file(name, st, bytes));
    if (static_cast<std::int64_t>(st.st_blocks) * 512 >= static_cast<std::int64_t>(st.st_size)) return Status::Ok();
    return hash_in_pieces(name, bytes);
  }

  Status erase(const Digest& name) override {
    if (::unlink(path_of(name).c_str()) != 0 && errno != ENOENT)
      return io_error(spec() + ": removing chunk " + to_hex(name) + ": " + errno_text(errno));
    return fsync_dir(root_, io_);
  }

  Status check_writable() const override {
    // Past PATH_MAX the kernel refuses a put's names however writable the
    // directory is.
    if (root_.size() + 1 + kLongestOwnName >= PATH_MAX)
      return io_error(spec() + ": cannot write into the store: its path is " + std::to_string(root_.size()) +
                      " bytes, and a chunk's temporary name in it would pass the system's path limit of " +
                      std::to_string(PATH_MAX) + " bytes");
    const std::string probe = unique_name(root_, kTempPrefix, kProbeName);
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return io_error(spec() + ": cannot write into the store: " + errno_text(errno));
    ::close(fd);
    ::unlink(probe.c_str());
    return Status::Ok();
  }

  Result<StoreStats> stats() const override {
    DIR* d = ::opendir(root_.c_str());
    if (d == nullptr) return io_error(spec() + ": cannot list: " + errno_text(errno));
    StoreStats s;
    while (const dirent* e = ::readdir(d)) {
      if (!is_chunk_name(e->d_name)) continue;
      struct stat st {};
      if (::lstat((root_ + "/" + e->d_name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      ++s.chunks;
      // A sparse file may claim up to 2^63 - 1 bytes: the sum is checked.
      if (__builtin_add_overflow(s.bytes, static_cast<std::int64_t>(st.st_size), &s.bytes)) {
        const std::string name = e->d_name;
        ::closedir(d);
        return io_error(spec() + ": the chunk files' sizes add up past 2^63 bytes (chunk " + name + " claims " +
                        std::to_string(st.st_size) + " bytes; sparse files?)");
      }
    }
    ::closedir(d);
    return s;
  }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    const std::string path = path_of(name);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT) return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
      if (err == ELOOP)
        return corruption(spec() + ": chunk " + to_hex(name) + " is " + file_type_name(S_IFLNK) + ", not a chunk file");
      return io_error(spec() + ": opening chunk " + to_hex(name) + ": " + errno_text(err));
    }
    struct stat st {};
    Status s;
    if (::fstat(fd, &st) != 0)
      s = io_error(spec() + ": chunk " + to_hex(name) + ": " + errno_text(errno));
    else
      s = check_file(name, st, static_cast<std::int64_t>(dst.size()));
    if (s.ok()) s = pread_all(fd, dst.data(), static_cast<std::int64_t>(dst.size()), 0, path);
    ::close(fd);
    return s;
  }

 private:
  std::string path_of(const Digest& name) const { return root_ + "/" + to_hex(name); }

  // The file under `name` (`bytes` long) hashes to `name`, read in bounded
  // pieces.
  Status hash_in_pieces(const Digest& name, std::int64_t bytes) const {
    const std::string path = path_of(name);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return io_error(spec() + ": opening chunk " + to_hex(name) + ": " + errno_text(errno));
    struct stat st {};
    Status s = ::fstat(fd, &st) != 0 ? io_error(spec() + ": chunk " + to_hex(name) + ": " + errno_text(errno))
                                     : check_file(name, st, bytes);
    Result<Digest> got = !s.ok()                     ? Result<Digest>(s)
                         : range_in_hole(fd, 0, bytes) ? Result<Digest>(zeros_digest(bytes))
                                                       : sha256_in_pieces(bytes, [&](std::int64_t at, std::int64_t n,
                                                                                     std::uint8_t* dst) {
                                                           return pread_all(fd, dst, n, at, path);
                                                         });
    ::close(fd);
    if (!got) return got.error();
#if !defined(FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION)
    if (*got != name)
      return corruption(spec() + ": chunk " + to_hex(name) + " is a file with holes whose bytes hash to " +
                        to_hex(*got) + " (damaged or planted)");
#endif
    return Status::Ok();
  }

  // The SHA-256 of `bytes` zero bytes. The last kZeroLengthsKept lengths'
  // digests are kept, and one is computed under the lock, so checks of many
  // chunk files of holes (a verify's, on every core) hash each length's
  // zeros once, not once a file: a chunk's length follows from its rows,
  // and a pack's chunks have few lengths.
  Digest zeros_digest(std::int64_t bytes) const {
    const std::lock_guard<std::mutex> lock(zeros_mu_);
    for (const auto& [n, digest] : zeros_)
      if (n == bytes) return digest;
    const Digest digest = sha256_of_zeros({bytes}).front();
    if (zeros_.size() == kZeroLengthsKept) zeros_.erase(zeros_.begin());
    zeros_.emplace_back(bytes, digest);
    return digest;
  }

  // A chunk file is a regular file of the chunk's size.
  Status check_file(const Digest& name, const struct stat& st, std::int64_t bytes) const {
    if (!S_ISREG(st.st_mode))
      return corruption(spec() + ": chunk " + to_hex(name) + " is " + file_type_name(st.st_mode) +
                        ", not a chunk file");
    if (static_cast<std::int64_t>(st.st_size) != bytes)
      return corruption(spec() + ": chunk " + to_hex(name) + " holds " + std::to_string(st.st_size) +
                        " bytes, the pack expects " + std::to_string(bytes));
    return Status::Ok();
  }

  // Frees a chunk's name of whatever is not a regular file. A directory may
  // hold someone's files: it is renamed aside (".quarantine-<name>-..."),
  // never emptied, and left for its owner. A symlink, a FIFO, a socket or a
  // device node is only a name in the store's namespace and is unlinked
  // (unlink never follows a symlink). A regular file is left for the
  // chunk's rename to replace.
  Status clear_name(const std::string& path, const struct stat& st) const {
    if (S_ISREG(st.st_mode)) return Status::Ok();
    if (S_ISDIR(st.st_mode)) {
      const std::string aside = unique_name(root_, kQuarantinePrefix, path.substr(root_.size() + 1));
      if (::rename(path.c_str(), aside.c_str()) != 0 && errno != ENOENT)
        return io_error(spec() + ": a directory is in the place of chunk " + path +
                        " and cannot be moved aside: " + errno_text(errno));
      return Status::Ok();
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      return io_error(spec() + ": cannot remove the non-file in the place of chunk " + path + ": " +
                      errno_text(errno));
    return Status::Ok();
  }

  // Writes a chunk under a temporary name and renames it into place. The
  // writer holds an exclusive flock on the temporary from its creation to
  // after the rename: gc_dir_store removes only temporaries nobody holds.
  Status write_chunk(const std::string& path, const ChunkData& c) const {
    const std::string temp = unique_name(root_, kTempPrefix, path.substr(root_.size() + 1));
    KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kOpen, temp));
    // Listed before it exists and until after it is renamed or gone, so a
    // signal that ends the program removes it (file_io.h).
    const int tracked = track_temporary(temp);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      const int err = errno;
      untrack_temporary(tracked);
      return io_error("creating " + temp + " (for " + path + "): " + errno_text(err));
    }
    bool renamed = false;
    auto step = [&]() -> Status {
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0)
        return io_error("locking " + temp + ": " + errno_text(errno));
      KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kWrite, temp));
      KVRING_RETURN_IF_ERROR(pwrite_all(fd, c.part1.data(), static_cast<std::int64_t>(c.part1.size()), 0, temp));
      KVRING_RETURN_IF_ERROR(pwrite_all(fd, c.part2.data(), static_cast<std::int64_t>(c.part2.size()),
                                        static_cast<std::int64_t>(c.part1.size()), temp));
      KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kFsync, temp));
      if (::fsync(fd) != 0) return io_error("syncing " + temp + ": " + errno_text(errno));
      KVRING_RETURN_IF_ERROR(inject(io_, IoStep::kRename, path));
      if (::rename(temp.c_str(), path.c_str()) != 0)
        return io_error("renaming " + temp + " to " + path + ": " + errno_text(errno));
      renamed = true;
      return Status::Ok();
    };
    const Status s = step();
    if (!renamed) ::unlink(temp.c_str());
    untrack_temporary(tracked);
    if (::close(fd) != 0 && s.ok()) return io_error("closing " + path + ": " + errno_text(errno));
    return s;
  }

  static constexpr std::size_t kZeroLengthsKept = 16;

  std::string root_;
  IoOptions io_;
  mutable std::mutex zeros_mu_;
  mutable std::vector<std::pair<std::int64_t, Digest>> zeros_;
};

}  // namespace

Result<DirStoreGcReport> gc_dir_store(const std::string& path, std::chrono::seconds min_age) {
  std::string root = path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  DIR* d = ::opendir(root.c_str());
  if (d == nullptr) return io_error("chunk store dir:" + root + ": cannot list: " + errno_text(errno));
  DirStoreGcReport report;
  Status failed;
  const auto now = std::chrono::system_clock::now();
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const std::string full = root + "/" + name;
    if (is_unique_name(name, kQuarantinePrefix, false)) {
      ++report.quarantined;
      continue;
    }
    if (!is_unique_name(name, kTempPrefix, true)) continue;
    struct stat st {};
    if (::lstat(full.c_str(), &st) != 0) continue;  // renamed into place meanwhile
    if (S_ISLNK(st.st_mode)) {
      // No writer creates one; unlinking a symlink never touches its target.
      if (::unlink(full.c_str()) == 0) ++report.removed;
      continue;
    }
    if (!S_ISREG(st.st_mode)) continue;
    const int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    // The lock is taken before the age is read and held over the unlink, so
    // a writer that still owns the file cannot be between the two.
    bool removed = false;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &st) == 0) {
      const auto modified = std::chrono::system_clock::time_point(
          std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec));
      if (now - modified >= min_age) {
        if (::unlink(full.c_str()) == 0) removed = true;
        else if (errno != ENOENT && failed.ok())
          failed = io_error("chunk store dir:" + root + ": removing " + name + ": " + errno_text(errno));
      }
    }
    ::close(fd);
    ++(removed ? report.removed : report.kept);
  }
  ::closedir(d);
  KVRING_RETURN_IF_ERROR(failed);
  if (report.removed > 0) KVRING_RETURN_IF_ERROR(fsync_dir(root, {}));
  return report;
}

Result<std::unique_ptr<ChunkStore>> open_dir_store(const std::string& path, IoOptions io) {
  std::string root = path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (io.create && ::mkdir(root.c_str(), 0755) != 0 && errno != EEXIST)
    return io_error("chunk store dir:" + root + ": cannot create the directory: " + errno_text(errno));
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0 && !io.create)
    return make_error(ErrorCode::kNotFound, "chunk store dir:" + root + ": " + errno_text(errno));
  if (!S_ISDIR(st.st_mode)) return io_error("chunk store dir:" + root + " is not a directory");
  return std::unique_ptr<ChunkStore>(new DirStore(std::move(root), std::move(io)));
}

}  // namespace kvring
