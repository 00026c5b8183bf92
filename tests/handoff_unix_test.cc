// The Unix-domain socket transport: messages both ways (empty, multi-part,
// several MiB), a hostile peer's size claim, truncation, timeouts, signals,
// close, the listener's file rules (a whole session over it is in
// handoff_session_test.cc, beside UCX's).
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "kvring/handoff.h"

namespace kvring::handoff {
namespace {

using Bytes = std::vector<std::uint8_t>;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

Bytes seeded_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<std::uint8_t>(rng());
  return b;
}

// A raw client socket (blocking) connected to `path`; -1 on failure.
int raw_connect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

// A socket file left at `path` by a socket bound there and closed (what a
// listener that died leaves).
void leave_stale_socket(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.data(), path.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  ::close(fd);
}

void write_all(int fd, const void* data, std::size_t n) {
  ASSERT_EQ(::send(fd, data, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
}

Bytes header_of(std::uint64_t size) {
  Bytes h(8);
  for (int i = 0; i < 8; ++i) h[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(size >> (8 * i));
  return h;
}

bool is_socket(const std::string& path) {
  struct stat st{};
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// Each test works in a fresh directory of its own, removed afterwards.
class UnixTransport : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "kvu.XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    path_ = dir_ + "/s";
    ASSERT_LT(path_.size(), 100u) << path_;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A listener at path_ and both ends of one connection to it.
  struct Linked {
    std::unique_ptr<UnixListener> listener;
    std::unique_ptr<Transport> client, server;
  };
  Linked linked() {
    Linked l;
    auto listener = unix_listen(path_);
    EXPECT_TRUE(listener.ok()) << listener.error().to_string();
    if (!listener.ok()) return l;
    l.listener = std::move(*listener);
    auto client = unix_connect(path_, deadline_in(5));
    EXPECT_TRUE(client.ok()) << client.error().to_string();
    auto server = l.listener->accept(deadline_in(5));
    EXPECT_TRUE(server.ok()) << server.error().to_string();
    if (client.ok()) l.client = std::move(*client);
    if (server.ok()) l.server = std::move(*server);
    return l;
  }

  // A listener at path_, a raw socket connected to it, and the accepted end.
  struct RawPeer {
    std::unique_ptr<UnixListener> listener;
    int raw = -1;
    std::unique_ptr<Transport> server;
  };
  void raw_peer(RawPeer& p) {
    auto listener = unix_listen(path_);
    ASSERT_TRUE(listener.ok()) << listener.error().to_string();
    p.listener = std::move(*listener);
    p.raw = raw_connect(path_);
    ASSERT_GE(p.raw, 0) << std::strerror(errno);
    auto server = p.listener->accept(deadline_in(5));
    ASSERT_TRUE(server.ok()) << server.error().to_string();
    p.server = std::move(*server);
  }

  std::string dir_, path_;
};

TEST_F(UnixTransport, MessagesRoundTripBothWays) {
  Linked l = linked();
  ASSERT_TRUE(l.client && l.server);
  EXPECT_EQ(l.client->describe(), "unix " + path_);
  EXPECT_EQ(l.server->describe(), "unix " + path_);
  EXPECT_FALSE(l.client->carries(MemoryKind::kCudaDevice));
  const Bytes small = seeded_bytes(1000, 1), big = seeded_bytes((6 << 20) + 13, 2);
  const Bytes a = seeded_bytes(300, 3), b = seeded_bytes(70000, 4);
  Bytes ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  const std::vector<Bytes> expected = {{}, small, ab, big, small};
  // The client sends from its thread: an empty message, a plain one, one of
  // three parts (one of them empty), several MiB, then receives the echoes.
  std::vector<Bytes> echoes;
  std::vector<Status> client_status;
  std::thread client([&] {
    client_status.push_back(l.client->send_message(nullptr, 0, deadline_in(10)));
    client_status.push_back(l.client->send_message(small.data(), small.size(), deadline_in(10)));
    client_status.push_back(
        l.client->send_message({{a.data(), a.size()}, {nullptr, 0}, {b.data(), b.size()}}, deadline_in(10)));
    client_status.push_back(l.client->send_message(big.data(), big.size(), deadline_in(10)));
    client_status.push_back(l.client->send_message(small.data(), small.size(), deadline_in(10)));
    for (std::size_t i = 0; i < expected.size(); ++i) {
      Bytes in = {9, 9};
      client_status.push_back(l.client->recv_message(in, deadline_in(10), 8 << 20));
      echoes.push_back(std::move(in));
    }
  });
  // The server checks each and echoes it back in two parts (on a failure
  // it closes the link, which ends the client's waits).
  for (const Bytes& want : expected) {
    Bytes in = {7};
    const Status s = l.server->recv_message(in, deadline_in(10), 8 << 20);
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(in, want);
    const std::size_t half = in.size() / 2;
    const Status e =
        l.server->send_message({{in.data(), half}, {in.data() + half, in.size() - half}}, deadline_in(10));
    EXPECT_TRUE(e.ok()) << e.to_string();
    if (!s.ok() || !e.ok()) break;
  }
  if (::testing::Test::HasFailure()) l.server->close();
  client.join();
  for (const Status& s : client_status) EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(echoes, expected);
}

// A peer that claims 2^62 bytes is refused by the claim alone: nothing of
// that size is allocated, and the link stays broken.
TEST_F(UnixTransport, HostileSizeIsRefusedBeforeAllocating) {
  RawPeer p;
  ASSERT_NO_FATAL_FAILURE(raw_peer(p));
  const int raw = p.raw;
  Transport* server = p.server.get();
  const Bytes h = header_of(std::uint64_t{1} << 62);
  write_all(raw, h.data(), h.size());
  write_all(raw, "abcd", 4);
  Bytes out;
  const Status s = server->recv_message(out, deadline_in(5), 1 << 20);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kIOError);
  EXPECT_NE(s.error().message.find("a message of 4611686018427387904 B from unix " + path_), std::string::npos)
      << s.to_string();
  EXPECT_NE(s.error().message.find("exceeds 1048576 B"), std::string::npos) << s.to_string();
  EXPECT_EQ(out.capacity(), 0u);
  const Status again = server->recv_message(out, deadline_in(1), 1 << 20);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().message, s.error().message);
  EXPECT_FALSE(server->send_message("x", 1, deadline_in(1)).ok());
  ::close(raw);
}

// A claim within the limit that the peer does not send costs about what it
// sent: the buffer grows with the bytes that arrive.
TEST_F(UnixTransport, AnUnsentClaimCostsWhatArrived) {
  RawPeer p;
  ASSERT_NO_FATAL_FAILURE(raw_peer(p));
  const int raw = p.raw;
  Transport* server = p.server.get();
  const std::size_t claim = std::size_t{256} << 20;
  const Bytes h = header_of(claim), body = seeded_bytes(3 << 20, 9);
  write_all(raw, h.data(), h.size());
  std::thread sender([&] {
    write_all(raw, body.data(), body.size());
    ::close(raw);
  });
  Bytes out;
  const Status s = server->recv_message(out, deadline_in(5), claim);
  sender.join();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("closed by the peer"), std::string::npos) << s.to_string();
  EXPECT_LE(out.capacity(), std::size_t{8} << 20);
}

TEST_F(UnixTransport, PeerClosingMidMessageOrBetweenIsAnError) {
  auto listener = unix_listen(path_);
  ASSERT_TRUE(listener.ok());
  for (const bool mid : {true, false}) {
    SCOPED_TRACE(mid ? "mid-message" : "between messages");
    const int raw = raw_connect(path_);
    ASSERT_GE(raw, 0);
    auto server = (*listener)->accept(deadline_in(5));
    ASSERT_TRUE(server.ok());
    const Bytes h = header_of(100), body = seeded_bytes(mid ? 50 : 100, 5);
    write_all(raw, h.data(), h.size());
    write_all(raw, body.data(), body.size());
    ::close(raw);
    Bytes out;
    Status s = (*server)->recv_message(out, deadline_in(5), 1 << 20);
    if (!mid) {
      ASSERT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(out, body);
      s = (*server)->recv_message(out, deadline_in(5), 1 << 20);
    }
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kIOError);
    EXPECT_NE(s.error().message.find("unix " + path_ + " closed by the peer"), std::string::npos) << s.to_string();
  }
}

TEST_F(UnixTransport, WaitsEndAtTheirDeadline) {
  Linked l = linked();
  ASSERT_TRUE(l.client && l.server);
  auto t0 = Clock::now();
  Bytes out;
  const Status s = l.server->recv_message(out, deadline_in(0.2), 1 << 20);
  const double took = seconds_since(t0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kIOError);
  EXPECT_NE(s.error().message.find("timed out"), std::string::npos) << s.to_string();
  EXPECT_GE(took, 0.19);
  EXPECT_LT(took, 2.0);
  EXPECT_FALSE(l.server->recv_message(out, deadline_in(5), 1 << 20).ok());  // broken after it

  // A send the peer never reads fills the socket's buffers, then times out.
  const Bytes big(64 << 20, 0x5a);
  t0 = Clock::now();
  const Status send = l.client->send_message(big.data(), big.size(), deadline_in(0.3));
  ASSERT_FALSE(send.ok());
  EXPECT_NE(send.error().message.find("timed out"), std::string::npos) << send.to_string();
  EXPECT_LT(seconds_since(t0), 2.5);

  t0 = Clock::now();
  auto none = l.listener->accept(deadline_in(0.2));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, ErrorCode::kIOError);
  EXPECT_NE(none.error().message.find("no sender connected to unix " + path_ + " in time"), std::string::npos)
      << none.error().to_string();
  EXPECT_LT(seconds_since(t0), 2.0);
}

void on_signal(int) {}

// Signals that interrupt a wait do not end it early nor lose bytes.
TEST_F(UnixTransport, SignalsDoNotInterruptAWait) {
  Linked l = linked();
  ASSERT_TRUE(l.client && l.server);
  struct sigaction act{}, old{};
  act.sa_handler = on_signal;
  sigemptyset(&act.sa_mask);
  act.sa_flags = 0;  // no SA_RESTART: poll and recv see EINTR
  ASSERT_EQ(::sigaction(SIGUSR1, &act, &old), 0);
  const pthread_t self = ::pthread_self();
  const Bytes msg = seeded_bytes(3 << 20, 6);
  std::atomic<bool> done{false};
  std::thread pester([&] {
    const auto until = Clock::now() + std::chrono::milliseconds(300);
    while (Clock::now() < until) {
      ::pthread_kill(self, SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::thread sender([&] { EXPECT_TRUE(l.client->send_message(msg.data(), msg.size(), deadline_in(10)).ok()); });
    while (!done) {
      ::pthread_kill(self, SIGUSR1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    sender.join();
  });
  Bytes out;
  const Status s = l.server->recv_message(out, deadline_in(10), 4 << 20);
  done = true;
  pester.join();
  ::sigaction(SIGUSR1, &old, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(out, msg);
}

TEST_F(UnixTransport, ConnectFailsAtOnceWhereNothingListens) {
  auto t0 = Clock::now();
  auto none = unix_connect(path_, deadline_in(5));  // no file
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, ErrorCode::kIOError);
  EXPECT_NE(none.error().message.find(path_), std::string::npos) << none.error().to_string();
  EXPECT_NE(none.error().message.find(std::strerror(ENOENT)), std::string::npos) << none.error().to_string();
  leave_stale_socket(path_);  // a socket file nobody listens on
  auto refused = unix_connect(path_, deadline_in(5));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find(std::strerror(ECONNREFUSED)), std::string::npos)
      << refused.error().to_string();
  EXPECT_LT(seconds_since(t0), 1.0);
}

TEST_F(UnixTransport, PathsAreChecked) {
  for (const std::string& bad : {std::string(), "/tmp/" + std::string(103, 'x')}) {
    ASSERT_EQ(bad.empty() ? 0u : 108u, bad.size());
    auto l = unix_listen(bad);
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.error().code, ErrorCode::kInvalidArgument);
    auto c = unix_connect(bad, deadline_in(1));
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.error().code, ErrorCode::kInvalidArgument);
  }
  EXPECT_NE(unix_listen("/tmp/" + std::string(103, 'x')).error().message.find("at most 107"), std::string::npos);
}

TEST_F(UnixTransport, ListenRefusesAnythingButASocket) {
  std::filesystem::remove(path_ + ".lock");
  { std::ofstream(path_) << "keep me"; }
  auto l = unix_listen(path_);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.error().code, ErrorCode::kIOError);
  EXPECT_NE(l.error().message.find("not a socket"), std::string::npos) << l.error().to_string();
  std::string content;
  std::getline(std::ifstream(path_), content);
  EXPECT_EQ(content, "keep me");
  // Refused before a lock file is made for a path that is not a socket.
  EXPECT_FALSE(std::filesystem::exists(path_ + ".lock"));
  std::filesystem::remove(path_);
  ASSERT_TRUE(std::filesystem::create_directory(path_));
  EXPECT_FALSE(unix_listen(path_).ok());
  EXPECT_TRUE(std::filesystem::is_directory(path_));
  std::filesystem::remove(path_);
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  EXPECT_FALSE(unix_listen(path_).ok());
  EXPECT_TRUE(std::filesystem::is_fifo(path_));
}

// The listener's lock file must be a regular file: a directory, a FIFO or
// a link there is refused by name (nothing blocks on the FIFO), and the
// path gets no socket.
TEST_F(UnixTransport, ListenRefusesALockFileThatIsNotAFile) {
  const std::string lock = path_ + ".lock";
  for (int kind = 0; kind < 3; ++kind) {
    SCOPED_TRACE(kind == 0 ? "a directory" : kind == 1 ? "a FIFO" : "a symbolic link");
    std::filesystem::remove_all(lock);
    if (kind == 0) {
      ASSERT_TRUE(std::filesystem::create_directory(lock));
    } else if (kind == 1) {
      ASSERT_EQ(::mkfifo(lock.c_str(), 0600), 0);
    } else {
      std::filesystem::create_symlink(path_ + ".elsewhere", lock);
    }
    const auto t0 = Clock::now();
    auto l = unix_listen(path_);
    ASSERT_FALSE(l.ok());
    EXPECT_LT(seconds_since(t0), 2.0);
    EXPECT_EQ(l.error().code, ErrorCode::kIOError);
    EXPECT_NE(l.error().message.find("lock file " + lock), std::string::npos) << l.error().to_string();
    EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(path_)));
  }
  std::filesystem::remove_all(lock);
  EXPECT_FALSE(std::filesystem::exists(path_ + ".elsewhere"));  // the link was not followed
}

TEST_F(UnixTransport, ListenReplacesAStaleSocketAndRemovesItsOwn) {
  leave_stale_socket(path_);
  ASSERT_TRUE(is_socket(path_));
  {
    auto l = unix_listen(path_);
    ASSERT_TRUE(l.ok()) << l.error().to_string();
    EXPECT_EQ((*l)->path(), path_);
    auto c = unix_connect(path_, deadline_in(5));
    ASSERT_TRUE(c.ok()) << c.error().to_string();
    ASSERT_TRUE((*l)->accept(deadline_in(5)).ok());
    EXPECT_TRUE(is_socket(path_));
  }
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(path_)));
  // A second listener on a live one's path is refused; the first still
  // takes connections.
  auto first = unix_listen(path_);
  ASSERT_TRUE(first.ok());
  auto second = unix_listen(path_);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.error().message.find("another listener is there"), std::string::npos) << second.error().message;
  auto c = unix_connect(path_, deadline_in(5));
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_TRUE((*first)->accept(deadline_in(5)).ok());
  // A listener whose file someone else replaced leaves that file alone.
  ASSERT_EQ(::unlink(path_.c_str()), 0);
  leave_stale_socket(path_);
  first->reset();
  EXPECT_TRUE(is_socket(path_));
  // Once the first is gone, the path is free again.
  auto third = unix_listen(path_);
  EXPECT_TRUE(third.ok()) << third.error().to_string();
}

TEST_F(UnixTransport, CloseEndsThePeersWaitAndItsOwnCalls) {
  Linked l = linked();
  ASSERT_TRUE(l.client && l.server);
  std::optional<Status> received;
  double took = 0;
  std::thread waiter([&] {
    const auto t0 = Clock::now();
    Bytes out;
    received = l.server->recv_message(out, deadline_in(10), 1 << 20);
    took = seconds_since(t0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  l.client->close();
  l.client->close();  // idempotent
  waiter.join();
  ASSERT_TRUE(received.has_value());
  ASSERT_FALSE(received->ok());
  EXPECT_NE(received->error().message.find("closed by the peer"), std::string::npos) << received->to_string();
  EXPECT_LT(took, 5.0);
  const Status send = l.client->send_message("x", 1, deadline_in(1));
  ASSERT_FALSE(send.ok());
  EXPECT_EQ(send.error().code, ErrorCode::kIOError);
  Bytes out;
  EXPECT_EQ(l.client->recv_message(out, deadline_in(1), 1).error().code, ErrorCode::kIOError);
  // Sending to the closed peer is an error, not a SIGPIPE.
  const Bytes big(4 << 20, 1);
  const Status to_gone = l.server->send_message(big.data(), big.size(), deadline_in(5));
  ASSERT_FALSE(to_gone.ok());
  EXPECT_EQ(to_gone.error().code, ErrorCode::kIOError);
  EXPECT_EQ(to_gone.error().message.find("timed out"), std::string::npos) << to_gone.to_string();
}

TEST_F(UnixTransport, DevicePartsAreRefused) {
  Linked l = linked();
  ASSERT_TRUE(l.client && l.server);
  const std::uint8_t host[4] = {1, 2, 3, 4};
  Part device{host, sizeof host, MemoryKind::kCudaDevice};
  const Status s = l.client->send_message({{host, sizeof host}, device}, deadline_in(1));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kUnsupported);
  // Refused before a byte was written: the link still works.
  ASSERT_TRUE(l.client->send_message(host, sizeof host, deadline_in(1)).ok());
  Bytes out;
  ASSERT_TRUE(l.server->recv_message(out, deadline_in(1), 16).ok());
  EXPECT_EQ(out, Bytes(host, host + 4));
}

}  // namespace
}  // namespace kvring::handoff
