#include "pack_test_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "kvring/chunk_store.h"
#include "kvring/sha256.h"
#include "pack/coding.h"

namespace kvring::testing {

void seeded_rows(std::uint64_t seed, std::int64_t layer, std::int64_t position, std::int64_t count,
                 std::int64_t kv_dim, float* k, float* v) {
  for (std::int64_t r = 0; r < count; ++r) {
    std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<std::uint64_t>(layer) << 40) ^
                        static_cast<std::uint64_t>(position + r));
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    for (std::int64_t e = 0; e < kv_dim; ++e) {
      k[r * kv_dim + e] = dist(rng);
      v[r * kv_dim + e] = dist(rng);
    }
  }
}

void fill(KvCache& cache, std::int64_t from, std::int64_t to, std::uint64_t seed, std::int64_t batch,
          std::int64_t split, std::uint64_t seed_after) {
  const std::int64_t kv = cache.config().kv_dim();
  std::vector<float> k, v;
  for (std::int64_t p = from; p < to;) {
    const std::int64_t n = std::min(batch, to - p);
    k.resize(static_cast<std::size_t>(n * kv));
    v.resize(k.size());
    for (std::int64_t l = 0; l < cache.n_layers(); ++l) {
      for (std::int64_t r = 0; r < n; ++r) {
        const std::int64_t pos = p + r;
        seeded_rows(split >= 0 && pos >= split ? seed_after : seed, l, pos, 1, kv,
                    k.data() + r * kv, v.data() + r * kv);
      }
      const Status s = cache.store_batch(l, p, n, k.data(), v.data());
      if (!s.ok()) std::abort();
    }
    p += n;
  }
}

std::unique_ptr<KvCache> filled_cache(const ModelConfig& config, std::int64_t context,
                                      std::int64_t tokens, std::uint64_t seed, std::int64_t slack) {
  auto c = make_cpu_cache(config, {.context = context, .slack = slack});
  if (!c.ok()) std::abort();
  fill(**c, 0, tokens, seed);
  return std::move(*c);
}

bool same_rows(const Snapshot& a, const Snapshot& b) {
  if (a.planes.size() != b.planes.size() || a.token_count != b.token_count ||
      a.token_ids != b.token_ids || a.metadata != b.metadata || a.context != b.context ||
      a.config.fingerprint() != b.config.fingerprint())
    return false;
  for (std::size_t l = 0; l < a.planes.size(); ++l) {
    const PlaneSnapshot& x = a.planes[l];
    const PlaneSnapshot& y = b.planes[l];
    if (!(x.ring == y.ring) || x.kind != y.kind || x.layout != y.layout || x.k != y.k || x.v != y.v)
      return false;
  }
  return true;
}

Snapshot snapshot_with_extras(const KvCache& cache, std::uint64_t seed) {
  auto s = take_snapshot(cache);
  if (!s.ok()) std::abort();
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < s->token_count; ++i)
    s->token_ids.push_back(static_cast<std::int32_t>(rng() % 50000));
  s->metadata = R"({"run":{"seed":)" + std::to_string(seed) + R"(,"hidden":64}})";
  return std::move(*s);
}

std::vector<std::int64_t> section_boundaries(const Manifest& m) {
  const std::int64_t n_layers = m.header.config.n_layers;
  std::vector<std::int64_t> b;
  std::int64_t at = 0;
  auto add = [&](std::int64_t width) {
    b.push_back(at);
    at += width;
  };
  add(8);  // magic
  add(2);  // version
  add(2);  // flags
  add(4);  // manifest_len
  add(24 + n_layers + kDigestBytes);  // geometry
  add(16);                            // cache
  add(8 + 4 * static_cast<std::int64_t>(m.header.token_ids.size()));  // tokens
  add(4 + static_cast<std::int64_t>(m.header.metadata.size()));       // metadata
  add(4 + n_layers * kPlaneRecordBytes);                              // plane table
  add(4 + static_cast<std::int64_t>(m.chunks.size()) * kChunkRecordBytes);  // chunk table
  add(kDigestBytes);
  if (!m.thin)
    for (const PackChunk& c : m.chunks) add(c.byte_length);
  b.push_back(at);  // the end
  return b;
}

void reseal(std::string* pack) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(pack->data());
  const std::int64_t len = coding::decode_fixed32(p + 12);
  const Digest d = sha256(pack->data(), static_cast<std::size_t>(kPreambleBytes + len));
  std::memcpy(pack->data() + kPreambleBytes + len, d.data(), d.size());
}

namespace {

std::string find_redis_server() {
  std::string path = std::getenv("PATH") ? std::getenv("PATH") : "";
  path += ":/usr/bin:/usr/sbin:/usr/local/bin";
  std::size_t start = 0;
  while (start <= path.size()) {
    const std::size_t end = std::min(path.find(':', start), path.size());
    const std::string dir = path.substr(start, end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/redis-server";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

}  // namespace

std::unique_ptr<RedisServer> RedisServer::start(std::string* why, const std::string& password,
                                                bool ipv6) {
  const std::string exe = find_redis_server();
  if (exe.empty()) {
    *why = "redis-server is not installed (scripts/setup.sh installs it)";
    return nullptr;
  }
  if (!redis_store_compiled()) {
    *why = "this build has no Redis store (hiredis was not found)";
    return nullptr;
  }
  // A port taken between the probe and the server's bind makes the server
  // exit; try a few.
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::unique_ptr<RedisServer> s(new RedisServer());
    s->dir_ = make_temp_dir("redis");
    s->password_ = password;
    s->port_ = free_loopback_port();
    const std::string port = std::to_string(s->port_);
    const std::string log = s->dir_ + "/redis.log";
    const pid_t pid = ::fork();
    if (pid == 0) {
      // The server must not outlive a test process that dies.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<const char*> args = {exe.c_str(), "--port", port.c_str(), "--bind", "127.0.0.1"};
      if (ipv6) args.push_back("::1");
      for (const char* a : {"--save", "", "--appendonly", "no", "--daemonize", "no", "--dir"}) args.push_back(a);
      args.push_back(s->dir_.c_str());
      if (!password.empty()) {
        args.push_back("--requirepass");
        args.push_back(password.c_str());
      }
      args.push_back(nullptr);
      ::execv(exe.c_str(), const_cast<char* const*>(args.data()));
      ::_exit(127);
    }
    if (pid < 0) {
      *why = "fork failed";
      return nullptr;
    }
    s->pid_ = pid;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        s->pid_ = -1;
        break;
      }
      if (open_chunk_store(s->url()).ok()) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  *why = "redis-server did not start";
  return nullptr;
}

RedisServer::~RedisServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  if (!dir_.empty()) remove_tree(dir_);
}

std::string make_temp_dir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/kvring-" + tag + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) std::abort();
  return templ;
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace kvring::testing
