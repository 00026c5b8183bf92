// Helpers shared by the handoff tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvring/handoff.h"
#include "kvring/model.h"
#include "kvring/store.h"

namespace kvring::testing {

// A new sequence of `store` prefilled with the prompt but its last token
// (a handoff's payload), `chunk` tokens a forward pass.
inline SeqId prefill_in(const ReferenceModel& model, KvStore& store, const std::vector<std::int32_t>& prompt,
                        std::int64_t chunk) {
  const SeqId seq = *store.add_sequence();
  const auto payload = static_cast<std::int64_t>(prompt.size()) - 1;
  std::vector<float> logits(static_cast<std::size_t>(chunk * model.options().vocab));
  for (std::int64_t at = 0; at < payload; at += chunk) {
    const SeqSpan span{seq, at, std::min(chunk, payload - at)};
    EXPECT_TRUE(model.forward(store, {&span, 1}, prompt.data() + at, logits.data()).ok());
  }
  return seq;
}

// Every live row of every layer of a sequence (with each ring's origin).
inline std::vector<std::uint16_t> live_bytes(const KvStore& s, SeqId seq) {
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

// A transport that passes every call to `inner`: tests override the calls
// they count or break.
class Relay : public handoff::Transport {
 public:
  explicit Relay(handoff::Transport& inner) : inner_(inner) {}
  bool carries(handoff::MemoryKind kind) const override { return inner_.carries(kind); }
  Status send_message(const std::vector<handoff::Part>& parts, handoff::Deadline d) override {
    return inner_.send_message(parts, d);
  }
  Status recv_message(std::vector<std::uint8_t>& out, handoff::Deadline d, std::size_t max) override {
    return inner_.recv_message(out, d, max);
  }
  Status recv(handoff::ReceivedMessage& out, handoff::Deadline d, std::size_t max, bool keep_device) override {
    return inner_.recv(out, d, max, keep_device);
  }
  std::string describe() const override { return inner_.describe(); }
  void close() override { inner_.close(); }

 protected:
  handoff::Transport& inner_;
};

}  // namespace kvring::testing
