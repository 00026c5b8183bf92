// The directory chunk store: chunk N is the file ROOT/<hex(N)>, written under
// a ".tmp-" name, fsynced and renamed into place, so a crash mid-write leaves
// a complete chunk or a temporary file no reader looks at.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "cpu/parallel.h"
#include "file_io.h"
#include "kvring/chunk_store.h"
#include "pack_common.h"

namespace kvring {

namespace {

using namespace pack_internal;

bool is_chunk_name(const char* name) {
  std::size_t n = 0;
  for (; name[n] != '\0'; ++n)
    if (!((name[n] >= '0' && name[n] <= '9') || (name[n] >= 'a' && name[n] <= 'f'))) return false;
  return n == 2 * kDigestBytes;
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
      // Already stored only if the file under the name holds bytes that
      // hash to the name: a damaged or planted file of the right size must
      // not stop the true bytes from being written. Anything else is replaced.
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
          static_cast<std::size_t>(st.st_size) == c.size() && holds(c.name, c.size()))
        return;
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

  Result<bool> contains(const Digest& name) const override {
    struct stat st {};
    if (::stat(path_of(name).c_str(), &st) == 0) return true;
    if (errno == ENOENT) return false;
    return io_error(spec() + ": checking chunk " + to_hex(name) + ": " + errno_text(errno));
  }

  Status erase(const Digest& name) override {
    if (::unlink(path_of(name).c_str()) != 0 && errno != ENOENT)
      return io_error(spec() + ": removing chunk " + to_hex(name) + ": " + errno_text(errno));
    return fsync_dir(root_, io_);
  }

  Result<StoreStats> stats() const override {
    DIR* d = ::opendir(root_.c_str());
    if (d == nullptr) return io_error(spec() + ": cannot list: " + errno_text(errno));
    StoreStats s;
    while (const dirent* e = ::readdir(d)) {
      if (!is_chunk_name(e->d_name)) continue;
      struct stat st {};
      if (::stat((root_ + "/" + e->d_name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      ++s.chunks;
      s.bytes += st.st_size;
    }
    ::closedir(d);
    return s;
  }

 protected:
  Status read_raw(const Digest& name, std::span<std::uint8_t> dst) const override {
    const std::string path = path_of(name);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT) return make_error(ErrorCode::kNotFound, spec() + ": chunk " + to_hex(name) + " is missing");
      return io_error(spec() + ": opening chunk " + to_hex(name) + ": " + errno_text(err));
    }
    struct stat st {};
    Status s;
    if (::fstat(fd, &st) != 0)
      s = io_error(spec() + ": chunk " + to_hex(name) + ": " + errno_text(errno));
    else if (static_cast<std::size_t>(st.st_size) != dst.size())
      s = corruption(spec() + ": chunk " + to_hex(name) + " holds " + std::to_string(st.st_size) +
                     " bytes, the pack expects " + std::to_string(dst.size()));
    else
      s = pread_all(fd, dst.data(), static_cast<std::int64_t>(dst.size()), 0, path);
    ::close(fd);
    return s;
  }

 private:
  std::string path_of(const Digest& name) const { return root_ + "/" + to_hex(name); }

  Status write_chunk(const std::string& path, const ChunkData& c) const {
    auto file = AtomicFile::create(path, io_);
    if (!file) return file.error();
    KVRING_RETURN_IF_ERROR((*file)->write_at(0, c.part1));
    if (!c.part2.empty())
      KVRING_RETURN_IF_ERROR((*file)->write_at(static_cast<std::int64_t>(c.part1.size()), c.part2));
    return (*file)->commit(/*sync_dir=*/false);
  }

  std::string root_;
  IoOptions io_;
};

}  // namespace

Result<std::unique_ptr<ChunkStore>> open_dir_store(const std::string& path, IoOptions io) {
  std::string root = path;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (::mkdir(root.c_str(), 0755) != 0 && errno != EEXIST)
    return io_error("chunk store dir:" + root + ": cannot create the directory: " + errno_text(errno));
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return io_error("chunk store dir:" + root + " is not a directory");
  return std::unique_ptr<ChunkStore>(new DirStore(std::move(root), std::move(io)));
}

}  // namespace kvring
