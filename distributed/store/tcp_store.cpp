// TCPStore client: plain POSIX sockets, non-blocking, every read and write bounded by poll()
// against a deadline. (The server is in tcp_store_server.cpp.)
#include <ember/distributed/store/tcp_store.h>

#include <cstdlib>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <system_error>
#include <thread>

#include <ember/distributed/store/detail/store_protocol.h>
#include <ember/distributed/store/detail/store_util.h>

namespace ember::dist {

namespace wire = dist::detail::store_wire;
using dist::detail::StoreClock;
using dist::detail::str_cat;
using TimePoint = StoreClock::time_point;

namespace {

// How long a client waits for the server's answer to a get/wait beyond the requested timeout.
// The server answers kTimeout at the timeout itself; this only matters when the server is
// stuck, and then the connection is closed and the call throws DistTimeoutError.
constexpr Duration kServerGrace = std::chrono::seconds(2);
// Idle connections kept for reuse; more exist only while more threads use the store at once.
constexpr size_t kMaxIdleConnections = 8;

// A failure below the Store API; request() turns it into the right DistError with context.
struct IoError {
  enum Kind { kTimeout, kClosed, kProtocol } kind;
  std::string what;
};

std::string errno_text(int err) { return std::system_category().message(err); }

}  // namespace

struct TCPStore::Reply {
  uint8_t type = 0;
  Bytes payload;
};

// One connected, authenticated socket. Used by one thread at a time (it lives in the pool or
// in exactly one call).
class TCPStore::Connection {
 public:
  explicit Connection(int fd) : fd_(fd) {}
  ~Connection() { ::close(fd_); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void send_all(const Bytes& frame, TimePoint deadline) {
    const uint8_t* p = frame.data();
    size_t n = frame.size();
    while (n) {
      const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_io(POLLOUT, deadline);
      } else {
        throw IoError{IoError::kClosed, k < 0 ? errno_text(errno) : "send returned 0"};
      }
    }
  }

  // An idle connection has nothing to read; if it has (EOF, a reset, stray bytes) the server
  // closed it or something is wrong, and it must not be used. One idle for kClientRetireIdle or
  // longer is not used either: a server may be about to close it (idle_timeout), and a request
  // sent as it does would fail.
  bool idle_ok() const {
    if (std::chrono::steady_clock::now() - idle_since_ >= kClientRetireIdle) return false;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  void mark_idle() { idle_since_ = std::chrono::steady_clock::now(); }

  Reply recv(TimePoint deadline) {
    uint8_t h[wire::kHeaderSize];
    read_exact(h, sizeof(h), deadline);
    std::string why;
    const auto hdr = wire::parse_header(h, &why);
    if (!hdr) throw IoError{IoError::kProtocol, why};
    if (hdr->length > wire::kMaxPayload) {
      throw IoError{IoError::kProtocol, str_cat("reply of ", hdr->length, " bytes is too large")};
    }
    Reply r;
    r.type = hdr->type;
    r.payload.resize(hdr->length);
    read_exact(r.payload.data(), r.payload.size(), deadline);
    return r;
  }

 private:
  void wait_io(short events, TimePoint deadline) {
    for (;;) {
      const int64_t ms = dist::detail::ms_until(deadline);
      if (ms == 0) throw IoError{IoError::kTimeout, "timed out"};
      pollfd p{fd_, events, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, INT_MAX)));
      if (rc > 0) return;  // ready, or an error the next send/recv reports
      if (rc < 0 && errno != EINTR) throw IoError{IoError::kClosed, errno_text(errno)};
    }
  }

  void read_exact(uint8_t* p, size_t n, TimePoint deadline) {
    while (n) {
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
      } else if (k == 0) {
        throw IoError{IoError::kClosed, "the server closed the connection"};
      } else if (errno == EINTR) {
        continue;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_io(POLLIN, deadline);
      } else {
        throw IoError{IoError::kClosed, errno_text(errno)};
      }
    }
  }

  int fd_;
  std::chrono::steady_clock::time_point idle_since_ = std::chrono::steady_clock::now();
};

namespace {

// One attempt to connect to host:port (every resolved address in turn). Returns the connected
// non-blocking socket, or -1 with *error set.
int connect_once(const std::string& host, uint16_t port, TimePoint deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    *error = str_cat("cannot resolve '", host, "': ", ::gai_strerror(rc));
    return -1;
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    const int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      *error = errno_text(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        err = 0;
        pollfd p{fd, POLLOUT, 0};
        int prc = 0;
        do {
          const int64_t ms = dist::detail::ms_until(deadline);
          prc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, INT_MAX)));
        } while (prc < 0 && errno == EINTR);
        socklen_t len = sizeof(err);
        if (prc == 0) {
          err = ETIMEDOUT;
        } else if (prc < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
          err = errno;
        }
      }
    }
    if (err == 0) {
      // Small request/reply messages: no Nagle delay. Keepalive probes (after 60 s idle) find
      // a vanished server and keep firewalls from dropping a pooled connection that waits
      // hours between a job's barriers.
      const int one = 1, idle = 60, interval = 10, count = 6;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
      return fd;
    }
    *error = errno_text(err);
    ::close(fd);
  }
  return -1;
}

void check_key(const std::string& op, const std::string& key) {
  EMBER_CHECK(key.size() <= wire::kMaxKeySize, "[", op, "] key ", dist::detail::quote_key(key),
              " is ", key.size(), " bytes; TCPStore keys are limited to ", wire::kMaxKeySize,
              " bytes");
}

void check_value(const std::string& op, const std::string& key, const Bytes& value) {
  EMBER_CHECK(value.size() <= wire::kMaxValueSize, "[", op, "] the value for key ",
              dist::detail::quote_key(key), " is ", value.size(),
              " bytes; TCPStore values are limited to ", wire::kMaxValueSize, " bytes");
}

void check_keys(const std::string& op, const std::vector<std::string>& keys) {
  EMBER_CHECK(keys.size() <= wire::kMaxKeysPerRequest, "[", op, "] got ", keys.size(),
              " keys; TCPStore takes at most ", wire::kMaxKeysPerRequest, " per call");
  for (const auto& k : keys) check_key(op, k);
}

}  // namespace

namespace {
// An address of this machine written as one (127.0.0.1, ::1, 192.0.2.2): the address a server
// rank may listen on alone, since its clients are told that very address. Names such as
// "localhost" or the host's own name are left out: they may resolve differently for the server
// and its clients (Debian maps the host name to 127.0.1.1), so a server for a name listens on
// every interface, as does one for an address that is not this machine's (behind NAT).
bool is_local_address_literal(const std::string& host) {
  sockaddr_storage addr{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    len = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    len = sizeof(sockaddr_in6);
  } else {
    return false;
  }
  // Port 0: binding tests that the address is one of this machine's without taking a port.
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool local = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) == 0;
  ::close(fd);
  return local;
}
}  // namespace

const std::vector<StoreLimit>& store_limits() {
  using O = TCPStoreServerOptions;
  constexpr uint64_t kMaxBytes = uint64_t{1} << 50;
  static const std::vector<StoreLimit> limits = {
      {"--store-max-stored-bytes", "EMBER_STORE_MAX_STORED_BYTES",
       "Bytes the workers' and the rendezvous store may hold, keys and values together; a write "
       "past it is refused naming the key (default 2 GiB; costs the store's memory, up to it)",
       &O::max_stored_bytes, kMaxBytes},
      {"--store-max-buffered-bytes", "EMBER_STORE_MAX_BUFFERED_BYTES",
       "Receive-buffer bytes a store holds across its connections; a frame past it drops its "
       "connection (default 1 GiB; below two values' size a large set may be refused)",
       &O::max_buffered_bytes, kMaxBytes},
      {"--store-max-connection-buffered-bytes", "EMBER_STORE_MAX_CONNECTION_BUFFERED_BYTES",
       "Receive-buffer bytes one connection may hold, its share of --store-max-buffered-bytes "
       "(default: a frame's maximum, about 128 MiB; a request larger than it is refused)",
       &O::max_connection_buffered_bytes, kMaxBytes},
      {"--store-max-connections", "EMBER_STORE_MAX_CONNECTIONS",
       "Connections a store accepts (default: 16384, at most the descriptor limit less a "
       "quarter; each costs a descriptor and a little memory)",
       &O::max_connections, uint64_t{1} << 20},
      {"--store-max-frame-time", "EMBER_STORE_MAX_FRAME_TIME",
       "Seconds a frame may take to arrive from its first byte (default 120; a shorter one "
       "drops large values sent over slow links)",
       nullptr, 0, &O::max_frame_time},
      {"--store-idle-timeout", "EMBER_STORE_IDLE_TIMEOUT",
       "Seconds an authenticated store connection may sit idle before the store closes it "
       "(default 600; a parked get or wait is not idle; Ember's clients reconnect on their "
       "next request, so below 60 a client's request may meet the close and fail)",
       nullptr, 0, &O::idle_timeout},
  };
  return limits;
}

void set_store_limit(TCPStoreServerOptions& options, const StoreLimit& limit,
                     const std::string& value, const std::string& named) {
  if (limit.seconds != nullptr) {
    char* end = nullptr;
    errno = 0;
    const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
    if (value.empty() || errno != 0 || end != value.c_str() + value.size() || !(v > 0) ||
        v > 1e6) {
      throw ValueError(str_cat(named, ": expected seconds in (0, 1e6], got '", value, "'"));
    }
    options.*limit.seconds = std::max(
        Duration(1), std::chrono::duration_cast<Duration>(std::chrono::duration<double>(v)));
    return;
  }
  uint64_t v = 0;
  const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (value.empty() || ec != std::errc() || p != value.data() + value.size() || v < 1 ||
      v > limit.max) {
    throw ValueError(
        str_cat(named, ": expected an integer in [1, ", limit.max, "], got '", value, "'"));
  }
  options.*limit.count = static_cast<size_t>(v);
}

TCPStoreServerOptions store_limits_from_env(TCPStoreServerOptions base) {
  for (const StoreLimit& limit : store_limits()) {
    const char* v = std::getenv(limit.env);
    if (v != nullptr && *v != '\0') set_store_limit(base, limit, v, limit.env);
  }
  return base;
}

std::string store_secret(const std::optional<std::string>& given) {
  if (given) return *given;
  const char* env = std::getenv(kStoreSecretEnv);
  return env ? env : "";
}

TCPStore::TCPStore(std::string host, uint16_t port, TCPStoreOptions options)
    : Store(options.timeout),
      host_(std::move(host)),
      port_(port),
      secret_(store_secret(options.secret)) {
  dist::detail::check_store_timeout("TCPStore", options.timeout);
  EMBER_CHECK(!options.world_size || *options.world_size >= 1,
              "[TCPStore] world_size must be at least 1, got ", options.world_size.value_or(0));
  if (options.is_server) {
    TCPStoreServerOptions so = options.server_limits;
    so.host = options.listen_host.empty() && is_local_address_literal(host_) ? host_
                                                                             : options.listen_host;
    so.port = port;
    so.secret = secret_;
    server_ = std::make_unique<TCPStoreServer>(std::move(so));
    port_ = server_->port();
  }
  EMBER_CHECK(port_ != 0,
              "[TCPStore] port 0 is only valid with is_server (the OS picks the "
              "server's port); a client needs the server's actual port, got 0 for host '",
              host_, "'");
  release(connect("TCPStore", timeout_));
  if (options.world_size) {
    Reply r = request("TCPStore join", wire::FrameWriter(wire::Type::kJoin).finish(), timeout_,
                      false, {});
    if (r.type != static_cast<uint8_t>(wire::Type::kOk)) {
      throw DistStoreError(str_cat("[TCPStore] the store", where(), " refused the join"));
    }
    if (server_ && options.wait_for_workers) {
      server_->wait_for_workers(*options.world_size, timeout_);
    }
  }
}

TCPStore::~TCPStore() {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    pool_.clear();
  }
  server_.reset();
}

std::string TCPStore::where() const { return str_cat(" at ", host_, ":", port_); }

std::unique_ptr<TCPStore::Connection> TCPStore::connect(const std::string& op, Duration timeout) {
  const TimePoint deadline = dist::detail::store_deadline(timeout);
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error;
  for (;;) {
    const int fd = connect_once(host_, port_, deadline, &last_error);
    if (fd >= 0) {
      auto conn = std::make_unique<Connection>(fd);
      try {
        const Reply challenge = conn->recv(deadline);
        wire::PayloadReader r(challenge.payload.data(), challenge.payload.size());
        Bytes nonce;
        uint64_t secret_required = 0;
        if (challenge.type != static_cast<uint8_t>(wire::Type::kChallenge) ||
            !r.blob(wire::kNonceSize, &nonce) || !r.u64(&secret_required) || !r.done()) {
          throw IoError{IoError::kProtocol, "unexpected handshake"};
        }
        const Bytes proof = secret_.empty() ? Bytes{} : wire::auth_proof(secret_, nonce);
        conn->send_all(wire::FrameWriter(wire::Type::kAuth).blob(proof).finish(), deadline);
        const Reply verdict = conn->recv(deadline);
        if (verdict.type == static_cast<uint8_t>(wire::Type::kAuthFailed)) {
          throw DistStoreError(str_cat(
              "[", op, "] store at ", host_, ":", port_,
              " refused the connection: wrong or missing secret (", kStoreSecretEnv, "); ",
              secret_.empty() ? "this client has no secret" : "this client's secret differs"));
        }
        if (verdict.type != static_cast<uint8_t>(wire::Type::kOk) || !verdict.payload.empty()) {
          throw IoError{IoError::kProtocol, "unexpected handshake"};
        }
        return conn;
      } catch (const IoError& e) {
        if (e.kind == IoError::kProtocol) {
          throw DistStoreError(str_cat("[", op, "] the server", where(),
                                       " is not an Ember TCPStore of this version: ", e.what));
        }
        // Closed or timed out during the handshake (e.g. the server is at its connection
        // limit or shutting down): retry like a refused connection.
        last_error = str_cat("handshake failed: ", e.what);
      }
    }
    const int64_t left = dist::detail::ms_until(deadline);
    if (left == 0) {
      throw DistNetworkError(str_cat("[", op, "] could not connect to the store", where(),
                                     " within ", timeout.count(), " ms (last error: ", last_error,
                                     ")"));
    }
    dist::detail::backoff_sleep(&backoff, deadline, std::chrono::seconds(1));
  }
}

std::unique_ptr<TCPStore::Connection> TCPStore::acquire(const std::string& op, Duration timeout) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    while (!pool_.empty()) {
      auto conn = std::move(pool_.back());
      pool_.pop_back();
      if (conn->idle_ok()) return conn;
    }
  }
  return connect(op, timeout);
}

void TCPStore::release(std::unique_ptr<Connection> conn) {
  conn->mark_idle();
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (pool_.size() < kMaxIdleConnections) pool_.push_back(std::move(conn));
}

TCPStore::Reply TCPStore::request(const std::string& op, Bytes frame, Duration timeout,
                                  bool server_waits, const std::vector<std::string>& keys) {
  auto conn = acquire(op, timeout);
  const Duration limit =
      server_waits ? std::min(timeout, dist::detail::kMaxStoreTimeout) + kServerGrace : timeout;
  const TimePoint deadline = dist::detail::store_deadline(limit);
  try {
    conn->send_all(frame, deadline);
    Reply r = conn->recv(deadline);
    const auto t = static_cast<wire::Type>(r.type);
    if (t != wire::Type::kOk && t != wire::Type::kTimeout && t != wire::Type::kError) {
      throw IoError{IoError::kProtocol, str_cat("unexpected reply type ", int(r.type))};
    }
    release(std::move(conn));
    if (t == wire::Type::kError) {
      std::string message;
      wire::PayloadReader pr(r.payload.data(), r.payload.size());
      if (!pr.blob(wire::kMaxPayload, &message)) message = "(unreadable error message)";
      throw DistStoreError(message + where());
    }
    return r;
  } catch (const IoError& e) {
    // The connection's state is unknown (a reply may still arrive): it is closed here, and the
    // next call opens a new one.
    const std::string about =
        keys.empty() ? "" : str_cat(" (keys ", dist::detail::quote_keys(keys), ")");
    switch (e.kind) {
      case IoError::kTimeout:
        throw DistTimeoutError(str_cat("[", op, "] timed out after ", timeout.count(),
                                       " ms: no reply from the store", where(), about,
                                       "; the connection was closed"));
      case IoError::kClosed:
        throw DistNetworkError(
            str_cat("[", op, "] lost the connection to the store", where(), about, ": ", e.what));
      case IoError::kProtocol:
        throw DistStoreError(
            str_cat("[", op, "] bad reply from the store", where(), about, ": ", e.what));
    }
    throw;
  }
}

namespace {
// Checks a reply that is not kTimeout and returns a reader over its payload.
wire::PayloadReader ok_payload(const std::string& op, const std::string& where,
                               const Bytes& payload, uint8_t type) {
  if (type != static_cast<uint8_t>(wire::Type::kOk)) {
    throw DistStoreError(
        str_cat("[", op, "] unexpected reply type ", int(type), " from the store", where));
  }
  return wire::PayloadReader(payload.data(), payload.size());
}

[[noreturn]] void bad_reply(const std::string& op, const std::string& where) {
  throw DistStoreError(str_cat("[", op, "] malformed reply from the store", where));
}
}  // namespace

void TCPStore::set(const std::string& key, const Bytes& value) {
  set_within(key, value, timeout_);
}

void TCPStore::set_within(const std::string& key, const Bytes& value, Duration timeout) {
  const std::string op = "TCPStore set";
  check_key(op, key);
  check_value(op, key, value);
  dist::detail::check_store_timeout(op, timeout);
  const Reply r = request(op, wire::FrameWriter(wire::Type::kSet).blob(key).blob(value).finish(),
                          timeout, false, {key});
  if (!ok_payload(op, where(), r.payload, r.type).done()) bad_reply(op, where());
}

Bytes TCPStore::get(const std::string& key, Duration timeout) {
  const std::string op = "TCPStore get";
  check_key(op, key);
  dist::detail::check_store_timeout(op, timeout);
  const uint64_t ms =
      static_cast<uint64_t>(std::min(timeout, dist::detail::kMaxStoreTimeout).count());
  const Reply r = request(op, wire::FrameWriter(wire::Type::kGet).blob(key).u64(ms).finish(),
                          timeout, true, {key});
  if (r.type == static_cast<uint8_t>(wire::Type::kTimeout)) {
    dist::detail::throw_store_timeout(op, timeout, {key}, {key}, " on the store" + where());
  }
  auto pr = ok_payload(op, where(), r.payload, r.type);
  Bytes value;
  if (!pr.blob(wire::kMaxValueSize, &value) || !pr.done()) bad_reply(op, where());
  return value;
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  const std::string op = "TCPStore add";
  check_key(op, key);
  const Reply r = request(
      op, wire::FrameWriter(wire::Type::kAdd).blob(key).u64(static_cast<uint64_t>(delta)).finish(),
      timeout_, false, {key});
  auto pr = ok_payload(op, where(), r.payload, r.type);
  uint64_t v = 0;
  if (!pr.u64(&v) || !pr.done()) bad_reply(op, where());
  return static_cast<int64_t>(v);
}

Bytes TCPStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  const std::string op = "TCPStore compare_set";
  check_key(op, key);
  check_value(op, key, expected);
  check_value(op, key, desired);
  const Reply r = request(
      op,
      wire::FrameWriter(wire::Type::kCompareSet).blob(key).blob(expected).blob(desired).finish(),
      timeout_, false, {key});
  auto pr = ok_payload(op, where(), r.payload, r.type);
  Bytes value;
  if (!pr.blob(wire::kMaxValueSize, &value) || !pr.done()) bad_reply(op, where());
  return value;
}

namespace {
wire::FrameWriter& put_keys(wire::FrameWriter& f, const std::vector<std::string>& keys) {
  f.u64(keys.size());
  for (const auto& k : keys) f.blob(k);
  return f;
}
}  // namespace

bool TCPStore::check(const std::vector<std::string>& keys) {
  const std::string op = "TCPStore check";
  check_keys(op, keys);
  wire::FrameWriter f(wire::Type::kCheck);
  put_keys(f, keys);
  const Reply r = request(op, std::move(f).finish(), timeout_, false, keys);
  auto pr = ok_payload(op, where(), r.payload, r.type);
  uint64_t v = 0;
  if (!pr.u64(&v) || !pr.done()) bad_reply(op, where());
  return v != 0;
}

void TCPStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  const std::string op = "TCPStore wait";
  check_keys(op, keys);
  dist::detail::check_store_timeout(op, timeout);
  const uint64_t ms =
      static_cast<uint64_t>(std::min(timeout, dist::detail::kMaxStoreTimeout).count());
  wire::FrameWriter f(wire::Type::kWait);
  f.u64(ms);
  put_keys(f, keys);
  const Reply r = request(op, std::move(f).finish(), timeout, true, keys);
  if (r.type == static_cast<uint8_t>(wire::Type::kTimeout)) {
    wire::PayloadReader pr(r.payload.data(), r.payload.size());
    uint64_t n = 0;
    if (!pr.u64(&n) || n > wire::kMaxKeysPerRequest) bad_reply(op, where());
    std::vector<std::string> missing(n);
    for (auto& k : missing) {
      if (!pr.blob(wire::kMaxKeySize, &k)) bad_reply(op, where());
    }
    dist::detail::throw_store_timeout(op, timeout, keys, missing, " on the store" + where());
  }
  if (!ok_payload(op, where(), r.payload, r.type).done()) bad_reply(op, where());
}

bool TCPStore::delete_key(const std::string& key) {
  const std::string op = "TCPStore delete_key";
  check_key(op, key);
  const Reply r = request(op, wire::FrameWriter(wire::Type::kDeleteKey).blob(key).finish(),
                          timeout_, false, {key});
  auto pr = ok_payload(op, where(), r.payload, r.type);
  uint64_t v = 0;
  if (!pr.u64(&v) || !pr.done()) bad_reply(op, where());
  return v != 0;
}

int64_t TCPStore::num_keys() {
  const std::string op = "TCPStore num_keys";
  const Reply r =
      request(op, wire::FrameWriter(wire::Type::kNumKeys).finish(), timeout_, false, {});
  auto pr = ok_payload(op, where(), r.payload, r.type);
  uint64_t v = 0;
  if (!pr.u64(&v) || !pr.done()) bad_reply(op, where());
  return static_cast<int64_t>(v);
}

}  // namespace ember::dist
