// Checks every handoff source makes of a message before it sizes anything
// by it (session.cc).
#pragma once

#include "kvring/handoff.h"

namespace kvring::handoff {

// A planned message names rows of one of the header's planes, all live
// there, and their bytes (K and V, f16); kInvalidArgument naming the
// message otherwise.
Status check_planned(const Snapshot& header, const PlannedMessage& m);

}  // namespace kvring::handoff
