// Checks the handoff sources make of a message before they size or index
// anything by it (session.cc).
#pragma once

#include "kvring/handoff.h"

namespace kvring::handoff {

// A planned message names rows of one of the header's planes, all live
// there, and their bytes (K and V, f16); kInvalidArgument naming the
// message otherwise.
Status check_planned(const Snapshot& header, const PlannedMessage& m);

// A message is the timeline's own: its index names one of the timeline's
// messages, of the same layer and rows (kInvalidArgument otherwise). A
// source that keeps state by message index takes only such a message.
Status check_in_timeline(const Timeline& timeline, const PlannedMessage& m);

}  // namespace kvring::handoff
