// The vocabulary the rendezvous (launcher/rendezvous.h) and its backends
// (launcher/rendezvous_backend.h) share: their errors, a round's failure, and RendezvousStore,
// one agent's handle on the run's rendezvous records in the store with the round steps every
// backend takes the same way. Internal to the launcher.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ember/distributed/store/store.h>
#include <ember/launcher/launch_config.h>

namespace ember::launcher {

/// The rendezvous failed for good: a node never arrived, the run was closed by another node,
/// the store could not be reached or was lost. what() is the message emberrun prints.
class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A wait in the rendezvous was cut short because `interrupted` returned true (a signal).
class RendezvousInterrupted : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

/// Why a round ended before its workers finished: the node that failed first and what
/// happened, or (node_rank == kNewNodes) nodes waiting to join an elastic job, which restarts
/// the round to admit them without counting as a failure.
struct RoundFailure {
  static constexpr int kNewNodes = -1;
  int node_rank = -1;
  std::string what;  // "node 1 (host pid 42): rank 3 exited with code 1"
  bool new_nodes() const { return node_rank == kNewNodes; }
};

namespace detail {

inline std::string to_s(const dist::Bytes& b) { return std::string(b.begin(), b.end()); }
inline dist::Bytes to_b(const std::string& s) { return dist::Bytes(s.begin(), s.end()); }

inline std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

inline std::string seconds_str(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

// "<k> <what>", as the failed key holds it.
inline RoundFailure parse_failure(const std::string& v) {
  const auto sp = v.find(' ');
  return {std::stoi(v.substr(0, sp)), v.substr(sp + 1)};
}

// Waits are cut in chunks of this to notice signals and closed runs.
inline constexpr std::chrono::milliseconds kPollChunk{200};
// The requests of an agent watching the others (its polls, its heartbeat): when node 0's agent
// dies its port refuses connections, and the client retries refused connections until the
// request timeout; this bounds how long that takes.
inline constexpr std::chrono::milliseconds kPollTimeout{3000};

}  // namespace detail

/// One agent's handle on the rendezvous records of a run (Note [Rendezvous keys] in
/// rendezvous.cpp): the stores its backend connected, the keys' names, bounded waits, and the
/// round steps that every backend takes the same way (restarts, expected nodes, closing a
/// round). Not a dist::Store: it uses the ones the backend owns. Not thread-safe; one agent's
/// rendezvous uses it from one thread.
class RendezvousStore {
 public:
  /// `config` must outlive it; its rdzv_host and rdzv_port name the store. `interrupted` is
  /// polled during every wait (every 200 ms at most); when it returns true the wait throws
  /// RendezvousInterrupted.
  RendezvousStore(const LaunchConfig& config, std::function<bool()> interrupted);

  /// Uses `records` for the run's records and `leased` for this agent's keys that must vanish
  /// when it dies (its heartbeat, a round it leads): the same store where keys never expire
  /// (TCPStore). The backend owns both, keeps them alive while it lives, and calls this again
  /// when it reconnects.
  void attach(dist::Store& records, dist::Store& leased);
  /// The records' store. Only after attach().
  dist::Store& store() { return *store_; }
  /// The store of this agent's leased keys. Only after attach().
  dist::Store& leased() { return *leased_; }

  /// The agent's settings.
  const LaunchConfig& config() const { return config_; }
  /// The store's host, as configured (an IPv6 address without brackets).
  const std::string& host() const { return config_.rdzv_host; }
  /// The store's port.
  int port() const { return config_.rdzv_port; }
  /// "host:port" of the store ("[v6]:port").
  std::string endpoint() const;
  /// This agent in messages and node records: "host pid N" (--local-addr, else the host name).
  const std::string& self() const { return self_; }
  /// This node's node rank in the round it joins or runs; -1 before it has one.
  int node_rank() const { return node_rank_; }
  /// Sets it (the rendezvous, as the node registers in a round or waits for the next one).
  void set_node_rank(int k) { node_rank_ = k; }
  /// This node's description in messages: "node 1 (host pid 42)", "node ? (...)" without a rank.
  std::string describe_self() const;
  /// One quick request (set, add, check, get of a key known to be there): --rdzv-conf
  /// read_timeout.
  std::chrono::milliseconds request_timeout() const;
  /// Whether a signal asks the rendezvous to stop waiting.
  bool interrupted() const { return interrupted_ && interrupted_(); }

  /// The run's key `k`: "emberrun/<rdzv-id>/<k>".
  std::string key(const std::string& k) const;
  /// Round `round`'s key `k`: "emberrun/<rdzv-id>/r<round>/<k>".
  std::string round_key(int round, const std::string& k) const;
  /// "r<round>/node/<node>": node `node`'s record.
  std::string node_key(int round, int node) const;
  /// This node's record: "<nproc_per_node> <self>".
  std::string node_record() const;

  /// Waits for `keys` until `deadline`, polling `interrupted` and, with watch_closed, the run's
  /// closed key. Returns false on the deadline; throws RendezvousInterrupted, or
  /// RendezvousError(why the run was closed). dist::DistError when the store is lost.
  bool wait_keys(const std::vector<std::string>& keys,
                 std::chrono::steady_clock::time_point deadline, bool watch_closed);
  /// Throws RendezvousError("the run was closed by another node: <why>") when it was.
  void throw_if_closed();
  /// Marks the whole run as over, with `reason`, unless it already is. Best effort: a lost store
  /// is ignored.
  void close(const std::string& reason);

  /// The restart count of round `round` > 0 (TORCHELASTIC_RESTART_COUNT), from the last
  /// round's: one more when the last round failed (nodes waiting to join are no failure).
  int round_restarts(int round);
  /// How many nodes round `round` expects before its leader closes it: --nnodes MAX for round
  /// 0; then those of the last round neither lost nor gone, plus the waiting ones (Note
  /// [Elastic membership] in rendezvous.cpp). `alive(prev_round, node)`, when given, is
  /// asked of each node of the last round as well (etcd: does it still hold its lease?).
  int expected_nodes(int round, const std::function<bool(int, int)>& alive = nullptr);
  /// The leader's part of the join: waits up to --rdzv-timeout for the first --nnodes MIN
  /// nodes (else closes the run naming the missing ones and throws RendezvousError), then,
  /// while fewer than `expected` (and MAX) joined, for more until --rdzv-last-call ends.
  /// `recount`, when given, is called every `recheck` of the last call with the nodes still
  /// expected and returns how many are now. Publishes and returns the round's number of nodes
  /// (r<R>/nnodes; the first writer wins).
  int close_round(int round, int expected, std::chrono::milliseconds recheck = {},
                  const std::function<int(int)>& recount = nullptr);
  /// The number of nodes of closed round `round`. A node `k` past it was too late: elastic, it
  /// waits for the next round (the caller sees k >= the result); else RendezvousError.
  int round_size(int round, int k);

 private:
  // Why round `round` did not close: the nodes below MIN that never arrived, and those that did.
  std::string round_timeout_message(int round);

  const LaunchConfig& config_;
  std::function<bool()> interrupted_;
  std::string self_;
  int node_rank_ = -1;
  dist::Store* store_ = nullptr;
  dist::Store* leased_ = nullptr;
};

}  // namespace ember::launcher
