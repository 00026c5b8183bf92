// The handoff's GPU side (device.h) in a build without the CUDA backend:
// nothing is usable, and every factory says so.
#include "device.h"

namespace kvring::handoff::device {
namespace {
Error no_cuda() {
  return make_error(ErrorCode::kUnsupported, "handoff: this build of kvring has no CUDA backend");
}
}  // namespace

bool usable() { return false; }
Status on_store_gpu(const KvStore&) { return Status::Ok(); }
Result<std::unique_ptr<DeviceBytes>> copy_parts(const std::vector<Part>&) { return no_cuda(); }
Status append_to_host(DeviceBytes&, std::vector<std::uint8_t>&) { return no_cuda(); }
Result<std::unique_ptr<Digester>> Digester::create() { return no_cuda(); }
Result<std::unique_ptr<Stream>> Stream::create() { return no_cuda(); }
Result<std::unique_ptr<SourceSlots>> SourceSlots::create(const KvStore&, std::int64_t) { return no_cuda(); }
Result<std::unique_ptr<TargetSlots>> TargetSlots::create() { return no_cuda(); }
Result<PeerPlan> plan_peer(int, int, bool) { return no_cuda(); }
Result<std::shared_ptr<PeerCopier>> PeerCopier::create(int, int) { return no_cuda(); }

}  // namespace kvring::handoff::device

namespace kvring::handoff {
Result<std::unique_ptr<Transport>> cuda_ipc_link(std::unique_ptr<Transport>, Deadline, bool) { return device::no_cuda(); }
}  // namespace kvring::handoff
