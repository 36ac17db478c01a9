#include <ember/launcher/rendezvous.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <ember/launcher/console.h>

namespace ember::launcher {
namespace {

using namespace detail;

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Note [Rendezvous keys]
// Every key lives under "emberrun/<rdzv-id>/", so runs sharing a store do not meet. Round R
// (one per restart, for a failure or a membership change) uses "r<R>/...": a restart is a
// fresh rendezvous; only the agent opening the next round reads the last round's keys. With
// etcd every key is unleased (it outlives its writer) except those marked "leased", which
// vanish when their writer's lease expires (Note [Leaderless rounds] in rendezvous_etcd.cpp).
//   round                the round opened last: where a newly started agent joins
//   r<R>/restarts        rounds before R that ended in a failure (TORCHELASTIC_RESTART_COUNT);
//                        written first when the round opens, so waiting nodes wait for it
//   r<R>/master          "addr:port" for the job's store (MASTER_ADDR/PORT): node 0's agent
//                        picks it when it opens the round; etcd: the round's node 0 (its first
//                        arrival) picks its own address, so it is on a node alive at the join,
//                        and writes it with r<R>/node/0, in one transaction
//   r<R>/node/<k>        "<nproc_per_node> <description>" of node k (compare_set: one owner);
//                        without --node-rank created by the agent's arrival itself, the first
//                        free k (Note [Arriving is registering])
//   r<R>/arrived         c10d: how many agents registered by arrival, counted after they did:
//                        where the next arrival starts looking for a free k
//   r<R>/leader          etcd, leased: the agent that completes round R (compare_set)
//   r<R>/nnodes          set by node 0 (etcd: the leader) when the round is complete
//   r<R>/failed          "<k> <what>": the first failure of the round (compare_set); k = -1:
//                        nodes wait to join (Note [Elastic membership])
//   r<R>/lost/<k>        node k was found silent in round R: the next round does not expect it
//   r<R>/waiting         elastic: the number of nodes that came after round R closed
//   r<R>/wait/<i>        the description of the i-th of them
//   r<R>/exit/<k>        node k left for good; node 0 stops hosting once all left
//   r<R>/beat/<k>        node k's heartbeat counter (Note [Heartbeats]); etcd: leased, and
//                        written when node k joins
//   closed               why the run is over; a node about to join a new round gives up

// Note [Arriving is registering]
// Without --node-rank an agent's node rank is its arrival in the round, and taking it is
// registering: the agent creates the first missing r<R>/node/<k> (compare_set against absent;
// etcd: one transaction, Note [Leaderless rounds]). A rank handed out first (a counter) and
// registered in a later request would leave the round waiting for that node until
// --rdzv-timeout when its agent dies in between. An agent that dies after arriving is a node of
// the round like any other: the round closes with it, and it is found silent within
// --heartbeat-timeout once the round runs (elastic: the next round goes on without it).
// How a backend finds the first missing record cheaply is its own (RendezvousBackend::arrive:
// c10d counts the arrivals, etcd asks one request per node already there).

// Note [Heartbeats]
// Node 0's store sees a partitioned node only as silence: its connection is not closed, and
// the job's own sockets (the workers' collectives) may wait for the kernel's TCP timeout,
// about 15 minutes. So every agent adds 1 to r<R>/beat/<k> every --heartbeat-interval while
// its workers run, and node 0 reads the counters: a node whose counter has not changed for
// --heartbeat-timeout, measured on node 0's own clock (no clock agreement needed), and that
// has not left (r<R>/exit/<k>), is recorded as the round's failure. Every agent then stops its
// workers as for any failure, and restarts or ends the run. Node 0 reads the counters at most
// once a second (once an interval, when shorter): it sees a beat up to one such period late,
// and the silence is noticed up to one period late, so it ends the round at most
// --heartbeat-timeout + 2 periods after the node's last beat (27 s by default, leaving room
// under the 30 s docs/launcher.md promises for stopping the workers). The partitioned node
// itself gives up within kPollTimeout (rendezvous_store.h), its requests going unanswered.
// With etcd there is no node 0 to trust: every agent watches every other one the same way (the
// first to record the failure wins; RendezvousBackend::watches_heartbeats), and a counter whose
// key vanished (its writer's lease expired; RendezvousBackend::read_counter) is a lost node at
// once.
constexpr milliseconds kHeartbeatCheck{1000};

// Note [Elastic membership]
// With --nnodes MIN:MAX (MIN < MAX) the set of nodes may change between rounds, as torchrun's:
// - a node lost (its heartbeat stale, or its agent gone after a failure) is a failure of the
//   round; the nodes left join the next round by arrival, so node ranks, ranks and WORLD_SIZE
//   are renumbered contiguously. Node 0 expects every node of the last round that is neither
//   lost nor gone (plus the waiting ones) and closes the round as soon as they joined, not
//   after --rdzv-last-call: the restart costs one join, not a last call.
// - a node that arrives after its round closed (every node record below MAX taken, or r<R>/nnodes
//   smaller than its rank) adds itself to r<R>/waiting and waits for r<R+1>/restarts. Node 0
//   (etcd: every agent) reads the counter with the heartbeats and, while the round has fewer
//   than MAX nodes and no node has left it, records the round's end with k = -1: every agent
//   stops its workers and joins the next round, which admits the newcomers. Such a restart is
//   no failure: it does not use up --max-restarts nor raise TORCHELASTIC_RESTART_COUNT.
// With the c10d backend node 0 hosts the store and cannot be replaced: losing it ends the run
// on every node (lost the rendezvous store). With etcd no node is special (Note [Leaderless
// rounds]): node 0 is lost as any other.

}  // namespace

Rendezvous::Rendezvous(const LaunchConfig& config, std::function<bool()> interrupted)
    : s_(config, std::move(interrupted)) {
  const RendezvousBackendType* type = find_rendezvous_backend(config.rdzv_backend);
  if (type == nullptr) {  // parse_args refuses it; a LaunchConfig made otherwise may not
    throw RendezvousError("--rdzv-backend: expected " + rendezvous_backend_names() + ", got '" +
                          config.rdzv_backend + "'");
  }
  kill_after_arrival_ = std::getenv("EMBER_TEST_KILL_AFTER_ARRIVAL") != nullptr;
  backend_ = type->make(s_);
  const auto deadline = Clock::now() + to_ms(config.rdzv_timeout_s);
  std::string last;
  for (;;) {
    // Short connection attempts, so a signal is noticed while node 0 is not up yet.
    try {
      backend_->connect(std::max(
          milliseconds(1), std::min<milliseconds>(milliseconds(1000),
                                                  std::chrono::duration_cast<milliseconds>(
                                                      deadline - Clock::now()))));
      break;
    } catch (const dist::DistNetworkError& e) {
      last = e.what();
    } catch (const dist::DistTimeoutError& e) {  // etcd answering slowly: retry as well
      last = e.what();
    } catch (const std::exception& e) {  // a wrong secret, a bad address: no use retrying
      throw RendezvousError("cannot use the rendezvous store at " + endpoint() + ": " + e.what());
    }
    if (s_.interrupted()) {
      throw RendezvousInterrupted("interrupted while connecting to " + endpoint());
    }
    if (Clock::now() >= deadline) throw RendezvousError(backend_->unreachable(last));
  }
}

Rendezvous::~Rendezvous() = default;

void Rendezvous::lost(const std::string& op, const std::exception& e) const {
  throw RendezvousError("lost the rendezvous store at " + endpoint() + " while " + op + " (" +
                        backend_->lost_hint() + "): " + e.what());
}

int Rendezvous::claim_node_rank(int round) {
  const LaunchConfig& c = s_.config();
  int k;
  bool registered = false;
  if (c.node_rank_given) {
    k = c.node_rank;
  } else if (is_host()) {
    k = 0;
  } else {
    // Note [Arriving is registering]; where no agent hosts (etcd), the first arrival is node 0.
    registered = true;
    k = backend_->arrive(round);
    if (kill_after_arrival_) ::kill(::getpid(), SIGKILL);
    if (k >= c.max_nodes && c.elastic()) return -1;
    if (k >= c.max_nodes) {
      throw RendezvousError("rendezvous round " + std::to_string(round) + " at " + endpoint() +
                            " already has --nnodes " + std::to_string(c.max_nodes) + " nodes; " +
                            s_.self() + " is one too many");
    }
  }
  const std::string mine = s_.node_record();
  const std::string owner =
      registered ? mine
                 : to_s(s_.store().compare_set(s_.node_key(round, k), {}, to_b(mine)));
  if (owner != mine) {
    throw RendezvousError("node rank " + std::to_string(k) + " of round " + std::to_string(round) +
                          " is already taken by " + owner.substr(owner.find(' ') + 1) +
                          " (two agents given --node-rank " + std::to_string(k) + "?)");
  }
  backend_->registered(round, k);
  return k;
}

int Rendezvous::current_round() {
  if (is_host()) return 0;
  try {
    backend_->check_run();
    const std::string k = s_.key("round");
    if (!s_.store().check({k})) return 0;
    return std::stoi(to_s(s_.store().get(k, s_.request_timeout())));
  } catch (const dist::DistError& e) {
    lost("reading the current round", e);
  }
}

void Rendezvous::wait_for_next_round(int round, int nnodes) {
  const LaunchConfig& c = s_.config();
  waiting_ = true;
  const int64_t i = s_.store().add(s_.round_key(round, "waiting"), 1) - 1;
  s_.store().set(s_.round_key(round, "wait/" + std::to_string(i)), s_.self());
  const std::string next = std::to_string(round + 1);
  log_line(s_.self() + " arrived after rendezvous round " + std::to_string(round) +
           (nnodes > 0 ? " closed with " + std::to_string(nnodes) + " nodes" : " filled up") +
           ": waiting to join round " + next + " (--nnodes " + std::to_string(c.min_nodes) + ":" +
           std::to_string(c.max_nodes) + ")");
  if (!s_.wait_keys({s_.round_key(round + 1, "restarts")},
                    Clock::now() + to_ms(c.rdzv_timeout_s), true)) {
    throw RendezvousError(
        s_.self() + " waited " + seconds_str(c.rdzv_timeout_s) + " (--rdzv-timeout) at " +
        endpoint() + " for rendezvous round " + next + ", " + backend_->round_not_opened() +
        ": round " + std::to_string(round) +
        " kept running (a round with --nnodes MAX nodes admits nobody until it restarts)");
  }
}

std::optional<RoundFailure> Rendezvous::find_waiting_nodes(int round) {
  const LaunchConfig& c = s_.config();
  if (!c.elastic() || nnodes_ >= c.max_nodes) return std::nullopt;
  dist::Store& store = s_.store();
  const int64_t n = store.add(s_.round_key(round, "waiting"), 0);
  if (n == 0) return std::nullopt;
  // A node that left for good (its workers done) would be waited for in vain by a new round.
  for (int i = 0; i < nnodes_; ++i)
    if (i != s_.node_rank() && store.check({s_.round_key(round, "exit/" + std::to_string(i))}))
      return std::nullopt;
  std::string who;
  for (int64_t i = 0; i < n; ++i) {
    const std::string k = s_.round_key(round, "wait/" + std::to_string(i));
    who += (i ? ", " : "") + (store.check({k}) ? to_s(store.get(k, s_.request_timeout())) : "?");
  }
  return RoundFailure{RoundFailure::kNewNodes,
                      std::to_string(n) + (n == 1 ? " node waits" : " nodes wait") +
                          " to join (" + who + "); round " + std::to_string(round) + " has " +
                          std::to_string(nnodes_) + " of at most " + std::to_string(c.max_nodes) +
                          " nodes"};
}

RoundInfo Rendezvous::read_round(int round, int k, int n) {
  dist::Store& store = s_.store();
  RoundInfo info;
  info.round = round;
  info.node_rank = k;
  info.nnodes = n;
  info.world_size = 0;
  for (int i = 0; i < n; ++i) {
    const int nproc = std::stoi(to_s(store.get(s_.node_key(round, i), s_.request_timeout())));
    if (i < k) info.rank_base += nproc;
    info.world_size += nproc;
  }
  info.restart_count =
      std::stoi(to_s(store.get(s_.round_key(round, "restarts"), s_.request_timeout())));
  const std::string master =
      to_s(store.get(s_.round_key(round, "master"), s_.request_timeout()));
  const auto colon = master.rfind(':');
  info.master_addr = master.substr(0, colon);
  info.master_port = std::stoi(master.substr(colon + 1));
  return info;
}

RoundInfo Rendezvous::join(int round) {
  try {
    for (;; ++round) {
      s_.throw_if_closed();
      backend_->open_round(round);
      const int k = claim_node_rank(round);
      s_.set_node_rank(k);
      const int n = k < 0 ? -1 : backend_->complete(round, k);
      if (k >= 0 && k < n) {
        nnodes_ = n;
        waiting_ = false;
        return read_round(round, k, n);
      }
      s_.set_node_rank(-1);
      wait_for_next_round(round, n);  // elastic: too late for this round
    }
  } catch (const RendezvousError&) {
    throw;
  } catch (const dist::DistError& e) {
    lost("joining round " + std::to_string(round), e);
  }
}

RoundFailure Rendezvous::report_failure(int round, const std::string& what) {
  try {
    return record_failure(round, {s_.node_rank(), what});
  } catch (const dist::DistError& e) {
    lost("reporting a failure", e);
  }
}

std::optional<RoundFailure> Rendezvous::poll_failure(int round) {
  dist::Store& store = s_.store();
  const std::string k = s_.round_key(round, "failed");
  try {
    store.set_timeout(std::min(kPollTimeout, s_.request_timeout()));
    const bool failed = store.check({k});
    store.set_timeout(s_.request_timeout());
    if (!failed) return std::nullopt;
    return parse_failure(to_s(store.get(k, s_.request_timeout())));
  } catch (const dist::DistError& e) {
    lost("watching the other nodes", e);
  }
}

void Rendezvous::start_beats(int round) {
  if (beat_round_ == round) return;
  const auto now = Clock::now();
  beat_round_ = round;
  next_beat_ = next_check_ = now;
  beats_.assign(std::max(nnodes_, 0), Beat{-1, now});
  silent_nodes_.clear();
}

void Rendezvous::beat(int round) {
  start_beats(round);
  const auto now = Clock::now();
  if (now < next_beat_) return;
  next_beat_ = now + to_ms(s_.config().heartbeat_interval_s);
  s_.leased().add(s_.round_key(round, "beat/" + std::to_string(s_.node_rank())), 1);
}

std::optional<RoundFailure> Rendezvous::find_silent_node(int round, bool admit_waiting) {
  const LaunchConfig& c = s_.config();
  dist::Store& store = s_.store();
  start_beats(round);
  const auto now = Clock::now();
  if (now < next_check_) return std::nullopt;
  next_check_ = now + std::min(kHeartbeatCheck, to_ms(c.heartbeat_interval_s));
  const auto bound = to_ms(c.heartbeat_timeout_s);
  for (int i = 0; i < static_cast<int>(beats_.size()); ++i) {
    if (i == s_.node_rank() ||
        std::find(silent_nodes_.begin(), silent_nodes_.end(), i) != silent_nodes_.end())
      continue;
    const int64_t count = backend_->read_counter(s_.round_key(round, "beat/" + std::to_string(i)));
    // etcd: a key seen and now gone expired with its writer's lease: that agent is gone.
    const bool expired = count < 0 && beats_[i].count >= 0;
    if (count != beats_[i].count && !expired) {
      beats_[i] = {count, now};
      continue;
    }
    const auto silent = std::chrono::duration_cast<milliseconds>(now - beats_[i].seen);
    if ((silent < bound && !expired) ||
        store.check({s_.round_key(round, "exit/" + std::to_string(i))}))
      continue;
    silent_nodes_.push_back(i);
    store.set(s_.round_key(round, "lost/" + std::to_string(i)), std::string("1"));
    const std::string v = to_s(store.get(s_.node_key(round, i), s_.request_timeout()));
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f s", silent.count() / 1000.0);
    return RoundFailure{i, "node " + std::to_string(i) + " (" + v.substr(v.find(' ') + 1) +
                               ") lost: no heartbeat for " + secs + " (--heartbeat-timeout " +
                               seconds_str(c.heartbeat_timeout_s) +
                               "; a network partition, or its agent stopped or hung)"};
  }
  return admit_waiting ? find_waiting_nodes(round) : std::nullopt;
}

RoundFailure Rendezvous::record_failure(int round, const RoundFailure& f) {
  const std::string v = std::to_string(f.node_rank) + " " + f.what;
  return parse_failure(
      to_s(s_.store().compare_set(s_.round_key(round, "failed"), {}, to_b(v))));
}

std::optional<RoundFailure> Rendezvous::watch(int round) {
  dist::Store& store = s_.store();
  try {
    store.set_timeout(std::min(kPollTimeout, s_.request_timeout()));
    beat(round);
    std::optional<RoundFailure> silent = backend_->watches_heartbeats()
                                             ? find_silent_node(round, /*admit_waiting=*/true)
                                             : std::nullopt;
    store.set_timeout(s_.request_timeout());
    if (silent) return record_failure(round, *silent);
  } catch (const dist::DistError& e) {
    lost("watching the other nodes", e);
  }
  return poll_failure(round);
}

void Rendezvous::report_exit(int round) {
  try {
    s_.store().set(s_.round_key(round, "exit/" + std::to_string(s_.node_rank())),
                   std::string("1"));
  } catch (const dist::DistError&) {
  }
}

void Rendezvous::report_success(int round) {
  report_exit(round);
  backend_->finished(round, nnodes_);
}

bool Rendezvous::wait_for_exits(int round, milliseconds timeout, bool stop_on_failure) {
  dist::Store& store = s_.store();
  std::vector<std::string> keys;
  for (int i = 0; i < nnodes_; ++i) {
    const bool silent =
        beat_round_ == round &&
        std::find(silent_nodes_.begin(), silent_nodes_.end(), i) != silent_nodes_.end();
    if (i != s_.node_rank() && !silent)
      keys.push_back(s_.round_key(round, "exit/" + std::to_string(i)));
  }
  if (keys.empty()) return true;
  const auto deadline = Clock::now() + timeout;
  const std::string failed = s_.round_key(round, "failed");
  try {
    for (;;) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return store.check(keys);
      try {
        store.wait(keys, std::clamp(left, milliseconds(1), kPollChunk));
        return true;
      } catch (const dist::DistTimeoutError&) {
      }
      if (s_.interrupted()) return false;
      if (!stop_on_failure) continue;
      if (std::optional<RoundFailure> silent = find_silent_node(round)) {
        record_failure(round, *silent);
        return false;
      }
      if (store.check({failed})) return false;
    }
  } catch (const dist::DistError&) {
    return false;
  }
}

}  // namespace ember::launcher
