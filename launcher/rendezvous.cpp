#include <ember/launcher/rendezvous.h>

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <thread>

#include <ember/distributed/store/etcd_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/launcher/console.h>
#include <ember/launcher/rendezvous_detail.h>

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
// The monitor's poll: when node 0's agent dies its port refuses connections, and the client
// retries refused connections until the request timeout; this bounds how long that takes.
constexpr milliseconds kPollTimeout{3000};

// Note [Arriving is registering]
// Without --node-rank an agent's node rank is its arrival in the round, and taking it is
// registering: the agent creates the first missing r<R>/node/<k> (compare_set against absent;
// etcd: one transaction, Note [Leaderless rounds]). A rank handed out first (a counter) and
// registered in a later request would leave the round waiting for that node until
// --rdzv-timeout when its agent dies in between. An agent that dies after arriving is a node of
// the round like any other: the round closes with it, and it is found silent within
// --heartbeat-timeout once the round runs (elastic: the next round goes on without it).
// c10d: keys are never deleted within a round and every claim takes the lowest free k, so
// once A arrivals are counted in r<R>/arrived, k = 1..A are taken: an arrival starts after
// them and costs a few requests (more only for agents arriving at the same time), not one per
// node already there, which matters to the one store node 0 hosts.

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
// itself gives up within kPollTimeout, its requests going unanswered. With etcd there is no
// node 0 to trust: every agent watches every other one the same way (the first to record the
// failure wins), and a counter whose key vanished (its writer's lease expired) is a lost node
// at once.
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

// Whether `host` names an address of this machine (network namespace): one of its addresses
// can be bound.
bool is_local_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool local = false;
  for (addrinfo* a = res; a && !local; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    local = bind(fd, a->ai_addr, a->ai_addrlen) == 0;  // port 0 from getaddrinfo
    close(fd);
  }
  freeaddrinfo(res);
  return local;
}

std::string this_host(const LaunchConfig& c) {
  if (!c.local_addr.empty()) return c.local_addr;
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

}  // namespace

Rendezvous::Rendezvous(const LaunchConfig& config, std::function<bool()> interrupted)
    : config_(config), interrupted_(std::move(interrupted)) {
  auto [host, port] = config_.rdzv_host_port();
  host_ = host;
  port_ = port;
  self_ = this_host(config_) + " pid " + std::to_string(getpid());
  etcd_ = config_.rdzv_backend == "etcd";
  kill_after_arrival_ = std::getenv("EMBER_TEST_KILL_AFTER_ARRIVAL") != nullptr;
  const bool want_host =
      !etcd_ && (config_.node_rank_given ? config_.node_rank == 0 : is_local_address(host_));
  if (want_host) {
    dist::TCPStoreServerOptions o;
    o.host = "";  // every interface: the endpoint's name may resolve to any of them
    o.port = static_cast<uint16_t>(port_);
    try {
      server_ = std::make_unique<dist::TCPStoreServer>(o);
    } catch (const std::exception& e) {
      // Without --node-rank another agent on this machine may have won the port: join it.
      if (config_.node_rank_given) {
        throw RendezvousError("node 0 could not host the rendezvous store on port " +
                              std::to_string(port_) + ": " + e.what());
      }
    }
  }
  const auto deadline = Clock::now() + to_ms(config_.rdzv_timeout_s);
  std::string last;
  for (;;) {
    // Short connection attempts, so a signal is noticed while node 0 is not up yet.
    try {
      connect(std::max(milliseconds(1),
                       std::min<milliseconds>(milliseconds(1000),
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
    if (interrupted_ && interrupted_()) {
      throw RendezvousInterrupted("interrupted while connecting to " + endpoint());
    }
    if (Clock::now() >= deadline && etcd_) {
      throw RendezvousError("could not reach etcd at " + endpoint() + " within " +
                            seconds_str(config_.rdzv_timeout_s) +
                            " (--rdzv-timeout or --rdzv-conf join_timeout). Last error: " + last);
    }
    if (Clock::now() >= deadline) {
      throw RendezvousError(
          "could not reach the rendezvous store at " + endpoint() + " within " +
          seconds_str(config_.rdzv_timeout_s) +
          " (--rdzv-timeout or --rdzv-conf join_timeout): is node 0's agent running? It hosts the "
          "store when started with "
          "--node-rank 0, or without --node-rank on the machine that owns that address. Last "
          "error: " +
          last);
    }
  }
}

Rendezvous::~Rendezvous() {
  live_.reset();
  store_.reset();
  if (server_) server_->stop();
}

void Rendezvous::connect(milliseconds timeout) {
  if (!etcd_) {
    dist::TCPStoreOptions o;
    o.timeout = timeout;
    store_ = std::make_unique<dist::TCPStore>(host_, static_cast<uint16_t>(port_), o);
    store_->set_timeout(request_timeout());
    return;
  }
  dist::EtcdStoreOptions eo;
  eo.timeout = timeout;
  eo.https = config_.etcd_https;
  eo.ca_file = config_.etcd_cacert;
  eo.cert_file = config_.etcd_cert;
  eo.key_file = config_.etcd_key;
  eo.username = config_.etcd_user;
  eo.password = config_.etcd_password;
  if (!store_) {
    store_ = std::make_unique<dist::EtcdStore>(endpoint(), eo);
    store_->set_timeout(request_timeout());
  }
  // The agent's leased keys vanish once it is gone for as long as a silent node is tolerated.
  eo.lease_ttl_s = std::max<int64_t>(2, std::llround(config_.heartbeat_timeout_s));
  live_ = std::make_unique<dist::EtcdStore>(endpoint(), eo);
  // Its requests (a heartbeat, the leader key) are the monitor's: bounded as its polls are.
  live_->set_timeout(std::min(kPollTimeout, request_timeout()));
  addr_ = config_.local_addr.empty() ? route_address(host_, port_) : config_.local_addr;
}

milliseconds Rendezvous::request_timeout() const { return to_ms(config_.rdzv_read_timeout_s); }

std::string Rendezvous::endpoint() const {
  return (host_.find(':') != std::string::npos ? "[" + host_ + "]" : host_) + ":" +
         std::to_string(port_);
}

std::string Rendezvous::key(const std::string& k) const {
  std::string out = "emberrun/";
  out.append(config_.rdzv_id).append("/").append(k);
  return out;
}
std::string Rendezvous::round_key(int round, const std::string& k) const {
  // Appended piecewise: GCC 12 warns (-Wrestrict, falsely) on "r" + to_string(...) + "/".
  std::string out = "r";
  out.append(std::to_string(round)).append("/").append(k);
  return key(out);
}

std::string Rendezvous::describe_self() const {
  return "node " + (node_rank_ < 0 ? std::string("?") : std::to_string(node_rank_)) + " (" + self_ +
         ")";
}

void Rendezvous::lost(const std::string& op, const std::exception& e) const {
  throw RendezvousError(
      "lost the rendezvous store at " + endpoint() + " while " + op +
      (config_.rdzv_backend == "etcd" ? " (etcd gone?): " : " (node 0's agent gone?): ") +
      e.what());
}

void Rendezvous::throw_if_closed() {
  const std::string k = key("closed");
  if (store_->check({k})) {
    throw RendezvousError("the run was closed by another node: " +
                          to_s(store_->get(k, request_timeout())));
  }
}

bool Rendezvous::wait_keys(const std::vector<std::string>& keys, Clock::time_point deadline,
                           bool watch_closed) {
  for (;;) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return store_->check(keys);
    try {
      store_->wait(keys, std::clamp(left, milliseconds(1), kPollChunk));
      return true;
    } catch (const dist::DistTimeoutError&) {
    }
    if (interrupted_ && interrupted_()) {
      throw RendezvousInterrupted("interrupted during the rendezvous");
    }
    if (watch_closed) throw_if_closed();
  }
}

std::string Rendezvous::node_key(int round, int node) const {
  return round_key(round, "node/" + std::to_string(node));
}

std::string Rendezvous::node_record() const {
  return std::to_string(config_.nproc_per_node) + " " + self_;
}

int Rendezvous::claim_node_rank(int round) {
  int k;
  bool registered = false;
  if (config_.node_rank_given) {
    k = config_.node_rank;
  } else if (is_host()) {
    k = 0;
  } else {
    // Note [Arriving is registering]; etcd has no host to be node 0: the first arrival is.
    registered = true;
    k = etcd_ ? arrive_etcd(round) : arrive_c10d(round);
    if (kill_after_arrival_) ::kill(::getpid(), SIGKILL);
    if (k >= config_.max_nodes && config_.elastic()) return -1;
    if (k >= config_.max_nodes) {
      throw RendezvousError("rendezvous round " + std::to_string(round) + " at " + endpoint() +
                            " already has --nnodes " + std::to_string(config_.max_nodes) +
                            " nodes; " + self_ + " is one too many");
    }
  }
  const std::string mine = node_record();
  const std::string owner =
      registered ? mine : to_s(store_->compare_set(node_key(round, k), {}, to_b(mine)));
  if (owner != mine) {
    throw RendezvousError("node rank " + std::to_string(k) + " of round " + std::to_string(round) +
                          " is already taken by " + owner.substr(owner.find(' ') + 1) +
                          " (two agents given --node-rank " + std::to_string(k) + "?)");
  }
  // etcd: this node's leased heartbeat key says it is alive from the join on.
  if (etcd_) live_->add(round_key(round, "beat/" + std::to_string(k)), 1);
  return k;
}

int Rendezvous::arrive_c10d(int round) {
  const dist::Bytes mine = to_b(node_record());
  const std::string arrived = round_key(round, "arrived");
  for (int k = 1 + static_cast<int>(store_->add(arrived, 0)); k < config_.max_nodes; ++k) {
    if (store_->compare_set(node_key(round, k), {}, mine) == mine) {
      store_->add(arrived, 1);
      return k;
    }
  }
  return config_.max_nodes;
}

int Rendezvous::complete_round(int round) {
  std::vector<std::string> required;
  for (int i = 0; i < config_.min_nodes; ++i) required.push_back(node_key(round, i));
  if (!wait_keys(required, Clock::now() + to_ms(config_.rdzv_timeout_s), false)) {
    const std::string msg = round_timeout_message(round);
    close(msg);
    throw RendezvousError(msg);
  }
  int n = config_.min_nodes;
  // MIN:MAX: more nodes may still come during the last call, unless every node expected did.
  // etcd: a node expected from the last round whose lease expires meanwhile (its workers failed
  // first, and nobody found it silent) is no longer waited for.
  const auto last_call = Clock::now() + to_ms(config_.last_call_s);
  const milliseconds chunk = etcd_ ? kLeaseCheck : to_ms(config_.last_call_s);
  while (n < config_.max_nodes && n < expected_) {
    if (wait_keys({node_key(round, n)}, std::min(last_call, Clock::now() + chunk), false)) {
      ++n;
      continue;
    }
    if (Clock::now() >= last_call) break;
    const int expected = expected_nodes(round);
    if (expected < expected_) {
      log_line("rendezvous round " + std::to_string(round) + " now expects " +
               std::to_string(expected) + " nodes: " + std::to_string(expected_ - expected) +
               " of round " + std::to_string(round - 1) + " gone (etcd lease expired)");
    }
    expected_ = expected;
  }
  while (n < config_.max_nodes && store_->check({node_key(round, n)})) ++n;  // already there
  // First writer wins: with etcd a leader that lost its lease may still get here beside the
  // one that replaced it.
  return std::stoi(
      to_s(store_->compare_set(round_key(round, "nnodes"), {}, to_b(std::to_string(n)))));
}

int Rendezvous::round_restarts(int round) {
  const int prev = round - 1;
  int restarts = std::stoi(to_s(store_->get(round_key(prev, "restarts"), request_timeout())));
  const std::string failed = round_key(prev, "failed");
  if (store_->check({failed}) &&
      !parse_failure(to_s(store_->get(failed, request_timeout()))).new_nodes())
    ++restarts;
  return restarts;
}

int Rendezvous::expected_nodes(int round) {
  if (round == 0) return config_.max_nodes;
  const int prev = round - 1;  // Note [Elastic membership]
  const int n = std::stoi(to_s(store_->get(round_key(prev, "nnodes"), request_timeout())));
  int alive = 0;
  for (int i = 0; i < n; ++i) {
    const std::string node = std::to_string(i);
    // etcd: the heartbeat key of the last round lives as long as its agent's lease.
    if (!store_->check({round_key(prev, "lost/" + node)}) &&
        !store_->check({round_key(prev, "exit/" + node)}) &&
        (!etcd_ || read_counter(round_key(prev, "beat/" + node)) >= 0))
      ++alive;
  }
  return alive + static_cast<int>(store_->add(round_key(prev, "waiting"), 0));
}

void Rendezvous::open_round(int round) {
  expected_ = expected_nodes(round);
  store_->set(round_key(round, "restarts"), std::to_string(round > 0 ? round_restarts(round) : 0));
  // Node 0 picks where the job's rank 0 will host its store, fresh for every round.
  const std::string addr = config_.local_addr.empty() ? host_ : config_.local_addr;
  store_->set(round_key(round, "master"), addr + ":" + std::to_string(pick_free_port(true)));
  store_->set(key("round"), std::to_string(round));
}

int Rendezvous::current_round() {
  if (is_host()) return 0;
  try {
    // etcd keeps a finished run's keys (no agent hosted them): reusing its id would join it.
    const std::string closed = key("closed");
    if (etcd_ && store_->check({closed})) {
      throw RendezvousError("the rendezvous id '" + config_.rdzv_id + "' at etcd " + endpoint() +
                            " belongs to a run that is over (" +
                            to_s(store_->get(closed, request_timeout())) +
                            "): give every job its own --rdzv-id");
    }
    const std::string k = key("round");
    if (!store_->check({k})) return 0;
    return std::stoi(to_s(store_->get(k, request_timeout())));
  } catch (const dist::DistError& e) {
    lost("reading the current round", e);
  }
}

void Rendezvous::wait_for_next_round(int round, int nnodes) {
  waiting_ = true;
  const int64_t i = store_->add(round_key(round, "waiting"), 1) - 1;
  store_->set(round_key(round, "wait/" + std::to_string(i)), self_);
  const std::string next = std::to_string(round + 1);
  log_line(self_ + " arrived after rendezvous round " + std::to_string(round) +
           (nnodes > 0 ? " closed with " + std::to_string(nnodes) + " nodes" : " filled up") +
           ": waiting to join round " + next + " (--nnodes " +
           std::to_string(config_.min_nodes) + ":" + std::to_string(config_.max_nodes) + ")");
  if (!wait_keys({round_key(round + 1, "restarts")},
                 Clock::now() + to_ms(config_.rdzv_timeout_s), true)) {
    throw RendezvousError(
        self_ + " waited " + seconds_str(config_.rdzv_timeout_s) +
        " (--rdzv-timeout) at " + endpoint() + " for rendezvous round " + next +
        (etcd_ ? ", which no agent opened: round " : ", which node 0 did not open: round ") +
        std::to_string(round) +
        " kept running (a round with --nnodes MAX nodes admits nobody until it restarts)");
  }
}

std::optional<RoundFailure> Rendezvous::find_waiting_nodes(int round) {
  if (!config_.elastic() || nnodes_ >= config_.max_nodes) return std::nullopt;
  const int64_t n = store_->add(round_key(round, "waiting"), 0);
  if (n == 0) return std::nullopt;
  // A node that left for good (its workers done) would be waited for in vain by a new round.
  for (int i = 0; i < nnodes_; ++i)
    if (i != node_rank_ && store_->check({round_key(round, "exit/" + std::to_string(i))}))
      return std::nullopt;
  std::string who;
  for (int64_t i = 0; i < n; ++i) {
    const std::string k = round_key(round, "wait/" + std::to_string(i));
    who += (i ? ", " : "") + (store_->check({k}) ? to_s(store_->get(k, request_timeout())) : "?");
  }
  return RoundFailure{RoundFailure::kNewNodes,
                      std::to_string(n) + (n == 1 ? " node waits" : " nodes wait") +
                          " to join (" + who + "); round " + std::to_string(round) + " has " +
                          std::to_string(nnodes_) + " of at most " +
                          std::to_string(config_.max_nodes) + " nodes"};
}

std::string Rendezvous::round_timeout_message(int round) {
  std::string missing, joined;
  for (int i = 0; i < config_.min_nodes; ++i) {
    const std::string ki = node_key(round, i);
    if (store_->check({ki})) {
      std::string v = to_s(store_->get(ki, request_timeout()));
      joined +=
          (joined.empty() ? "" : ", ") + std::to_string(i) + " (" + v.substr(v.find(' ') + 1) + ")";
    } else {
      missing += (missing.empty() ? "" : ", ") + std::to_string(i);
    }
  }
  return "rendezvous round " + std::to_string(round) + " at " + endpoint() + " timed out after " +
         seconds_str(config_.rdzv_timeout_s) +
         " (--rdzv-timeout or --rdzv-conf join_timeout): nodes " + missing +
         " never arrived (expected " + std::to_string(config_.min_nodes) + "; joined: " + joined +
         ")" + (config_.node_rank_given ? "" : "; node ranks are given out by arrival");
}

int Rendezvous::await_round(int round, int k) {
  const std::string nn = round_key(round, "nnodes");
  // Node 0 may take the whole join timeout and then the last call.
  const auto deadline = Clock::now() + to_ms(config_.rdzv_timeout_s) + to_ms(config_.last_call_s) +
                        milliseconds(5000);
  if (!wait_keys({nn}, deadline, true)) {
    throw RendezvousError(
        "rendezvous round " + std::to_string(round) + " at " + endpoint() +
        ": node 0 did not complete the round within " + seconds_str(config_.rdzv_timeout_s) +
        " (--rdzv-timeout or --rdzv-conf join_timeout); this node is " + describe_self());
  }
  return round_size(round, k);
}

int Rendezvous::round_size(int round, int k) {
  const int n = std::stoi(to_s(store_->get(round_key(round, "nnodes"), request_timeout())));
  if (k >= n && !config_.elastic()) {
    throw RendezvousError(describe_self() + " arrived after rendezvous round " +
                          std::to_string(round) + " closed with " + std::to_string(n) +
                          " nodes (--nnodes " + std::to_string(config_.min_nodes) + ":" +
                          std::to_string(config_.max_nodes) + ", --rdzv-last-call)");
  }
  return n;
}

RoundInfo Rendezvous::read_round(int round, int k, int n) {
  RoundInfo info;
  info.round = round;
  info.node_rank = k;
  info.nnodes = n;
  info.world_size = 0;
  for (int i = 0; i < n; ++i) {
    const int nproc = std::stoi(to_s(store_->get(node_key(round, i), request_timeout())));
    if (i < k) info.rank_base += nproc;
    info.world_size += nproc;
  }
  info.restart_count =
      std::stoi(to_s(store_->get(round_key(round, "restarts"), request_timeout())));
  const std::string master = to_s(store_->get(round_key(round, "master"), request_timeout()));
  const auto colon = master.rfind(':');
  info.master_addr = master.substr(0, colon);
  info.master_port = std::stoi(master.substr(colon + 1));
  return info;
}

RoundInfo Rendezvous::join(int round) {
  try {
    for (;; ++round) {
      throw_if_closed();
      if (is_host()) open_round(round);
      if (etcd_) open_round_etcd(round);
      const int k = claim_node_rank(round);
      node_rank_ = k;
      const int n = k < 0         ? -1
                    : is_host()   ? complete_round(round)
                    : etcd_       ? lead_or_await(round, k)
                                  : await_round(round, k);
      if (k >= 0 && k < n) {
        nnodes_ = n;
        waiting_ = false;
        return read_round(round, k, n);
      }
      node_rank_ = -1;
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
    return record_failure(round, {node_rank_, what});
  } catch (const dist::DistError& e) {
    lost("reporting a failure", e);
  }
}

std::optional<RoundFailure> Rendezvous::poll_failure(int round) {
  const std::string k = round_key(round, "failed");
  try {
    store_->set_timeout(std::min(kPollTimeout, request_timeout()));
    const bool failed = store_->check({k});
    store_->set_timeout(request_timeout());
    if (!failed) return std::nullopt;
    return parse_failure(to_s(store_->get(k, request_timeout())));
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
  next_beat_ = now + to_ms(config_.heartbeat_interval_s);
  (etcd_ ? live_ : store_)->add(round_key(round, "beat/" + std::to_string(node_rank_)), 1);
}

std::optional<RoundFailure> Rendezvous::find_silent_node(int round, bool admit_waiting) {
  start_beats(round);
  const auto now = Clock::now();
  if (now < next_check_) return std::nullopt;
  next_check_ = now + std::min(kHeartbeatCheck, to_ms(config_.heartbeat_interval_s));
  const auto bound = to_ms(config_.heartbeat_timeout_s);
  for (int i = 0; i < static_cast<int>(beats_.size()); ++i) {
    if (i == node_rank_ ||
        std::find(silent_nodes_.begin(), silent_nodes_.end(), i) != silent_nodes_.end())
      continue;
    const int64_t count = read_counter(round_key(round, "beat/" + std::to_string(i)));
    // etcd: a key seen and now gone expired with its writer's lease: that agent is gone.
    const bool expired = count < 0 && beats_[i].count >= 0;
    if (count != beats_[i].count && !expired) {
      beats_[i] = {count, now};
      continue;
    }
    const auto silent = std::chrono::duration_cast<milliseconds>(now - beats_[i].seen);
    if ((silent < bound && !expired) ||
        store_->check({round_key(round, "exit/" + std::to_string(i))}))
      continue;
    silent_nodes_.push_back(i);
    store_->set(round_key(round, "lost/" + std::to_string(i)), std::string("1"));
    const std::string v = to_s(store_->get(node_key(round, i), request_timeout()));
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f s", silent.count() / 1000.0);
    return RoundFailure{i, "node " + std::to_string(i) + " (" + v.substr(v.find(' ') + 1) +
                               ") lost: no heartbeat for " + secs + " (--heartbeat-timeout " +
                               seconds_str(config_.heartbeat_timeout_s) +
                               "; a network partition, or its agent stopped or hung)"};
  }
  return admit_waiting ? find_waiting_nodes(round) : std::nullopt;
}

RoundFailure Rendezvous::record_failure(int round, const RoundFailure& f) {
  const std::string v = std::to_string(f.node_rank) + " " + f.what;
  return parse_failure(to_s(store_->compare_set(round_key(round, "failed"), {}, to_b(v))));
}

std::optional<RoundFailure> Rendezvous::watch(int round) {
  try {
    store_->set_timeout(std::min(kPollTimeout, request_timeout()));
    beat(round);
    // With etcd every agent watches the others: there is no node 0 to rely on.
    std::optional<RoundFailure> silent = is_host() || etcd_
                                             ? find_silent_node(round, /*admit_waiting=*/true)
                                             : std::nullopt;
    store_->set_timeout(request_timeout());
    if (silent) return record_failure(round, *silent);
  } catch (const dist::DistError& e) {
    lost("watching the other nodes", e);
  }
  return poll_failure(round);
}

void Rendezvous::close(const std::string& reason) {
  try {
    store_->compare_set(key("closed"), {}, to_b(reason));
  } catch (const dist::DistError&) {
  }
}

void Rendezvous::report_exit(int round) {
  try {
    store_->set(round_key(round, "exit/" + std::to_string(node_rank_)), std::string("1"));
  } catch (const dist::DistError&) {
  }
}

void Rendezvous::report_success(int round) {
  report_exit(round);
  if (!etcd_) return;
  try {
    std::vector<std::string> keys;
    for (int i = 0; i < nnodes_; ++i) keys.push_back(round_key(round, "exit/" + std::to_string(i)));
    if (store_->check(keys)) close("the run finished");  // for nodes waiting to join it
  } catch (const dist::DistError&) {
  }
}

bool Rendezvous::wait_for_exits(int round, milliseconds timeout, bool stop_on_failure) {
  std::vector<std::string> keys;
  for (int i = 0; i < nnodes_; ++i) {
    const bool silent =
        beat_round_ == round &&
        std::find(silent_nodes_.begin(), silent_nodes_.end(), i) != silent_nodes_.end();
    if (i != node_rank_ && !silent) keys.push_back(round_key(round, "exit/" + std::to_string(i)));
  }
  if (keys.empty()) return true;
  const auto deadline = Clock::now() + timeout;
  const std::string failed = round_key(round, "failed");
  try {
    for (;;) {
      auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return store_->check(keys);
      try {
        store_->wait(keys, std::clamp(left, milliseconds(1), kPollChunk));
        return true;
      } catch (const dist::DistTimeoutError&) {
      }
      if (interrupted_ && interrupted_()) return false;
      if (!stop_on_failure) continue;
      if (std::optional<RoundFailure> silent = find_silent_node(round)) {
        record_failure(round, *silent);
        return false;
      }
      if (store_->check({failed})) return false;
    }
  } catch (const dist::DistError&) {
    return false;
  }
}

}  // namespace ember::launcher
