// What tests that forge a handoff stream need: a transport that records a
// real sender's messages, and the wire's digests computed again after an
// edit (docs/DESIGN.md, "Handoff"). Shared by the handoff tests and the
// handoff receiver's fuzz target.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvring/handoff.h"
#include "kvring/sha256.h"

namespace kvring::testing {

using handoff::Deadline;
using handoff::Part;
using handoff::Transport;

// A ROWS message's fixed head, its SHA-256 at [kRowsHead, kRowsFixed), the
// rows after it; END names the header's digest at [kEndDigest, +32).
constexpr std::size_t kRowsHead = 29, kRowsFixed = 61, kEndDigest = 17;

// Records every message a sender sends, each flattened to host bytes, and
// passes it on to `inner`; without one, it records the first message and
// fails the send (a header captured alone).
class Recorder : public Transport {
 public:
  explicit Recorder(Transport* inner) : inner_(inner) {}
  std::vector<std::vector<std::uint8_t>> sent;
  Status send_message(const std::vector<Part>& parts, Deadline d) override {
    std::vector<std::uint8_t> m;
    for (const Part& p : parts)
      m.insert(m.end(), static_cast<const std::uint8_t*>(p.data), static_cast<const std::uint8_t*>(p.data) + p.size);
    sent.push_back(std::move(m));
    if (!inner_) return io_error("recorder: header captured");
    return inner_->send_message(parts, d);
  }
  Status recv_message(std::vector<std::uint8_t>& out, Deadline d, std::size_t max) override {
    if (!inner_) return io_error("recorder: nothing to receive");
    return inner_->recv_message(out, d, max);
  }
  std::string describe() const override { return "recorder"; }
  void close() override {
    if (inner_) inner_->close();
  }

 private:
  Transport* inner_;
};

// Re-signs a header (its trailing SHA-256).
inline void reseal_header(std::vector<std::uint8_t>& m) {
  const Digest d = sha256(m.data(), m.size() - 32);
  std::memcpy(m.data() + m.size() - 32, d.data(), 32);
}

// Re-signs a SHA-256 ROWS message (at least kRowsFixed bytes).
inline void reseal_rows(std::vector<std::uint8_t>& m) {
  Sha256 h;
  h.update(m.data(), kRowsHead);
  h.update(m.data() + kRowsFixed, m.size() - kRowsFixed);
  const Digest d = h.finish();
  std::memcpy(m.data() + kRowsHead, d.data(), 32);
}

// Points END at `header`'s digest.
inline void restamp_end(std::vector<std::uint8_t>& end, const std::vector<std::uint8_t>& header) {
  std::memcpy(end.data() + kEndDigest, header.data() + header.size() - 32, 32);
}

}  // namespace kvring::testing
