// Hostile inputs: files that are not regular files, configs without end,
// packs whose manifests claim gigabytes they do not hold, run records whose
// fields disagree, and text meant for a terminal. Every case must fail fast,
// with a clear error, in bounded memory; the command-line cases run the
// kvring tool in a child with a wall-clock deadline (a hang fails the test)
// and, where memory is the point, under RLIMIT_AS.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <future>
#include <nlohmann/json.hpp>
#include <gtest/gtest.h>
#include <string>
#include <vector>

#include "../tools/run_pack.h"
#include "core/text.h"
#include "core/file_read.h"
#include "hostile_pack.h"
#include "kvring/cache.h"
#include "kvring/config.h"
#include "kvring/pack.h"
#include "pack_test_util.h"
#include "test_util.h"

namespace kvring {
namespace {

using testing::gigabyte_chunks_pack;
using testing::hostile_pack_head;
using testing::HostilePack;

// A call that may block on `fifo` (the old behaviour of opening one): runs it
// on another thread and, past the deadline, opens the FIFO's other end so
// the call returns, then fails the test.
template <class F>
auto within_deadline(const std::string& fifo, F fn) {
  auto fut = std::async(std::launch::async, fn);
  if (fut.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    ADD_FAILURE() << "blocked on " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  }
  return fut.get();
}

struct Ran {
  int rc = -1;
  bool timed_out = false;
  std::string out, err;
};

// Runs the kvring tool with `args` in `dir`, under an address-space limit
// when `as_bytes` > 0 and a file size limit when `file_bytes` > 0, killed
// after `seconds`. SIGXFSZ is as a shell leaves it (the default action),
// whatever this process set.
Ran run_tool(const std::vector<std::string>& args, const std::string& dir, std::int64_t as_bytes = 0,
             int seconds = 60, std::int64_t file_bytes = 0) {
  int out_pipe[2], err_pipe[2];
  if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) std::abort();
  std::vector<std::string> argv_s = {KVRING_TOOL};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    if (::chdir(dir.c_str()) != 0) ::_exit(126);
    if (as_bytes > 0) {
      const rlimit lim{static_cast<rlim_t>(as_bytes), static_cast<rlim_t>(as_bytes)};
      if (::setrlimit(RLIMIT_AS, &lim) != 0) ::_exit(126);
    }
    if (file_bytes > 0) {
      const rlimit lim{static_cast<rlim_t>(file_bytes), static_cast<rlim_t>(file_bytes)};
      if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) ::_exit(126);
    }
    ::signal(SIGXFSZ, SIG_DFL);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  Ran r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    if (::poll(fds, 2, static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<std::size_t>(n));
      } else {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) ::close(f.fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::string describe(const Ran& r) {
  return "exit " + std::to_string(r.rc) + (r.timed_out ? " (timed out)" : "") + "\nstdout: " + r.out +
         "\nstderr: " + r.err;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

class HostileFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::make_temp_dir("hostile");
    fifo_ = dir_ + "/fifo";
    ASSERT_EQ(::mkfifo(fifo_.c_str(), 0600), 0) << std::strerror(errno);
  }
  void TearDown() override { testing::remove_tree(dir_); }
  std::string dir_, fifo_;
};

// An empty value is refused, not taken for the option's absence (an empty
// --resume ran a fresh session, an empty --save saved nothing, an empty
// --config ran the default model).
TEST_F(HostileFiles, EmptyOptionValuesAreRefused) {
  for (const char* opt : {"--resume", "--save", "--config", "--model", "--backend", "--store", "--tokens"}) {
    const Ran r = run_tool({"run", opt, "", "--no-progress"}, dir_);
    EXPECT_EQ(r.rc, 2) << opt << describe(r);
    EXPECT_NE(r.err.find(std::string(opt) + " needs a value, got an empty one"), std::string::npos) << describe(r);
    EXPECT_EQ(r.out, "") << opt;
  }
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"footprint", "--model", ""}, {"pack", "verify", "x.kvpack", "--store", ""},
           {"handoff", "serve", "--listen", "", "--tokens", "5"}, {"config", "--config", ""}}) {
    const Ran r = run_tool(args, dir_);
    EXPECT_EQ(r.rc, 2) << args[0] << describe(r);
    EXPECT_NE(r.err.find("needs a value, got an empty one"), std::string::npos) << describe(r);
  }
}

TEST_F(HostileFiles, FifoAsPackIsRefusedWithoutBlocking) {
  auto r = within_deadline(fifo_, [&] { return open_pack_file(fifo_); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message.find(fifo_ + ": it is a FIFO, not a regular file"), std::string::npos)
      << r.error().message;
}

TEST_F(HostileFiles, FifoAsConfigIsRefusedWithoutBlocking) {
  auto r = within_deadline(fifo_, [&] { return load_hf_config(fifo_); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kConfig);
  EXPECT_NE(r.error().message.find("it is a FIFO"), std::string::npos) << r.error().message;
}

TEST_F(HostileFiles, DevicesAsConfigAreRefused) {
  for (const char* dev : {"/dev/zero", "/dev/urandom", "/dev/null"}) {
    auto r = load_hf_config(dev);
    ASSERT_FALSE(r.ok()) << dev;
    EXPECT_NE(r.error().message.find(std::string(dev) + ": it is a character device"), std::string::npos)
        << r.error().message;
  }
  auto d = load_hf_config(dir_);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("it is a directory"), std::string::npos) << d.error().message;
}

TEST_F(HostileFiles, OversizedConfigIsRefusedUnread) {
  // A sparse file: 4 MiB of nothing plus one byte, past the config limit.
  const std::string path = dir_ + "/huge.json";
  write_file(path, "{");
  ASSERT_EQ(::truncate(path.c_str(), file_internal::kMaxConfigBytes + 1), 0);
  auto r = load_hf_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("holds more than 4194304 bytes"), std::string::npos) << r.error().message;
  // At the limit it is read (and is then merely not JSON text).
  ASSERT_EQ(::truncate(path.c_str(), file_internal::kMaxConfigBytes), 0);
  auto at = load_hf_config(path);
  ASSERT_FALSE(at.ok());
  EXPECT_NE(at.error().message.find("a NUL byte at byte 1"), std::string::npos) << at.error().message;
}

TEST_F(HostileFiles, MissingFilesNameTheReason) {
  auto c = load_hf_config(dir_ + "/absent.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("absent.json: No such file or directory"), std::string::npos)
      << c.error().message;
  auto p = open_pack_file(dir_ + "/absent.kvpack");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code, ErrorCode::kNotFound);
  EXPECT_NE(p.error().message.find("absent.kvpack: No such file or directory"), std::string::npos)
      << p.error().message;
}

TEST_F(HostileFiles, ToolRefusesFifosAndDevicesFast) {
  struct Case {
    std::vector<std::string> args;
    const char* says;
  };
  const Case cases[] = {
      {{"pack", "verify", "fifo"}, "cannot read pack fifo: it is a FIFO, not a regular file"},
      {{"pack", "inspect", "fifo"}, "cannot read pack fifo: it is a FIFO, not a regular file"},
      {{"run", "--resume", "fifo", "--no-progress"}, "cannot read pack fifo: it is a FIFO"},
      {{"config", "--config", "fifo"}, "cannot read config file fifo: it is a FIFO"},
      {{"footprint", "--config", "fifo"}, "cannot read config file fifo: it is a FIFO"},
      {{"config", "--config", "/dev/zero"}, "/dev/zero: it is a character device, not a regular file"},
      {{"config", "--config", "/dev/urandom"}, "/dev/urandom: it is a character device"},
      {{"pack", "verify", "/dev/zero"}, "/dev/zero: it is a character device"},
  };
  for (const Case& c : cases) {
    // 256 MiB of address space: /dev/zero read whole would exhaust it.
    const Ran r = run_tool(c.args, dir_, std::int64_t{256} << 20, 20);
    EXPECT_FALSE(r.timed_out) << describe(r);
    EXPECT_EQ(r.rc, 2) << describe(r);
    EXPECT_NE(r.err.find(c.says), std::string::npos) << describe(r);
    EXPECT_EQ(r.out, "") << describe(r);
  }
}

// --- Claims the pack does not back -------------------------------------------

// A run record for a pack of `tokens` tokens (hidden 32, vocabulary 64).
std::string record_for(std::int64_t tokens, std::int64_t vocab = 64, std::int64_t hidden = 32) {
  cli::RunRecord r;
  r.model = "hostile";
  r.rope_theta = 10000.0;
  r.options = ModelOptions{.hidden = hidden, .vocab = vocab, .mlp = 0, .seed = 1};
  r.seed = 1;
  r.prompt_tokens = tokens;
  r.chunk = 128;
  r.last_logits.assign(64, 0.5f);
  return cli::encode_run_record(r);
}

HostilePack with_record(HostilePack p) {
  p.token_ids.assign(static_cast<std::size_t>(p.token_count), 7);
  p.metadata = record_for(p.token_count);
  return p;
}

// What the tool may use: enough for itself, far below the claimed chunks
// (1 GiB each) and rows (512 MiB per chunk).
constexpr std::int64_t kToolAddressSpace = std::int64_t{768} << 20;
// The first chunk a gigabyte_chunks_pack names is sha256 of this counter.
constexpr std::uint32_t kFirst = 0;

TEST_F(HostileFiles, ThinPackClaimingGigabyteChunksFailsSmall) {
  std::int64_t payload = 0;
  const std::string head = hostile_pack_head(with_record(gigabyte_chunks_pack(2, /*thin=*/true)), &payload);
  EXPECT_EQ(payload, std::int64_t{2} << 30);
  write_file(dir_ + "/thin.kvpack", head);
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());

  const Ran v = run_tool({"pack", "verify", "thin.kvpack", "--store", "dir:store"}, dir_, kToolAddressSpace);
  EXPECT_EQ(v.rc, 1) << describe(v);
  EXPECT_NE(v.err.find("thin.kvpack: chunk 0 (layer 0, positions [0, 16384)"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find(": dir:store: chunk " + to_hex(sha256(&kFirst, sizeof kFirst)) + " is missing"), std::string::npos)
      << describe(v);
  EXPECT_NE(v.err.find("2 of 2 chunks are bad"), std::string::npos) << describe(v);

  const Ran r = run_tool({"run", "--resume", "thin.kvpack", "--store", "dir:store", "--no-progress"}, dir_,
                         kToolAddressSpace);
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_NE(r.err.find("NotFound: thin.kvpack: chunk 0"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("dir:store: chunk " + to_hex(sha256(&kFirst, sizeof kFirst)) + " is missing"), std::string::npos)
      << describe(r);
  EXPECT_EQ(r.out, "");
}

// A save cut short by the file size limit (ulimit -f) is an error with its
// reason, and leaves neither a pack nor a temporary, into a file or a store.
TEST_F(HostileFiles, FileSizeLimitFailsTheSaveCleanly) {
  write_file(dir_ + "/tiny.json",
             R"({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,)"
             R"( "sliding_window": 32, "max_position_embeddings": 256, "sliding_window_pattern": 2})");
  const std::vector<std::string> common = {"run",     "--config", "tiny.json", "--hidden", "32",
                                           "--vocab", "64",       "--tokens",  "200",      "--no-progress"};
  for (const bool thin : {false, true}) {
    std::vector<std::string> args = common;
    for (const char* a : {"--save", "out.kvpack"}) args.push_back(a);
    if (thin)
      for (const char* a : {"--store", "dir:store"}) args.push_back(a);
    const Ran r = run_tool(args, dir_, 0, 60, /*file_bytes=*/4096);
    EXPECT_EQ(r.rc, 2) << describe(r);
    EXPECT_NE(r.err.find("File too large"), std::string::npos) << describe(r);
    std::vector<std::string> left;
    for (const std::string& sub : {std::string(), std::string("/store")}) {
      DIR* d = ::opendir((dir_ + sub).c_str());
      if (d == nullptr) continue;
      while (const dirent* e = ::readdir(d))
        if (std::string_view(e->d_name).starts_with(".tmp-") || std::string_view(e->d_name) == "out.kvpack")
          left.push_back(sub + "/" + e->d_name);
      ::closedir(d);
    }
    EXPECT_TRUE(left.empty()) << (thin ? "thin: " : "") << left.front();
  }
}

// Small files under the names of chunks that claim 1 GiB each: each is
// refused for its size before any buffer is sized by the claim.
TEST_F(HostileFiles, ThinPackOverSmallPlantedChunksFailsSmall) {
  std::int64_t payload = 0;
  write_file(dir_ + "/thin.kvpack",
             hostile_pack_head(with_record(gigabyte_chunks_pack(2, /*thin=*/true)), &payload));
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());
  for (std::uint32_t n : {0u, 1u}) write_file(dir_ + "/store/" + to_hex(sha256(&n, sizeof n)), "tiny");

  const Ran v = run_tool({"pack", "verify", "thin.kvpack", "--store", "dir:store"}, dir_, kToolAddressSpace);
  EXPECT_EQ(v.rc, 1) << describe(v);
  EXPECT_NE(v.err.find("thin.kvpack: chunk 0 (layer 0, positions [0, 16384)"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find("holds 4 bytes, the pack expects 1073741824"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find("2 of 2 chunks are bad"), std::string::npos) << describe(v);

  const Ran r = run_tool({"run", "--resume", "thin.kvpack", "--store", "dir:store", "--no-progress"}, dir_,
                         kToolAddressSpace);
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_NE(r.err.find("Corruption: thin.kvpack: chunk 0"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("holds 4 bytes, the pack expects 1073741824"), std::string::npos) << describe(r);
  EXPECT_EQ(r.out, "");
}

// Files of the claimed size with no data (holes) under the chunk names:
// each is hashed in pieces and refused before rows or a chunk buffer are
// sized by the claim.
TEST_F(HostileFiles, ThinPackOverSparsePlantedChunksFailsSmall) {
  std::int64_t payload = 0;
  write_file(dir_ + "/thin.kvpack",
             hostile_pack_head(with_record(gigabyte_chunks_pack(2, /*thin=*/true)), &payload));
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());
  for (std::uint32_t n : {0u, 1u}) {
    const std::string path = dir_ + "/store/" + to_hex(sha256(&n, sizeof n));
    write_file(path, "");
    ASSERT_EQ(::truncate(path.c_str(), std::int64_t{1} << 30), 0);
  }
  const std::string holes = " is a file with holes whose bytes hash to ";

  const Ran v = run_tool({"pack", "verify", "thin.kvpack", "--store", "dir:store"}, dir_, kToolAddressSpace);
  EXPECT_EQ(v.rc, 1) << describe(v);
  EXPECT_NE(v.err.find("thin.kvpack: chunk 0 (layer 0, positions [0, 16384)"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find(holes), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find("2 of 2 chunks are bad"), std::string::npos) << describe(v);

  const Ran r = run_tool({"run", "--resume", "thin.kvpack", "--store", "dir:store", "--no-progress"}, dir_,
                         kToolAddressSpace);
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_NE(r.err.find("Corruption: thin.kvpack: chunk 0"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find(holes), std::string::npos) << describe(r);
  EXPECT_EQ(r.out, "");
}

// What stands under a thin pack's chunk names in a directory store and is
// not a chunk file is named for what it is, not called missing, and the
// tool reads nothing through it.
TEST_F(HostileFiles, ANonFileUnderAChunkNameIsNamedNotMissing) {
  std::int64_t payload = 0;
  write_file(dir_ + "/thin.kvpack",
             hostile_pack_head(with_record(gigabyte_chunks_pack(3, /*thin=*/true)), &payload));
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());
  const auto chunk_path = [&](std::uint32_t n) { return dir_ + "/store/" + to_hex(sha256(&n, sizeof n)); };
  ASSERT_EQ(::mkdir(chunk_path(0).c_str(), 0755), 0);
  ASSERT_EQ(::mkfifo(chunk_path(1).c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/dev/zero", chunk_path(2).c_str()), 0);

  const Ran v = run_tool({"pack", "verify", "thin.kvpack", "--store", "dir:store"}, dir_, kToolAddressSpace);
  EXPECT_EQ(v.rc, 1) << describe(v);
  EXPECT_NE(v.err.find("thin.kvpack: chunk 0 (layer 0, positions [0, 16384)"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find(" is a directory, not a chunk file"), std::string::npos) << describe(v);
  EXPECT_EQ(v.err.find("missing"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find("3 of 3 chunks are bad"), std::string::npos) << describe(v);

  for (const auto& [n, kind] : {std::pair{0u, "a directory"}, {1u, "a FIFO"}, {2u, "a symbolic link"}}) {
    auto store = open_dir_store(dir_ + "/store", {.create = false});
    ASSERT_TRUE(store.ok());
    const Result<bool> has = (*store)->contains(sha256(&n, sizeof n));
    ASSERT_FALSE(has.ok());
    EXPECT_EQ(has.error().code, ErrorCode::kCorruption);
    EXPECT_NE(has.error().message.find(std::string(" is ") + kind + ", not a chunk file"), std::string::npos)
        << has.error().message;
  }
}

TEST_F(HostileFiles, SparseSelfContainedPackFailsSmall) {
  std::int64_t payload = 0;
  const std::string head = hostile_pack_head(with_record(gigabyte_chunks_pack(1, /*thin=*/false)), &payload);
  const std::string path = dir_ + "/sparse.kvpack";
  write_file(path, head);
  // The payload the manifest claims, as a hole: the file has its size but
  // none of its bytes.
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(head.size()) + payload), 0);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  if (st.st_blocks * 512 >= st.st_size) GTEST_SKIP() << "this file system does not keep files sparse";

  const Ran v = run_tool({"pack", "verify", "sparse.kvpack"}, dir_, kToolAddressSpace);
  EXPECT_EQ(v.rc, 1) << describe(v);
  EXPECT_NE(v.err.find("sparse.kvpack: chunk 0 (layer 0, positions [0, 16384)"), std::string::npos) << describe(v);
  EXPECT_NE(v.err.find("its bytes hash to"), std::string::npos) << describe(v);

  const Ran r = run_tool({"run", "--resume", "sparse.kvpack", "--no-progress"}, dir_, kToolAddressSpace);
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_NE(r.err.find("sparse.kvpack: chunk 0"), std::string::npos) << describe(r);
  EXPECT_NE(r.err.find("its bytes hash to"), std::string::npos) << describe(r);
}

TEST_F(HostileFiles, LibraryChecksChunksBeforeRows) {
  // The same claims through the library: the errors come before any row.
  std::int64_t payload = 0;
  const std::string thin = hostile_pack_head(gigabyte_chunks_pack(2, true), &payload);
  auto store = open_dir_store(dir_ + "/store");
  ASSERT_TRUE(store.ok());
  auto src = memory_pack_source(thin.data(), static_cast<std::int64_t>(thin.size()), "thin");
  auto r = read_pack(*src, {.store = store->get()});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kNotFound);
  EXPECT_NE(r.error().message.find(" is missing"), std::string::npos) << r.error().message;
  auto v = verify_pack(*src, store->get());
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->thin);
  EXPECT_EQ(v->bad_chunks, 2);
  EXPECT_EQ(v->first_error.error().code, ErrorCode::kNotFound);
}

TEST_F(HostileFiles, GeometryBoundsHoldInPacksAndConfigs) {
  // kv_dim above kMaxKvDim: 128 kv heads of 1024.
  ModelConfig c = make_hybrid_config("wide", 1, 1, 128, 128, 1024, 0, 64);
  auto s = c.validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("num_key_value_heads * head_dim = 131072 is out of range [1, 65536]"),
            std::string::npos)
      << s.error().message;
  auto j = parse_hf_config(R"({"num_hidden_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "head_dim": 1024, "max_position_embeddings": 64})");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.error().message.find("num_key_value_heads * head_dim"), std::string::npos);
  auto v = parse_hf_config(R"({"num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
    "max_position_embeddings": 64, "vocab_size": 99999999})");
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.error().message.find("vocab_size = 99999999 is out of range"), std::string::npos);
  auto h = parse_hf_config(R"({"num_hidden_layers": 1, "num_attention_heads": 8, "head_dim": 64,
    "max_position_embeddings": 64, "hidden_size": 1000000})");
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.error().message.find("hidden_size = 1000000 is out of range"), std::string::npos);

  // A number past a double's range (found by fuzz/config_fuzz.cc).
  auto o = parse_hf_config(R"({"num_hidden_layers": 1, "hidden_size": 1e692})");
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.error().message.find("number overflow parsing '1e692'"), std::string::npos) << o.error().message;

  // The pack reader applies the same bounds to a pack's geometry.
  HostilePack p;
  p.config = c;
  p.context = 64;
  p.token_count = 0;
  p.chunk_tokens = 1;
  std::int64_t payload = 0;
  const std::string head = hostile_pack_head(p, &payload);
  auto m = read_manifest(*memory_pack_source(head.data(), static_cast<std::int64_t>(head.size())));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("not a valid geometry: num_key_value_heads * head_dim"), std::string::npos)
      << m.error().message;
}

TEST(ConfigFuzzRegressions, EveryInputParsesOrIsRefused) {
  // Inputs that once made the config parser throw (fuzz/config_regressions).
  const std::string dir = std::string(KVRING_SOURCE_DIR) + "/fuzz/config_regressions";
  int n = 0;
  for (const auto& name : testing::list_dir(dir)) {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto c = parse_hf_config(text, name);
    if (c.ok()) EXPECT_TRUE(c->validate().ok()) << name;
    else EXPECT_FALSE(c.error().message.empty()) << name;
    ++n;
  }
  EXPECT_GE(n, 1);
}

// --- Run records ----------------------------------------------------------------

// The head of a thin pack of 4 positions of a one-layer model whose
// metadata is `record` (its chunks are in no store).
std::string thin_record_pack(std::string record) {
  HostilePack p;
  p.config = make_hybrid_config("m", 1, 1, 2, 2, 16, 0, 64);
  p.context = 64;
  p.token_count = 4;
  p.chunk_tokens = 16;
  p.thin = true;
  p.token_ids.assign(4, 1);
  p.metadata = std::move(record);
  std::int64_t payload = 0;
  return hostile_pack_head(p, &payload);
}

// A small config's fields, open for more (JSON text up to its last comma).
constexpr const char* kConfigHead =
    R"({"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "max_position_embeddings": 256,)";

// Runs the tool with `args` in `dir` under each address-space limit of
// `mib`: every run exits `done` or 2 naming host memory (never an abort),
// and some runs take each outcome.
void expect_memory_named_or_done(const std::vector<std::string>& args, int done, const std::string& dir,
                                 const std::vector<std::int64_t>& mib) {
  int out_of_memory = 0, finished = 0;
  for (const std::int64_t limit : mib) {
    const Ran r = run_tool(args, dir, limit << 20, 30);
    const bool named = r.err.find("out of host memory") != std::string::npos;
    EXPECT_TRUE((r.rc == 2 && named) || (r.rc == done && !named))
        << args[2] << " at " << limit << " MiB: " << describe(r);
    out_of_memory += named;
    finished += !named;
  }
  EXPECT_GT(out_of_memory, 0) << args[2];
  EXPECT_GT(finished, 0) << args[2];
}

TEST_F(HostileFiles, RecordWithHugeModelAndFewLogitsFailsBeforeTheBuild) {
  // vocabulary 2^20 and hidden 1024 would build 8 GiB of weights; the record
  // holds 64 logits, which the vocabulary contradicts.
  write_file(dir_ + "/big.kvpack", thin_record_pack(record_for(4, /*vocab=*/std::int64_t{1} << 20, /*hidden=*/1024)));
  const Ran r = run_tool({"run", "--resume", "big.kvpack", "--store", "dir:store", "--no-progress"}, dir_,
                         kToolAddressSpace);
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_NE(r.err.find("field 'last_logits_f32le' holds 512 hex digits; field 'vocab' = 1048576 needs 8388608"),
            std::string::npos)
      << describe(r);
}

// JSON text at its size cap whose tree outgrows the memory the tool may
// use: at every limit the tool exits (0 or 2, the memory named), never
// aborts while freeing the tree (a container's destructor allocates in the
// JSON library), and some limits take each outcome.
TEST_F(HostileFiles, JsonTreesPastTheMemoryLimitFailCleanly) {
  const std::string head = kConfigHead;
  std::string flat = head + R"( "pad": [1)", nested = head + R"( "pad": [[[1]])";
  while (flat.size() < (std::size_t{4} << 20) - 16) flat += ",1";
  while (nested.size() < (std::size_t{4} << 20) - 16) nested += ",[[1]]";
  write_file(dir_ + "/flat.json", flat + "]}");
  write_file(dir_ + "/nested.json", nested + "]}");
  // A run record at its cap: 8 MiB of a flat array beside its fields.
  std::string record = record_for(4);
  record.pop_back();
  record += R"(,"pad":[1)";
  while (static_cast<std::int64_t>(record.size()) < cli::kMaxRunRecordBytes - 16) record += ",1";
  write_file(dir_ + "/record.kvpack", thin_record_pack(record + "]}"));
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());

  // The exit once the tree is built and freed: 0, or 2 for the pack, whose
  // chunks are in no store.
  const std::vector<std::int64_t> mib{24, 48, 64, 80, 96, 112, 128, 160, 192, 256, 384};
  expect_memory_named_or_done({"config", "--config", "flat.json"}, 0, dir_, mib);
  expect_memory_named_or_done({"config", "--config", "nested.json"}, 0, dir_, mib);
  expect_memory_named_or_done({"run", "--resume", "record.kvpack", "--store", "dir:store", "--no-progress"}, 2, dir_,
                              mib);
}

// A key given twice whose first value is a large array: the last value
// wins (as before the tree, and as in Python's json), and the array it
// replaces comes down while the text is still being parsed. At every limit
// the tool exits (0 or 2, the memory named), never aborts while freeing
// that array (a container's destructor allocates in the JSON library), and
// some limits take each outcome.
TEST_F(HostileFiles, DuplicateKeysPastTheMemoryLimitFailCleanly) {
  const std::string head = kConfigHead;
  auto last = parse_hf_config(head + R"( "num_attention_heads": {"x": [1]}, "num_attention_heads": 1})");
  ASSERT_TRUE(last.ok()) << last.error().message;
  EXPECT_EQ(last->n_heads, 1);
  // Just under 2^21 elements: the array's storage is about full, and
  // freeing it the library's way asks for as much again, more than its
  // growth ever held at once.
  std::string pad = R"("pad": [1)";
  for (int i = 1; i < (1 << 21) - 256; ++i) pad += ",1";
  pad += R"(], "pad": 0})";
  write_file(dir_ + "/dup.json", head + " " + pad);
  std::string record = record_for(4);
  record.back() = ',';
  write_file(dir_ + "/dup.kvpack", thin_record_pack(record + pad));
  ASSERT_TRUE(open_dir_store(dir_ + "/store").ok());

  // Steps of 8 MiB: the limits at which only that freeing runs out span
  // more than that.
  std::vector<std::int64_t> mib;
  for (std::int64_t limit = 24; limit <= 192; limit += 8) mib.push_back(limit);
  expect_memory_named_or_done({"config", "--config", "dup.json"}, 0, dir_, mib);
  expect_memory_named_or_done({"run", "--resume", "dup.kvpack", "--store", "dir:store", "--no-progress"}, 2, dir_, mib);
}

// A session of 40 tokens over vocabulary 50, and a pack of it whose record
// and token ids a test may edit.
struct SavedSession {
  ModelConfig config = testing::small_config(32, 256, 4, 4, 2, 16);
  ModelOptions options{.hidden = 32, .vocab = 50, .mlp = 0, .seed = 4};
  Snapshot snapshot;
  cli::RunRecord record;

  SavedSession() {
    auto model = ReferenceModel::create(config, options);
    auto cache = make_cpu_cache(config);
    if (!model.ok() || !cache.ok()) std::abort();
    Session s(*model, std::move(*cache));
    if (!s.feed(seeded_tokens(40, 50, 1), 7).ok()) std::abort();
    snapshot = *take_snapshot(s.cache());
    snapshot.token_ids = s.tokens();
    record = cli::RunRecord{"small", config.rope_theta, options, 1, 40, 7, s.last_logits()};
  }
  std::string write(const std::string& path) {
    snapshot.metadata = cli::encode_run_record(record);
    EXPECT_TRUE(write_pack(snapshot, path).ok());
    return path;
  }
};

TEST_F(HostileFiles, TokenIdsOutsideTheVocabularyAreRefused) {
  SavedSession s;
  EXPECT_TRUE(cli::resume_run(s.write(dir_ + "/ok.kvpack"), "", BackendKind::kCpu, 0).ok());
  for (std::int32_t bad : {50, -1, 1 << 30}) {
    s.snapshot.token_ids[3] = bad;
    auto r = cli::resume_run(s.write(dir_ + "/bad.kvpack"), "", BackendKind::kCpu, 0);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message.find("bad.kvpack: tokens: token id " + std::to_string(bad) +
                                     " at position 3 is outside the vocabulary [0, 50) of model 'small'"),
              std::string::npos)
        << r.error().message;
  }
}

TEST_F(HostileFiles, RecordFieldsThatFailToParseAreNamed) {
  const std::string good = cli::encode_run_record(SavedSession().record);
  ASSERT_TRUE(cli::decode_run_record(good, "p").ok());
  // A syntax error inside the value of 'hidden'.
  std::string broken = good;
  const auto at = broken.find("\"hidden\":");
  ASSERT_NE(at, std::string::npos);
  broken.insert(at + 9, "x");
  auto r = cli::decode_run_record(broken, "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("p: metadata: the run record does not parse in field 'hidden'"),
            std::string::npos)
      << r.error().message;
  EXPECT_EQ(r.error().message.find("not written by"), std::string::npos) << r.error().message;
  // A field of the wrong type.
  auto j = nlohmann::json::parse(good);
  j["vocab"] = "fifty";
  r = cli::decode_run_record(j.dump(), "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("field 'vocab' must be an integer, got \"fifty\""), std::string::npos)
      << r.error().message;
  j = nlohmann::json::parse(good);
  j["model"] = "";
  r = cli::decode_run_record(j.dump(), "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("field 'model' is empty"), std::string::npos) << r.error().message;
  j = nlohmann::json::parse(good);
  j["hidden"] = 1 << 20;
  r = cli::decode_run_record(j.dump(), "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("field 'hidden' = 1048576 outside [1, 16384]"), std::string::npos)
      << r.error().message;
  // A number past a double's range is a parse error, not an exception.
  std::string huge = good;
  huge.replace(huge.find("\"hidden\":32"), 11, "\"hidden\":1e692");
  r = cli::decode_run_record(huge, "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("p: metadata: the run record does not parse: "), std::string::npos)
      << r.error().message;
  EXPECT_NE(r.error().message.find("number overflow parsing '1e692'"), std::string::npos) << r.error().message;
  // A NUL byte ends JSON text nowhere: a whole record before one, with
  // anything after it, is refused, naming the byte.
  std::string nul = good;
  nul.append(1, '\0').append("junk");
  r = cli::decode_run_record(nul, "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("p: metadata: a NUL byte at byte " + std::to_string(good.size())),
            std::string::npos)
      << r.error().message;
  // Metadata that is not a run record at all still says so, NUL or none.
  const std::string plain = "{\"x\": 1}";
  for (const std::string& other : {plain, std::string(plain).append(1, '\0').append("bin")}) {
    r = cli::decode_run_record(other, "p");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("p was not written by kvring run --save"), std::string::npos)
        << r.error().message;
  }
  r = cli::decode_run_record("", "p");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("its metadata is empty"), std::string::npos);
}

TEST(Printable, EscapesWhatCouldActOnATerminal) {
  using kvring::printable;
  EXPECT_EQ(printable("muse-glimmer"), "muse-glimmer");
  EXPECT_EQ(printable("a\x1b[2Jb\n\t\x7f"), "a\\x1b[2Jb\\x0a\\x09\\x7f");
  EXPECT_EQ(printable("back\\slash"), "back\\x5cslash");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac"), "caf\xc3\xa9 \xe2\x82\xac");  // UTF-8 passes
  EXPECT_EQ(printable("\xc2\x9b" "1m"), "\\xc2\\x9b1m");                          // C1 CSI
  EXPECT_EQ(printable("\xff\xc3"), "\\xff\\xc3");                                 // not UTF-8
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");                                 // overlong
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");                        // surrogate
}

TEST_F(HostileFiles, ToolEscapesTheModelNameAndNamesIt) {
  SavedSession s;
  s.record.model = "evil\x1b]0;title\x07\x1b[2J\xc2\x9b" "31m";
  s.write(dir_ + "/evil.kvpack");
  for (const bool json : {false, true}) {
    std::vector<std::string> args = {"run", "--resume", "evil.kvpack", "--tokens", "44", "--no-progress"};
    if (json) args.push_back("--json");
    const Ran r = run_tool(args, dir_);
    ASSERT_EQ(r.rc, 0) << describe(r);
    for (const std::string* text : {&r.out, &r.err})
      for (unsigned char ch : *text)
        EXPECT_TRUE(ch == '\n' || (ch >= 0x20 && ch < 0x7f)) << "raw byte " << int{ch} << " in " << describe(r);
    if (!json) {
      EXPECT_NE(r.out.find("kvring run: model evil\\x1b]0;title\\x07\\x1b[2J\\xc2\\x9b31m on cpu"), std::string::npos)
          << describe(r);
    }
  }
  // Errors of a resumed run name its model, escaped.
  const Ran e = run_tool({"run", "--resume", "evil.kvpack", "--tokens", "100000", "--no-progress"}, dir_);
  EXPECT_EQ(e.rc, 2) << describe(e);
  EXPECT_NE(e.err.find("of model 'evil\\x1b]0;title"), std::string::npos) << describe(e);
  // pack inspect shows metadata text escaped.
  s.snapshot.metadata = "note: \x1b[2Jcleared\x7f\n";
  ASSERT_TRUE(write_pack(s.snapshot, dir_ + "/note.kvpack").ok());
  const Ran i = run_tool({"pack", "inspect", "note.kvpack"}, dir_);
  EXPECT_EQ(i.rc, 0) << describe(i);
  EXPECT_NE(i.out.find("metadata         note: \\x1b[2Jcleared\\x7f\\x0a\n"), std::string::npos) << describe(i);
  EXPECT_EQ(i.out.find('\x1b'), std::string::npos);
}

// A path with control bytes is shown escaped, on stdout and in errors:
// nothing the tool prints sends them to the terminal.
TEST_F(HostileFiles, ControlBytesInPathsAreShownEscaped) {
  SavedSession s;
  const std::string name = "p\x1b[2J\x07.kvpack";
  s.write(dir_ + "/" + name);
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"pack", "verify", name}, {"pack", "inspect", name}, {"pack", "verify", "no\x1b[2J.kvpack"},
           {"config", "--config", "no\x1b]0;t\x07.json"}}) {
    const Ran r = run_tool(args, dir_);
    EXPECT_EQ((r.out + r.err).find('\x1b'), std::string::npos) << describe(r);
    EXPECT_EQ((r.out + r.err).find('\x07'), std::string::npos) << describe(r);
    EXPECT_NE((r.out + r.err).find("\\x1b"), std::string::npos) << describe(r);
  }
}

TEST_F(HostileFiles, VerifyOfASelfContainedPackDoesNotClaimTheStore) {
  SavedSession s;
  s.write(dir_ + "/own.kvpack");
  const Ran r = run_tool({"pack", "verify", "own.kvpack", "--store", "dir:store"}, dir_);
  EXPECT_EQ(r.rc, 0) << describe(r);
  EXPECT_NE(r.out.find("verified in the pack itself (self-contained: --store was not read)"), std::string::npos)
      << describe(r);
  // Nor is a store it could not reach: a Redis where nothing listens.
  const Ran redis = run_tool({"pack", "verify", "own.kvpack", "--store", "redis://127.0.0.1:1"}, dir_);
  EXPECT_EQ(redis.rc, 0) << describe(redis);
  EXPECT_EQ(r.out.find("verified in dir:store"), std::string::npos) << describe(r);
  // Nor does resuming it: the absent store is neither read nor made.
  const Ran resumed =
      run_tool({"run", "--resume", "own.kvpack", "--tokens", "44", "--store", "dir:store", "--no-progress"}, dir_);
  EXPECT_EQ(resumed.rc, 0) << describe(resumed);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/store"));
}

TEST_F(HostileFiles, ArgumentErrorsPrintNothingOnStdout) {
  SavedSession s;
  s.write(dir_ + "/a.kvpack");
  const std::vector<std::vector<std::string>> cases = {
      {"pack", "verify", "a.kvpack", "--store", "ftp://x"},
      {"pack", "inspect", "a.kvpack", "--store", "dir:store"},
      {"pack", "inspect", "a.kvpack", "b.kvpack"},
      {"pack", "frob", "a.kvpack"},
      {"run", "--resume", "a.kvpack", "--tokens", "10"},
      {"run", "--resume", "a.kvpack", "--hidden", "64"},
      {"run", "--resume", "a.kvpack", "--tokens", "x"},
      {"config", "--config", "fifo"},
      {"help", "nosuch"},
  };
  for (const auto& args : cases) {
    const Ran r = run_tool(args, dir_);
    EXPECT_EQ(r.rc, 2) << describe(r);
    EXPECT_EQ(r.out, "") << describe(r);
    EXPECT_NE(r.err, "") << describe(r);
  }
}

}  // namespace
}  // namespace kvring
