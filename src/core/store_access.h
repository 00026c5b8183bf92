// What the library's own code may do to a store that an engine may not.
#pragma once

#include "kvring/status.h"
#include "kvring/store.h"

namespace kvring {

struct KvStoreAccess {
  // Removes a sequence whose handle never left the library (a restore or a
  // handoff refused part-way, into a detached sequence it added): its slot
  // and blocks are free again, and the slot's next sequence gets the handle
  // this one had, so the refusal leaves even the next handle as it was.
  static Status discard(KvStore& store, SeqId seq);
};

}  // namespace kvring
