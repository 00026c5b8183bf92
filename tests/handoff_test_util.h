// Helpers shared by the handoff tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

}  // namespace kvring::testing
