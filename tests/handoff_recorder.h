// A transport that records every message a sender sends, each flattened to
// host bytes, and passes it on to `inner`; without one, it records the
// first message and fails the send (a header captured alone). Shared by the
// hostile-peer tests and the handoff receiver's fuzz target.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvring/handoff.h"

namespace kvring::testing {

using handoff::Deadline;
using handoff::Part;
using handoff::Transport;

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

}  // namespace kvring::testing
