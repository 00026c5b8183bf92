// In-process transport: two endpoints over a pair of message queues in host
// memory (the CPU backend's same-process handoff).
#include <cstring>
#include <deque>

#include "kvring/handoff.h"

namespace kvring::handoff {

namespace {

struct Link {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::vector<std::uint8_t>> queue[2];  // queue[i]: messages to endpoint i
  bool closed = false;
};

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<Link> link, int self) : link_(std::move(link)), self_(self) {}
  ~LocalTransport() override { close(); }

  Status send_message(const std::vector<Part>& parts, Deadline) override {
    std::vector<std::uint8_t> m;
    std::size_t n = 0;
    for (const Part& p : parts) {
      if (p.kind != MemoryKind::kHost)
        return make_error(ErrorCode::kUnsupported, "the in-process transport carries host memory only");
      n += p.size;
    }
    m.resize(n);
    std::size_t at = 0;
    for (const Part& p : parts) {
      if (p.size) std::memcpy(m.data() + at, p.data, p.size);
      at += p.size;
    }
    {
      std::lock_guard lock(link_->mu);
      if (link_->closed) return io_error("in-process link is closed");
      link_->queue[1 - self_].push_back(std::move(m));
    }
    link_->cv.notify_all();
    return Status::Ok();
  }

  Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline, std::size_t max_size) override {
    std::unique_lock lock(link_->mu);
    auto& q = link_->queue[self_];
    if (!link_->cv.wait_until(lock, deadline, [&] { return !q.empty() || link_->closed; }))
      return io_error("in-process link: timed out waiting for a message");
    if (q.empty()) return io_error("in-process link closed by the peer");
    if (q.front().size() > max_size)
      return io_error("in-process link: a message of " + std::to_string(q.front().size()) + " B exceeds " +
                      std::to_string(max_size) + " B");
    out = std::move(q.front());
    q.pop_front();
    return Status::Ok();
  }

  std::string describe() const override { return "in-process link"; }

  void close() override {
    {
      std::lock_guard lock(link_->mu);
      link_->closed = true;
    }
    link_->cv.notify_all();
  }

 private:
  std::shared_ptr<Link> link_;
  int self_;
};

}  // namespace

std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>> local_pair() {
  auto link = std::make_shared<Link>();
  return {std::make_unique<LocalTransport>(link, 0), std::make_unique<LocalTransport>(link, 1)};
}

}  // namespace kvring::handoff
