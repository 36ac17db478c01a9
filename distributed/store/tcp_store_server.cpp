// TCPStoreServer: one Boost.Asio thread owns every key, connection and parked waiter, so the
// store's state needs no locks; only the workers' join counter is shared with other threads.
#include <fcntl.h>
#include <sys/resource.h>

// clang-format off
#include <utility>  // before asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
// clang-format on

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <ember/distributed/store/detail/store_protocol.h>
#include <ember/distributed/store/detail/store_util.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/log.h>

namespace ember::dist {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
namespace wire = dist::detail::store_wire;
using dist::detail::str_cat;

namespace {

// A frame that breaks the protocol: the connection that sent it is dropped.
struct ProtocolError {
  std::string why;
};

// Asio opens sockets without close-on-exec; a launcher that spawns workers must not leak the
// listening socket into them (a child holding it would keep the port "open" after the server
// died, and clients would hang in the accept queue instead of being refused).
void set_cloexec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

// At most kLines log lines per second, so a flood of hostile connections cannot flood the log
// (or the disk behind it); how many were left out is said on the next line that is written.
class LogLimiter {
 public:
  static constexpr int kLines = 5;
  // True if a line may be written now; *suppressed is then the number left out before it.
  bool allow(int64_t* suppressed) {
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= std::chrono::seconds(1)) {
      window_start_ = now;
      lines_ = 0;
    }
    if (lines_ >= kLines) {
      ++suppressed_;
      return false;
    }
    ++lines_;
    *suppressed = std::exchange(suppressed_, 0);
    return true;
  }

 private:
  std::chrono::steady_clock::time_point window_start_{};
  int lines_ = 0;
  int64_t suppressed_ = 0;
};

std::chrono::milliseconds clamp_ms(uint64_t ms) {
  return std::chrono::milliseconds(
      std::min<uint64_t>(ms, static_cast<uint64_t>(dist::detail::kMaxStoreTimeout.count())));
}

}  // namespace

class TCPStoreServer::Impl {
 public:
  class Session;

  explicit Impl(TCPStoreServerOptions options);
  ~Impl() { stop(); }

  void stop();
  uint16_t port() const { return port_; }
  int64_t num_workers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return workers_;
  }
  void wait_for_workers(int64_t n, Duration timeout);
  Stats stats() const {
    Stats s;
    s.accepted = accepted_.load();
    s.active = active_.load();
    s.authenticated = authenticated_.load();
    s.auth_failures = auth_failures_.load();
    s.protocol_errors = protocol_errors_.load();
    s.waiting = static_cast<int64_t>(waiting_.load());
    s.frame_timeouts = frame_timeouts_.load();
    s.buffer_refusals = buffer_refusals_.load();
    s.buffered_bytes = buffered_.load();
    s.stored_bytes = stored_.load();
    s.quota_refusals = quota_refusals_.load();
    s.idle_closes = idle_closes_.load();
    return s;
  }

 private:
  friend class Session;
  // A get or wait parked until its keys are set or its timer fires.
  struct Waiter {
    std::shared_ptr<Session> session;
    std::vector<std::string> keys;  // distinct
    size_t missing = 0;             // keys not yet seen set
    bool is_get = false;            // reply with the value of keys[0]
    std::unique_ptr<asio::steady_timer> timer;
  };

  bool try_listen(const tcp::endpoint& ep, std::string* error);
  void do_accept();
  void run();
  void handle(const std::shared_ptr<Session>& s, uint8_t type, const wire::Bytes& payload);
  void set_key(const std::string& key, wire::Bytes value);
  // Whether replacing `key`'s value (if any) by `bytes` more keeps the store within
  // max_stored_bytes; if not, answers the session with an error naming the key and the quota.
  bool within_quota(const std::shared_ptr<Session>& s, const std::string& key, size_t bytes);
  void park(const std::shared_ptr<Session>& s, std::vector<std::string> keys, bool is_get,
            uint64_t timeout_ms);
  void complete(uint64_t id);
  void expire(uint64_t id);
  void unregister(uint64_t id, const Waiter& w);
  void cancel_waiter(uint64_t id);
  wire::Bytes new_nonce();
  void log_peer(const std::string& peer, const std::string& why);
  // Every quarter of idle_timeout: closes the sessions idle for longer (one timer for all, not
  // one per connection).
  void sweep_idle();

  // Declared first so it is destroyed last: sockets and timers below belong to it.
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_;
  asio::steady_timer idle_sweep_;
  TCPStoreServerOptions opts_;
  std::string secret_;
  uint16_t port_ = 0;
  std::mutex stop_mu_;
  std::thread thread_;

  // Owned by the io thread.
  bool stopping_ = false;
  std::unordered_map<std::string, wire::Bytes> data_;
  std::unordered_set<std::shared_ptr<Session>> sessions_;
  std::unordered_map<uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiting_on_;  // missing key -> waiters
  uint64_t next_waiter_ = 1;
  std::random_device random_;
  LogLimiter log_limiter_;

  // Shared with wait_for_workers callers.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t workers_ = 0;
  bool stopped_ = false;

  std::atomic<int64_t> accepted_{0}, active_{0}, authenticated_{0}, auth_failures_{0},
      protocol_errors_{0}, frame_timeouts_{0}, buffer_refusals_{0};
  // Receive-buffer bytes held by all sessions; changed only on the io thread.
  std::atomic<int64_t> buffered_{0};
  // Bytes of the stored keys and values; changed only on the io thread.
  std::atomic<int64_t> stored_{0};
  std::atomic<int64_t> quota_refusals_{0};
  std::atomic<int64_t> idle_closes_{0};
  std::atomic<size_t> waiting_{0};  // waiters_.size(), readable from other threads
};

// One client connection. Reads frames forever (so a client that goes away is noticed even
// while its request is parked), answers each request, and closes on anything malformed.
//
// A frame's payload buffer grows with the bytes that arrive (doubling from kFirstChunk, and
// never beyond the length the header claims), so a header that claims a huge payload costs
// nothing until the payload is really sent, and every growth is charged against the server's
// max_buffered_bytes. A frame whose bytes stop arriving for partial_frame_timeout is dropped.
class TCPStoreServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl& server, tcp::socket socket)
      : srv_(server),
        sock_(std::move(socket)),
        handshake_timer_(server.io_),
        frame_timer_(server.io_) {
    boost::system::error_code ec;
    const auto peer = sock_.remote_endpoint(ec);
    peer_ = ec ? std::string("an unknown peer") : str_cat(peer);
  }

  void start() {
    srv_.sessions_.insert(shared_from_this());
    last_active_ = Clock::now();
    ++srv_.active_;
    set_cloexec(sock_.native_handle());
    boost::system::error_code ec;
    sock_.set_option(tcp::no_delay(true), ec);
    nonce_ = srv_.new_nonce();
    send(wire::FrameWriter(wire::Type::kChallenge)
             .blob(nonce_)
             .u64(srv_.secret_.empty() ? 0 : 1)
             .finish());
    const auto limit = std::min(srv_.opts_.handshake_timeout, dist::detail::kMaxStoreTimeout);
    handshake_timer_.expires_after(limit);
    handshake_timer_.async_wait(
        [self = shared_from_this(), limit](const boost::system::error_code& e) {
          if (e || self->authenticated_ || self->closed_) return;
          self->srv_.log_peer(
              self->peer_, str_cat("bad handshake: none completed within ", limit.count(), " ms"));
          self->close();
        });
    read_more();
  }

  void send(wire::Bytes frame) {
    if (closed_) return;
    out_.push_back(std::move(frame));
    if (out_.size() == 1) do_write();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    const auto self = shared_from_this();  // sessions_ may hold the last reference
    // Bookkeeping first, so that stats() is current by the time the peer sees the close.
    if (waiter_) srv_.cancel_waiter(std::exchange(waiter_, 0));
    srv_.buffered_ -= static_cast<int64_t>(std::exchange(accounted_, 0));
    --srv_.active_;
    srv_.sessions_.erase(self);
    handshake_timer_.cancel();
    frame_timer_.cancel();
    boost::system::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);  // cancels a pending read, so its buffer may go now
    payload_ = wire::Bytes();
  }

  // The parked request of this session, 0 if none.
  uint64_t waiter_ = 0;

  // Whether this is an authenticated connection with nothing in flight (no request parked or
  // arriving, no reply being written) whose last byte in or out was before `cutoff`.
  bool idle_since(std::chrono::steady_clock::time_point cutoff) const {
    return authenticated_ && !closed_ && waiter_ == 0 && !frame_active_ && out_.empty() &&
           last_active_ < cutoff;
  }
  const std::string& peer() const { return peer_; }

 private:
  // The first growth of a payload buffer; also what a buffer may keep between frames.
  static constexpr size_t kFirstChunk = size_t{64} << 10;
  using Clock = std::chrono::steady_clock;

  // Logged (rate-limited) and counted before closing, so that a test or monitor that sees
  // the close also sees the line and the count.
  void drop(const std::string& why) {
    srv_.log_peer(peer_, why);
    ++srv_.protocol_errors_;
    close();
  }

  // Charges the payload buffer's current capacity to the server's total.
  void account() {
    if (closed_) return;  // close() has taken the buffer off the total
    const size_t cap = payload_.capacity();
    srv_.buffered_ += static_cast<int64_t>(cap) - static_cast<int64_t>(accounted_);
    accounted_ = cap;
  }

  // One read: the rest of the header, or as much of the payload as the buffer has room for.
  void read_more() {
    if (in_payload_ && got_ == payload_.size() && !grow()) return;
    const auto buf = in_payload_
                         ? asio::buffer(payload_.data() + got_, payload_.size() - got_)
                         : asio::buffer(header_.data() + header_got_, header_.size() - header_got_);
    sock_.async_read_some(
        buf, [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
          if (self->closed_) return;
          if (ec) return self->close();  // EOF or reset: the client went away
          self->on_read(n);
        });
  }

  // Makes room for the next payload bytes: twice what has arrived (at least kFirstChunk more),
  // at most the claimed length, within the server's total. False if the connection was dropped.
  bool grow() {
    const size_t want = std::min<size_t>(length_, std::max(got_ + kFirstChunk, 2 * got_));
    if (want > payload_.capacity()) {
      const size_t share = srv_.opts_.max_connection_buffered_bytes;
      if (share != 0 && want > share) {
        ++srv_.buffer_refusals_;
        drop(str_cat("connection's buffer share: a frame of ", length_, " bytes needs a ", want,
                     "-byte buffer, past max_connection_buffered_bytes ", share));
        return false;
      }
      const size_t extra = want - payload_.capacity();
      const int64_t total = srv_.buffered_.load();
      if (static_cast<size_t>(total) + extra > srv_.opts_.max_buffered_bytes) {
        ++srv_.buffer_refusals_;
        drop(str_cat("server buffer full: a frame of ", length_, " bytes needs ", extra,
                     " more while all connections hold ", total, " of max_buffered_bytes ",
                     srv_.opts_.max_buffered_bytes));
        return false;
      }
      try {
        payload_.reserve(want);
      } catch (const std::bad_alloc&) {
        drop(str_cat("out of memory for a frame of ", length_, " bytes"));
        return false;
      }
      account();
    }
    payload_.resize(want);
    return true;
  }

  void on_read(size_t n) {
    last_progress_ = last_active_ = Clock::now();
    if (!in_payload_) {
      if (header_got_ == 0 && n > 0) begin_frame();
      header_got_ += n;
      if (header_got_ < header_.size()) return read_more();
      header_got_ = 0;
      return on_header();
    }
    got_ += n;
    if (got_ < length_) return read_more();
    end_frame();
    on_payload();
  }

  // The partial-frame timer runs from a frame's first byte to its last; it is re-armed from
  // the last progress rather than reset on every read, which would cost a timer per read.
  void begin_frame() {
    frame_active_ = true;
    frame_started_ = Clock::now();
    if (!frame_timer_armed_) arm_frame_timer();
  }
  void end_frame() {
    frame_active_ = false;
    in_payload_ = false;
  }

  Duration frame_limit() const {
    return std::min(srv_.opts_.partial_frame_timeout, dist::detail::kMaxStoreTimeout);
  }

  Duration whole_frame_limit() const {
    return std::min(srv_.opts_.max_frame_time, dist::detail::kMaxStoreTimeout);
  }

  // Fires at the earlier of the stall limit (from the last byte) and the whole frame's (from its
  // first byte).
  void arm_frame_timer() {
    frame_timer_armed_ = true;
    frame_timer_.expires_at(
        std::min(last_progress_ + frame_limit(), frame_started_ + whole_frame_limit()));
    frame_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& e) {
      self->frame_timer_armed_ = false;
      if (e || self->closed_ || !self->frame_active_) return;
      const auto limit = self->frame_limit();
      const auto now = Clock::now();
      if (now - self->frame_started_ >= self->whole_frame_limit()) {
        ++self->srv_.frame_timeouts_;
        return self->drop(str_cat(
            "frame too slow: ",
            self->in_payload_ ? self->got_ + wire::kHeaderSize : self->header_got_, " of ",
            self->in_payload_ ? str_cat(self->length_ + wire::kHeaderSize) : std::string("?"),
            " bytes arrived in ", self->whole_frame_limit().count(), " ms (max_frame_time)"));
      }
      if (now - self->last_progress_ < limit) return self->arm_frame_timer();
      ++self->srv_.frame_timeouts_;
      self->drop(str_cat(
          "partial frame timed out: ",
          self->in_payload_ ? self->got_ + wire::kHeaderSize : self->header_got_, " of ",
          self->in_payload_ ? str_cat(self->length_ + wire::kHeaderSize) : std::string("?"),
          " bytes arrived, then nothing for ", limit.count(), " ms (partial_frame_timeout)"));
    });
  }

  void on_header() {
    std::string why;
    const auto h = wire::parse_header(header_.data(), &why);
    if (!h) return drop(authenticated_ ? why : str_cat("bad handshake: ", why));
    type_ = h->type;
    const bool ok_type =
        authenticated_ ? wire::is_request(type_) : type_ == static_cast<uint8_t>(wire::Type::kAuth);
    if (!ok_type) {
      return drop(
          str_cat(authenticated_ ? "" : "bad handshake: ", "unexpected frame type ", int(type_)));
    }
    const size_t limit = authenticated_ ? wire::kMaxPayload : wire::kMaxHandshakePayload;
    if (h->length > limit) {
      return drop(str_cat("oversized frame: payload of ", h->length, " bytes, at most ", limit,
                          authenticated_ ? "" : " before authenticating"));
    }
    length_ = h->length;
    got_ = 0;
    payload_.clear();
    if (length_ == 0) {
      end_frame();
      return on_payload();
    }
    in_payload_ = true;
    read_more();
  }

  void on_payload() {
    if (!authenticated_) return on_auth();
    // Clients send one request at a time; a second one while the first is parked is a bug
    // or an attack.
    if (waiter_) return drop("request while another is pending");
    try {
      srv_.handle(shared_from_this(), type_, payload_);
    } catch (const ProtocolError& e) {
      return drop(e.why);
    } catch (const std::exception& e) {  // bad_alloc and the like: this connection only
      return drop(e.what());
    }
    if (closed_) return;
    // An idle connection keeps at most a small buffer, so idle clients cost little of the
    // server's max_buffered_bytes.
    if (payload_.capacity() > kFirstChunk) {
      payload_ = wire::Bytes();
      account();
    }
    read_more();
  }

  void on_auth() {
    wire::PayloadReader r(payload_.data(), payload_.size());
    wire::Bytes proof;
    if (!r.blob(64, &proof) || !r.done()) return drop("bad handshake: malformed auth frame");
    if (!srv_.secret_.empty() &&
        !wire::constant_time_equal(proof, wire::auth_proof(srv_.secret_, nonce_))) {
      ++srv_.auth_failures_;
      srv_.log_peer(peer_, "bad handshake: wrong or missing secret");
      close_after_write_ = true;
      send(wire::FrameWriter(wire::Type::kAuthFailed).finish());
      return;  // no further reads: the connection closes once the refusal is written
    }
    authenticated_ = true;
    ++srv_.authenticated_;
    handshake_timer_.cancel();
    send(wire::FrameWriter(wire::Type::kOk).finish());
    read_more();
  }

  void do_write() {
    asio::async_write(sock_, asio::buffer(out_.front()),
                      [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                        if (self->closed_) return;
                        if (ec) return self->close();
                        self->last_active_ = Clock::now();
                        self->out_.pop_front();
                        if (!self->out_.empty()) {
                          self->do_write();
                        } else if (self->close_after_write_) {
                          self->close();
                        }
                      });
  }

  Impl& srv_;
  tcp::socket sock_;
  asio::steady_timer handshake_timer_;
  asio::steady_timer frame_timer_;
  std::string peer_;  // host:port, for the log
  wire::Bytes nonce_;
  bool authenticated_ = false;
  bool closed_ = false;
  bool close_after_write_ = false;
  // The frame being read: its header, then its payload.
  std::array<uint8_t, wire::kHeaderSize> header_{};
  size_t header_got_ = 0;
  bool in_payload_ = false;
  uint8_t type_ = 0;
  uint32_t length_ = 0;  // the payload's length, from the header
  size_t got_ = 0;       // payload bytes received
  wire::Bytes payload_;  // size() = room made so far; capacity() is charged to the server
  size_t accounted_ = 0;
  bool frame_active_ = false;  // a frame's first byte has arrived, its last not yet
  bool frame_timer_armed_ = false;
  Clock::time_point last_progress_;
  Clock::time_point frame_started_;
  Clock::time_point last_active_;  // the last byte received or reply written
  std::deque<wire::Bytes> out_;
};

size_t default_max_connections(uint64_t nofile) {
  constexpr size_t kMost = 16384;
  if (nofile == RLIM_INFINITY || nofile > uint64_t{1} << 40) return kMost;
  const uint64_t reserve = std::max<uint64_t>(256, nofile / 4);
  return nofile > reserve ? static_cast<size_t>(std::min<uint64_t>(kMost, nofile - reserve)) : 1;
}

TCPStoreServer::Impl::Impl(TCPStoreServerOptions options)
    : work_(asio::make_work_guard(io_)),
      acceptor_(io_),
      accept_retry_(io_),
      idle_sweep_(io_),
      opts_(std::move(options)),
      secret_(store_secret(opts_.secret)) {
  if (opts_.max_connections == 0) {
    rlimit nofile{};
    opts_.max_connections = default_max_connections(
        ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 ? nofile.rlim_cur : RLIM_INFINITY);
  }
  const std::string where = str_cat(opts_.host.empty() ? "*" : opts_.host, ":", opts_.port);
  std::vector<tcp::endpoint> endpoints;
  if (opts_.host.empty()) {
    // Dual-stack IPv6 takes IPv4 clients too; fall back to IPv4 where IPv6 is off.
    endpoints = {tcp::endpoint(tcp::v6(), opts_.port), tcp::endpoint(tcp::v4(), opts_.port)};
  } else {
    boost::system::error_code ec;
    tcp::resolver resolver(io_);
    const auto results = resolver.resolve(opts_.host, std::to_string(opts_.port), ec);
    if (ec) {
      throw DistNetworkError(str_cat("[TCPStoreServer] cannot listen on ", where,
                                     ": cannot resolve '", opts_.host, "': ", ec.message()));
    }
    for (const auto& r : results) endpoints.push_back(r.endpoint());
  }
  std::string error = "no address to listen on";
  bool listening = false;
  for (const auto& ep : endpoints) {
    if ((listening = try_listen(ep, &error))) break;
  }
  if (!listening) {
    throw DistNetworkError(str_cat("[TCPStoreServer] cannot listen on ", where, ": ", error));
  }
  port_ = acceptor_.local_endpoint().port();
  do_accept();
  if (opts_.idle_timeout > Duration::zero()) sweep_idle();
  thread_ = std::thread([this] { run(); });
}

bool TCPStoreServer::Impl::try_listen(const tcp::endpoint& ep, std::string* error) {
  boost::system::error_code ec;
  acceptor_.open(ep.protocol(), ec);
  if (!ec) set_cloexec(acceptor_.native_handle());
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec && ep.address().is_v6() && opts_.host.empty()) {
    acceptor_.set_option(asio::ip::v6_only(false), ec);
  }
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    *error = str_cat(ec.message(), " (", ep, ")");
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    return false;
  }
  return true;
}

void TCPStoreServer::Impl::run() {
  for (;;) {
    try {
      io_.run();
      return;
    } catch (const std::exception& e) {
      // Handlers catch their own errors; this is a last line so one bug cannot end the store.
      logging::error("[TCPStoreServer] error in the serving thread (continuing): ", e.what());
    }
  }
}

void TCPStoreServer::Impl::do_accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (stopping_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of file descriptors and the like: try again shortly rather than spin.
      accept_retry_.expires_after(std::chrono::milliseconds(50));
      accept_retry_.async_wait([this](const boost::system::error_code& e) {
        if (!e && !stopping_) do_accept();
      });
      return;
    }
    ++accepted_;
    if (sessions_.size() >= opts_.max_connections) {
      boost::system::error_code ec;
      const auto peer = socket.remote_endpoint(ec);
      log_peer(ec ? std::string("an unknown peer") : str_cat(peer),
               str_cat("refused: ", opts_.max_connections, " connections open (max_connections)"));
      socket.close(ec);
    } else {
      std::make_shared<Session>(*this, std::move(socket))->start();
    }
    do_accept();
  });
}

void TCPStoreServer::Impl::sweep_idle() {
  const Duration limit = std::min(opts_.idle_timeout, dist::detail::kMaxStoreTimeout);
  const auto cutoff = std::chrono::steady_clock::now() - limit;
  std::vector<std::shared_ptr<Session>> idle;
  for (const auto& s : sessions_) {
    if (s->idle_since(cutoff)) idle.push_back(s);
  }
  for (const auto& s : idle) {  // close() erases from sessions_
    ++idle_closes_;
    // Routine (a client's pooled connection left unused): not a warning. Its client reconnects.
    logging::debug("[TCPStoreServer] port ", port_, ": closed ", s->peer(), ", idle for ",
                   limit.count(), " ms (idle_timeout)");
    s->close();
  }
  // A session goes idle at most a quarter period before the sweep that closes it.
  idle_sweep_.expires_after(std::clamp<Duration>(limit / 4, Duration(10), Duration(30'000)));
  idle_sweep_.async_wait([this](const boost::system::error_code& e) {
    if (!e && !stopping_) sweep_idle();
  });
}

void TCPStoreServer::Impl::stop() {
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (thread_.joinable()) {
    asio::post(io_, [this] {
      stopping_ = true;
      boost::system::error_code ignored;
      acceptor_.close(ignored);
      accept_retry_.cancel();
      idle_sweep_.cancel();
      const auto sessions = sessions_;  // close() erases from sessions_
      for (const auto& s : sessions) s->close();
      waiters_.clear();
      waiting_on_.clear();
      waiting_ = 0;
      work_.reset();
      io_.stop();
    });
    thread_.join();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

void TCPStoreServer::Impl::wait_for_workers(int64_t n, Duration timeout) {
  dist::detail::check_store_timeout("TCPStoreServer wait_for_workers", timeout);
  const auto deadline = dist::detail::store_deadline(timeout);
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return workers_ >= n || stopped_; })) {
    throw DistTimeoutError(str_cat(
        "[TCPStoreServer wait_for_workers] timed out after ", timeout.count(), " ms waiting for ",
        n, " workers to join the store on port ", port_, "; ", workers_, " joined"));
  }
  if (workers_ < n) {
    throw DistStoreError(str_cat("[TCPStoreServer wait_for_workers] the store on port ", port_,
                                 " was stopped while waiting for ", n, " workers (", workers_,
                                 " joined)"));
  }
}

wire::Bytes TCPStoreServer::Impl::new_nonce() {
  wire::Bytes nonce(wire::kNonceSize);
  for (size_t i = 0; i < nonce.size(); i += 4) {
    const uint32_t r = random_();
    for (size_t j = 0; j < 4 && i + j < nonce.size(); ++j) nonce[i + j] = uint8_t(r >> (8 * j));
  }
  return nonce;
}

void TCPStoreServer::Impl::log_peer(const std::string& peer, const std::string& why) {
  int64_t suppressed = 0;
  if (!log_limiter_.allow(&suppressed)) return;
  const std::string more =
      suppressed ? str_cat(" (", suppressed, " similar lines suppressed before this one)") : "";
  logging::warn("[TCPStoreServer] port ", port_, ": dropped ", peer, ": ", why, more);
}

namespace {
std::vector<std::string> read_keys(wire::PayloadReader& r) {
  uint64_t count = 0;
  if (!r.u64(&count) || count > wire::kMaxKeysPerRequest) {
    throw ProtocolError{"bad key count"};
  }
  std::vector<std::string> keys(count);
  for (auto& k : keys) {
    if (!r.blob(wire::kMaxKeySize, &k)) throw ProtocolError{"bad key"};
  }
  return keys;
}

void expect(bool ok, wire::PayloadReader& r, const char* what) {
  if (!ok || !r.done()) throw ProtocolError{str_cat("malformed ", what, " request")};
}
}  // namespace

void TCPStoreServer::Impl::handle(const std::shared_ptr<Session>& s, uint8_t type,
                                  const wire::Bytes& payload) {
  using wire::FrameWriter;
  using wire::Type;
  wire::PayloadReader r(payload.data(), payload.size());
  std::string key;
  switch (static_cast<Type>(type)) {
    case Type::kSet: {
      wire::Bytes value;
      expect(r.blob(wire::kMaxKeySize, &key) && r.blob(wire::kMaxValueSize, &value), r, "set");
      if (!within_quota(s, key, value.size())) return;
      set_key(key, std::move(value));
      s->send(FrameWriter(Type::kOk).finish());
      return;
    }
    case Type::kGet: {
      uint64_t timeout_ms = 0;
      expect(r.blob(wire::kMaxKeySize, &key) && r.u64(&timeout_ms), r, "get");
      const auto it = data_.find(key);
      if (it != data_.end()) {
        s->send(FrameWriter(Type::kOk).blob(it->second).finish());
      } else {
        park(s, {key}, /*is_get=*/true, timeout_ms);
      }
      return;
    }
    case Type::kAdd: {
      uint64_t delta = 0;
      expect(r.blob(wire::kMaxKeySize, &key) && r.u64(&delta), r, "add");
      int64_t result = 0;
      try {
        const auto it = data_.find(key);
        const int64_t current =
            it == data_.end() ? 0
                              : dist::detail::parse_store_counter("TCPStore add", key, it->second);
        result = dist::detail::add_store_counter("TCPStore add", key, current,
                                                  static_cast<int64_t>(delta));
      } catch (const DistStoreError& e) {
        s->send(FrameWriter(Type::kError).blob(std::string(e.what())).finish());
        return;
      }
      wire::Bytes counter = dist::detail::format_store_counter(result);
      if (!within_quota(s, key, counter.size())) return;
      set_key(key, std::move(counter));
      s->send(FrameWriter(Type::kOk).u64(static_cast<uint64_t>(result)).finish());
      return;
    }
    case Type::kCompareSet: {
      wire::Bytes expected, desired;
      expect(r.blob(wire::kMaxKeySize, &key) && r.blob(wire::kMaxValueSize, &expected) &&
                 r.blob(wire::kMaxValueSize, &desired),
             r, "compare_set");
      const auto it = data_.find(key);
      if (it == data_.end()) {
        // torch: create the key only if expected is empty; else answer `expected`.
        if (expected.empty()) {
          if (!within_quota(s, key, desired.size())) return;
          set_key(key, desired);
          s->send(FrameWriter(Type::kOk).blob(desired).finish());
        } else {
          s->send(FrameWriter(Type::kOk).blob(expected).finish());
        }
      } else {
        if (it->second == expected) {
          if (!within_quota(s, key, desired.size())) return;
          stored_ += static_cast<int64_t>(desired.size()) - static_cast<int64_t>(it->second.size());
          it->second = std::move(desired);
        }
        s->send(FrameWriter(Type::kOk).blob(it->second).finish());
      }
      return;
    }
    case Type::kCheck: {
      const auto keys = read_keys(r);
      expect(true, r, "check");
      bool all = true;
      for (const auto& k : keys) all = all && data_.count(k);
      s->send(FrameWriter(Type::kOk).u64(all ? 1 : 0).finish());
      return;
    }
    case Type::kWait: {
      uint64_t timeout_ms = 0;
      if (!r.u64(&timeout_ms)) throw ProtocolError{"malformed wait request"};
      auto keys = dist::detail::unique_keys(read_keys(r));
      expect(true, r, "wait");
      bool all = true;
      for (const auto& k : keys) all = all && data_.count(k);
      if (all) {
        s->send(FrameWriter(Type::kOk).finish());
      } else {
        park(s, std::move(keys), /*is_get=*/false, timeout_ms);
      }
      return;
    }
    case Type::kDeleteKey: {
      expect(r.blob(wire::kMaxKeySize, &key), r, "delete_key");
      const auto it = data_.find(key);
      const bool existed = it != data_.end();
      if (existed) {
        stored_ -= static_cast<int64_t>(key.size() + it->second.size());
        data_.erase(it);
      }
      s->send(FrameWriter(Type::kOk).u64(existed ? 1 : 0).finish());
      return;
    }
    case Type::kNumKeys: {
      expect(true, r, "num_keys");
      s->send(FrameWriter(Type::kOk).u64(data_.size()).finish());
      return;
    }
    case Type::kJoin: {
      expect(true, r, "join");
      int64_t n = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        n = ++workers_;
      }
      cv_.notify_all();
      s->send(FrameWriter(Type::kOk).u64(static_cast<uint64_t>(n)).finish());
      return;
    }
    default:
      throw ProtocolError{str_cat("unknown request type ", int(type))};
  }
}

bool TCPStoreServer::Impl::within_quota(const std::shared_ptr<Session>& s, const std::string& key,
                                        size_t bytes) {
  const auto it = data_.find(key);
  const int64_t now = stored_.load();
  const int64_t after = now + static_cast<int64_t>(bytes) -
                        (it == data_.end() ? -static_cast<int64_t>(key.size())
                                           : static_cast<int64_t>(it->second.size()));
  if (after <= now || static_cast<size_t>(after) <= opts_.max_stored_bytes) return true;
  ++quota_refusals_;
  s->send(wire::FrameWriter(wire::Type::kError)
              .blob(str_cat("the store is full: setting '", key.substr(0, 200), "' to ", bytes,
                            " bytes would make its keys and values ", after,
                            " bytes, past max_stored_bytes ", opts_.max_stored_bytes))
              .finish());
  return false;
}

void TCPStoreServer::Impl::set_key(const std::string& key, wire::Bytes value) {
  const auto old = data_.find(key);
  stored_ += static_cast<int64_t>(value.size()) -
             (old == data_.end() ? -static_cast<int64_t>(key.size())
                                 : static_cast<int64_t>(old->second.size()));
  data_[key] = std::move(value);
  // Waiters are registered only on keys missing when they parked, and a key's list is taken
  // whole the first time it is set, so each waiter counts each of its keys once.
  const auto it = waiting_on_.find(key);
  if (it == waiting_on_.end()) return;
  const std::vector<uint64_t> ids = std::move(it->second);
  waiting_on_.erase(it);
  for (const uint64_t id : ids) {
    const auto w = waiters_.find(id);
    if (w != waiters_.end() && --w->second.missing == 0) complete(id);
  }
}

void TCPStoreServer::Impl::park(const std::shared_ptr<Session>& s, std::vector<std::string> keys,
                                bool is_get, uint64_t timeout_ms) {
  const uint64_t id = next_waiter_++;
  Waiter w;
  w.session = s;
  w.is_get = is_get;
  w.keys = std::move(keys);
  for (const auto& k : w.keys) {
    if (!data_.count(k)) {
      waiting_on_[k].push_back(id);
      ++w.missing;
    }
  }
  w.timer = std::make_unique<asio::steady_timer>(io_, clamp_ms(timeout_ms));
  w.timer->async_wait([this, id](const boost::system::error_code& ec) {
    if (!ec) expire(id);
  });
  s->waiter_ = id;
  waiters_.emplace(id, std::move(w));
  waiting_ = waiters_.size();
}

void TCPStoreServer::Impl::complete(uint64_t id) {
  auto node = waiters_.extract(id);
  waiting_ = waiters_.size();
  Waiter& w = node.mapped();
  w.session->waiter_ = 0;
  if (w.is_get) {
    w.session->send(wire::FrameWriter(wire::Type::kOk).blob(data_.at(w.keys[0])).finish());
  } else {
    w.session->send(wire::FrameWriter(wire::Type::kOk).finish());
  }
}

void TCPStoreServer::Impl::expire(uint64_t id) {
  const auto it = waiters_.find(id);
  if (it == waiters_.end()) return;  // completed or cancelled after the timer fired
  auto node = waiters_.extract(it);
  waiting_ = waiters_.size();
  Waiter& w = node.mapped();
  unregister(id, w);
  std::vector<std::string> missing;
  for (const auto& k : w.keys) {
    if (!data_.count(k)) missing.push_back(k);
  }
  wire::FrameWriter f(wire::Type::kTimeout);
  f.u64(missing.size());
  for (const auto& k : missing) f.blob(k);
  w.session->waiter_ = 0;
  w.session->send(std::move(f).finish());
}

void TCPStoreServer::Impl::unregister(uint64_t id, const Waiter& w) {
  for (const auto& k : w.keys) {
    const auto it = waiting_on_.find(k);
    if (it == waiting_on_.end()) continue;
    std::erase(it->second, id);
    if (it->second.empty()) waiting_on_.erase(it);
  }
}

void TCPStoreServer::Impl::cancel_waiter(uint64_t id) {
  const auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  unregister(id, it->second);
  waiters_.erase(it);
  waiting_ = waiters_.size();
}

// ---- public API ----

TCPStoreServer::TCPStoreServer(TCPStoreServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
TCPStoreServer::~TCPStoreServer() = default;
uint16_t TCPStoreServer::port() const { return impl_->port(); }
void TCPStoreServer::stop() { impl_->stop(); }
int64_t TCPStoreServer::num_workers() const { return impl_->num_workers(); }
void TCPStoreServer::wait_for_workers(int64_t n, Duration timeout) {
  impl_->wait_for_workers(n, timeout);
}
TCPStoreServer::Stats TCPStoreServer::stats() const { return impl_->stats(); }

}  // namespace ember::dist
