// Chunk stores a user points kvring at that do not behave: a Redis server
// that accepts and then stalls, or announces replies larger than asked for
// (fake servers on loopback), credential and IPv6 URLs (redis-server started
// on loopback), and directory stores with symlinks, FIFOs or directories
// under chunk names and temporary files of killed writers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "kvring/chunk_store.h"
#include "pack_test_util.h"

namespace kvring {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::span<const std::uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
ChunkData chunk_of(const std::string& bytes) {
  return ChunkData{sha256(bytes.data(), bytes.size()), bytes_of(bytes), {}};
}
// A chunk views its bytes: a temporary would be gone before the chunk is used.
ChunkData chunk_of(std::string&&) = delete;
std::span<std::uint8_t> span_of(std::string& s) {
  return {reinterpret_cast<std::uint8_t*>(s.data()), s.size()};
}

// A loopback TCP server that answers each read, from whichever connection,
// with the next reply of `script` and, once the script is spent, reads and
// never answers. A reply "<CLOSE>" closes the connection instead, one that
// ends in "<THENCLOSE>" closes it after sending the rest.
class FakeServer {
 public:
  static std::unique_ptr<FakeServer> start(const std::string& host, std::vector<std::string> script) {
    std::unique_ptr<FakeServer> s(new FakeServer());
    s->script_ = std::move(script);
    const bool v6 = host.find(':') != std::string::npos;
    s->listen_ = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->listen_ < 0) return nullptr;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (v6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      if (::inet_pton(AF_INET6, host.c_str(), &a->sin6_addr) != 1) return nullptr;
      len = sizeof *a;
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      if (::inet_pton(AF_INET, host.c_str(), &a->sin_addr) != 1) return nullptr;
      len = sizeof *a;
    }
    if (::bind(s->listen_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(s->listen_, 16) != 0)
      return nullptr;
    if (::getsockname(s->listen_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return nullptr;
    s->port_ = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                        : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    s->thread_ = std::thread([p = s.get()] { p->serve(); });
    return s;
  }
  ~FakeServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : clients_)
      if (fd >= 0) ::close(fd);
    if (listen_ >= 0) ::close(listen_);
  }
  int port() const { return port_; }

 private:
  FakeServer() = default;

  // Polls in short steps so that the destructor's stop flag ends it.
  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds = {{listen_, POLLIN, 0}};
      for (int fd : clients_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c >= 0) clients_.push_back(c);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        int& fd = clients_[i - 1];
        char buf[4096];
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n > 0 && next_ < script_.size()) {
          std::string reply = script_[next_++];
          const bool close = reply == "<CLOSE>" || reply.ends_with("<THENCLOSE>");
          reply.resize(reply == "<CLOSE>" ? 0 : reply.size() - (close ? 11 : 0));
          send_all(fd, reply);
          if (close) {
            ::close(fd);
            fd = -1;
          }
        }
      }
    }
  }

  // The whole reply, unless the client stops reading or the test ends.
  void send_all(int fd, const std::string& reply) {
    for (std::size_t off = 0; off < reply.size() && !stop_;) {
      const ssize_t w = ::send(fd, reply.data() + off, reply.size() - off, MSG_NOSIGNAL);
      if (w > 0) {
        off += static_cast<std::size_t>(w);
        continue;
      }
      if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
      pollfd o{fd, POLLOUT, 0};
      ::poll(&o, 1, 20);
    }
  }

  int listen_ = -1, port_ = 0;
  std::vector<std::string> script_;
  std::size_t next_ = 0;
  std::vector<int> clients_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The Redis store's tests, skipped by a build without it.
class RedisHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!redis_store_compiled()) GTEST_SKIP() << "this build has no Redis store (hiredis was not found)";
  }
};

std::string loopback(const FakeServer& s) { return "127.0.0.1:" + std::to_string(s.port()); }

TEST_F(RedisHostile, AServerThatNeverAnswersTimesOutNamingIt) {
  auto server = FakeServer::start("127.0.0.1", {});
  ASSERT_TRUE(server);
  const auto t0 = Clock::now();
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=300");
  const double took = seconds_since(t0);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.error().message.find("timed out"), std::string::npos) << store.error().to_string();
  EXPECT_NE(store.error().message.find(loopback(*server)), std::string::npos) << store.error().to_string();
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 2.0);
}

// A server that stalls after the handshake costs one timeout per
// operation, not one per chunk.
TEST_F(RedisHostile, AStalledServerCostsOneTimeoutPerOperation) {
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=300");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  std::string buf(64, '\0');
  auto t0 = Clock::now();
  for (int i = 0; i < 20; ++i) {
    const std::string bytes = "chunk " + std::to_string(i);
    const Status s = (*store)->get(sha256(bytes.data(), bytes.size()), span_of(buf));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.error().message.find("timed out"), std::string::npos) << s.to_string();
    EXPECT_NE(s.error().message.find(loopback(*server)), std::string::npos) << s.to_string();
  }
  EXPECT_LT(seconds_since(t0), 1.5);  // 20 waits of 300 ms would take 6 s
  // A new operation tries the server again, and a save fails the same way.
  (*store)->begin_operation();
  t0 = Clock::now();
  const std::string a = "a chunk to save";
  const std::vector<ChunkData> chunks = {chunk_of(a)};
  const Status put = (*store)->put(chunks);
  ASSERT_FALSE(put.ok());
  EXPECT_NE(put.error().message.find("timed out"), std::string::npos) << put.to_string();
  EXPECT_GE(seconds_since(t0), 0.25);
  EXPECT_LT(seconds_since(t0), 2.0);
}

// deadline_ms bounds an operation whatever timeout_ms allows one wait.
TEST_F(RedisHostile, TheDeadlineCapsAnOperation) {
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=20000&deadline_ms=400");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  std::string buf(8, '\0');
  const auto t0 = Clock::now();
  const Status s = (*store)->get(sha256("x", 1), span_of(buf));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("timed out"), std::string::npos) << s.to_string();
  EXPECT_NE(s.error().message.find("deadline_ms"), std::string::npos) << s.to_string();
  EXPECT_LT(seconds_since(t0), 2.0);
}

// Replies that announce more than the call can use are refused from their
// header, long before the (default, 5 s) timeout and without waiting for
// or buffering the announced bytes.
TEST_F(RedisHostile, OversizeRepliesAreRefusedFromTheirHeader) {
  struct Case {
    std::string reply, expect;
  };
  // The chunk read below expects 100 bytes: GETRANGE asks for 101 at most,
  // and a reply may cost 160 more (one item's fixed cost and its framing).
  for (const Case& c : {Case{":1\r\n$2000000000\r\n", "a value of 2000000000 bytes"},
                        Case{":1\r\n$102\r\n" + std::string(2000, 'x'), "a value of 102 bytes"},
                        Case{":1\r\n*2000000000\r\n", "an array of 2000000000 elements"},
                        Case{":1\r\n+" + std::string(100000, 'y'), "a reply of more than 261 bytes"},
                        Case{":1\r\n!weird\r\n", "not Redis protocol"}}) {
    SCOPED_TRACE(c.expect);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", c.reply});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server));
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    std::string buf(100, '\0');
    const auto t0 = Clock::now();
    const Status s = (*store)->get(sha256("x", 1), span_of(buf));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.error().message.find(c.expect), std::string::npos) << s.to_string();
    EXPECT_LT(seconds_since(t0), 4.0);  // refused at once, not at the 5 s timeout
  }
  // Other commands are held to their own limits (SCAN's here), all of them
  // within kMaxRedisControlBytes.
  for (const Case& c : {Case{"$2000000000\r\n", "a value of 2000000000 bytes"},
                        Case{"+" + std::string(100000, 'y'), "a reply line longer than 65536 bytes"}}) {
    SCOPED_TRACE(c.expect);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", c.reply});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server));
    ASSERT_TRUE(store.ok());
    const auto stats = (*store)->stats();
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.error().message.find(c.expect), std::string::npos) << stats.error().to_string();
  }
}

// A server that hangs up while a put is being written: the put fails naming
// the server, and the process lives (the bytes go out with MSG_NOSIGNAL; a
// write(2) to the closed socket would end the process with SIGPIPE).
TEST_F(RedisHostile, AServerThatHangsUpMidPutIsAnErrorNotSigpipe) {
  EXPECT_EXIT(
      {
        auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", "<CLOSE>"});
        if (!server) std::_Exit(2);
        auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=5000");
        if (!store.ok()) std::_Exit(3);
        const std::string big(16 << 20, 'x');
        const std::vector<ChunkData> chunks = {chunk_of(big)};
        const Status s = (*store)->put(chunks);
        std::fprintf(stderr, "put: %s\n", s.to_string().c_str());
        std::_Exit(s.ok() ? 4 : 0);
      },
      ::testing::ExitedWithCode(0),
      "put: IOError: redis://127\\.0\\.0\\.1:[0-9]+: sending SET: the server closed the connection");
}

// A server that refuses what it is sent and hangs up (a value past Redis's
// proto-max-bulk-len) is quoted in the error.
TEST_F(RedisHostile, WhatAServerSaidBeforeHangingUpIsShown) {
  EXPECT_EXIT(
      {
        auto server = FakeServer::start(
            "127.0.0.1", {"+PONG\r\n", "-ERR Protocol error: invalid bulk length\r\n<THENCLOSE>"});
        if (!server) std::_Exit(2);
        auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=5000");
        if (!store.ok()) std::_Exit(3);
        const std::string big(64 << 20, 'x');
        const std::vector<ChunkData> chunks = {chunk_of(big)};
        const Status s = (*store)->put(chunks);
        std::fprintf(stderr, "put: %s\n", s.to_string().c_str());
        std::_Exit(s.ok() ? 4 : 0);
      },
      ::testing::ExitedWithCode(0),
      "sending SET: the server closed the connection \\([^)]*\\); it said: ERR Protocol error: invalid bulk length");
}

// A pooled connection the server has since closed (as Redis's `timeout`
// does to idle clients) is dropped, and the call gets a fresh one.
TEST_F(RedisHostile, AConnectionTheServerClosedIsNotReused) {
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n<THENCLOSE>", "+OK\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string bytes = "after the hang-up";
  const std::vector<ChunkData> chunks = {chunk_of(bytes)};
  const Status s = (*store)->put(chunks);
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// Replies shaped to cost far more memory than their wire bytes (arrays of
// empty arrays: 4 bytes on the wire, a reply object each) are charged what
// they cost and refused within each command's budget.
TEST_F(RedisHostile, RepliesAreChargedWhatTheyCostNotTheirWireBytes) {
  std::string flat = "*1048576\r\n";
  for (int i = 0; i < 1048576; ++i) flat += "*0\r\n";
  {
    // EXISTS takes no arrays at all.
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", flat});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server));
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    const auto t0 = Clock::now();
    auto has = (*store)->contains(sha256("x", 1));
    ASSERT_FALSE(has.ok());
    EXPECT_EQ(has.error().code, ErrorCode::kIOError);
    EXPECT_NE(has.error().message.find("an array of 1048576 elements, where this call takes no arrays"),
              std::string::npos)
        << has.error().to_string();
    EXPECT_LT(seconds_since(t0), 4.0);  // refused at once, not at the 5 s timeout
  }
  {
    // SCAN takes an array of keys: arrays of 10000 empty arrays in its place
    // cost about 1 MiB each for 40 KB on the wire, and the fourth runs out
    // its 4 MiB budget.
    std::string inner = "*10000\r\n";
    for (int i = 0; i < 10000; ++i) inner += "*0\r\n";
    std::string scan = "*2\r\n$1\r\n0\r\n*10000\r\n";
    for (int i = 0; i < 6; ++i) scan += inner;
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", scan});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server));
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    const auto t0 = Clock::now();
    auto stats = (*store)->stats();
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.error().message.find("SCAN: refused a reply of more than 4194304 bytes"), std::string::npos)
        << stats.error().to_string();
    EXPECT_LT(seconds_since(t0), 4.0);  // refused at once, not at the 5 s timeout
  }
}

// An error reply to the first of two pipelined commands leaves the second's
// reply owed: that connection is closed, never pooled, so no later call
// reads an earlier call's answer.
TEST_F(RedisHostile, AnErrorReplyNeverShiftsLaterAnswers) {
  const std::string loading = "-LOADING Redis is loading the dataset in memory\r\n";
  {
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", loading + loading, ":1\r\n$5\r\nhello\r\n",
                                                  ":1\r\n$5\r\nworld\r\n"});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    std::string buf(5, '\0');
    const Status first = (*store)->get(sha256("hello", 5), span_of(buf));
    ASSERT_FALSE(first.ok());
    EXPECT_NE(first.error().message.find("EXISTS refused: LOADING"), std::string::npos) << first.to_string();
    const Status second = (*store)->get(sha256("hello", 5), span_of(buf));
    ASSERT_TRUE(second.ok()) << second.to_string();
    EXPECT_EQ(buf, "hello");
    const Status third = (*store)->get(sha256("world", 5), span_of(buf));
    ASSERT_TRUE(third.ok()) << third.to_string();
    EXPECT_EQ(buf, "world");
  }
  {
    // The same for stats(): its pipelined STRLENs.
    auto key = [](char c) { return "$77\r\nkvpack:chunk:" + std::string(64, c) + "\r\n"; };
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", "*2\r\n$1\r\n0\r\n*2\r\n" + key('a') + key('b'),
                                                  loading + ":5\r\n", ":1\r\n"});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    auto stats = (*store)->stats();
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.error().message.find("STRLEN refused: LOADING"), std::string::npos) << stats.error().to_string();
    auto has = (*store)->contains(sha256("x", 1));
    ASSERT_TRUE(has.ok()) << has.error().to_string();
    EXPECT_TRUE(*has);
  }
}

// EXISTS answers 0 or 1; any other reply is an error, never "missing".
TEST_F(RedisHostile, AnUnexpectedReplyToExistsIsAnError) {
  for (const std::string& reply : {std::string("$2\r\nno\r\n"), std::string(":7\r\n"), std::string("+OK\r\n"),
                                    std::string("$-1\r\n")}) {
    SCOPED_TRACE(reply);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", reply, reply + "$0\r\n\r\n"});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    auto has = (*store)->contains(sha256("x", 1));
    ASSERT_FALSE(has.ok());
    EXPECT_EQ(has.error().code, ErrorCode::kIOError);
    EXPECT_NE(has.error().message.find("unexpected reply to EXISTS"), std::string::npos) << has.error().to_string();
    std::string buf(5, '\0');
    const Status s = (*store)->get(sha256("hello", 5), span_of(buf));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kIOError) << s.to_string();
    EXPECT_NE(s.error().message.find("unexpected reply to EXISTS"), std::string::npos) << s.to_string();
  }
}

// A key that EXISTS but whose GETRANGE answers other than a string: the
// message says what GETRANGE answered.
TEST_F(RedisHostile, AGetrangeThatAnswersNoStringIsNamed) {
  for (const auto& [reply, named] : {std::pair<std::string, std::string>("$-1\r\n", "GETRANGE answered a nil"),
                                     {":5\r\n", "GETRANGE answered the integer 5"}}) {
    SCOPED_TRACE(reply);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", ":1\r\n" + reply});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    std::string buf(5, '\0');
    const Status s = (*store)->get(sha256("hello", 5), span_of(buf));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kCorruption) << s.to_string();
    EXPECT_NE(s.error().message.find(named), std::string::npos) << s.to_string();
  }
}

// The server's words reach a terminal escaped and cut short.
TEST_F(RedisHostile, ServerTextIsEscapedAndCut) {
  const std::string hostile = "-ERR \x1b]0;owned-title\x07\x1b[2K\rkvring: ok: all chunks verified\r\n";
  const std::string longer = "-ERR " + std::string(3000, 'e') + "\r\n";
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", hostile, longer});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  auto has = (*store)->contains(sha256("x", 1));
  ASSERT_FALSE(has.ok());
  const std::string& m = has.error().message;
  for (char c : m) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << m;
  EXPECT_EQ(m.find('\x7f'), std::string::npos) << m;
  EXPECT_NE(m.find("EXISTS refused: ERR \\x1b]0;owned-title\\x07\\x1b[2K\\x0dkvring"), std::string::npos) << m;
  has = (*store)->contains(sha256("x", 1));
  ASSERT_FALSE(has.ok());
  EXPECT_LT(has.error().message.size(), 400u) << has.error().message;
  EXPECT_NE(has.error().message.find("... (3004 bytes)"), std::string::npos) << has.error().message;
}

// STRLEN answers a size a Redis string can have; stats() refuses others
// instead of summing them into an overflow.
TEST_F(RedisHostile, StatsRefusesImpossibleSizes) {
  const std::string scan = "*2\r\n$1\r\n0\r\n*2\r\n$77\r\nkvpack:chunk:" + std::string(64, 'a') +
                           "\r\n$77\r\nkvpack:chunk:" + std::string(64, 'b') + "\r\n";
  for (const std::string& lens : {std::string(":9223372036854775807\r\n:9223372036854775807\r\n"),
                                  std::string(":-5\r\n:1\r\n"), std::string("$1\r\n5\r\n:1\r\n")}) {
    SCOPED_TRACE(lens);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", scan, lens});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    auto stats = (*store)->stats();
    ASSERT_FALSE(stats.ok());
    EXPECT_NE(stats.error().message.find("unexpected reply to STRLEN"), std::string::npos)
        << stats.error().to_string();
  }
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", scan, ":10\r\n:0\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  auto stats = (*store)->stats();
  ASSERT_TRUE(stats.ok()) << stats.error().to_string();
  EXPECT_EQ(stats->chunks, 1);  // the other was deleted since the SCAN
  EXPECT_EQ(stats->bytes, 10);
}

// SCAN may return a key twice (while the server rehashes): stats counts
// each key once and asks STRLEN of it once. A key that names no chunk
// (other than key_of's 64 lowercase hex digits) is not counted. The server
// here answers one STRLEN on the second page, so a STRLEN of b or of
// either other key would wait it out.
TEST_F(RedisHostile, StatsCountsAKeyScanRepeatsOnce) {
  auto key = [](char c) { return "$77\r\nkvpack:chunk:" + std::string(64, c) + "\r\n"; };
  const std::string page1 = "*2\r\n$1\r\n7\r\n*3\r\n" + key('a') + key('b') + key('a');
  const std::string page2 = "*2\r\n$1\r\n0\r\n*4\r\n" + key('b') + key('c') + key('C') +
                            "$15\r\nkvpack:chunk:zz\r\n";
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", page1, ":10\r\n:20\r\n", page2, ":30\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  auto stats = (*store)->stats();
  ASSERT_TRUE(stats.ok()) << stats.error().to_string();
  EXPECT_EQ(stats->chunks, 3);
  EXPECT_EQ(stats->bytes, 60);
}

// AUTH is answered OK and PING PONG; any other answer (here from a
// server that is not what the spec names) refuses the store, naming the
// reply and never the password.
TEST_F(RedisHostile, OnlyOkAuthenticatesAndOnlyPongAnswersPing) {
  for (const std::string& reply : {std::string(":0\r\n"), std::string("+PONG\r\n"), std::string("$2\r\nOK\r\n")}) {
    SCOPED_TRACE(reply);
    auto server = FakeServer::start("127.0.0.1", {reply, "+PONG\r\n"});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://:s3cret@" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_FALSE(store.ok());
    EXPECT_NE(store.error().message.find("unexpected reply to AUTH"), std::string::npos) << store.error().to_string();
    EXPECT_EQ(store.error().message.find("s3cret"), std::string::npos) << store.error().to_string();
  }
  for (const std::string& reply : {std::string("+OK\r\n"), std::string(":1\r\n")}) {
    SCOPED_TRACE(reply);
    auto server = FakeServer::start("127.0.0.1", {reply});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_FALSE(store.ok());
    EXPECT_NE(store.error().message.find("unexpected reply to PING"), std::string::npos) << store.error().to_string();
  }
  auto server = FakeServer::start("127.0.0.1", {"+OK\r\n", "+PONG\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://:s3cret@" + loopback(*server) + "?timeout_ms=2000");
  EXPECT_TRUE(store.ok()) << store.error().to_string();
}

// The userinfo runs to the last '@': a password may hold '/', '?' or '@'
// unescaped, and no message shows any of it.
TEST_F(RedisHostile, PasswordsWithDelimitersParseAndNeverShow) {
  for (const auto& [spec, password] : std::vector<std::pair<std::string, std::string>>{
           {"redis://alice:s3cret/pw@db:6379", "s3cret/pw"},
           {"redis://alice:s3cret?pw@db:6379", "s3cret?pw"},
           {"redis://alice:s3cret@pw@db:6379", "s3cret@pw"},
           {"redis://:s3cret/pw@db", "s3cret/pw"}}) {
    auto o = parse_redis_spec(spec);
    ASSERT_TRUE(o.ok()) << spec << ": " << o.error().to_string();
    EXPECT_EQ(o->password, password) << spec;
    EXPECT_EQ(o->host, "db") << spec;
    EXPECT_EQ(o->port, 6379) << spec;
  }
  for (const std::string spec :
       {"redis://alice:s3cret/pw@db:99999", "redis://alice:s3cret?pw@db:x", "redis://:s3cret/pw@db/2",
        "redis://alice:s3cret%zz/pw@db", "redis://s3cret/pw@db", "redis://alice:s3cret?pw@db?timeout_ms=abc",
        "redis://alice:s3cret/pw@db?bogus=1", "redis://alice:s3cret@pw@[::1", "rediss://alice:s3cret/pw@db",
        "redis:/alice:s3cret/pw@db", "redis://alice:s3cret/pw@127.0.0.1:1?timeout_ms=2000"}) {
    auto r = open_chunk_store(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.error().message.find("s3cret"), std::string::npos) << r.error().to_string();
  }
}

TEST_F(RedisHostile, SpecsAreParsedAndPasswordsNeverShown) {
  auto o = parse_redis_spec("redis://us%40er:p%3Aw%2Fd@db.example:7000/?timeout_ms=250&deadline_ms=9000");
  ASSERT_TRUE(o.ok()) << o.error().to_string();
  EXPECT_EQ(o->user, "us@er");
  EXPECT_EQ(o->password, "p:w/d");
  EXPECT_EQ(o->host, "db.example");
  EXPECT_EQ(o->port, 7000);
  EXPECT_EQ(o->timeout.count(), 250);
  EXPECT_EQ(o->deadline.count(), 9000);
  auto v6 = parse_redis_spec("redis://[::1]:6380");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 6380);
  auto bare = parse_redis_spec("redis://[::1]");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->port, 6379);
  EXPECT_EQ(bare->timeout.count(), 5000);
  for (const auto& [spec, why] : std::vector<std::pair<std::string, std::string>>{
           {"redis://::1:6379", "IPv6 address goes in brackets"},
           {"redis://[::1:6379", "lacks its ']'"},
           {"redis://[::1]x", "unexpected text after"},
           {"redis://h?timeout_ms=0", "timeout_ms = '0' is not in"},
           {"redis://h?deadline_ms=soon", "deadline_ms = 'soon'"},
           {"redis://h?retries=3", "unknown option 'retries'"},
           {"redis://h?timeout_ms=1&timeout_ms=2", "timeout_ms is given twice"},
           {"redis://h?deadline_ms=9&timeout_ms=1&deadline_ms=9", "deadline_ms is given twice"},
           {"redis://u:s3cret-pw%zz@h", "malformed %XX"},
           {"redis://u:s3cret-pw@h:99999", "port '99999'"},
           {"redis://u:s3cret-pw@h/2", "database paths"},
           {"redis://user-only@h", "a user needs a password"}}) {
    auto r = open_chunk_store(spec);
    ASSERT_FALSE(r.ok()) << spec;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument) << spec;
    EXPECT_NE(r.error().message.find(why), std::string::npos) << r.error().to_string();
    EXPECT_EQ(r.error().message.find("s3cret-pw"), std::string::npos) << r.error().to_string();
  }
  // The form a refusal quotes is the one the parser takes: a user only
  // with a password.
  auto user_only = parse_redis_spec("redis://user-only@h");
  ASSERT_FALSE(user_only.ok());
  EXPECT_NE(user_only.error().message.find("(redis://[[USER]:PASSWORD@]HOST[:PORT][?timeout_ms=N&deadline_ms=N])"),
            std::string::npos)
      << user_only.error().to_string();
  auto unknown = open_chunk_store("rediss://u:s3cret-pw@h");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().message.find("s3cret-pw"), std::string::npos) << unknown.error().to_string();
  if (!redis_store_compiled()) return;
  // A stalled server reached with credentials: the timeout names it, not them.
  auto server = FakeServer::start("127.0.0.1", {});
  ASSERT_TRUE(server);
  auto stalled = open_chunk_store("redis://alice:s3cret-pw@" + loopback(*server) + "?timeout_ms=200");
  ASSERT_FALSE(stalled.ok());
  EXPECT_NE(stalled.error().message.find("timed out"), std::string::npos) << stalled.error().to_string();
  EXPECT_NE(stalled.error().message.find("redis://alice@" + loopback(*server)), std::string::npos)
      << stalled.error().to_string();
  EXPECT_EQ(stalled.error().message.find("s3cret-pw"), std::string::npos) << stalled.error().to_string();
}

std::unique_ptr<testing::RedisServer> start_redis(const std::string& password, bool ipv6) {
  std::string why;
  auto server = testing::RedisServer::start(&why, password, ipv6);
  if (!server && why.find("not installed") == std::string::npos && why.find("no Redis store") == std::string::npos)
    ADD_FAILURE() << why;
  return server;
}

TEST_F(RedisHostile, PasswordsAuthenticateAndStaySecret) {
  const std::string password = "hunter2-very-secret";
  auto redis = start_redis(password, false);
  if (!redis) GTEST_SKIP() << "redis-server is not available";
  const std::string hostport = "127.0.0.1:" + std::to_string(redis->port());
  for (const std::string& url : {"redis://:" + password + "@" + hostport,
                                 "redis://default:" + password + "@" + hostport}) {
    auto store = open_chunk_store(url);
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    EXPECT_EQ((*store)->spec().find(password), std::string::npos) << (*store)->spec();
    const std::string bytes = "a chunk behind a password";
    const std::vector<ChunkData> chunks = {chunk_of(bytes)};
    ASSERT_TRUE((*store)->put(chunks).ok());
    std::string back(bytes.size(), '\0');
    ASSERT_TRUE((*store)->get(chunks[0].name, span_of(back)).ok());
    EXPECT_EQ(back, bytes);
  }
  for (const std::string& url : {"redis://" + hostport, "redis://:wrong-" + password + "@" + hostport,
                                 "redis://mallory:" + password + "@" + hostport}) {
    auto store = open_chunk_store(url);
    ASSERT_FALSE(store.ok()) << url;
    EXPECT_NE(store.error().message.find(hostport), std::string::npos) << store.error().to_string();
    EXPECT_EQ(store.error().message.find(password), std::string::npos) << store.error().to_string();
  }
}

// A server that refuses writes refuses check_writable's probe, naming why;
// one that takes it answers OK to its SET and then its DEL.
TEST_F(RedisHostile, CheckWritableTriesAWrite) {
  for (const std::string& refusal : {std::string("-NOPERM this user has no permissions to run the 'set' command\r\n"),
                                     std::string("-OOM command not allowed when used memory > 'maxmemory'.\r\n"),
                                     std::string("-READONLY You can't write against a read only replica.\r\n")}) {
    SCOPED_TRACE(refusal);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", refusal});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    const Status s = (*store)->check_writable();
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kIOError);
    EXPECT_NE(s.error().message.find("SET refused: " + refusal.substr(1, refusal.find(' ') - 1)), std::string::npos)
        << s.to_string();
  }
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", "+OK\r\n", ":1\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  EXPECT_TRUE((*store)->check_writable().ok());
}

// Only +OK answers a put's SET: another status (QUEUED, or PONG, a reply
// meant for another command) fails the put, naming it, and the connection
// is dropped.
TEST_F(RedisHostile, OnlyOkAnswersAPutsSet) {
  const std::string a = "a chunk to put", b = "another chunk to put";
  const std::vector<ChunkData> chunks = {chunk_of(a), chunk_of(b)};
  for (const auto& [reply, named] :
       {std::pair<std::string, std::string>("+QUEUED\r\n+QUEUED\r\n", "the status 'QUEUED'"),
        {"+OK\r\n+PONG\r\n", "the status 'PONG'"}}) {
    SCOPED_TRACE(reply);
    auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", reply});
    ASSERT_TRUE(server);
    auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
    ASSERT_TRUE(store.ok()) << store.error().to_string();
    const Status s = (*store)->put(chunks);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kIOError);
    EXPECT_NE(s.error().message.find(std::string("unexpected reply to SET: ").append(named)), std::string::npos)
        << s.to_string();
  }
  auto server = FakeServer::start("127.0.0.1", {"+PONG\r\n", "+OK\r\n+OK\r\n"});
  ASSERT_TRUE(server);
  auto store = open_chunk_store("redis://" + loopback(*server) + "?timeout_ms=2000");
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  const Status s = (*store)->put(chunks);
  EXPECT_TRUE(s.ok()) << s.to_string();
}

// One command sent to a server as RESP, its first reply line returned.
std::string raw_command(int port, const std::vector<std::string>& args) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  std::string line;
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    std::string req = "*" + std::to_string(args.size()) + "\r\n";
    for (const std::string& s : args)
      req.append("$").append(std::to_string(s.size())).append("\r\n").append(s).append("\r\n");
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char c = 0;
      while (::recv(fd, &c, 1, 0) == 1 && c != '\n') line += c;
    }
  }
  if (fd >= 0) ::close(fd);
  return line;
}

// On a real server: the probe leaves no key; once maxmemory is reached
// (noeviction, the default policy), the probe is refused as a put would be.
TEST_F(RedisHostile, CheckWritableOnARealServer) {
  auto redis = start_redis("", false);
  if (!redis) GTEST_SKIP() << "redis-server is not available";
  auto store = open_chunk_store(redis->spec());
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  ASSERT_TRUE((*store)->check_writable().ok());
  EXPECT_EQ(raw_command(redis->port(), {"DBSIZE"}), ":0\r");
  ASSERT_EQ(raw_command(redis->port(), {"CONFIG", "SET", "maxmemory", "1"}), "+OK\r");
  const Status s = (*store)->check_writable();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("SET refused: OOM"), std::string::npos) << s.to_string();
  const std::string past = "a chunk past maxmemory";  // chunk_of views its bytes
  const std::vector<ChunkData> chunks = {chunk_of(past)};
  EXPECT_FALSE((*store)->put(chunks).ok());
  ASSERT_EQ(raw_command(redis->port(), {"CONFIG", "SET", "maxmemory", "0"}), "+OK\r");
  EXPECT_TRUE((*store)->check_writable().ok());
  EXPECT_TRUE((*store)->put(chunks).ok());
}

bool ipv6_loopback() {
  auto s = FakeServer::start("::1", {});
  return s != nullptr;
}

TEST_F(RedisHostile, IPv6Loopback) {
  if (!ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback here";
  auto server = FakeServer::start("::1", {});
  ASSERT_TRUE(server);
  const std::string where = "[::1]:" + std::to_string(server->port());
  auto stalled = open_chunk_store("redis://" + where + "?timeout_ms=200");
  ASSERT_FALSE(stalled.ok());
  EXPECT_NE(stalled.error().message.find("timed out"), std::string::npos) << stalled.error().to_string();
  EXPECT_NE(stalled.error().message.find(where), std::string::npos) << stalled.error().to_string();
  auto redis = start_redis("", true);
  if (!redis) GTEST_SKIP() << "redis-server is not available";
  auto store = open_chunk_store("redis://[::1]:" + std::to_string(redis->port()));
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  EXPECT_EQ((*store)->spec(), "redis://[::1]:" + std::to_string(redis->port()));
  const std::string bytes = "over IPv6";
  const std::vector<ChunkData> chunks = {chunk_of(bytes)};
  ASSERT_TRUE((*store)->put(chunks).ok());
  EXPECT_TRUE(*(*store)->contains(chunks[0].name));
}

// Runs `probe` in a child of its own mount and network namespaces whose
// resolver (files, then DNS at 127.0.0.1:53) holds no name but localhost and
// whose name server takes queries and never answers. The child's exit
// code: 0 passed, 1 failed (its message on `out`), 77 no such namespace
// could be made here (no privilege, or a read-only /etc).
int in_a_silent_resolver(const std::function<std::string()>& probe, std::string* out) {
  int fds[2];
  if (::pipe(fds) != 0) return 77;
  const std::string dir = testing::make_temp_dir("resolver");
  const pid_t pid = ::fork();
  if (pid < 0) return 77;
  if (pid == 0) {
    ::close(fds[0]);
    auto finish = [&](int code, const std::string& message) {
      (void)!::write(fds[1], message.data(), message.size());
      ::_exit(code);
    };
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) finish(77, "unshare: " + std::string(std::strerror(errno)));
    // Nothing mounted here reaches the rest of the machine.
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) finish(77, "private mounts");
    const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ifreq ifr{};
    std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (s < 0 || ::ioctl(s, SIOCGIFFLAGS, &ifr) != 0) finish(77, "loopback flags");
    ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
    if (::ioctl(s, SIOCSIFFLAGS, &ifr) != 0) finish(77, "loopback up");
    // The name server: a socket that takes every query and answers none.
    sockaddr_in ns{};
    ns.sin_family = AF_INET;
    ns.sin_port = htons(53);
    ns.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(s, reinterpret_cast<sockaddr*>(&ns), sizeof ns) != 0) finish(77, "bind 53");
    const std::pair<const char*, const char*> files[] = {
        {"/etc/resolv.conf", "nameserver 127.0.0.1\noptions timeout:5 attempts:2\n"},
        {"/etc/hosts", "127.0.0.1 localhost\n"},
        {"/etc/nsswitch.conf", "hosts: files dns\n"}};
    for (const auto& [target, text] : files) {
      const std::string mine = dir + "/" + std::strrchr(target, '/');
      std::ofstream(mine) << text;
      if (::mount(mine.c_str(), target, nullptr, MS_BIND, nullptr) != 0)
        finish(77, std::string("bind ") + target + ": " + std::strerror(errno));
    }
    const std::string failure = probe();
    finish(failure.empty() ? 0 : 1, failure);
  }
  ::close(fds[1]);
  // The child is ended if it outlives its bound; the pipe closes with it.
  int status = 0;
  const auto t0 = Clock::now();
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(t0) > 30) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      *out = "the probe ran past 30 s";
      ::close(fds[0]);
      testing::remove_tree(dir);
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  testing::remove_tree(dir);
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out->append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

TEST_F(RedisHostile, AHostNameIsResolvedWithinTheTimeout) {
  // The resolver would wait 2 x 5 s for its name server; the store gives
  // up at timeout_ms, naming the wait.
  std::string message;
  const int rc = in_a_silent_resolver(
      [] {
        const auto t0 = Clock::now();
        auto store = open_chunk_store("redis://kvring-cache.example:6379?timeout_ms=300");
        const double took = seconds_since(t0);
        if (store.ok()) return std::string("a store opened with no server");
        const std::string m = store.error().to_string();
        if (m.find("timed out resolving kvring-cache.example:6379") == std::string::npos)
          return "not a timeout naming the host: " + m;
        if (took < 0.25 || took > 2.0) return "took " + std::to_string(took) + " s: " + m;
        // The name in the hosts file still connects (nothing listens on
        // this port, so the connection is refused, at once).
        auto local = open_chunk_store("redis://localhost:1?timeout_ms=300");
        if (local.ok() || local.error().message.find("cannot connect") == std::string::npos)
          return "localhost:1: " + (local.ok() ? std::string("opened") : local.error().to_string());
        return std::string();
      },
      &message);
  if (rc == 77) GTEST_SKIP() << "no private mount and network namespace here (" << message << ")";
  EXPECT_EQ(rc, 0) << message;
}

// --- Directory stores ---------------------------------------------------

class DirStoreHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("dirhostile");
    root_ = dir_ + "/store";
    auto s = open_dir_store(root_);
    ASSERT_TRUE(s.ok());
    store_ = std::move(*s);
    chunk_ = chunk_of(bytes_);
    path_ = root_ + "/" + to_hex(chunk_.name);
    // A FIFO opened for reading without O_NONBLOCK would wait for a writer
    // forever: end the test process instead of hanging.
    ::alarm(60);
  }
  void TearDown() override {
    ::alarm(0);
    testing::remove_tree(dir_);
  }

  // The store reads the chunk back, and the name holds a regular file.
  void expect_stored() {
    ASSERT_TRUE(store_->put({&chunk_, 1}).ok());
    struct stat st {};
    ASSERT_EQ(::lstat(path_.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    std::string back(bytes_.size(), '\0');
    ASSERT_TRUE(store_->get(chunk_.name, span_of(back)).ok());
    EXPECT_EQ(back, bytes_);
    EXPECT_TRUE(*store_->contains(chunk_.name));
  }

  Status get() const {
    std::string back(bytes_.size(), '\0');
    return store_->get(chunk_.name, span_of(back));
  }

  std::string dir_, root_, path_;
  const std::string bytes_ = "rows that belong under this name";
  ChunkData chunk_;
  std::unique_ptr<ChunkStore> store_;
};

TEST_F(DirStoreHostile, ASymlinkUnderAChunkNameIsReplacedNotFollowed) {
  const std::string victim = dir_ + "/victim";
  std::ofstream(victim) << "not the store's";
  for (const std::string& target : {victim, dir_ + "/nowhere"}) {
    SCOPED_TRACE(target);
    ::unlink(path_.c_str());
    ASSERT_EQ(::symlink(target.c_str(), path_.c_str()), 0);
    const Status s = get();
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.error().code, ErrorCode::kCorruption);
    EXPECT_NE(s.error().message.find("is a symbolic link, not a chunk file"), std::string::npos) << s.to_string();
    const Result<bool> has = store_->contains(chunk_.name);
    ASSERT_FALSE(has.ok());
    EXPECT_EQ(has.error().code, ErrorCode::kCorruption);
    EXPECT_NE(has.error().message.find("is a symbolic link, not a chunk file"), std::string::npos);
    expect_stored();
  }
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "not the store's");
  EXPECT_EQ(::access((dir_ + "/nowhere").c_str(), F_OK), -1);
}

TEST_F(DirStoreHostile, AFifoUnderAChunkNameNeitherBlocksNorStays) {
  ASSERT_EQ(::mkfifo(path_.c_str(), 0644), 0);
  const auto t0 = Clock::now();
  const Status s = get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kCorruption);
  EXPECT_NE(s.error().message.find("is a FIFO, not a chunk file"), std::string::npos) << s.to_string();
  const Result<bool> has = store_->contains(chunk_.name);
  ASSERT_FALSE(has.ok());
  EXPECT_NE(has.error().message.find("is a FIFO, not a chunk file"), std::string::npos);
  expect_stored();
  EXPECT_LT(seconds_since(t0), 5.0);
}

// A directory may hold someone's files: it is moved aside, whole.
TEST_F(DirStoreHostile, ADirectoryUnderAChunkNameIsMovedAside) {
  ASSERT_EQ(::mkdir(path_.c_str(), 0755), 0);
  std::ofstream(path_ + "/keep-me") << "precious";
  EXPECT_FALSE(get().ok());
  expect_stored();
  std::string aside;
  for (const std::string& n : testing::list_dir(root_))
    if (n.rfind(".quarantine-" + to_hex(chunk_.name), 0) == 0) aside = n;
  ASSERT_FALSE(aside.empty());
  std::ifstream in(root_ + "/" + aside + "/keep-me");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious");
  auto stats = store_->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->chunks, 1);
  auto report = gc_dir_store(root_, std::chrono::seconds(0));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->quarantined, 1);
  EXPECT_EQ(::access((root_ + "/" + aside + "/keep-me").c_str(), F_OK), 0);
}

// A file system that lets a file claim 2^63 - 1 bytes (tmpfs does) makes
// the sizes' sum overflow: stats() says so instead.
TEST_F(DirStoreHostile, StatsOfHugeSparseFilesIsAnErrorNotAnOverflow) {
  // The store's place, or else tmpfs.
  const std::string shm = "/dev/shm/kvring-sparse-" + std::to_string(::getpid());
  std::string root;
  for (const std::string& r : {root_, shm}) {
    if (!open_dir_store(r).ok()) continue;
    const std::string probe = r + "/" + std::string(64, 'a');
    std::ofstream(probe) << "";
    if (::truncate(probe.c_str(), INT64_MAX) == 0) {
      root = r;
      break;
    }
    ::unlink(probe.c_str());
  }
  if (root.empty()) {
    testing::remove_tree(shm);
    GTEST_SKIP() << "no file system here takes a file of 2^63 - 1 bytes";
  }
  const std::string second = root + "/" + std::string(64, 'b');
  std::ofstream(second) << "";
  ASSERT_EQ(::truncate(second.c_str(), INT64_MAX), 0);
  auto store = open_dir_store(root);
  ASSERT_TRUE(store.ok());
  auto stats = (*store)->stats();
  testing::remove_tree(shm);
  ASSERT_FALSE(stats.ok());
  EXPECT_NE(stats.error().message.find("sizes add up past 2^63 bytes"), std::string::npos)
      << stats.error().to_string();
}

TEST_F(DirStoreHostile, CheckWritableRefusesAStoreThatCannotBeWritten) {
  EXPECT_TRUE(store_->check_writable().ok());
  EXPECT_TRUE(testing::list_dir(root_).empty());  // the probe leaves nothing
  // /proc refuses new files even to root.
  auto proc = open_dir_store("/proc");
  ASSERT_TRUE(proc.ok());
  const Status s = (*proc)->check_writable();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("dir:/proc: cannot write into the store"), std::string::npos) << s.to_string();
}

TEST_F(DirStoreHostile, CheckWritableRefusesARootTooLongForAChunksNames) {
  // Nested directories to a root of PATH_MAX - 60 bytes: the probe's name
  // (".tmp-probe-" and three numbers) fits under PATH_MAX, a chunk's
  // temporary (".tmp-", 64 digits and three numbers) does not.
  const std::size_t target = PATH_MAX - 60;
  std::string root = root_, first;
  while (root.size() < target) {
    const std::size_t left = target - root.size() - 1;
    root.append(1, '/').append(left >= 202 ? 200 : left, 'd');
    ASSERT_EQ(::mkdir(root.c_str(), 0755), 0) << root.size();
    if (first.empty()) first = root;
  }
  ASSERT_EQ(root.size(), target);
  auto store = open_dir_store(root);
  ASSERT_TRUE(store.ok()) << store.error().to_string();
  const Status s = (*store)->check_writable();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, ErrorCode::kIOError);
  EXPECT_NE(s.error().message.find("system's path limit"), std::string::npos) << s.to_string();
  // What check_writable guards against: the put it refuses would fail.
  const std::string bytes = "a chunk";
  const ChunkData chunk = chunk_of(bytes);
  EXPECT_FALSE((*store)->put({&chunk, 1}).ok());
  // A shorter root, with room for every name, is writable and takes a put.
  auto shorter = open_dir_store(first);
  ASSERT_TRUE(shorter.ok());
  EXPECT_TRUE((*shorter)->check_writable().ok());
  EXPECT_TRUE((*shorter)->put({&chunk, 1}).ok());
}

void age(const std::string& path, int seconds) {
  const timespec t[2] = {{::time(nullptr) - seconds, 0}, {::time(nullptr) - seconds, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), t, AT_SYMLINK_NOFOLLOW), 0);
}

// Temporaries of dead writers go; those of live writers, recent ones, and
// everything else stay, files named like temporaries but not by a writer
// among them.
TEST_F(DirStoreHostile, GcRemovesOnlyTemporariesNoWriterOwns) {
  ASSERT_TRUE(store_->put({&chunk_, 1}).ok());
  const std::string dead = root_ + "/.tmp-" + to_hex(chunk_.name) + "-999999-0-1";
  const std::string held = root_ + "/.tmp-" + to_hex(chunk_.name) + "-999999-1-1";
  const std::string fresh = root_ + "/.tmp-" + to_hex(chunk_.name) + "-999999-2-1";
  const std::string link = root_ + "/.tmp-probe-999999-3-1";
  const std::string victim = dir_ + "/victim";
  const std::vector<std::string> foreign = {
      root_ + "/.tmp-notes.txt", root_ + "/.tmp-" + to_hex(chunk_.name) + "-999999-4",
      root_ + "/.tmp-" + to_hex(chunk_.name) + "-9x-4-1", root_ + "/.tmp-" + to_hex(chunk_.name) + "-1-2-3-4",
      root_ + "/.tmp-probe-1-2-", root_ + "/.tmp-" + to_hex(chunk_.name).substr(1) + "-1-2-3"};
  for (const std::string& p : {dead, held, fresh, victim}) std::ofstream(p) << "partial";
  for (const std::string& p : foreign) {
    std::ofstream(p) << "someone's";
    age(p, 3600);
  }
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  age(dead, 3600);
  age(held, 3600);
  age(victim, 3600);
  const int fd = ::open(held.c_str(), O_RDONLY);  // a writer that still holds its lock
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  auto report = gc_dir_store(root_, std::chrono::seconds(600));
  ASSERT_TRUE(report.ok()) << report.error().to_string();
  EXPECT_EQ(report->removed, 2);  // dead, link
  EXPECT_EQ(report->kept, 2);     // held, fresh
  EXPECT_EQ(::access(dead.c_str(), F_OK), -1);
  EXPECT_EQ(::access(held.c_str(), F_OK), 0);
  EXPECT_EQ(::access(fresh.c_str(), F_OK), 0);
  EXPECT_EQ(::access(victim.c_str(), F_OK), 0);
  EXPECT_EQ(::access(path_.c_str(), F_OK), 0);  // chunks are never touched
  for (const std::string& p : foreign) EXPECT_EQ(::access(p.c_str(), F_OK), 0) << p;
  ::close(fd);                                  // the writer died
  report = gc_dir_store(root_, std::chrono::seconds(600));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->removed, 1);
  EXPECT_EQ(::access(held.c_str(), F_OK), -1);
  EXPECT_EQ(::access(fresh.c_str(), F_OK), 0);
  EXPECT_TRUE(get().ok());
  EXPECT_FALSE(gc_dir_store(dir_ + "/absent").ok());
}

// A gc that runs while a put is between creating its temporary and
// renaming it, with no age limit at all, leaves the writer's file alone.
TEST_F(DirStoreHostile, GcNeverRemovesALiveWritersTemporary) {
  IoOptions io;
  std::int64_t kept = -1, removed = -1;
  io.fault = [&](IoStep step, const std::string& path) {
    if (step == IoStep::kFsync && path.find("/.tmp-") != std::string::npos) {
      auto r = gc_dir_store(root_, std::chrono::seconds(0));
      if (r.ok()) {
        kept = r->kept;
        removed = r->removed;
      }
    }
    return Status::Ok();
  };
  auto store = open_dir_store(root_, io);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->put({&chunk_, 1}).ok());
  EXPECT_EQ(kept, 1);
  EXPECT_EQ(removed, 0);
  EXPECT_TRUE(get().ok());
}

}  // namespace
}  // namespace kvring
