#include "core/file_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

namespace kvring::file_internal {

const char* file_type_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
  }
  return "a file of unknown type";
}

Result<OpenedFile> open_regular_file(const std::string& path, const std::string& what) {
  // O_NOCTTY: a terminal given as a file never becomes the controlling one.
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    return make_error(err == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIOError,
                      "cannot read " + what + " " + path + ": " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return io_error("cannot read " + what + " " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("cannot read " + what + " " + path + ": it is " +
                            file_type_name(st.st_mode) + ", not a regular file");
  }
  // Reads of a regular file never block on data; back to ordinary reads.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return io_error("cannot read " + what + " " + path + ": " + std::strerror(err));
  }
  return OpenedFile{fd, static_cast<std::int64_t>(st.st_size),
                    static_cast<std::int64_t>(st.st_blocks) * 512};
}

Result<std::string> read_small_file(const std::string& path, const std::string& what,
                                    std::int64_t max_bytes) {
  auto f = open_regular_file(path, what);
  if (!f) return f.error();
  const int fd = f->fd;
  auto too_large = [&]() -> Error {
    return invalid_argument("cannot read " + what + " " + path + ": it holds more than " +
                            std::to_string(max_bytes) + " bytes, the limit for a " + what);
  };
  if (f->size > max_bytes) {
    ::close(fd);
    return too_large();
  }
  // Read until end of file, but never more than one byte past the limit: the
  // size from fstat bounds nothing if the file grows while it is read.
  std::string text(static_cast<std::size_t>(f->size) + 1, '\0');
  std::int64_t done = 0;
  for (;;) {
    if (done == static_cast<std::int64_t>(text.size())) {
      if (done > max_bytes) {
        ::close(fd);
        return too_large();
      }
      text.resize(std::min<std::size_t>(text.size() * 2, static_cast<std::size_t>(max_bytes) + 1));
    }
    const ssize_t r = ::read(fd, text.data() + done, text.size() - static_cast<std::size_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return io_error("error reading " + what + " " + path + ": " + std::strerror(err));
    }
    if (r == 0) break;
    done += r;
  }
  ::close(fd);
  text.resize(static_cast<std::size_t>(done));
  return text;
}

namespace {

std::int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0 || pages > std::numeric_limits<std::int64_t>::max() / page)
    return std::numeric_limits<std::int64_t>::max();
  return static_cast<std::int64_t>(pages) * page;
}

// The first line of a small file as a byte count, or none ("max", absent,
// unreadable).
std::optional<std::int64_t> read_limit(const std::string& path) {
  auto text = read_small_file(path, "cgroup limit", 8192);
  if (!text) return std::nullopt;
  std::int64_t v = 0;
  const char* b = text->data();
  const char* e = b + text->size();
  while (e > b && (e[-1] == '\n' || e[-1] == ' ')) --e;
  auto [end, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || end != e || v <= 0) return std::nullopt;
  return v;
}

}  // namespace

std::int64_t memory_limit_bytes() {
  std::int64_t limit = physical_memory_bytes();
  auto self = read_small_file("/proc/self/cgroup", "cgroup list", 64 << 10);
  if (!self) return limit;
  std::size_t at = 0;
  while (at < self->size()) {
    std::size_t nl = self->find('\n', at);
    if (nl == std::string::npos) nl = self->size();
    const std::string line = self->substr(at, nl - at);
    at = nl + 1;
    // "ID:CONTROLLERS:PATH": v2 has ID 0 and no controllers.
    const auto c1 = line.find(':');
    const auto c2 = c1 == std::string::npos ? std::string::npos : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    std::string controllers(1, ',');
    controllers.append(line, c1 + 1, c2 - c1 - 1).push_back(',');
    std::string path = line.substr(c2 + 1);
    std::string base, file;
    if (line.compare(0, c1, "0") == 0 && controllers == ",,") {
      base = "/sys/fs/cgroup";
      file = "memory.max";
    } else if (controllers.find(",memory,") != std::string::npos) {
      base = "/sys/fs/cgroup/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    if (path.find("/..") != std::string::npos) continue;
    for (;;) {
      while (path.size() > 1 && path.back() == '/') path.pop_back();
      if (auto v = read_limit(base + (path == "/" ? "" : path) + "/" + file)) limit = std::min(limit, *v);
      if (path.empty() || path == "/") break;
      const auto slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return limit;
}

}  // namespace kvring::file_internal
