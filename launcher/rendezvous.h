// The agents' rendezvous across nodes: the protocol every backend shares (rounds, node records,
// heartbeats, failures, exits) over a RendezvousBackend picked by --rdzv-backend
// (launcher/rendezvous_backend.h): c10d, a TCPStoreServer hosted by node 0's agent, or etcd, an
// etcd server that no agent hosts (Note [Leaderless rounds] in rendezvous_etcd.cpp). See
// docs/launcher.md (Multi-node) and Note [Rendezvous keys].
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/launcher/launch_config.h>
#include <ember/launcher/rendezvous_backend.h>
#include <ember/launcher/rendezvous_store.h>

namespace ember::launcher {

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

/// One agent's side of the rendezvous: the protocol, written once over the backend that
/// --rdzv-backend names. Not thread-safe; used by the agent's loop only.
class Rendezvous {
 public:
  /// Makes the backend --rdzv-backend names (which may host the store: c10d's node 0, that is
  /// --node-rank 0, or without --node-rank the agent on the machine that owns the endpoint's
  /// address and wins its port), then connects to the store, retrying until --rdzv-timeout
  /// (etcd: two clients, one without a lease for the rounds' records and one with a lease of
  /// --heartbeat-timeout seconds for its heartbeat and any round it leads). `interrupted` is
  /// polled during every wait (every 200 ms at most); when it returns true the wait throws
  /// RendezvousInterrupted. Throws RendezvousError naming the endpoint when the store cannot be
  /// hosted or reached.
  Rendezvous(const LaunchConfig& config, std::function<bool()> interrupted);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  /// Whether this agent hosts the store (it leads the rounds, and so must outlive the others'
  /// use of the rendezvous). Never with --rdzv-backend etcd.
  bool is_host() const { return backend_->is_host(); }
  /// "host:port" of the store.
  std::string endpoint() const { return s_.endpoint(); }
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
  /// elastic, node 0 (etcd: every agent) also ends the round (RoundFailure::kNewNodes) when
  /// nodes wait to join and the round has fewer than MAX. Returns the round's failure, if any.
  /// Throws RendezvousError when the store is lost (within a few seconds: a partitioned node
  /// gives up on its own).
  std::optional<RoundFailure> watch(int round);
  /// Marks the whole run as over (no more rounds): later joins throw RendezvousError(reason).
  /// Best effort: a lost store is ignored.
  void close(const std::string& reason) { s_.close(reason); }
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
  std::string describe_self() const { return s_.describe_self(); }

 private:
  // The steps of join: registers this node under its rank (given, 0 for the host, else by
  // arrival) and returns it; -1 when an elastic round is already full (the node waits for the
  // next one).
  int claim_node_rank(int round);
  // Registers this node as waiting after round `round` closed without it; returns when the
  // next round was opened (bounded by --rdzv-timeout).
  void wait_for_next_round(int round, int nnodes);
  // The watcher: the round's end for the nodes waiting to join, if any may join.
  std::optional<RoundFailure> find_waiting_nodes(int round);
  RoundInfo read_round(int round, int k, int n);
  // Heartbeats (Note [Heartbeats] in rendezvous.cpp): this node's beat, throttled to
  // --heartbeat-interval; on the watcher, the first node silent for --heartbeat-timeout.
  void start_beats(int round);  // resets the state for a round not watched before
  void beat(int round);
  // With admit_waiting, also the round's end for waiting nodes (find_waiting_nodes).
  std::optional<RoundFailure> find_silent_node(int round, bool admit_waiting = false);
  // Records `f` as the round's failure unless one came first; returns the first.
  RoundFailure record_failure(int round, const RoundFailure& f);
  [[noreturn]] void lost(const std::string& op, const std::exception& e) const;

  RendezvousStore s_;
  std::unique_ptr<RendezvousBackend> backend_;  // works on s_, so declared after it
  int nnodes_ = 0;  // this round's
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
