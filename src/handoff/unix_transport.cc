// Transport over Unix-domain stream sockets (processes of one host, host
// memory only). Each message is an 8-byte little-endian length and its
// bytes; a send gathers its parts with sendmsg (no staging copy). Sockets
// are non-blocking and every wait is a poll() bounded by the call's
// deadline; EINTR retries, short reads and writes continue where they
// stopped, and MSG_NOSIGNAL turns a vanished peer into EPIPE, never
// SIGPIPE. Any failure mid-stream leaves the framing unknown, so it breaks
// the transport for good. No threads: one call at a time per endpoint.
#include <limits.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/file_read.h"
#include "kvring/handoff.h"

namespace kvring::handoff {

namespace {

constexpr std::size_t kMaxPath = sizeof(sockaddr_un::sun_path) - 1;  // 107 on Linux

std::string errno_text() { return std::strerror(errno); }

Status check_path(const std::string& path) {
  if (path.empty()) return invalid_argument("a unix socket path must not be empty");
  if (path.size() > kMaxPath)
    return invalid_argument("unix socket path '" + path + "' is " + std::to_string(path.size()) +
                            " bytes; at most " + std::to_string(kMaxPath) + " fit");
  if (path.find('\0') != std::string::npos) return invalid_argument("unix socket path has a NUL byte");
  return Status::Ok();
}

sockaddr_un make_addr(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());  // check_path: it fits with its NUL
  return a;
}

// Polls `fd` for `events` until it is ready (true; an error or hang-up
// counts as ready: the next call reports it) or the deadline passes (false).
// Callers try their operation first, so a passed deadline still lets ready
// bytes through.
bool wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(ms, INT_MAX)));
    if (rc > 0) return true;
    // rc == 0 re-checks the clock; rc < 0 is EINTR or a transient ENOMEM:
    // retried until the deadline.
  }
}

class UnixTransport : public Transport {
 public:
  UnixTransport(int fd, std::string path) : fd_(fd), name_("unix " + std::move(path)) {}
  ~UnixTransport() override { close(); }

  Status send_message(const std::vector<Part>& parts, Deadline deadline) override {
    KVRING_RETURN_IF_ERROR(usable(true));
    std::uint64_t total = 0;
    for (const Part& p : parts) {
      if (p.kind != MemoryKind::kHost)
        return make_error(ErrorCode::kUnsupported,
                          "the unix socket transport carries host memory only (stage device rows through host buffers)");
      total += p.size;
    }
    std::uint8_t head[8];
    for (int i = 0; i < 8; ++i) head[i] = static_cast<std::uint8_t>(total >> (8 * i));
    std::vector<iovec> iov{{head, sizeof head}};
    for (const Part& p : parts)
      if (p.size) iov.push_back({const_cast<void*>(p.data), p.size});  // sendmsg only reads them
    std::size_t first = 0;  // iov[first..] is still to be sent
    while (first < iov.size()) {
      msghdr m{};
      m.msg_iov = iov.data() + first;
      m.msg_iovlen = std::min<std::size_t>(iov.size() - first, IOV_MAX);
      const ssize_t n = ::sendmsg(fd_, &m, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return lost("send", true);
        if (!wait_ready(fd_, POLLOUT, deadline)) return fail_send("timed out waiting to send to " + name_);
        continue;
      }
      for (auto left = static_cast<std::size_t>(n); left > 0;) {
        iovec& v = iov[first];
        const std::size_t take = std::min(left, v.iov_len);
        v.iov_base = static_cast<std::uint8_t*>(v.iov_base) + take;
        v.iov_len -= take;
        left -= take;
        if (v.iov_len == 0) ++first;
      }
    }
    return Status::Ok();
  }

  Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline, std::size_t max_size) override {
    KVRING_RETURN_IF_ERROR(usable(false));
    std::uint8_t head[8];
    KVRING_RETURN_IF_ERROR(read_exact(head, sizeof head, deadline));
    std::uint64_t size = 0;
    for (int i = 0; i < 8; ++i) size |= std::uint64_t{head[i]} << (8 * i);
    // Checked before anything is allocated, and the buffer then grows with
    // the bytes that arrive (to twice what came, from 1 MiB on), so that a
    // claim the peer does not send costs it, not this end.
    if (size > max_size)
      return fail("a message of " + std::to_string(size) + " B from " + name_ + " exceeds " +
                  std::to_string(max_size) + " B");
    if (size <= out.capacity()) {  // memory this end holds already
      out.resize(static_cast<std::size_t>(size));
      return read_exact(out.data(), out.size(), deadline);
    }
    constexpr std::uint64_t kFirstStep = std::uint64_t{1} << 20;
    out.clear();
    for (std::uint64_t have = 0; have < size;) {
      const std::uint64_t next = std::min(size, std::max(kFirstStep, 2 * have));
      out.resize(static_cast<std::size_t>(next));
      KVRING_RETURN_IF_ERROR(read_exact(out.data() + have, static_cast<std::size_t>(next - have), deadline));
      have = next;
    }
    return Status::Ok();
  }

  std::string describe() const override { return name_; }

  // Readable now: bytes of a message, the peer's end of stream or an
  // error, each of which the next recv_message reports without waiting.
  bool message_waiting() override {
    if (broken_ || fd_ < 0) return true;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  void close() override {
    if (fd_ < 0) return;
    ::shutdown(fd_, SHUT_RDWR);  // the peer sees end of stream even if another process shares the fd
    ::close(fd_);
    fd_ = -1;
  }

 private:
  // A failed read ends the link both ways. A failed send ends sending
  // only (the outgoing stream may stop mid-message): what the peer sent
  // before it went is still read, such as its reason for ending.
  Status usable(bool sending) const {
    if (broken_) return *broken_;
    if (sending && send_broken_) return *send_broken_;
    if (fd_ < 0) return io_error("the link to " + name_ + " is closed");
    return Status::Ok();
  }
  Error fail(std::string message) {
    broken_ = io_error(std::move(message));
    return *broken_;
  }
  Error fail_send(std::string message) {
    send_broken_ = io_error(std::move(message));
    return *send_broken_;
  }
  Error lost(const char* call, bool sending) {
    std::string message = "the link to " + name_ + " failed (" + call + ": " + errno_text() +
                          "): the peer is gone or the link dropped";
    return sending ? fail_send(std::move(message)) : fail(std::move(message));
  }

  Status read_exact(std::uint8_t* data, std::size_t size, Deadline deadline) {
    for (std::size_t got = 0; got < size;) {
      const ssize_t n = ::recv(fd_, data + got, size - got, 0);
      if (n > 0) {
        got += static_cast<std::size_t>(n);
      } else if (n == 0) {
        return fail(name_ + " closed by the peer" + (got ? " in the middle of a message" : ""));
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait_ready(fd_, POLLIN, deadline)) return fail("timed out waiting to receive from " + name_);
      } else if (errno != EINTR) {
        return lost("recv", false);
      }
    }
    return Status::Ok();
  }

  int fd_;
  std::string name_;
  std::optional<Error> broken_, send_broken_;
};

class Listener : public UnixListener {
 public:
  explicit Listener(std::string path) : path_(std::move(path)) {}
  ~Listener() override {
    // Removes the file only while it is still the one bind() made: a later
    // listener that replaced it keeps its own.
    struct stat st{};
    if (bound_ && ::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == dev_ &&
        st.st_ino == ino_)
      ::unlink(path_.c_str());
    if (fd_ >= 0) ::close(fd_);
    if (lock_fd_ >= 0) ::close(lock_fd_);  // the lock goes with it; the file stays for the next listener
  }

  Status open() {
    // A live listener holds an exclusive lock on PATH.lock for its life, so
    // a second one on the path is refused, and a socket file at the path
    // while the lock is free is what a listener that died left: replaced.
    // The lock file is never removed (removing it would let two listeners
    // lock two files of one name). Anything but a socket at the path is
    // someone's data: refused, untouched (before a lock file is made for
    // it, and again under the lock).
    const auto not_a_socket = [&](mode_t mode) {
      return io_error("cannot listen on unix " + path_ + ": it exists and is not a socket (" +
                      file_internal::file_type_name(mode) + "); left as it is");
    };
    struct stat st{};
    if (::lstat(path_.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) return not_a_socket(st.st_mode);
    const std::string lock_path = path_ + ".lock";
    lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    if (lock_fd_ < 0 || ::fstat(lock_fd_, &st) != 0 || !S_ISREG(st.st_mode))
      return io_error("cannot listen on unix " + path_ + ": its lock file " + lock_path + ": " +
                      (lock_fd_ < 0 ? errno_text() : std::string("not a regular file")));
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0)
      return io_error("cannot listen on unix " + path_ + ": " +
                      (errno == EWOULDBLOCK ? std::string("another listener is there") : errno_text()));
    if (::lstat(path_.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) return not_a_socket(st.st_mode);
      if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
        return io_error("cannot listen on unix " + path_ + ": removing the old socket: " + errno_text());
    } else if (errno != ENOENT) {
      return io_error("cannot listen on unix " + path_ + ": " + errno_text());
    }
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return io_error("cannot listen on unix " + path_ + ": socket: " + errno_text());
    const sockaddr_un addr = make_addr(path_);
    if (::bind(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
      return io_error("cannot listen on unix " + path_ + ": " + errno_text());
    if (::lstat(path_.c_str(), &st) == 0) {
      bound_ = true;
      dev_ = st.st_dev;
      ino_ = st.st_ino;
    }
    if (::listen(fd_, SOMAXCONN) != 0) return io_error("cannot listen on unix " + path_ + ": " + errno_text());
    return Status::Ok();
  }

  const std::string& path() const override { return path_; }

  Result<std::unique_ptr<Transport>> accept(Deadline deadline) override {
    for (;;) {
      const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) return std::unique_ptr<Transport>(std::make_unique<UnixTransport>(fd, path_));
      // A connection that went away before it was taken, or a signal: try again.
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return io_error("cannot accept on unix " + path_ + ": " + errno_text());
      if (!wait_ready(fd_, POLLIN, deadline)) return io_error("no sender connected to unix " + path_ + " in time");
    }
  }

 private:
  std::string path_;
  int fd_ = -1, lock_fd_ = -1;
  bool bound_ = false;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

}  // namespace

Result<std::unique_ptr<UnixListener>> unix_listen(const std::string& path) {
  KVRING_RETURN_IF_ERROR(check_path(path));
  auto l = std::make_unique<Listener>(path);
  KVRING_RETURN_IF_ERROR(l->open());
  return std::unique_ptr<UnixListener>(std::move(l));
}

Result<std::unique_ptr<Transport>> unix_connect(const std::string& path, Deadline deadline) {
  KVRING_RETURN_IF_ERROR(check_path(path));
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return io_error("cannot connect to unix " + path + ": socket: " + errno_text());
  // Owns fd from here: every return below either hands it on or closes it.
  auto t = std::make_unique<UnixTransport>(fd, path);
  const sockaddr_un addr = make_addr(path);
  for (;;) {
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) break;
    const int err = errno;
    if (err == EAGAIN) {
      // The listener's backlog is full; a unix socket cannot be polled for
      // room, so retry in short steps until the deadline.
      if (Clock::now() >= deadline) return io_error("timed out connecting to unix " + path + " (its backlog is full)");
      ::poll(nullptr, 0, 2);
      continue;
    }
    if (err == EINPROGRESS || err == EINTR || err == EALREADY) {
      // Completes in the background: wait for it, then read its outcome.
      if (!wait_ready(fd, POLLOUT, deadline)) return io_error("timed out connecting to unix " + path);
      int so = 0;
      socklen_t len = sizeof so;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0) so = errno;
      if (so == 0) break;
      return io_error("cannot connect to unix " + path + ": " + std::strerror(so));
    }
    // ENOENT, ECONNREFUSED and the like: nothing listens there.
    return io_error("cannot connect to unix " + path + ": " + std::strerror(err));
  }
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace kvring::handoff
