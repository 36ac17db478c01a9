// The parts of the rendezvous that only --rdzv-backend etcd uses (launcher/rendezvous.h).
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include <ember/distributed/store/etcd_store.h>
#include <ember/distributed/store/store.h>
#include <ember/launcher/console.h>
#include <ember/launcher/rendezvous.h>
#include <ember/launcher/rendezvous_detail.h>

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
// - Heartbeats: every agent watches every other one (Note [Heartbeats]); the first to find one
//   silent records the failure and r<R>/lost/<k>, which the next round's leader reads.
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

}  // namespace

std::string detail::route_address(const std::string& host, int port) {
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

void Rendezvous::open_round_etcd(int round) {
  const std::string rk = round_key(round, "restarts");
  if (!store_->check({rk})) {
    const int restarts = round > 0 ? round_restarts(round) : 0;
    store_->compare_set(rk, {}, to_b(std::to_string(restarts)));
  }
  raise_round(round);
}

void Rendezvous::raise_round(int round) {
  const std::string k = key("round"), want = std::to_string(round);
  for (;;) {  // ends when the key holds `round` or more: each retry saw another agent's write
    const std::string cur = store_->check({k}) ? to_s(store_->get(k, request_timeout())) : "";
    if (!cur.empty() && std::stoi(cur) >= round) return;
    if (to_s(store_->compare_set(k, to_b(cur), to_b(want))) == want) return;
  }
}

int Rendezvous::arrive_etcd(int round) {
  auto& etcd = static_cast<dist::EtcdStore&>(*store_);
  const dist::Bytes mine = to_b(node_record());
  for (int k = 0; k < config_.max_nodes; ++k) {
    std::vector<std::pair<std::string, dist::Bytes>> also;
    if (k == 0) {  // node 0's MASTER_ADDR, with its record: whoever finds one finds the other
      also.emplace_back(round_key(round, "master"),
                        to_b(addr_ + ":" + std::to_string(pick_free_port(true))));
    }
    if (etcd.create_with(node_key(round, k), mine, also) == mine) return k;
  }
  return config_.max_nodes;
}

int Rendezvous::lead_or_await(int round, int k) {
  const std::string nn = round_key(round, "nnodes"), lk = round_key(round, "leader");
  // A leader may take the whole join timeout and then the last call; one that dies is
  // replaced within its lease's TTL.
  const auto deadline = Clock::now() + to_ms(config_.rdzv_timeout_s) +
                        to_ms(config_.last_call_s) + to_ms(config_.heartbeat_timeout_s) +
                        milliseconds(5000);
  std::string seen;  // another agent seen leading
  while (!store_->check({nn})) {
    const std::string leader = to_s(live_->compare_set(lk, {}, to_b(self_)));
    if (leader == self_) {
      if (!seen.empty()) {
        log_line(describe_self() + " leads rendezvous round " + std::to_string(round) +
                 " in place of " + seen + ", whose lease expired");
      }
      expected_ = expected_nodes(round);
      complete_round(round);
      break;
    }
    seen = leader;
    if (Clock::now() >= deadline) {
      throw RendezvousError("rendezvous round " + std::to_string(round) + " at etcd " +
                            endpoint() + ": its leader (" + leader +
                            ") did not complete it within " +
                            seconds_str(config_.rdzv_timeout_s) +
                            " (--rdzv-timeout or --rdzv-conf join_timeout); this node is " +
                            describe_self());
    }
    wait_keys({nn}, std::min(deadline, Clock::now() + kLeaseCheck), true);
  }
  return round_size(round, k);
}

int64_t Rendezvous::read_counter(const std::string& key) {
  if (!etcd_) return store_->add(key, 0);  // TCPStore: a missing counter reads (and is) 0
  // Not add(key, 0), which would recreate a key that expired, without its writer's lease.
  if (!store_->check({key})) return -1;
  try {
    return std::stoll(to_s(store_->get(key, request_timeout())));
  } catch (const dist::DistTimeoutError&) {
    return -1;  // expired between the two requests
  }
}

}  // namespace ember::launcher
