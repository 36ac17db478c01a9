// TCPStore: a Store served over TCP (torch.distributed.TCPStore).
//
// One process runs a TCPStoreServer (rank 0 through TCPStore's is_server, or the launcher on
// its own); every rank connects a TCPStore client to it. The server is a Boost.Asio loop on one
// thread that serves any number of clients at once and parks blocking get/wait requests until
// their keys are set or their timeout passes (no polling). The wire protocol is in
// distributed/store/detail/store_protocol.h (Note [TCPStore protocol]).
//
// Shared secret: if the server has one (option or EMBER_STORE_SECRET), a client must prove it
// knows the same secret (HMAC-SHA256 over a fresh server nonce) before any request; otherwise
// the server closes the connection and the client throws DistStoreError. Without a secret on
// the server, anyone who can reach the port can use the store: bind to 127.0.0.1 or set a
// secret on machines shared with strangers.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/store/store.h>

namespace ember::dist {

/// Environment variable holding the shared secret (used when no secret is passed explicitly).
inline constexpr const char* kStoreSecretEnv = "EMBER_STORE_SECRET";

/// The secret a TCPStore or its server uses: `given` if set, else $EMBER_STORE_SECRET, else ""
/// (none).
std::string store_secret(const std::optional<std::string>& given);

/// Options of TCPStoreServer.
struct TCPStoreServerOptions {
  /// Address to listen on: "" = every interface (IPv6 and IPv4 when available, as torch),
  /// or a host name / IP literal such as "127.0.0.1".
  std::string host;
  /// Port to listen on; 0 lets the OS pick a free one (read it back with port()).
  uint16_t port = 0;
  /// The shared secret clients must prove; nullopt reads EMBER_STORE_SECRET (unset or empty
  /// means none); "" means none even if the variable is set.
  std::optional<std::string> secret;
  /// A connection that has not authenticated within this time is closed (a client
  /// authenticates in one round trip after connecting).
  Duration handshake_timeout = std::chrono::seconds(10);
  /// Connections beyond this many are closed on accept. 0: 16384, but at most the process's
  /// descriptor limit (RLIMIT_NOFILE) less a quarter of it (at least 256) kept for the job
  /// itself (its sockets, shared memory, checkpoint files): see default_max_connections().
  size_t max_connections = 0;
  /// A frame that has begun to arrive but then receives no byte for this long is dropped
  /// together with its connection, so a sender that stalls mid-frame cannot hold a buffer.
  Duration partial_frame_timeout = std::chrono::seconds(30);
  /// A frame must arrive whole within this time from its first byte, however its bytes
  /// trickle: a sender cannot hold its share of max_buffered_bytes longer (a 128 MiB frame
  /// takes about 10 s at 100 Mbit/s).
  Duration max_frame_time = std::chrono::seconds(120);
  /// The most receive-buffer memory the server holds across all connections. A connection
  /// whose frame would take the total beyond it is dropped ("server buffer full"); buffers
  /// grow as bytes arrive, so one connection holds at most about twice what it has sent (and
  /// never more than a frame's maximum, kMaxPayload: two 64 MiB values plus keys).
  size_t max_buffered_bytes = size_t{1} << 30;
  /// The most of max_buffered_bytes one connection may hold: a frame that would take its buffer
  /// past it drops the connection ("connection's buffer share"), so that a few connections
  /// cannot take the whole budget from the others (each may hold this much at most, not a
  /// frame's maximum). 0: a frame's maximum (two 64 MiB values plus keys). Below the largest
  /// request the job sends, that request is refused.
  size_t max_connection_buffered_bytes = 0;
  /// The most the stored keys and values may hold together (etcd's default quota): a set,
  /// add or compare_set that would go past it is refused with DistStoreError naming the key and
  /// the quota, and the store keeps serving.
  size_t max_stored_bytes = size_t{2} << 30;
  /// An authenticated connection with no request in flight or parked (a get or wait waiting on
  /// the server is not idle, however long) and no byte received for this long is closed, so
  /// that idle connections cannot hold max_connections' places for good. Ember's clients retire
  /// a pooled connection after kClientRetireIdle idle and check for the server's close before
  /// reusing one, so closing theirs costs them a reconnection, not an error. 0: never.
  Duration idle_timeout = std::chrono::minutes(10);
};

/// How long a TCPStore client keeps a pooled connection idle before opening a fresh one
/// instead: below every idle_timeout of 2x this or more, a server never closes a connection as
/// the client starts to reuse it.
inline constexpr Duration kClientRetireIdle = std::chrono::seconds(30);

/// One limit of TCPStoreServerOptions that a job sets from outside: emberrun's option
/// (`--store-max-stored-bytes`) and the variable it exports to the workers, which rank 0's
/// store reads (EMBER_STORE_MAX_STORED_BYTES, store_limits_from_env()).
struct StoreLimit {
  const char* option;  // "--store-max-stored-bytes"
  const char* env;     // "EMBER_STORE_MAX_STORED_BYTES"
  const char* help;    // for emberrun's --help: what it bounds, its default and its cost
  size_t TCPStoreServerOptions::*count = nullptr;  // a count (bytes, connections) in [1, max]
  uint64_t max = 0;
  Duration TCPStoreServerOptions::*seconds = nullptr;  // or a time, given in seconds
};
/// The limits settable so: max_stored_bytes, max_buffered_bytes, max_connection_buffered_bytes,
/// max_connections, max_frame_time and idle_timeout (seconds).
const std::vector<StoreLimit>& store_limits();
/// Sets `limit` in `options` from its text `value`; ValueError "`named`: expected ..., got
/// '<value>'" when it is not a whole number (seconds: a number) in the limit's range.
void set_store_limit(TCPStoreServerOptions& options, const StoreLimit& limit,
                     const std::string& value, const std::string& named);
/// `base` with each limit whose EMBER_STORE_* variable is set (and not empty) taken from it;
/// ValueError naming the variable for a bad value.
TCPStoreServerOptions store_limits_from_env(TCPStoreServerOptions base = {});

/// max_connections' default for a process allowed `nofile` descriptors: 16384, or fewer so that
/// a quarter of the descriptors (at least 256) stays for the job.
size_t default_max_connections(uint64_t nofile);

/// The store's server: owns the keys and answers clients until stopped or destroyed.
/// Usable on its own (a launcher that is not a rank) or through TCPStore(is_server = true).
/// Thread-safe.
class TCPStoreServer {
 public:
  /// Binds, listens and starts the serving thread. Throws DistNetworkError naming host:port
  /// and the system's reason if it cannot listen (e.g. the port is in use).
  explicit TCPStoreServer(TCPStoreServerOptions options = {});
  /// Stops the server (see stop()).
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  /// The port the server listens on (the OS's pick when constructed with port 0).
  uint16_t port() const;
  /// Closes the listening socket and every connection, then joins the serving thread. Clients
  /// blocked in get/wait get DistNetworkError at once; wait_for_workers throws. Idempotent.
  void stop();

  /// Number of TCPStore clients that announced themselves (those constructed with a
  /// world_size).
  int64_t num_workers() const;
  /// Blocks until num_workers() >= n. Throws DistTimeoutError naming n, the count reached and
  /// the timeout, or DistStoreError if the server is stopped meanwhile.
  void wait_for_workers(int64_t n, Duration timeout);

  /// Counters for monitoring and tests.
  struct Stats {
    int64_t accepted = 0;         // connections accepted
    int64_t active = 0;           // connections open now
    int64_t authenticated = 0;    // handshakes that succeeded
    int64_t auth_failures = 0;    // wrong or missing secret
    int64_t protocol_errors = 0;  // connections dropped for malformed or oversized frames
    int64_t waiting = 0;          // get/wait requests parked now
    int64_t frame_timeouts = 0;   // connections dropped for a partial frame that stalled
    int64_t buffer_refusals = 0;  // connections dropped because the server's buffers were full
    int64_t buffered_bytes = 0;   // receive-buffer memory held now, all connections together
    int64_t stored_bytes = 0;     // keys and values stored now
    int64_t quota_refusals = 0;   // writes refused by max_stored_bytes
    int64_t idle_closes = 0;      // connections closed after idle_timeout
    int64_t queued_bytes = 0;     // replies not yet written to their sockets, all connections
  };
  /// A snapshot taken on the serving thread between two of its handlers, so that counts agree
  /// with what peers can see (a connection counted closed has been closed). Waits for that
  /// thread, which never blocks; DistError if it has not answered within 60 s.
  Stats stats() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

/// Options of TCPStore (torch's TCPStore constructor arguments).
struct TCPStoreOptions {
  /// Start a TCPStoreServer in this process (torch's is_master).
  bool is_server = false;
  /// Number of TCPStore clients that will use the store (ranks, server included); each client
  /// announces itself on construction. nullopt = not fixed.
  std::optional<int64_t> world_size;
  /// With is_server and world_size: the constructor waits until world_size clients joined.
  bool wait_for_workers = true;
  /// Default timeout of get/wait, and the limit on connecting and on every other request.
  Duration timeout = Store::kDefaultTimeout;
  /// Shared secret, both to prove (client) and to require (own server). nullopt reads
  /// EMBER_STORE_SECRET.
  std::optional<std::string> secret;
  /// With is_server: the address the server listens on. "" = the client's host when that is
  /// an address of this machine written as one (MASTER_ADDR 127.0.0.1 of a single-node or
  /// `emberrun --standalone` job, or node 0's IP), so that the store is not reachable through
  /// other interfaces; otherwise (a host name, or an address of another machine such as a NAT's)
  /// every interface. "0.0.0.0" or "::" listens on every interface whatever the host.
  std::string listen_host;
  /// With is_server: the limits of the server this client starts (its host, port and secret
  /// are ignored: they come from the fields above). init_process_group's rank 0 takes them
  /// from store_limits_from_env().
  TCPStoreServerOptions server_limits;
};

/// A client of a TCPStoreServer at host:port (and the server itself with is_server).
///
/// Connecting retries with backoff until the timeout, then throws DistNetworkError naming
/// host:port and the timeout. A wrong or missing secret throws DistStoreError at once. Each
/// request uses a connection from a small pool, so a thread blocked in get/wait does not hold
/// up other threads. Keys are limited to 4 KiB, values to 64 MiB, check/wait to 4096 keys
/// (ValueError). If the connection is lost mid-request the call throws DistNetworkError (it is
/// not retried: add is not idempotent); the next call opens a new connection.
class TCPStore : public Store {
 public:
  TCPStore(std::string host, uint16_t port, TCPStoreOptions options = {});
  /// Closes the connections, then stops the owned server, if any.
  ~TCPStore() override;

  using Store::get;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  /// set() with `timeout` bounding the reconnection (a server that went away refuses it) and
  /// the exchange: DistNetworkError or DistTimeoutError after it.
  void set_within(const std::string& key, const Bytes& value, Duration timeout) override;
  /// Parked on the server until key is set; DistTimeoutError after timeout.
  Bytes get(const std::string& key, Duration timeout) override;
  /// DistStoreError if the key holds a non-integer or the sum overflows.
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  /// Parked on the server until every key has been set; DistTimeoutError naming the missing
  /// keys after timeout.
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  bool delete_key(const std::string& key) override;
  /// The number of keys (the workers' join counter is not a key, unlike torch's "init/").
  int64_t num_keys() override;

  /// The host clients connect to, as given.
  const std::string& host() const { return host_; }
  /// The server's port (the OS's pick when is_server with port 0).
  uint16_t port() const { return port_; }
  /// The owned server, or null for a pure client.
  TCPStoreServer* server() const { return server_.get(); }

 private:
  class Connection;
  struct Reply;
  // A new authenticated connection, retrying refused connections until `timeout`.
  std::unique_ptr<Connection> connect(const std::string& op, Duration timeout);
  // An idle pooled connection, or a new one.
  std::unique_ptr<Connection> acquire(const std::string& op, Duration timeout);
  void release(std::unique_ptr<Connection> conn);
  // Sends one request and reads its reply. `timeout` bounds the exchange; with server_waits
  // (get, wait) the server answers kTimeout itself at `timeout`, and the client gives up a
  // little later. `keys` are named in error messages.
  Reply request(const std::string& op, Bytes frame, Duration timeout, bool server_waits,
                const std::vector<std::string>& keys);
  std::string where() const;

  std::string host_;
  uint16_t port_;
  std::string secret_;
  std::unique_ptr<TCPStoreServer> server_;
  std::mutex pool_mu_;
  std::vector<std::unique_ptr<Connection>> pool_;
};

}  // namespace ember::dist
