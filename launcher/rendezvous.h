// The agents' rendezvous across nodes: one TCPStoreServer hosted by node 0's agent, one
// TCPStore client per agent; or, with --rdzv-backend etcd, an etcd server that no agent hosts
// and a leaderless protocol on it (Note [Leaderless rounds] in rendezvous_etcd.cpp). See
// docs/launcher.md (Multi-node) and Note [Rendezvous keys].
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ember/launcher/config.h>

namespace ember::dist {
class Store;
class TCPStoreServer;
}  // namespace ember::dist

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

/// What one round of the rendezvous gave this node.
struct RoundInfo {
  int round = 0;
  int node_rank = 0;
  int nnodes = 1;
  int rank_base = 0;        // global rank of this node's local rank 0
  int world_size = 1;       // sum of every node's nproc_per_node
  std::string master_addr;  // where the job's rank 0 hosts its store (MASTER_ADDR)
  int master_port = 0;
  int restart_count = 0;    // rounds before this one that ended in a failure
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

/// One agent's side of the rendezvous. Not thread-safe; used by the agent's loop only.
class Rendezvous {
 public:
  /// Hosts the store when this agent is node 0 (--node-rank 0, or without --node-rank the
  /// agent on the machine that owns the endpoint's address and wins its port), then connects
  /// to it, retrying until --rdzv-timeout. With --rdzv-backend etcd nobody hosts: every agent
  /// connects to etcd twice, once without a lease (the rounds' records) and once with a lease
  /// of --heartbeat-timeout seconds (its heartbeat and any round it leads). `interrupted` is polled during every wait (every
  /// 200 ms at most); when it returns true the wait throws RendezvousInterrupted. Throws
  /// RendezvousError naming the endpoint when the store cannot be hosted or reached.
  Rendezvous(const LaunchConfig& config, std::function<bool()> interrupted);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  /// Whether this agent hosts the store (it leads the rounds, and so must outlive the others'
  /// use of the rendezvous). Never with --rdzv-backend etcd.
  bool is_host() const { return server_ != nullptr; }
  /// "host:port" of the store.
  std::string endpoint() const;
  /// Whether this node waits to join an elastic job (it came after its round closed).
  bool waiting() const { return waiting_; }

  /// The round a newly started agent joins: the one opened last (0 before any). With etcd,
  /// throws RendezvousError when the run id belongs to a run that is over.
  /// Throws RendezvousError when the store is lost.
  int current_round();
  /// Joins round `round`: registers this node, waits until --nnodes nodes joined (MIN:MAX:
  /// MIN, then up to --rdzv-last-call for more, or, after a restart, until every node of the
  /// last round still alive and every waiting one joined), and returns the ranks. Elastic
  /// (MIN < MAX): a node that arrives after the round closed registers as waiting and joins
  /// the next round opened (within --rdzv-timeout), so the returned round may be later
  /// than `round`. Throws RendezvousError listing the nodes that never arrived after
  /// --rdzv-timeout, or the reason another node closed the run; RendezvousInterrupted on a
  /// signal.
  RoundInfo join(int round);

  /// Records that `round` failed on this node (`what` says how) unless another node's failure
  /// was recorded first; returns the failure recorded first. Throws RendezvousError when the
  /// store is lost.
  RoundFailure report_failure(int round, const std::string& what);
  /// The failure recorded for `round`, if any (one request; does not wait). Throws
  /// RendezvousError when the store is lost.
  std::optional<RoundFailure> poll_failure(int round);
  /// What the agent calls while the round's workers run (every --monitor-interval): writes this
  /// node's heartbeat when --heartbeat-interval has passed since the last one; on node 0 (with
  /// etcd, on every agent), a node whose heartbeat has not changed for --heartbeat-timeout (and
  /// that has not left) is recorded as the round's failure, unless another failure came first;
  /// elastic, node 0 (etcd: every agent) also ends the round (RoundFailure::kNewNodes) when nodes wait to join and the round has fewer
  /// than MAX. Returns the round's failure, if any. Throws RendezvousError when the store is
  /// lost (within a few seconds: a partitioned node gives up on its own).
  std::optional<RoundFailure> watch(int round);
  /// Marks the whole run as over (no more rounds): later joins throw RendezvousError(reason).
  /// Best effort: a lost store is ignored.
  void close(const std::string& reason);
  /// Tells node 0 that this agent leaves for good (it stops hosting once all left). Best effort.
  void report_exit(int round);
  /// This node's workers finished: reports its exit; with etcd (no host waits for the others)
  /// the last node of the round to finish closes the run for the nodes waiting to join it.
  void report_success(int round);
  /// Host only: waits until every other node of `round` reported its exit, for at most
  /// `timeout`; with stop_on_failure, returns early when `round` fails, a node's heartbeat
  /// going stale included (recorded as the failure). Nodes found silent are not waited for.
  /// Returns whether all left. A signal ends the wait early (returns false).
  bool wait_for_exits(int round, std::chrono::milliseconds timeout, bool stop_on_failure);

  /// This node's description in messages: "node 1 (host pid 42)".
  std::string describe_self() const;

 private:
  // Connects store_ (and, with etcd, live_) once; rethrows the store's errors.
  void connect(std::chrono::milliseconds timeout);
  // One quick request (set, add, check, get of a key known to be there): --rdzv-conf
  // read_timeout.
  std::chrono::milliseconds request_timeout() const;
  std::string key(const std::string& k) const;
  std::string round_key(int round, const std::string& k) const;
  std::string node_key(int round, int node) const;  // "r<R>/node/<k>"
  std::string node_record() const;                  // "<nproc_per_node> <self_>"
  // The steps of join: registers this node under its rank (given, 0 for the host, else by
  // arrival) and returns it; on the host, waits for the nodes and publishes their number; on
  // the others, waits for that number; then reads the round's ranks and rank 0's address.
  // -1 when an elastic round is already full (the node waits for the next one).
  int claim_node_rank(int round);
  // Host: publishes the round (the current one, its restart count, MASTER_ADDR) and how many
  // nodes it expects in it.
  void open_round(int round);
  int complete_round(int round);
  // The restart count of round `round` > 0 and the nodes it expects (those of the last round
  // neither lost nor gone, plus the waiting ones), from the last round's keys.
  int round_restarts(int round);
  int expected_nodes(int round);
  // etcd (rendezvous_etcd.cpp): opens the round if nobody did (first writer wins); elects the
  // round's leader through a leased key and, leading, completes the round, else waits for it
  // (taking over when the leader's lease expires). Returns the round's number of nodes.
  void open_round_etcd(int round);
  // c10d, a node other than the host without --node-rank: this agent's arrival in `round`:
  // creates the first missing node record r<R>/node/<k>, k >= 1, and returns its k; --nnodes
  // MAX when every one is taken.
  int arrive_c10d(int round);
  // etcd: this agent's arrival in `round`: creates the first missing node record (node 0's with
  // MASTER_ADDR, picked here) and returns its k; --nnodes MAX when every one is taken.
  int arrive_etcd(int round);
  int lead_or_await(int round, int k);
  // Raises the "round" key to `round` (never lowers it).
  void raise_round(int round);
  // A counter's value, or -1 when the key is missing (etcd: its writer's lease expired).
  int64_t read_counter(const std::string& key);
  // Registers this node as waiting after round `round` closed without it; returns when node 0
  // opened the next round (bounded by --rdzv-timeout).
  void wait_for_next_round(int round, int nnodes);
  // Host: the round's end for the nodes waiting to join, if any may join.
  std::optional<RoundFailure> find_waiting_nodes(int round);
  std::string round_timeout_message(int round);
  int await_round(int round, int k);
  // The round's number of nodes once set (a node past it waits for the next round, elastic).
  int round_size(int round, int k);
  RoundInfo read_round(int round, int k, int n);
  // Waits for `keys` until `deadline`, polling `interrupted_` and the run's closed key.
  // Returns false on the deadline; throws RendezvousInterrupted or RendezvousError(closed).
  bool wait_keys(const std::vector<std::string>& keys,
                 std::chrono::steady_clock::time_point deadline, bool watch_closed);
  void throw_if_closed();
  // Heartbeats (Note [Heartbeats] in rendezvous.cpp): this node's beat, throttled to
  // --heartbeat-interval; on the host, the first node silent for --heartbeat-timeout.
  void start_beats(int round);  // resets the state for a round not watched before
  void beat(int round);
  // With admit_waiting, also the round's end for waiting nodes (find_waiting_nodes).
  std::optional<RoundFailure> find_silent_node(int round, bool admit_waiting = false);
  // Records `f` as the round's failure unless one came first; returns the first.
  RoundFailure record_failure(int round, const RoundFailure& f);
  [[noreturn]] void lost(const std::string& op, const std::exception& e) const;

  const LaunchConfig& config_;
  std::function<bool()> interrupted_;
  std::string host_;
  int port_ = 0;
  std::unique_ptr<dist::TCPStoreServer> server_;
  std::unique_ptr<dist::Store> store_;  // a TCPStore, or an EtcdStore without a lease
  std::unique_ptr<dist::Store> live_;   // etcd: an EtcdStore with this agent's lease
  bool etcd_ = false;
  std::string addr_;    // etcd: this node's address for MASTER_ADDR when it is a round's node 0
  std::string self_;    // "host pid N" (local address or host name)
  int node_rank_ = -1;  // this round's
  int nnodes_ = 0;      // this round's
  int expected_ = 0;    // host: nodes the round being joined waits for before closing
  bool waiting_ = false;
  // Tests only (EMBER_TEST_KILL_AFTER_ARRIVAL set): the agent SIGKILLs itself as soon as it has
  // taken its arrival in a round (by arrival, not --node-rank; with c10d, not the host), the
  // crash the rendezvous must survive.
  bool kill_after_arrival_ = false;
  // Heartbeat state of round beat_round_ (reset when a new round is watched).
  struct Beat {
    int64_t count = -1;                          // the node's counter as last read
    std::chrono::steady_clock::time_point seen;  // when it last changed (this clock)
  };
  int beat_round_ = -1;
  std::chrono::steady_clock::time_point next_beat_, next_check_;
  std::vector<Beat> beats_;        // the watcher (host, or every etcd agent): per node rank
  std::vector<int> silent_nodes_;  // the watcher: nodes declared lost in beat_round_
};

}  // namespace ember::launcher
