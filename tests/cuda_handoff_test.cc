// Handoff on the GPU: a CUDA store's session moved device to device in one
// process (local_device_pair: StoreSource gathers rows into device staging,
// digests them there, the transport copies device to device, StoreTarget
// digests and installs them where they lie) decodes bit for bit as a session
// that never moved; a corrupted byte or a dropped link leaves the receiving
// store as it was; CPU->CUDA and CUDA->CPU, and CUDA->CUDA through pinned
// staging (a host transport), store the sender's bytes exactly; the GPU's
// digest64 is the host's.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <tuple>

#include "cuda/digest.h"
#include "core/digest64.h"
#include "cuda_test_util.h"
#include "kvring/handoff.h"
#include "kvring/model.h"

namespace kvring::handoff {
namespace {

using testing::DeviceArray;

constexpr std::int64_t kPrompt = 100, kTokens = 130, kChunk = 7, kVocab = 64;

// Passes messages through, counting device parts sent and device messages
// received; the n-th send (from 1) can flip a byte of its device bytes (in a
// copy: the sender's staging is left alone) or drop the link.
class Probe : public Transport {
 public:
  explicit Probe(Transport& inner) : inner_(inner) {}
  int flip_at_send = -1, drop_at_send = -1;
  int device_parts_sent = 0, device_messages_received = 0;

  bool carries(MemoryKind kind) const override { return inner_.carries(kind); }
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
  Status recv_message(std::vector<std::uint8_t>& out, Deadline d, std::size_t max) override {
    return inner_.recv_message(out, d, max);
  }
  Status recv(ReceivedMessage& out, Deadline d, std::size_t max, bool keep_device) override {
    Status s = inner_.recv(out, d, max, keep_device);
    if (s.ok() && out.device) ++device_messages_received;
    return s;
  }
  std::string describe() const override { return inner_.describe(); }
  void close() override { inner_.close(); }

 private:
  Transport& inner_;
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

// Every live row of every layer of a sequence (with each ring's origin).
std::vector<std::uint16_t> live_bytes(const KvStore& s, SeqId seq) {
  std::vector<std::uint16_t> out;
  for (std::int64_t l = 0; l < s.n_layers(); ++l) {
    const RingState r = *s.ring(seq, l);
    const auto n = static_cast<std::size_t>(r.len() * s.config().kv_dim());
    std::vector<std::uint16_t> k(n), v(n);
    EXPECT_TRUE(s.read_rows(seq, l, r.origin_logical(), r.len(), k.data(), v.data()).ok());
    out.insert(out.end(), k.begin(), k.end());
    out.insert(out.end(), v.begin(), v.end());
    out.push_back(static_cast<std::uint16_t>(r.origin_logical()));
  }
  return out;
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

TEST_F(CudaHandoff, DeviceToDeviceIsBitExact) {
  KVRING_SKIP_WITHOUT_GPU();
  auto from = store(BackendKind::kCuda);
  auto to = store(BackendKind::kCuda);
  ASSERT_TRUE(from && to);
  const SeqId seq = prefilled(*from, prompt_);
  const SeqId other = prefilled(*to, seeded_tokens(kPrompt, kVocab, 5));
  const auto other_before = live_bytes(*to, other);
  for (std::int64_t message_bytes : {std::int64_t{4} << 20, std::int64_t{3 * 256}}) {
    SCOPED_TRACE("messages of " + std::to_string(message_bytes) + " B");
    const Timeline t = plan(config_, kPrompt, message_bytes);
    auto src = source(*from, seq, t);
    ASSERT_TRUE(src);
    EXPECT_EQ(src->digest(), RowDigest::kDigest64);
    auto pair = local_device_pair();
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
