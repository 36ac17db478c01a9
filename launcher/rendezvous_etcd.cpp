// --rdzv-backend etcd: the rendezvous store is an etcd server that no agent hosts, and no agent
// is special (Note [Leaderless rounds]): ranks by arrival, a leader per round elected through a
// leased key, so that losing any node, node 0 included, leaves the others a job.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include <ember/distributed/store/etcd_store.h>
#include <ember/launcher/config.h>
#include <ember/launcher/console.h>
#include <ember/launcher/rendezvous_backend.h>

namespace ember::launcher {

// Note [Leaderless rounds]
// With the c10d backend node 0's agent hosts the store, so it may as well lead: it opens every
// round, closes it, picks MASTER_ADDR and watches the heartbeats, and losing it ends the run.
// With etcd the store outlives every agent, and nothing may depend on one of them:
// - Opening round R (its restart count, and raising the "round" key) is done by whichever
//   agent joins first, with compare_set: every agent computes the same values from round R-1.
// - Node ranks are handed out by arrival in the round: node 0 is the first agent to join,
//   whatever its host or start order. Arriving is registering: an agent creates the first
//   missing r<R>/node/<k>, k = 0, 1, ... (node 0's with r<R>/master, in the same transaction),
//   so no agent can die holding a rank it has not registered (a counter handed out first would
//   leave its round waiting for that node until --rdzv-timeout). An agent that dies after
//   arriving is a node of the round like any other: found silent within --heartbeat-timeout
//   once the round runs, or, as its leader, replaced when its lease expires. The cost is one
//   request per node that arrived before it.
// - Closing the round (waiting for MIN nodes and the last call, then r<R>/nnodes) needs one
//   agent: the leader, which wins the leased key r<R>/leader. Every other agent waits for
//   r<R>/nnodes and retries the key every kLeaseCheck; when the leader dies its lease expires
//   (--heartbeat-timeout, etcd's TTL) and one of them takes over, so a round is closed within
//   TTL + kLeaseCheck of its leader's death plus its own join time.
// - MASTER_ADDR: the round's node 0 writes its own address (--local-addr, else the address of
//   its interface towards etcd) and a free port as it registers, so the workers' store is on a
//   node that joined the round, never on one lost in an earlier round.
// - Heartbeats: every agent watches every other one (Note [Heartbeats] in rendezvous.cpp); the
//   first to find one silent records the failure and r<R>/lost/<k>, which the next round's
//   leader reads.
// - The next round expects the last round's nodes neither lost nor gone nor without a lease:
//   when a node dies its peers' workers usually fail first (their collectives lose it), so
//   nobody finds it silent; its lease then expires within the TTL, and the leader, re-reading
//   that every kLeaseCheck during the last call, stops waiting for it (instead of the whole
//   --rdzv-last-call).
// Keys that must outlive their writer (the round's records, failures, exits, "closed") are
// written without a lease; the leader key and the heartbeats carry the writer's lease.

namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// etcd's client port: --rdzv-endpoint's when it names none.
constexpr int kEtcdPort = 2379;
// How often an agent retries a round's leader key, and a leader re-reads which nodes of the
// last round still hold a lease.
constexpr milliseconds kLeaseCheck{1000};

// The address of this machine's interface on the route to host:port (no packet is sent), or
// its host name when there is none.
std::string route_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  std::string out;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0) {
    for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
      // A UDP "connect" sends nothing: it only asks the kernel for the route's source address.
      const int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      char buf[INET6_ADDRSTRLEN] = {};
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
          getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
          getnameinfo(reinterpret_cast<sockaddr*>(&local), len, buf, sizeof(buf), nullptr, 0,
                      NI_NUMERICHOST) == 0)
        out = buf;
      close(fd);
    }
    freeaddrinfo(res);
  }
  if (!out.empty()) return out;
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 ? name : "127.0.0.1";
}

class EtcdBackend final : public RendezvousBackend {
 public:
  explicit EtcdBackend(RendezvousStore& s) : s_(s) {}

  // Two clients: one without a lease for the round's records, which outlive any agent, and one
  // with this agent's lease for its heartbeat and any round it leads.
  void connect(milliseconds timeout) override {
    const LaunchConfig& c = s_.config();
    dist::EtcdStoreOptions eo;
    eo.timeout = timeout;
    eo.https = c.etcd_https;
    eo.ca_file = c.etcd_cacert;
    eo.cert_file = c.etcd_cert;
    eo.key_file = c.etcd_key;
    eo.username = c.etcd_user;
    eo.password = c.etcd_password;
    if (!records_) {
      records_ = std::make_unique<dist::EtcdStore>(s_.endpoint(), eo);
      records_->set_timeout(s_.request_timeout());
    }
    // The agent's leased keys vanish once it is gone for as long as a silent node is tolerated.
    eo.lease_ttl_s = std::max<int64_t>(2, std::llround(c.heartbeat_timeout_s));
    live_ = std::make_unique<dist::EtcdStore>(s_.endpoint(), eo);
    // Its requests (a heartbeat, the leader key) are the monitor's: bounded as its polls are.
    live_->set_timeout(std::min(kPollTimeout, s_.request_timeout()));
    addr_ = c.local_addr.empty() ? route_address(s_.host(), s_.port()) : c.local_addr;
    s_.attach(*records_, *live_);
  }

  std::string unreachable(const std::string& last) const override {
    return "could not reach etcd at " + s_.endpoint() + " within " +
           seconds_str(s_.config().rdzv_timeout_s) +
           " (--rdzv-timeout or --rdzv-conf join_timeout). Last error: " + last;
  }

  std::string lost_hint() const override { return "etcd gone?"; }
  bool is_host() const override { return false; }

  // etcd keeps a finished run's keys (no agent hosted them): reusing its id would join it.
  void check_run() override {
    const std::string closed = s_.key("closed");
    if (s_.store().check({closed})) {
      throw RendezvousError("the rendezvous id '" + s_.config().rdzv_id + "' at etcd " +
                            s_.endpoint() + " belongs to a run that is over (" +
                            to_s(s_.store().get(closed, s_.request_timeout())) +
                            "): give every job its own --rdzv-id");
    }
  }

  // Whoever joins first opens the round; every agent computes the same restart count.
  void open_round(int round) override {
    const std::string rk = s_.round_key(round, "restarts");
    if (!s_.store().check({rk})) {
      const int restarts = round > 0 ? s_.round_restarts(round) : 0;
      s_.store().compare_set(rk, {}, to_b(std::to_string(restarts)));
    }
    raise_round(round);
  }

  // Node 0 is the first arrival: its record carries MASTER_ADDR, picked here.
  int arrive(int round) override {
    const dist::Bytes mine = to_b(s_.node_record());
    const int max_nodes = s_.config().max_nodes;
    for (int k = 0; k < max_nodes; ++k) {
      std::vector<std::pair<std::string, dist::Bytes>> also;
      if (k == 0) {  // node 0's MASTER_ADDR, with its record: whoever finds one finds the other
        also.emplace_back(s_.round_key(round, "master"),
                          to_b(addr_ + ":" + std::to_string(pick_free_port(true))));
      }
      if (records_->create_with(s_.node_key(round, k), mine, also) == mine) return k;
    }
    return max_nodes;
  }

  // This node's leased heartbeat key says it is alive from the join on.
  void registered(int round, int k) override {
    live_->add(s_.round_key(round, "beat/" + std::to_string(k)), 1);
  }

  // The leader (the agent holding the leased key r<R>/leader) closes the round; the others wait
  // for it and retry the key every kLeaseCheck, taking over once the leader's lease expired.
  int complete(int round, int k) override {
    const LaunchConfig& c = s_.config();
    const std::string nn = s_.round_key(round, "nnodes"), lk = s_.round_key(round, "leader");
    // A leader may take the whole join timeout and then the last call; one that dies is
    // replaced within its lease's TTL.
    const auto deadline = Clock::now() + to_ms(c.rdzv_timeout_s) + to_ms(c.last_call_s) +
                          to_ms(c.heartbeat_timeout_s) + milliseconds(5000);
    std::string seen;  // another agent seen leading
    while (!s_.store().check({nn})) {
      const std::string leader = to_s(live_->compare_set(lk, {}, to_b(s_.self())));
      if (leader == s_.self()) {
        if (!seen.empty()) {
          log_line(s_.describe_self() + " leads rendezvous round " + std::to_string(round) +
                   " in place of " + seen + ", whose lease expired");
        }
        lead(round);
        break;
      }
      seen = leader;
      if (Clock::now() >= deadline) {
        throw RendezvousError("rendezvous round " + std::to_string(round) + " at etcd " +
                              s_.endpoint() + ": its leader (" + leader +
                              ") did not complete it within " + seconds_str(c.rdzv_timeout_s) +
                              " (--rdzv-timeout or --rdzv-conf join_timeout); this node is " +
                              s_.describe_self());
      }
      s_.wait_keys({nn}, std::min(deadline, Clock::now() + kLeaseCheck), true);
    }
    return s_.round_size(round, k);
  }

  std::string round_not_opened() const override { return "which no agent opened"; }
  // No node 0 to rely on: every agent watches the others.
  bool watches_heartbeats() const override { return true; }

  int64_t read_counter(const std::string& key) override {
    // Not add(key, 0), which would recreate a key that expired, without its writer's lease.
    if (!s_.store().check({key})) return -1;
    try {
      return std::stoll(to_s(s_.store().get(key, s_.request_timeout())));
    } catch (const dist::DistTimeoutError&) {
      return -1;  // expired between the two requests
    }
  }

  // No host waits for the others: the last node of the round to finish closes the run for the
  // nodes waiting to join it.
  void finished(int round, int nnodes) override {
    try {
      std::vector<std::string> keys;
      for (int i = 0; i < nnodes; ++i)
        keys.push_back(s_.round_key(round, "exit/" + std::to_string(i)));
      if (s_.store().check(keys)) s_.close("the run finished");
    } catch (const dist::DistError&) {
    }
  }

 private:
  // Closes `round` as its leader: expects the last round's nodes that still hold their lease
  // (the heartbeat key of the last round lives as long as its agent's lease), and re-reads the
  // leases every kLeaseCheck of the last call.
  void lead(int round) {
    auto alive = [this](int prev, int node) {
      return read_counter(s_.round_key(prev, "beat/" + std::to_string(node))) >= 0;
    };
    s_.close_round(round, s_.expected_nodes(round, alive), kLeaseCheck, [&](int before) {
      const int now = s_.expected_nodes(round, alive);
      if (now < before) {
        log_line("rendezvous round " + std::to_string(round) + " now expects " +
                 std::to_string(now) + " nodes: " + std::to_string(before - now) + " of round " +
                 std::to_string(round - 1) + " gone (etcd lease expired)");
      }
      return now;
    });
  }

  // Raises the "round" key to `round` (never lowers it).
  void raise_round(int round) {
    dist::Store& store = s_.store();
    const std::string k = s_.key("round"), want = std::to_string(round);
    for (;;) {  // ends when the key holds `round` or more: each retry saw another agent's write
      const std::string cur = store.check({k}) ? to_s(store.get(k, s_.request_timeout())) : "";
      if (!cur.empty() && std::stoi(cur) >= round) return;
      if (to_s(store.compare_set(k, to_b(cur), to_b(want))) == want) return;
    }
  }

  RendezvousStore& s_;
  // Declared in this order so that live_ (the lease) goes first.
  std::unique_ptr<dist::EtcdStore> records_;  // without a lease: the run's records
  std::unique_ptr<dist::EtcdStore> live_;     // with this agent's lease
  std::string addr_;  // this node's address for MASTER_ADDR when it is a round's node 0
};

// etcd's rendezvous is leaderless (Note [Leaderless rounds]): it needs the etcd server's
// address, and node ranks go by arrival in each round, as with torchrun's etcd backend, which
// ignores --node-rank too.
void check_options(LaunchConfig& c) {
  if (!c.multi_node()) return;
  if (c.rdzv_endpoint.empty()) {
    throw UsageError(
        "--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT] (the etcd server; port " +
        std::to_string(kEtcdPort) + " if omitted)");
  }
  if (c.node_rank_given) {
    c.notices.push_back("--node-rank " + std::to_string(c.node_rank) +
                        " is ignored with --rdzv-backend etcd: node ranks are given by arrival "
                        "in each rendezvous round");
    c.node_rank = 0;
    c.node_rank_given = false;
  }
}

std::unique_ptr<RendezvousBackend> make(RendezvousStore& s) {
  return std::make_unique<EtcdBackend>(s);
}

}  // namespace

/// Registered as "etcd" (rendezvous_backend.cpp).
extern const RendezvousBackendType kEtcdRendezvous = {
    kEtcdPort,
    "an etcd server at --rdzv-endpoint holds it; no node is special, node 0 may be lost",
    check_options, make};

}  // namespace ember::launcher
