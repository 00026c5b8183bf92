// Handoff on the GPU: a CUDA store's session moved device to device in one
// process (local_device_pair: StoreSource gathers rows into device staging,
// digests them there, the transport copies device to device, StoreTarget
// digests and installs them where they lie) decodes bit for bit as a session
// that never moved; a corrupted byte or a dropped link leaves the receiving
// store as it was; CPU->CUDA and CUDA->CPU, and CUDA->CUDA through pinned
// staging (a host transport), store the sender's bytes exactly; the GPU's
// digest64 is the host's. local_peer_pair between GPUs of one process, and
// cuda_ipc_link between two processes, carry the same sessions exactly.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>

#include "cuda/digest.h"
#include "core/digest64.h"
#include "cuda_test_util.h"
#include "handoff_test_util.h"
#include "kvring/handoff.h"
#include "kvring/model.h"

namespace kvring::handoff {
namespace {

using testing::DeviceArray;
using testing::live_bytes;

constexpr std::int64_t kPrompt = 100, kTokens = 130, kChunk = 7, kVocab = 64;

// Passes messages through, counting device parts sent and device messages
// received; the n-th send (from 1) can flip a byte of its device bytes (in a
// copy: the sender's staging is left alone) or drop the link.
class Probe : public kvring::testing::Relay {
 public:
  using Relay::Relay;
  int flip_at_send = -1, drop_at_send = -1;
  int device_parts_sent = 0, device_messages_received = 0;

  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    ++sends_;
    if (sends_ == drop_at_send) {
      inner_.close();
      return io_error("test: the sender died");
    }
    std::size_t device_bytes = 0;
    for (const Part& p : parts)
      if (p.kind == MemoryKind::kCudaDevice) {
        ++device_parts_sent;
        device_bytes += p.size;
      }
    if (sends_ != flip_at_send || device_bytes == 0) return inner_.send_message(parts, d);
    // The device parts gathered into a copy with one byte flipped mid-way.
    DeviceArray<std::uint8_t> copy(device_bytes);
    std::vector<Part> flipped;
    std::size_t at = 0;
    for (const Part& p : parts) {
      if (p.kind != MemoryKind::kCudaDevice) {
        flipped.push_back(p);
        continue;
      }
      EXPECT_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(copy.get() + at, p.data, p.size, cudaMemcpyDeviceToDevice), cudaSuccess);
      flipped.push_back({copy.get() + at, p.size, MemoryKind::kCudaDevice, nullptr});
      at += p.size;
    }
    std::uint8_t byte = 0;
    EXPECT_EQ(cudaMemcpy(&byte, copy.get() + device_bytes / 2, 1, cudaMemcpyDeviceToHost), cudaSuccess);
    byte ^= 0x10;
    EXPECT_EQ(cudaMemcpy(copy.get() + device_bytes / 2, &byte, 1, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the flipped byte has landed
    const Status s = inner_.send_message(flipped, d);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the transport's copy is done before `copy` goes
    return s;
  }
  Status recv(ReceivedMessage& out, Deadline d, std::size_t max, bool keep_device) override {
    Status s = inner_.recv(out, d, max, keep_device);
    if (s.ok() && out.device) ++device_messages_received;
    return s;
  }

 private:
  int sends_ = 0;
};

struct Outcome {
  Result<SendReport> sent = io_error("not run");
  Result<ReceiveReport> received = io_error("not run");
};

// The receiver on a thread, the sender here.
Outcome run(Transport& send_end, Transport& recv_end, HandoffSource& src, const Timeline& t, HandoffTarget& target,
            double timeout_s = 10) {
  Outcome o;
  std::thread receiver([&] {
    o.received = receive_session(recv_end, target, {.timeout_s = timeout_s, .credit_bytes = 64 << 20});
    recv_end.close();
  });
  o.sent = send_session(send_end, src, t, {.timeout_s = timeout_s});
  send_end.close();
  receiver.join();
  return o;
}

Timeline plan(const ModelConfig& c, std::int64_t prompt, std::int64_t message_bytes) {
  PlanOptions o;
  o.chunk_tokens = kChunk;
  o.message_bytes = message_bytes;
  auto t = plan_handoff(c, prompt, o);
  EXPECT_TRUE(t.ok()) << t.error().to_string();
  return *t;
}

class CudaHandoff : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = kvring::testing::small_config(32, 256);
    auto m = ReferenceModel::create(config_, {.hidden = 32, .vocab = kVocab});
    ASSERT_TRUE(m.ok());
    model_ = *m;
    prompt_ = seeded_tokens(kPrompt, kVocab, 7);
  }
  std::unique_ptr<KvStore> store(BackendKind kind, std::int64_t sequences = 2) {
    return kvring::testing::new_store(kind, config_, {.max_sequences = sequences, .block_rows = 16});
  }
  // A sequence prefilled with the prompt but its last token (the payload).
  SeqId prefilled(KvStore& s, const std::vector<std::int32_t>& prompt) {
    const SeqId seq = *s.add_sequence();
    std::vector<float> logits(static_cast<std::size_t>(kChunk * kVocab));
    for (std::int64_t at = 0; at < kPrompt - 1; at += kChunk) {
      const SeqSpan span{seq, at, std::min(kChunk, kPrompt - 1 - at)};
      EXPECT_TRUE(model_->forward(s, {&span, 1}, prompt.data() + at, logits.data()).ok());
    }
    return seq;
  }
  // Feeds the prompt's last token, then decodes greedily to kTokens.
  std::pair<std::vector<std::int32_t>, std::vector<float>> decode(KvStore& s, SeqId seq) {
    return kvring::testing::greedy_decode(*model_, s, seq, {prompt_.begin(), prompt_.end() - 1}, prompt_.back(),
                                          kTokens);
  }
  std::unique_ptr<StoreSource> source(const KvStore& s, SeqId seq, const Timeline& t) {
    auto src = StoreSource::create(s, seq, t, std::vector<std::int32_t>(prompt_.begin(), prompt_.end() - 1), "meta");
    EXPECT_TRUE(src.ok()) << src.error().to_string();
    return src.ok() ? std::move(*src) : nullptr;
  }

  ModelConfig config_;
  std::shared_ptr<const ReferenceModel> model_;
  std::vector<std::int32_t> prompt_;
};

// Both in-process device links: local_device_pair, and local_peer_pair
// with one GPU at both ends (its buffers, their reuse and growth).
TEST_F(CudaHandoff, DeviceToDeviceIsBitExact) {
  KVRING_SKIP_WITHOUT_GPU();
  auto from = store(BackendKind::kCuda);
  auto to = store(BackendKind::kCuda);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  const SeqId other = prefilled(*to, seeded_tokens(kPrompt, kVocab, 5));
  const auto other_before = live_bytes(*to, other);
  for (const bool peer : {false, true})
  for (std::int64_t message_bytes : {std::int64_t{4} << 20, std::int64_t{3 * 256}}) {
    SCOPED_TRACE(std::string(peer ? "local_peer_pair" : "local_device_pair") + ", messages of " +
                 std::to_string(message_bytes) + " B");
    const Timeline t = plan(config_, kPrompt, message_bytes);
    auto src = source(*from, seq, t);
    ASSERT_TRUE(src);
    EXPECT_EQ(src->digest(), RowDigest::kDigest64);
    auto pair = peer ? local_peer_pair({.sender_gpu = 0, .receiver_gpu = 0}) : local_device_pair();
    ASSERT_TRUE(pair.ok()) << pair.error().to_string();
    Probe probe(*pair->first);
    Probe seen(*pair->second);
    StoreTarget target(*to, {.expect = config_});
    auto o = run(probe, seen, *src, t, target);
    ASSERT_TRUE(o.sent.ok()) << o.sent.error().to_string();
    ASSERT_TRUE(o.received.ok()) << o.received.error().to_string();
    // Every row message went device to device.
    EXPECT_EQ(probe.device_parts_sent, 2 * static_cast<int>(t.messages.size()));
    EXPECT_EQ(seen.device_messages_received, static_cast<int>(t.messages.size()));
    ASSERT_TRUE(target.sequence().has_value());
    EXPECT_EQ(target.header().metadata, "meta");
    EXPECT_EQ(live_bytes(*to, *target.sequence()), live_bytes(*from, seq));
    EXPECT_EQ(live_bytes(*to, other), other_before);
    // Decoded on the receiver, it is the session that never moved.
    const SeqId moved = *target.sequence();
    const auto stay_or = from->fork_sequence(seq);
  ASSERT_TRUE(stay_or.ok()) << stay_or.error().to_string();
  const SeqId stay = *stay_or;
    const auto [want_tokens, want_logits] = decode(*from, stay);
    const auto [tokens, logits] = decode(*to, moved);
    EXPECT_EQ(tokens, want_tokens);
    EXPECT_EQ(std::memcmp(logits.data(), want_logits.data(), logits.size() * 4), 0) << "logits differ";
    ASSERT_TRUE(from->remove_sequence(stay).ok());
    ASSERT_TRUE(to->remove_sequence(moved).ok());
  }
}

TEST_F(CudaHandoff, CorruptedByteOrDroppedLinkLeavesTheStoreAsItWas) {
  KVRING_SKIP_WITHOUT_GPU();
  auto from = store(BackendKind::kCuda, 1);
  auto to = store(BackendKind::kCuda);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  const SeqId other = prefilled(*to, seeded_tokens(kPrompt, kVocab, 5));
  const auto other_before = live_bytes(*to, other);
  const auto from_before = live_bytes(*from, seq);
  const std::int64_t free_before = to->free_blocks();
  const Timeline t = plan(config_, kPrompt, 3 * 256);
  for (int fault = 0; fault < 2; ++fault) {
    SCOPED_TRACE(fault == 0 ? "a flipped byte" : "a dropped link");
    auto src = source(*from, seq, t);
    ASSERT_TRUE(src);
    auto pair = local_device_pair();
    ASSERT_TRUE(pair.ok());
    Probe probe(*pair->first);
    (fault == 0 ? probe.flip_at_send : probe.drop_at_send) = 4;
    StoreTarget target(*to);
    auto o = run(probe, *pair->second, *src, t, target, 2);
    ASSERT_FALSE(o.received.ok());
    EXPECT_FALSE(o.sent.ok());
    if (fault == 0) {
      EXPECT_EQ(o.received.error().code, ErrorCode::kCorruption);
      EXPECT_NE(o.received.error().message.find("digest64 does not match"), std::string::npos)
          << o.received.error().message;
    } else {
      EXPECT_EQ(o.received.error().code, ErrorCode::kIOError);
    }
    EXPECT_FALSE(target.sequence().has_value());
    EXPECT_EQ(to->sequence_count(), 1);
    EXPECT_EQ(to->free_blocks(), free_before);
    EXPECT_EQ(live_bytes(*to, other), other_before);
    EXPECT_EQ(live_bytes(*from, seq), from_before);  // the sender's session is untouched
  }
}

// Seeded rows stored directly (no model): the receiver stores exactly the
// sender's bytes, whichever backends and transport.
TEST_F(CudaHandoff, MixedBackendsAndPinnedStagingStoreTheSendersBytes) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::int64_t prompt = 90, kv = config_.kv_dim();
  const std::int64_t rows = prompt - 1;
  const auto k = kvring::testing::random_floats(static_cast<std::size_t>(config_.n_layers * rows * kv), 3, 2.0f);
  const auto v = kvring::testing::random_floats(k.size(), 4, 2.0f);
  auto filled = [&](BackendKind kind) {
    auto s = store(kind, 1);
    const SeqId seq = *s->add_sequence();
    const SeqSpan span{seq, 0, rows};
    EXPECT_TRUE(s->store_all_layers({&span, 1}, host_view(k.data(), config_.n_layers * rows, kv),
                                    host_view(v.data(), config_.n_layers * rows, kv)).ok());
    return std::make_pair(std::move(s), seq);
  };
  struct Case {
    BackendKind from, to;
    bool device_link;
  };
  for (const Case c : {Case{BackendKind::kCpu, BackendKind::kCuda, true}, Case{BackendKind::kCuda, BackendKind::kCpu, true},
                       Case{BackendKind::kCuda, BackendKind::kCuda, false}, Case{BackendKind::kCpu, BackendKind::kCuda, false}}) {
    SCOPED_TRACE(std::string(backend_name(c.from)) + " -> " + backend_name(c.to) +
                 (c.device_link ? " over the device link" : " over the host link"));
    auto [sender, seq] = filled(c.from);
    auto receiver = store(c.to);
    const Timeline t = plan(config_, prompt, 5 * 256);
    auto src = StoreSource::create(*sender, seq, t, std::vector<std::int32_t>(static_cast<std::size_t>(rows), 1), "");
    ASSERT_TRUE(src.ok()) << src.error().to_string();
    std::unique_ptr<Transport> a, b;
    if (c.device_link) {
      auto pair = local_device_pair();
      ASSERT_TRUE(pair.ok());
      a = std::move(pair->first);
      b = std::move(pair->second);
    } else {
      std::tie(a, b) = local_pair();
    }
    StoreTarget target(*receiver);
    auto o = run(*a, *b, **src, t, target);
    ASSERT_TRUE(o.sent.ok()) << o.sent.error().to_string();
    ASSERT_TRUE(o.received.ok()) << o.received.error().to_string();
    ASSERT_TRUE(target.sequence().has_value());
    EXPECT_EQ(live_bytes(*receiver, *target.sequence()), live_bytes(*sender, seq));
  }
}

// The pinned staging path between processes' worth of transport: CUDA to
// CUDA over UCX on loopback (Debian's UCX carries host memory only).
TEST_F(CudaHandoff, UcxLoopbackStagesThroughPinnedMemory) {
  KVRING_SKIP_WITHOUT_GPU();
  if (!ucx_compiled()) GTEST_SKIP() << "no UCX in this build";
  auto from = store(BackendKind::kCuda);  // room for the fork that decodes below
  auto to = store(BackendKind::kCuda);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  const Timeline t = plan(config_, kPrompt, 3 * 256);
  auto src = source(*from, seq, t);
  ASSERT_TRUE(src);
  auto listener = ucx_listen("127.0.0.1:0");
  ASSERT_TRUE(listener.ok()) << listener.error().to_string();
  StoreTarget target(*to);
  std::optional<Result<ReceiveReport>> received;
  std::thread receiver([&] {
    auto link = (*listener)->accept(deadline_in(10));
    if (!link) {
      received.emplace(link.error());
      return;
    }
    received.emplace(receive_session(**link, target, {.timeout_s = 10}));
    (*link)->close();
  });
  auto link = ucx_connect("127.0.0.1:" + std::to_string((*listener)->port()), deadline_in(10));
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  auto sent = send_session(**link, *src, t, {.timeout_s = 10});
  (*link)->close();
  receiver.join();
  ASSERT_TRUE(sent.ok()) << sent.error().to_string();
  ASSERT_TRUE(received->ok()) << received->error().to_string();
  ASSERT_TRUE(target.sequence().has_value());
  EXPECT_EQ(live_bytes(*to, *target.sequence()), live_bytes(*from, seq));
  const auto stay_or = from->fork_sequence(seq);
  ASSERT_TRUE(stay_or.ok()) << stay_or.error().to_string();
  const SeqId stay = *stay_or;
  const auto want = decode(*from, stay);
  const auto got = decode(*to, *target.sequence());
  EXPECT_EQ(got.first, want.first);
  EXPECT_EQ(std::memcmp(got.second.data(), want.second.data(), got.second.size() * 4), 0) << "logits differ";
}

// Where a link cannot carry device memory (asked to stage; two ends of a
// CUDA IPC link in one process), its endpoints say so and a CUDA store's
// rows travel through pinned host memory, stored exactly.
TEST_F(CudaHandoff, LinksThatStageSayWhyAndStoreTheSendersBytes) {
  KVRING_SKIP_WITHOUT_GPU();
  auto from = store(BackendKind::kCuda);
  auto to = store(BackendKind::kCuda);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  for (const bool ipc : {false, true}) {
    SCOPED_TRACE(ipc ? "cuda_ipc_link in one process" : "local_peer_pair with host_staging");
    std::unique_ptr<Transport> a, b;
    if (ipc) {
      std::unique_ptr<Transport> x, y;
      std::tie(x, y) = local_pair();
      Result<std::unique_ptr<Transport>> other = io_error("not run");
      std::thread t([&] { other = cuda_ipc_link(std::move(y), deadline_in(10)); });
      auto one = cuda_ipc_link(std::move(x), deadline_in(10));
      t.join();
      ASSERT_TRUE(one.ok()) << one.error().to_string();
      ASSERT_TRUE(other.ok()) << other.error().to_string();
      a = std::move(*one);
      b = std::move(*other);
      EXPECT_NE(a->describe().find("one process"), std::string::npos) << a->describe();
    } else {
      auto pair = local_peer_pair({.sender_gpu = 0, .receiver_gpu = 0, .host_staging = true});
      ASSERT_TRUE(pair.ok()) << pair.error().to_string();
      a = std::move(pair->first);
      b = std::move(pair->second);
    }
    EXPECT_FALSE(a->carries(MemoryKind::kCudaDevice));
    EXPECT_NE(a->describe().find("staged through pinned host memory"), std::string::npos) << a->describe();
    const Timeline t = plan(config_, kPrompt, 3 * 256);
    auto src = source(*from, seq, t);
    ASSERT_TRUE(src);
    Probe probe(*a);
    StoreTarget target(*to);
    auto o = run(probe, *b, *src, t, target);
    ASSERT_TRUE(o.sent.ok()) << o.sent.error().to_string();
    ASSERT_TRUE(o.received.ok()) << o.received.error().to_string();
    EXPECT_EQ(probe.device_parts_sent, 0);
    ASSERT_TRUE(target.sequence().has_value());
    EXPECT_EQ(live_bytes(*to, *target.sequence()), live_bytes(*from, seq));
    ASSERT_TRUE(to->remove_sequence(*target.sequence()).ok());
  }
}

TEST_F(CudaHandoff, PeerLinkRefusesAGpuThatIsNotVisible) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const int bad : {-1, cuda_device_count()}) {
    auto pair = local_peer_pair({.sender_gpu = 0, .receiver_gpu = bad});
    ASSERT_FALSE(pair.ok());
    EXPECT_EQ(pair.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(pair.error().message.find("GPU " + std::to_string(bad)), std::string::npos) << pair.error().message;
  }
}

// GPU 0's session into a store of GPU 1 in one process (peer to peer where
// the pair has peer access, staged otherwise), then decoded there.
TEST_F(CudaHandoff, PeerLinkBetweenTwoGpusIsBitExact) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto from = store(BackendKind::kCuda);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  auto to = store(BackendKind::kCuda);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  for (std::int64_t message_bytes : {std::int64_t{4} << 20, std::int64_t{3 * 256}}) {
    SCOPED_TRACE("messages of " + std::to_string(message_bytes) + " B");
    const Timeline t = plan(config_, kPrompt, message_bytes);
    auto src = source(*from, seq, t);
    ASSERT_TRUE(src);
    auto pair = local_peer_pair({.sender_gpu = 0, .receiver_gpu = 1});
    ASSERT_TRUE(pair.ok()) << pair.error().to_string();
    std::printf("  %s\n", pair->first->describe().c_str());
    Probe probe(*pair->first);
    StoreTarget target(*to);
    Outcome o;
    std::thread receiver([&] {
      ASSERT_EQ(cudaSetDevice(1), cudaSuccess);  // the receiver's session works on its store's GPU
      o.received = receive_session(*pair->second, target, {.timeout_s = 10});
      pair->second->close();
    });
    o.sent = send_session(probe, *src, t, {.timeout_s = 10});
    probe.close();
    receiver.join();
    ASSERT_TRUE(o.sent.ok()) << o.sent.error().to_string();
    ASSERT_TRUE(o.received.ok()) << o.received.error().to_string();
    EXPECT_EQ(probe.device_parts_sent > 0, pair->first->carries(MemoryKind::kCudaDevice));
    ASSERT_TRUE(target.sequence().has_value());
    EXPECT_EQ(live_bytes(*to, *target.sequence()), live_bytes(*from, seq));
    const auto stay_or = from->fork_sequence(seq);
    ASSERT_TRUE(stay_or.ok()) << stay_or.error().to_string();
    const auto want = decode(*from, *stay_or);
    const auto got = decode(*to, *target.sequence());
    EXPECT_EQ(got.first, want.first);
    EXPECT_EQ(std::memcmp(got.second.data(), want.second.data(), got.second.size() * 4), 0) << "logits differ";
    ASSERT_TRUE(from->remove_sequence(*stay_or).ok());
    ASSERT_TRUE(to->remove_sequence(*target.sequence()).ok());
  }
  // A receiving thread whose current GPU is not its store's is refused at
  // the header, by name, and the store is as it was.
  const Timeline t = plan(config_, kPrompt, 3 * 256);
  auto src = source(*from, seq, t);
  ASSERT_TRUE(src);
  auto pair = local_peer_pair({.sender_gpu = 0, .receiver_gpu = 1});
  ASSERT_TRUE(pair.ok());
  StoreTarget target(*to);
  auto o = run(*pair->first, *pair->second, *src, t, target);  // the receiver's thread has GPU 0 current
  ASSERT_FALSE(o.received.ok());
  EXPECT_EQ(o.received.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(o.received.error().message.find("current GPU is 0"), std::string::npos) << o.received.error().message;
  EXPECT_EQ(to->sequence_count(), 0);
}

// Runs `argv` with its output in `out`; its exit status, or -1 when it ran
// past `seconds` (then killed).
int run_process(const std::vector<std::string>& args, const std::string& out, double seconds, pid_t* started = nullptr) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -2;
  if (started) {
    *started = pid;
    return 0;
  }
  const Deadline end = deadline_in(seconds);
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (Clock::now() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The peer program beside this test's executable (the build puts both in
// one directory).
std::string ipc_peer() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / "kvring_handoff_ipc_peer").string();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Runs a receiver and a sender of kvring_handoff_ipc_peer, each with its
// extra arguments; their outputs.
struct PeerRun {
  int sent = -3, received = -3;
  std::string send_out, recv_out;
};
PeerRun run_peers(const std::vector<std::string>& recv_extra, const std::vector<std::string>& send_extra) {
  PeerRun run;
  const std::string dir = ::testing::TempDir(), sock = dir + "kvring-ipc-" + std::to_string(getpid()) + ".sock";
  const std::string recv_out = dir + "ipc-recv.out", send_out = dir + "ipc-send.out";
  const std::string peer = ipc_peer();
  if (access(peer.c_str(), X_OK) != 0) {
    run.recv_out = "no program " + peer;
    return run;
  }
  std::vector<std::string> recv_args = {peer, "recv", sock}, send_args = {peer, "send", sock};
  recv_args.insert(recv_args.end(), recv_extra.begin(), recv_extra.end());
  send_args.insert(send_args.end(), send_extra.begin(), send_extra.end());
  pid_t receiver = 0;
  if (run_process(recv_args, recv_out, 0, &receiver) != 0) return run;
  // The sender connects once the receiver listens.
  struct stat st{};
  int status = 0;
  bool reaped = false;
  for (int i = 0; i < 6000 && stat(sock.c_str(), &st) != 0 && !reaped; ++i) {
    reaped = waitpid(receiver, &status, WNOHANG) == receiver;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  run.sent = run_process(send_args, send_out, 120);
  const Deadline end = deadline_in(120);
  while (!reaped && waitpid(receiver, &status, WNOHANG) != receiver) {
    if (Clock::now() > end) {
      kill(receiver, SIGKILL);
      waitpid(receiver, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  run.received = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.recv_out = slurp(recv_out);
  run.send_out = slurp(send_out);
  std::printf("  %s  %s", run.send_out.c_str(), run.recv_out.c_str());
  return run;
}

// Two processes on this GPU: rows through CUDA IPC (the receiver maps the
// sender's buffers), and through pinned host memory where the receiver asks
// to stage; either way the receiver's new sequence holds the session it
// prefilled itself and decodes bit for bit as it.
TEST(CudaHandoffIpc, TwoProcessesHandOffBitExact) {
  KVRING_SKIP_WITHOUT_GPU();
  for (const bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged through host memory" : "through CUDA IPC");
    const PeerRun p = run_peers(staged ? std::vector<std::string>{"--host-staging"} : std::vector<std::string>{}, {});
    const std::string &r = p.recv_out, &s = p.send_out;
    EXPECT_EQ(p.sent, 0) << s;
    ASSERT_EQ(p.received, 0) << r;
    ASSERT_EQ(r.rfind("ok received", 0), 0u) << r;
    const bool device = r.find("device_messages=0 ") == std::string::npos;
    EXPECT_EQ(device, !staged) << r;
    EXPECT_EQ(r.find("rows received are staged through pinned host memory (asked for)") != std::string::npos, staged) << r;
    EXPECT_EQ(s.find("rows sent are staged through pinned host memory (asked for)") != std::string::npos, staged) << s;
  }
}

// One link, two sessions: the second's messages are larger, so the sender's
// buffers grow between them (new exports, the old ones freed once the
// receiver let them go), and both sessions arrive bit-exact.
TEST(CudaHandoffIpc, TwoSessionsOverOneLinkGrowItsBuffers) {
  KVRING_SKIP_WITHOUT_GPU();
  const PeerRun p = run_peers({"--two-sessions"}, {"--two-sessions"});
  const std::string &r = p.recv_out, &s = p.send_out;
  EXPECT_EQ(p.sent, 0) << s;
  ASSERT_EQ(p.received, 0) << r;
  EXPECT_EQ(r.rfind("ok received sessions=2 ", 0), 0u) << r;
  EXPECT_EQ(r.find("device_messages=0 "), std::string::npos) << r;
  const std::size_t at = s.find("most_device_bytes=");
  ASSERT_NE(at, std::string::npos) << s;
  unsigned long long first = 0, second = 0;
  ASSERT_EQ(std::sscanf(s.c_str() + at, "most_device_bytes=%llu,%llu", &first, &second), 2) << s;
  EXPECT_GT(first, 0u) << s;
  EXPECT_GT(second, first) << s;
}

// A sender whose process ends mid-session, its rows mapped by the receiver:
// the receiver refuses the session in bounded time and its store is as it
// was.
TEST(CudaHandoffIpc, ASenderThatDiesLeavesTheReceiversStoreAsItWas) {
  KVRING_SKIP_WITHOUT_GPU();
  const PeerRun p = run_peers({"--expect-loss"}, {"--die-after", "9"});
  EXPECT_EQ(p.sent, 3) << p.send_out;
  ASSERT_EQ(p.received, 0) << p.recv_out;
  EXPECT_EQ(p.recv_out.rfind("ok refused", 0), 0u) << p.recv_out;
  EXPECT_EQ(p.recv_out.find("after 0 device messages"), std::string::npos) << p.recv_out;
}

// The seconds an "ok refused (...) ... in T s" line says its session took.
double refused_after(const std::string& out) {
  const std::size_t at = out.rfind(" in ");
  double took = -1;
  if (at == std::string::npos || std::sscanf(out.c_str() + at, " in %lf s", &took) != 1) return -1;
  return took;
}

// A peer whose GPU work before its event does not end (a stream stalled
// for 8 s): the other end waits for that event on the host, up to its own
// timeout (2 s), and refuses the session, rather than make its streams wait
// on the peer's. Both ways: the sender's copy into a buffer, and the
// receiver's reads of one (the sender reuses the buffer four messages on).
TEST(CudaHandoffIpc, APeerWhoseWorkStallsCostsATimeout) {
  KVRING_SKIP_WITHOUT_GPU();
  const std::vector<std::string> stalls = {"--expect-loss", "--timeout", "10", "--stall-at", "2", "--stall-s", "8"},
                                  waits = {"--expect-loss", "--timeout", "2"};
  // Whichever end waited: its exit, its output, and what it waited for.
  const auto waited = [](int exit, const std::string& out, const char* says) {
    EXPECT_EQ(exit, 0) << out;
    EXPECT_EQ(out.rfind("ok refused", 0), 0u) << out;
    EXPECT_NE(out.find(says), std::string::npos) << out;
    const double took = refused_after(out);
    EXPECT_GT(took, 1.5) << out;
    EXPECT_LT(took, 6) << out;
  };
  {
    SCOPED_TRACE("the sender's copy stalls");
    const PeerRun p = run_peers(waits, stalls);
    waited(p.received, p.recv_out, "timed out waiting for the sender's copy");
    EXPECT_EQ(p.sent, 0) << p.send_out;
  }
  {
    SCOPED_TRACE("the receiver's reads stall");
    const PeerRun p = run_peers(stalls, waits);
    waited(p.sent, p.send_out, "timed out waiting for the receiver's reads");
    EXPECT_EQ(p.received, 0) << p.recv_out;
  }
}

// One end of a cuda_ipc_link whose other end is raw frames on `raw`,
// spoken as another process on this GPU would (another pid).
struct RawIpcPeer {
  std::unique_ptr<Transport> link, raw;
};
RawIpcPeer raw_ipc_peer(bool host_staging) {
  RawIpcPeer p;
  std::unique_ptr<Transport> end;
  std::tie(end, p.raw) = local_pair();
  int dev = 0;
  EXPECT_EQ(cudaGetDevice(&dev), cudaSuccess);
  cudaDeviceProp prop{};
  EXPECT_EQ(cudaGetDeviceProperties(&prop, dev), cudaSuccess);
  char bus[32] = {};
  EXPECT_EQ(cudaDeviceGetPCIBusId(bus, sizeof bus, dev), cudaSuccess);
  // The link's frames end in their kind: magic, nonce, uuid, bus id, 'H'.
  std::vector<std::uint8_t> hello(8 + 8 + 16 + 16 + 1, 0);
  const std::uint64_t nonce = 0x5eed;  // not this process's
  std::memcpy(hello.data(), "kvripc01", 8);
  std::memcpy(hello.data() + 8, &nonce, 8);
  std::memcpy(hello.data() + 16, prop.uuid.bytes, 16);
  std::memcpy(hello.data() + 32, bus, 16);
  hello.back() = 'H';
  EXPECT_TRUE(p.raw->send_message(hello.data(), hello.size(), deadline_in(5)).ok());
  const std::uint8_t verdict[2] = {1, 'V'};
  EXPECT_TRUE(p.raw->send_message(verdict, 2, deadline_in(5)).ok());
  auto link = cuda_ipc_link(std::move(end), deadline_in(5), host_staging);
  EXPECT_TRUE(link.ok()) << link.error().to_string();
  if (link.ok()) p.link = std::move(*link);
  std::vector<std::uint8_t> in;
  EXPECT_TRUE(p.raw->recv_message(in, deadline_in(5), 4096).ok());  // its hello
  EXPECT_TRUE(p.raw->recv_message(in, deadline_in(5), 4096).ok());  // its verdict
  return p;
}

// A device frame of no host bytes: slot, generation, buffer and message
// sizes, zeroed handles unless given, 'D'.
std::vector<std::uint8_t> device_frame(std::uint8_t slot, std::uint64_t buffer, std::uint64_t size,
                                       const cudaIpcMemHandle_t* mem = nullptr) {
  std::vector<std::uint8_t> f(1 + 24 + 128 + 1, 0);
  f[0] = slot;
  const std::uint64_t fields[3] = {1, buffer, size};
  std::memcpy(f.data() + 1, fields, sizeof fields);
  if (mem) std::memcpy(f.data() + 25, mem, 64);
  f.back() = 'D';
  return f;
}

// Frames a peer process could send wrongly: each is refused with a clear
// error, the link stays broken after it, and nothing is read past what a
// mapping holds.
TEST(CudaHandoffIpc, HostileFramesAreRefused) {
  KVRING_SKIP_WITHOUT_GPU();
  {
    auto [end, raw] = local_pair();
    const std::uint8_t not_hello[3] = {1, 2, 'M'};
    ASSERT_TRUE(raw->send_message(not_hello, 3, deadline_in(5)).ok());
    auto link = cuda_ipc_link(std::move(end), deadline_in(5));
    ASSERT_FALSE(link.ok());
    EXPECT_NE(link.error().message.find("did not answer as a cuda ipc link"), std::string::npos) << link.error().message;
  }
  // A buffer of this process, exported: the receiver maps it as it would a
  // peer's, since the hello claims another pid.
  DeviceArray<std::uint8_t> buffer(1 << 16);
  cudaIpcMemHandle_t mem{};
  ASSERT_EQ(cudaIpcGetMemHandle(&mem, buffer.get()), cudaSuccess);
  struct Case {
    const char* what;
    std::vector<std::uint8_t> frame;
    bool host_staging;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"a slot past the link's", device_frame(9, 4096, 1024), false, "malformed device frame"},
      {"more bytes than the buffer", device_frame(0, 4096, 8192), false, "malformed device frame"},
      {"more bytes than asked for", device_frame(0, std::uint64_t{1} << 40, std::uint64_t{1} << 40), false,
       "exceeds"},
      {"a handle that maps nothing", device_frame(0, 4096, 1024), false, "cudaIpcOpenMemHandle"},
      {"device memory to an end that stages", device_frame(0, 4096, 1024, &mem), true, "cannot map"},
      {"a release of a buffer never sent", {0, 0, 'R'}, false, "malformed"},
      {"an empty frame", {}, false, "empty frame"},
      {"a frame of no kind", {1, 'Z'}, false, "malformed frame"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawIpcPeer p = raw_ipc_peer(c.host_staging);
    ASSERT_TRUE(p.link);
    std::vector<std::uint8_t> frame = c.frame;
    if (frame.size() == 3 && frame.back() == 'R') frame.insert(frame.begin() + 2, 64, 0);  // a zero handle
    ASSERT_TRUE(p.raw->send_message(frame.data(), frame.size(), deadline_in(5)).ok());
    ReceivedMessage m;
    const Status st = p.link->recv(m, deadline_in(5), 1 << 20, true);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find(c.says), std::string::npos) << st.error().message;
    const Status again = p.link->recv(m, deadline_in(5), 1 << 20, true);
    EXPECT_FALSE(again.ok());  // broken for good
  }
  // A buffer it claims to be larger than the mapping is refused; its
  // true size is read, whatever the frame says.
  {
    RawIpcPeer p = raw_ipc_peer(false);
    ASSERT_TRUE(p.link);
    const auto frame = device_frame(0, std::uint64_t{1} << 18, 1024, &mem);
    ASSERT_TRUE(p.raw->send_message(frame.data(), frame.size(), deadline_in(5)).ok());
    ReceivedMessage m;
    const Status st = p.link->recv(m, deadline_in(5), 1 << 20, true);
    // CUDA IPC maps nothing in the process that exported it: the open
    // fails here; between processes the size check refuses it.
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(st.error().message.find("cudaIpcOpenMemHandle") != std::string::npos ||
                st.error().message.find("its mapping holds") != std::string::npos)
        << st.error().message;
  }
}

// message_waiting reads what the host link holds: a release is taken (its
// buffer is free again, and nothing waits), a message is kept for the next
// recv, and the peer's close is waiting too.
TEST(CudaHandoffIpc, MessageWaitingReadsAheadWithoutLosingAFrame) {
  KVRING_SKIP_WITHOUT_GPU();
  RawIpcPeer p = raw_ipc_peer(false);
  ASSERT_TRUE(p.link);
  ASSERT_TRUE(p.link->carries(MemoryKind::kCudaDevice));
  const auto waiting_within = [&](double s) {
    for (const auto until = deadline_in(s); Clock::now() < until;) {
      if (p.link->message_waiting()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  };
  EXPECT_FALSE(p.link->message_waiting());

  // A device message takes buffer 0; the peer's release frees it.
  DeviceArray<std::uint8_t> bytes(std::vector<std::uint8_t>(256, 0x5a));
  const std::vector<Part> parts = {{bytes.get(), 256, MemoryKind::kCudaDevice, nullptr}};
  ASSERT_TRUE(p.link->send_message(parts, deadline_in(5)).ok());
  std::vector<std::uint8_t> frame;
  ASSERT_TRUE(p.raw->recv_message(frame, deadline_in(5), 4096).ok());
  ASSERT_FALSE(frame.empty());
  EXPECT_EQ(frame.back(), 'D');
  std::vector<std::uint8_t> release(1 + 1 + 64 + 1, 0);  // buffer 0, no event
  release.back() = 'R';
  ASSERT_TRUE(p.raw->send_message(release.data(), release.size(), deadline_in(5)).ok());
  EXPECT_FALSE(waiting_within(0.2)) << "a release is not a message";

  // A host message is kept for recv, however often it is asked about.
  const std::uint8_t hello[3] = {'h', 'i', 'M'};
  ASSERT_TRUE(p.raw->send_message(hello, 3, deadline_in(5)).ok());
  ASSERT_TRUE(waiting_within(5));
  EXPECT_TRUE(p.link->message_waiting());
  std::vector<std::uint8_t> got;
  ASSERT_TRUE(p.link->recv_message(got, deadline_in(5), 1 << 20).ok());
  EXPECT_EQ(got, (std::vector<std::uint8_t>{'h', 'i'}));
  EXPECT_FALSE(p.link->message_waiting());

  // Buffer 0 was released: four more device messages need no release.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(p.link->send_message(parts, deadline_in(1)).ok()) << i;

  // The peer's close is waiting, and recv says so.
  const std::uint8_t closed = 'C';
  ASSERT_TRUE(p.raw->send_message(&closed, 1, deadline_in(5)).ok());
  ASSERT_TRUE(waiting_within(5));
  const Status st = p.link->recv_message(got, deadline_in(5), 1 << 20);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("closed by the peer"), std::string::npos) << st.error().message;
}

TEST(CudaDigest64, TheGpuSumIsTheHosts) {
  KVRING_SKIP_WITHOUT_GPU();
  std::vector<std::uint8_t> host(1 << 20);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::uint8_t>((i * 2654435761u) >> 13);
  DeviceArray<std::uint8_t> dev(host);
  DeviceArray<unsigned long long> sum(1);
  // Sizes around word and pair boundaries, at 16-, 8- and 2-byte alignment.
  for (std::size_t offset : {0u, 8u, 2u, 5u})
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{15}, std::size_t{16},
                          std::size_t{24}, std::size_t{1000}, std::size_t{65536 + 3}, host.size() - 16}) {
      ASSERT_EQ(cudaMemset(sum.get(), 0, 8), cudaSuccess);
      ASSERT_EQ(cuda::launch_digest_words(dev.get() + offset, n, 7, sum.get(), nullptr), cudaSuccess);
      EXPECT_EQ(sum.download()[0], digest64::words(host.data() + offset, n, 7)) << "offset " << offset << ", " << n << " B";
    }
}

}  // namespace
}  // namespace kvring::handoff
