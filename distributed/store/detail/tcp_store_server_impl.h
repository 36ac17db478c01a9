// TCPStoreServer's internals, shared by its files (internal: not installed):
//   tcp_store_server.cpp           listening, accepting, the idle sweep, stop, the workers' joins
//   tcp_store_server_session.cpp   one connection: the handshake, framing, buffers, timers
//   tcp_store_server_requests.cpp  the requests: keys, counters, parked gets and waits
// One Boost.Asio thread owns every key, connection and parked waiter, so the store's state
// needs no locks; only the workers' join counter is shared with other threads.
#pragma once

// clang-format off
#include <utility>  // before asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
// clang-format on

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ember/distributed/store/detail/store_protocol.h>
#include <ember/distributed/store/detail/store_util.h>
#include <ember/distributed/store/tcp_store.h>

namespace ember::dist {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
namespace wire = dist::detail::store_wire;
using dist::detail::str_cat;

namespace store_server {

// A frame that breaks the protocol: the connection that sent it is dropped.
struct ProtocolError {
  std::string why;
};

// Asio opens sockets without close-on-exec; a launcher that spawns workers must not leak the
// listening socket into them (a child holding it would keep the port "open" after the server
// died, and clients would hang in the accept queue instead of being refused).
void set_cloexec(int fd);

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

// A parked request's timeout, at most the store's longest.
std::chrono::milliseconds clamp_ms(uint64_t ms);

}  // namespace store_server

using store_server::clamp_ms;
using store_server::LogLimiter;
using store_server::ProtocolError;
using store_server::set_cloexec;

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
  /// Taken on the serving thread between two handlers, so that a count is seen only with
  /// everything the handler that moved it did: a connection counted closed has been closed
  /// (its peer can see the end), a key counted stored is readable.
  Stats stats();

 private:
  Stats snapshot() const {
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
    s.queued_bytes = queued_.load();
    return s;
  }
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
  std::atomic<int64_t> queued_{0};  // reply bytes not yet written (Session::send)
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
  Session(Impl& server, tcp::socket socket);
  void start();
  void send(wire::Bytes frame);
  void close();

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
  void drop(const std::string& why);

  // Charges the payload buffer's current capacity to the server's total.
  void account();

  // One read: the rest of the header, or as much of the payload as the buffer has room for.
  void read_more();

  // Makes room for the next payload bytes: twice what has arrived (at least kFirstChunk more),
  // at most the claimed length, within the server's total. False if the connection was dropped.
  bool grow();
  void on_read(size_t n);

  // The partial-frame timer runs from a frame's first byte to its last; it is re-armed from
  // the last progress rather than reset on every read, which would cost a timer per read.
  void begin_frame();
  void end_frame();
  Duration frame_limit() const;
  Duration whole_frame_limit() const;

  // Fires at the earlier of the stall limit (from the last byte) and the whole frame's (from its
  // first byte).
  void arm_frame_timer();
  void on_header();
  void on_payload();
  void on_auth();
  void do_write();

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
  // A request arrived while a reply was still being written: the next is read only once the
  // replies are out (Session::on_payload).
  bool read_deferred_ = false;
};

}  // namespace ember::dist
