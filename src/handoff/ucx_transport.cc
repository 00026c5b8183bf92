// Transport over UCX (Debian's libucx, ucp API): a client-server endpoint over
// a TCP sockaddr, each message one tagged send (eager or rendezvous, as UCX
// chooses by size), received after a probe tells its length. UCX picks the
// lanes for the data (TCP, or shared memory and CMA between processes of one
// host). Every wait progresses the worker and sleeps on its event fd, up to a
// deadline; a peer that dies or a link that drops fails the endpoint through
// its error handler (peer error-handling mode), and every pending request
// with it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstring>

#include "kvring/handoff.h"

#if KVRING_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

namespace kvring::handoff {

Result<std::pair<std::string, int>> parse_host_port(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return invalid_argument("'" + s + "' is not HOST:PORT");
  const std::string host = s.substr(0, colon), port_s = s.substr(colon + 1);
  int port = -1;
  auto [end, ec] = std::from_chars(port_s.data(), port_s.data() + port_s.size(), port);
  if (port_s.empty() || ec != std::errc() || end != port_s.data() + port_s.size() || port < 0 || port > 65535)
    return invalid_argument("'" + s + "': port must be an integer in [0, 65535]");
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) != 1)
    return invalid_argument("'" + s + "': host must be an IPv4 address such as 127.0.0.1");
  return std::pair<std::string, int>(host, port);
}

#if !KVRING_HAVE_UCX

bool ucx_compiled() { return false; }
Result<std::unique_ptr<UcxListener>> ucx_listen(const std::string&) {
  return make_error(ErrorCode::kUnsupported, "this build has no UCX transport (install libucx-dev and rebuild)");
}
Result<std::unique_ptr<Transport>> ucx_connect(const std::string&, Deadline) {
  return make_error(ErrorCode::kUnsupported, "this build has no UCX transport (install libucx-dev and rebuild)");
}

#else

bool ucx_compiled() { return true; }

namespace {

Error ucx_error(const std::string& what, ucs_status_t s) {
  return io_error(what + ": " + ucs_status_string(s));
}

sockaddr_in make_addr(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  return a;
}

// A UCP context and one worker (single-threaded; each transport or listener
// owns its own).
class Worker {
 public:
  static Result<std::shared_ptr<Worker>> create() {
    auto w = std::shared_ptr<Worker>(new Worker());
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) return ucx_error("ucp_config_read", s);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    ucs_status_t s = ucp_init(&params, config, &w->context_);
    ucp_config_release(config);
    if (s != UCS_OK) return ucx_error("ucp_init", s);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (s = ucp_worker_create(w->context_, &wp, &w->worker_); s != UCS_OK) return ucx_error("ucp_worker_create", s);
    if (s = ucp_worker_get_efd(w->worker_, &w->efd_); s != UCS_OK) return ucx_error("ucp_worker_get_efd", s);
    return w;
  }
  ~Worker() {
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
  }
  ucp_worker_h get() const { return worker_; }

  // Progresses until done() or the deadline; false on the deadline. Spins
  // for a while first (a stream in full flow completes requests within
  // microseconds, and not every completion wakes the event fd), then sleeps
  // on the fd in steps of at most 1 ms.
  template <class Done>
  bool wait(Done done, Deadline deadline) {
    const auto spin_until = Clock::now() + std::chrono::microseconds(200);
    for (;;) {
      while (ucp_worker_progress(worker_) != 0) {
      }
      if (done()) return true;
      const auto now = Clock::now();
      if (now >= deadline) return false;
      if (now < spin_until) continue;
      const ucs_status_t s = ucp_worker_arm(worker_);
      if (s == UCS_ERR_BUSY) continue;
      pollfd p{efd_, POLLIN, 0};
      ::poll(&p, 1, 1);
    }
  }

 private:
  Worker() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
};

void noop_send_cb(void*, ucs_status_t, void*) {}
void noop_tag_recv_cb(void*, ucs_status_t, const ucp_tag_recv_info_t*, void*) {}
// Every message of a link carries this tag; each link has its own worker.
constexpr ucp_tag_t kTag = 0x6b7668616e646f66ULL;

class UcxTransport : public Transport {
 public:
  UcxTransport(std::shared_ptr<Worker> worker, std::string peer) : worker_(std::move(worker)), peer_(std::move(peer)) {}
  ~UcxTransport() override { close(); }

  // Makes the endpoint: from a connection request (server) or to an address (client).
  Status open(ucp_conn_request_h request, const sockaddr_in* addr) {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &UcxTransport::on_error;
    p.err_handler.arg = this;
    if (request) {
      p.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
      p.conn_request = request;
    } else {
      p.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
      p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      p.sockaddr.addr = reinterpret_cast<const sockaddr*>(addr);
      p.sockaddr.addrlen = sizeof *addr;
    }
    if (ucs_status_t s = ucp_ep_create(worker_->get(), &p, &ep_); s != UCS_OK) {
      ep_ = nullptr;
      return ucx_error("cannot reach " + peer_, s);
    }
    return Status::Ok();
  }

  Status send_message(const std::vector<Part>& parts, Deadline deadline) override {
    KVRING_RETURN_IF_ERROR(usable());
    std::uint64_t total = 0;
    for (const Part& p : parts) {
      if (p.kind != MemoryKind::kHost)
        return make_error(ErrorCode::kUnsupported, "this UCX build carries host memory only (stage device rows through host buffers)");
      total += p.size;
    }
    // One tagged message, contiguous (UCX picks eager or rendezvous by its
    // size; its iov datatype measured several times slower on loopback), so
    // several parts are gathered into a staging buffer first.
    const void* data = parts.empty() ? nullptr : parts[0].data;
    if (parts.size() > 1) {
      staging_.resize(total);
      std::size_t at = 0;
      for (const Part& p : parts) {
        if (p.size) std::memcpy(staging_.data() + at, p.data, p.size);
        at += p.size;
      }
      data = staging_.data();
    }
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    rp.cb.send = noop_send_cb;
    ucs_status_ptr_t r = ucp_tag_send_nbx(ep_, data, total, kTag, &rp);
    return complete(r, deadline, "send to");
  }

  Status recv_message(std::vector<std::uint8_t>& out, Deadline deadline, std::size_t max_size) override {
    KVRING_RETURN_IF_ERROR(usable());
    // Probe for the next message to learn its size, then receive it whole.
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = nullptr;
    const bool arrived = worker_->wait(
        [&] {
          msg = ucp_tag_probe_nb(worker_->get(), kTag, ~ucp_tag_t{0}, 1, &info);
          return msg != nullptr || failed_ != UCS_OK;
        },
        deadline);
    if (msg == nullptr) {
      if (failed_ != UCS_OK) return lost(failed_);
      if (!arrived) {
        broken_ = io_error("timed out waiting to receive from " + peer_);
        return *broken_;
      }
    }
    if (info.length > max_size) {
      const Error too_big = io_error("a message of " + std::to_string(info.length) + " B from " + peer_ +
                                     " exceeds " + std::to_string(max_size) + " B");
      // Taken off the queue into a few bytes, whatever size the peer
      // claims: the receive ends truncated and UCX drops the rest.
      std::uint8_t sink[64];
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
      rp.cb.recv = noop_tag_recv_cb;
      (void)complete(ucp_tag_msg_recv_nbx(worker_->get(), sink, sizeof sink, msg, &rp), deadline, "receive from");
      broken_ = too_big;
      return too_big;
    }
    out.resize(info.length);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    rp.cb.recv = noop_tag_recv_cb;
    return complete(ucp_tag_msg_recv_nbx(worker_->get(), out.data(), out.size(), msg, &rp), deadline, "receive from");
  }

  std::string describe() const override { return "ucx " + peer_; }

  // A tagged message in the worker's queue (probed without removing it),
  // or a link that failed.
  bool message_waiting() override {
    if (broken_ || ep_ == nullptr || failed_ != UCS_OK) return true;
    while (ucp_worker_progress(worker_->get()) != 0) {
    }
    ucp_tag_recv_info_t info{};
    return ucp_tag_probe_nb(worker_->get(), kTag, ~ucp_tag_t{0}, 0, &info) != nullptr || failed_ != UCS_OK;
  }

  void close() override {
    if (!ep_) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A broken endpoint can only be closed by force; a healthy one flushes.
    p.flags = (broken_ || failed_ != UCS_OK) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &p);
    if (UCS_PTR_IS_PTR(r)) {
      // A flush close completes when the peer's worker acknowledges it; a
      // peer that never does costs at most this wait.
      if (!worker_->wait([&] { return ucp_request_check_status(r) != UCS_INPROGRESS; }, deadline_in(1.0))) {
        ucp_request_cancel(worker_->get(), r);
        worker_->wait([&] { return ucp_request_check_status(r) != UCS_INPROGRESS; }, deadline_in(1.0));
      }
      ucp_request_free(r);
    }
    ep_ = nullptr;
  }

 private:
  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<UcxTransport*>(arg)->failed_ = status;
  }

  Status usable() {
    if (broken_) return *broken_;
    if (!ep_) return io_error("the link to " + peer_ + " is closed");
    if (failed_ != UCS_OK) return lost(failed_);
    return Status::Ok();
  }

  Error lost(ucs_status_t s) {
    broken_ = io_error("the link to " + peer_ + " failed (" + ucs_status_string(s) +
                       "): the peer is gone or the link dropped");
    return *broken_;
  }

  // Waits for a request; on the deadline cancels it and breaks the link (a
  // half-done stream operation leaves the framing unknown).
  Status complete(ucs_status_ptr_t r, Deadline deadline, const char* what) {
    if (r == nullptr) return Status::Ok();
    if (UCS_PTR_IS_ERR(r)) return lost(UCS_PTR_STATUS(r));
    const bool done = worker_->wait(
        [&] { return ucp_request_check_status(r) != UCS_INPROGRESS || failed_ != UCS_OK; }, deadline);
    if (!done || ucp_request_check_status(r) == UCS_INPROGRESS) {
      ucp_request_cancel(worker_->get(), r);
      worker_->wait([&] { return ucp_request_check_status(r) != UCS_INPROGRESS; }, deadline_in(1.0));
      ucp_request_free(r);
      if (failed_ != UCS_OK) return lost(failed_);
      broken_ = io_error(std::string("timed out waiting to ") + what + " " + peer_);
      return *broken_;
    }
    const ucs_status_t s = ucp_request_check_status(r);
    ucp_request_free(r);
    if (s != UCS_OK) return lost(failed_ != UCS_OK ? failed_ : s);
    return Status::Ok();
  }

  std::shared_ptr<Worker> worker_;
  std::string peer_;
  ucp_ep_h ep_ = nullptr;
  ucs_status_t failed_ = UCS_OK;
  std::optional<Error> broken_;
  std::vector<std::uint8_t> staging_;
};

// Binds `addr` with a socket of its own and closes it, so that an address
// this host cannot listen on (not one of its own, a port in use or
// privileged) is refused with the system's reason, before UCX, which would
// log its own lines about it to stderr. Same SO_REUSEADDR as UCX's listener.
Status check_bindable(const sockaddr_in& addr, const std::string& where) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return io_error("cannot listen on " + where + ": socket: " + std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int rc = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return io_error("cannot listen on " + where + ": " + std::strerror(err));
  return Status::Ok();
}

class Listener : public UcxListener {
 public:
  Listener(std::shared_ptr<Worker> w, std::string host) : worker_(std::move(w)), host_(std::move(host)) {}
  ~Listener() override {
    for (ucp_conn_request_h r : pending_) ucp_listener_reject(listener_, r);
    if (listener_) ucp_listener_destroy(listener_);
  }

  Status open(int port) {
    const sockaddr_in addr = make_addr(host_, port);
    KVRING_RETURN_IF_ERROR(check_bindable(addr, host_ + ":" + std::to_string(port)));
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    p.sockaddr.addrlen = sizeof addr;
    p.conn_handler.cb = &Listener::on_conn;
    p.conn_handler.arg = this;
    if (ucs_status_t s = ucp_listener_create(worker_->get(), &p, &listener_); s != UCS_OK) {
      listener_ = nullptr;
      return ucx_error("cannot listen on " + host_ + ":" + std::to_string(port), s);
    }
    ucp_listener_attr_t a{};
    a.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucs_status_t s = ucp_listener_query(listener_, &a); s != UCS_OK) return ucx_error("ucp_listener_query", s);
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&a.sockaddr)->sin_port);
    return Status::Ok();
  }

  int port() const override { return port_; }

  Result<std::unique_ptr<Transport>> accept(Deadline deadline) override {
    if (!worker_->wait([&] { return !pending_.empty(); }, deadline))
      return io_error("no sender connected to " + host_ + ":" + std::to_string(port_) + " in time");
    ucp_conn_request_h req = pending_.front();
    pending_.erase(pending_.begin());
    std::string peer = host_ + ":" + std::to_string(port_);
    ucp_conn_request_attr_t ra{};
    ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &ra) == UCS_OK && ra.client_address.ss_family == AF_INET) {
      const auto* c = reinterpret_cast<const sockaddr_in*>(&ra.client_address);
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &c->sin_addr, buf, sizeof buf);
      peer = std::string(buf) + ":" + std::to_string(ntohs(c->sin_port));
    }
    auto t = std::make_unique<UcxTransport>(worker_, peer);
    KVRING_RETURN_IF_ERROR(t->open(req, nullptr));
    return std::unique_ptr<Transport>(std::move(t));
  }

 private:
  static void on_conn(ucp_conn_request_h request, void* arg) {
    static_cast<Listener*>(arg)->pending_.push_back(request);
  }
  std::shared_ptr<Worker> worker_;
  std::string host_;
  ucp_listener_h listener_ = nullptr;
  int port_ = 0;
  std::vector<ucp_conn_request_h> pending_;
};

}  // namespace

Result<std::unique_ptr<UcxListener>> ucx_listen(const std::string& host_port) {
  auto hp = parse_host_port(host_port);
  if (!hp) return hp.error();
  auto w = Worker::create();
  if (!w) return w.error();
  auto l = std::make_unique<Listener>(*w, hp->first);
  KVRING_RETURN_IF_ERROR(l->open(hp->second));
  return std::unique_ptr<UcxListener>(std::move(l));
}

Result<std::unique_ptr<Transport>> ucx_connect(const std::string& host_port, Deadline deadline) {
  auto hp = parse_host_port(host_port);
  if (!hp) return hp.error();
  if (hp->second == 0) return invalid_argument("'" + host_port + "': a sender needs the receiver's port");
  auto w = Worker::create();
  if (!w) return w.error();
  const sockaddr_in addr = make_addr(hp->first, hp->second);
  auto t = std::make_unique<UcxTransport>(*w, host_port);
  KVRING_RETURN_IF_ERROR(t->open(nullptr, &addr));
  (void)deadline;  // the connection completes with the first message; its deadline bounds it
  return std::unique_ptr<Transport>(std::move(t));
}

#endif

}  // namespace kvring::handoff
