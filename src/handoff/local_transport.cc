// In-process transport: two endpoints over a pair of message queues (the
// same-process handoff). local_pair carries host memory; local_device_pair
// also carries device memory of the current GPU, copied device to device,
// and local_peer_pair device memory between two GPUs, copied peer to peer
// (device.h), so that rows never bounce through the host.
#include <cstring>
#include <deque>

#include "device.h"
#include "kvring/handoff.h"

namespace kvring::handoff {

namespace {

struct Message {
  std::vector<std::uint8_t> host;
  std::unique_ptr<DeviceBytes> device;  // the bytes of its device parts, in order
  std::size_t size() const { return host.size() + (device ? device->size() : 0); }
};

struct Link {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Message> queue[2];  // queue[i]: messages to endpoint i
  bool closed = false;
};

class LocalTransport : public Transport {
 public:
  // `peer`: device parts go through it (local_peer_pair); otherwise,
  // where `device`, into a new allocation of the current GPU.
  LocalTransport(std::shared_ptr<Link> link, int self, bool device, std::shared_ptr<device::PeerCopier> peer,
                 std::string what)
      : link_(std::move(link)), self_(self), device_(device), peer_(std::move(peer)), what_(std::move(what)) {}
  ~LocalTransport() override { close(); }

  bool carries(MemoryKind kind) const override { return kind == MemoryKind::kHost || device_; }

  Status send_message(const std::vector<Part>& parts, Deadline deadline) override {
    Message m;
    std::size_t host_bytes = 0, first_device = parts.size();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      if (p.kind == MemoryKind::kHost) {
        if (first_device < parts.size())
          return invalid_argument("in-process link: a host part after a device part");
        host_bytes += p.size;
      } else if (!device_) {
        return make_error(ErrorCode::kUnsupported, "the in-process transport carries host memory only");
      } else if (first_device == parts.size()) {
        first_device = i;
      }
    }
    {
      std::lock_guard lock(link_->mu);
      if (link_->closed) return io_error("in-process link is closed");
    }
    m.host.resize(host_bytes);
    std::size_t at = 0;
    for (std::size_t i = 0; i < first_device; ++i) {
      if (parts[i].size) std::memcpy(m.host.data() + at, parts[i].data, parts[i].size);
      at += parts[i].size;
    }
    if (first_device < parts.size()) {
      const std::vector<Part> device_parts(parts.begin() + static_cast<std::ptrdiff_t>(first_device), parts.end());
      auto block = peer_ ? peer_->copy(device_parts, deadline) : device::copy_parts(device_parts);
      if (!block) return block.error();
      m.device = std::move(*block);
    }
    {
      std::lock_guard lock(link_->mu);
      if (link_->closed) return io_error("in-process link is closed");
      link_->queue[1 - self_].push_back(std::move(m));
    }
    link_->cv.notify_all();
    return Status::Ok();
  }

  Status recv(ReceivedMessage& out, Deadline deadline, std::size_t max_size, bool keep_device) override {
    Message m;
    {
      std::unique_lock lock(link_->mu);
      auto& q = link_->queue[self_];
      if (!link_->cv.wait_until(lock, deadline, [&] { return !q.empty() || link_->closed; }))
        return io_error("in-process link: timed out waiting for a message");
      if (q.empty()) return io_error("in-process link closed by the peer");
      if (q.front().size() > max_size)
        return io_error("in-process link: a message of " + std::to_string(q.front().size()) + " B exceeds " +
                        std::to_string(max_size) + " B");
      m = std::move(q.front());
      q.pop_front();
    }
    out.host = std::move(m.host);
    out.device.reset();
    if (m.device && keep_device) {
      out.device = std::move(m.device);
    } else if (m.device) {
      KVRING_RETURN_IF_ERROR(device::append_to_host(*m.device, out.host));
    }
    return Status::Ok();
  }

  Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline, std::size_t max_size) override {
    ReceivedMessage m;
    KVRING_RETURN_IF_ERROR(recv(m, deadline, max_size, false));
    out = std::move(m.host);
    return Status::Ok();
  }

  std::string describe() const override { return what_; }

  bool message_waiting() override {
    std::lock_guard lock(link_->mu);
    return !link_->queue[self_].empty() || link_->closed;
  }

  void close() override {
    {
      std::lock_guard lock(link_->mu);
      link_->closed = true;
    }
    link_->cv.notify_all();
    if (peer_) peer_->close();
  }

 private:
  std::shared_ptr<Link> link_;
  int self_;
  bool device_;
  std::shared_ptr<device::PeerCopier> peer_;
  std::string what_;
};

std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>> make_pair(
    bool device, std::string what, std::shared_ptr<device::PeerCopier> peer = nullptr) {
  auto link = std::make_shared<Link>();
  return {std::make_unique<LocalTransport>(link, 0, device, peer, what),
          std::make_unique<LocalTransport>(link, 1, device, peer, what)};
}

}  // namespace

std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>> local_pair() {
  return make_pair(false, "in-process link");
}

Result<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>> local_device_pair() {
  if (!device::usable())
    return make_error(ErrorCode::kUnsupported,
                      "the in-process device transport needs the CUDA backend and a visible GPU");
  return make_pair(true, "in-process device link");
}

Result<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>> local_peer_pair(
    const PeerLinkOptions& options) {
  auto plan = device::plan_peer(options.sender_gpu, options.receiver_gpu, options.host_staging);
  if (!plan) return plan.error();
  const std::string what = "in-process link " + plan->note;
  if (!plan->device) return make_pair(false, what);
  auto peer = device::PeerCopier::create(options.sender_gpu, options.receiver_gpu);
  if (!peer) return peer.error();
  return make_pair(true, what, std::move(*peer));
}

}  // namespace kvring::handoff
