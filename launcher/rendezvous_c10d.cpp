// --rdzv-backend c10d (and static, torchrun's default name for it): node 0's agent hosts the
// rendezvous store, a TCPStoreServer listening on every interface, and leads every round: it
// opens the round, picks MASTER_ADDR, closes the round and watches the heartbeats. Losing it
// ends the run (Note [Leaderless rounds] in rendezvous_etcd.cpp is the alternative).
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>

#include <ember/distributed/store/tcp_store.h>
#include <ember/launcher/config.h>
#include <ember/launcher/rendezvous_backend.h>

namespace ember::launcher {
namespace {

using namespace detail;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

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

class C10dBackend final : public RendezvousBackend {
 public:
  // Node 0 (--node-rank 0, or without --node-rank the agent on the machine that owns the
  // endpoint's address and wins its port) starts hosting the store here.
  explicit C10dBackend(RendezvousStore& s) : s_(s) {
    const LaunchConfig& c = s_.config();
    if (!(c.node_rank_given ? c.node_rank == 0 : is_local_address(s_.host()))) return;
    dist::TCPStoreServerOptions o;
    o.host = "";  // every interface: the endpoint's name may resolve to any of them
    o.port = static_cast<uint16_t>(s_.port());
    for (const auto& [var, value] : c.store_limits) {  // checked by parse_args
      for (const dist::StoreLimit& l : dist::store_limits()) {
        if (var == l.env) dist::set_store_limit(o, l, value, l.option);
      }
    }
    try {
      server_ = std::make_unique<dist::TCPStoreServer>(o);
    } catch (const std::exception& e) {
      // Without --node-rank another agent on this machine may have won the port: join it.
      if (c.node_rank_given) {
        throw RendezvousError("node 0 could not host the rendezvous store on port " +
                              std::to_string(s_.port()) + ": " + e.what());
      }
    }
  }
  ~C10dBackend() override {
    store_.reset();
    if (server_) server_->stop();
  }

  void connect(milliseconds timeout) override {
    dist::TCPStoreOptions o;
    o.timeout = timeout;
    store_ = std::make_unique<dist::TCPStore>(s_.host(), static_cast<uint16_t>(s_.port()), o);
    store_->set_timeout(s_.request_timeout());
    s_.attach(*store_, *store_);  // node 0's store keeps every key as long as it runs
  }

  std::string unreachable(const std::string& last) const override {
    return "could not reach the rendezvous store at " + s_.endpoint() + " within " +
           seconds_str(s_.config().rdzv_timeout_s) +
           " (--rdzv-timeout or --rdzv-conf join_timeout): is node 0's agent running? It hosts "
           "the store when started with --node-rank 0, or without --node-rank on the machine "
           "that owns that address. Last error: " +
           last;
  }

  std::string lost_hint() const override { return "node 0's agent gone?"; }
  bool is_host() const override { return server_ != nullptr; }

  // Node 0 publishes the round (its restart count, MASTER_ADDR) and how many nodes it expects
  // in it; the others only read them.
  void open_round(int round) override {
    if (!is_host()) return;
    dist::Store& store = s_.store();
    expected_ = s_.expected_nodes(round);
    store.set(s_.round_key(round, "restarts"),
              std::to_string(round > 0 ? s_.round_restarts(round) : 0));
    // Node 0 picks where the job's rank 0 will host its store, fresh for every round.
    const LaunchConfig& c = s_.config();
    const std::string addr = c.local_addr.empty() ? s_.host() : c.local_addr;
    store.set(s_.round_key(round, "master"), addr + ":" + std::to_string(pick_free_port(true)));
    store.set(s_.key("round"), std::to_string(round));
  }

  // Note [Arriving is registering] in rendezvous.cpp. Node 0 is the host, so arrivals take
  // k = 1, 2, ...; keys are never deleted within a round and every claim takes the lowest free
  // k, so once A arrivals are counted in r<R>/arrived, k = 1..A are taken: an arrival starts
  // after them and costs a few requests (more only for agents arriving at the same time), not
  // one per node already there, which matters to the one store node 0 hosts.
  int arrive(int round) override {
    dist::Store& store = s_.store();
    const dist::Bytes mine = to_b(s_.node_record());
    const std::string arrived = s_.round_key(round, "arrived");
    const int max_nodes = s_.config().max_nodes;
    for (int k = 1 + static_cast<int>(store.add(arrived, 0)); k < max_nodes; ++k) {
      if (store.compare_set(s_.node_key(round, k), {}, mine) == mine) {
        store.add(arrived, 1);
        return k;
      }
    }
    return max_nodes;
  }

  int complete(int round, int k) override {
    if (is_host()) return s_.close_round(round, expected_);
    const LaunchConfig& c = s_.config();
    // Node 0 may take the whole join timeout and then the last call.
    const auto deadline =
        Clock::now() + to_ms(c.rdzv_timeout_s) + to_ms(c.last_call_s) + milliseconds(5000);
    if (!s_.wait_keys({s_.round_key(round, "nnodes")}, deadline, true)) {
      throw RendezvousError(
          "rendezvous round " + std::to_string(round) + " at " + s_.endpoint() +
          ": node 0 did not complete the round within " + seconds_str(c.rdzv_timeout_s) +
          " (--rdzv-timeout or --rdzv-conf join_timeout); this node is " + s_.describe_self());
    }
    return s_.round_size(round, k);
  }

  std::string round_not_opened() const override { return "which node 0 did not open"; }
  bool watches_heartbeats() const override { return is_host(); }
  // A missing counter reads (and is) 0: node 0's store loses no key while it runs.
  int64_t read_counter(const std::string& key) override { return s_.store().add(key, 0); }

 private:
  RendezvousStore& s_;
  std::unique_ptr<dist::TCPStoreServer> server_;
  std::unique_ptr<dist::TCPStore> store_;
  int expected_ = 0;  // node 0: nodes the round being joined waits for before closing
};

std::unique_ptr<RendezvousBackend> make(RendezvousStore& s) {
  return std::make_unique<C10dBackend>(s);
}

}  // namespace

/// Registered as "static" and "c10d" (rendezvous_backend.cpp).
extern const RendezvousBackendType kC10dRendezvous = {29400, "node 0's agent hosts the store",
                                                      nullptr, make};

}  // namespace ember::launcher
