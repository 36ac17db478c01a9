// The gloo backend's registration: its factory reads gloo's environment settings and picks
// the flat group or the hierarchical one (process_group_hierarchical.h) for ranks spanning
// nodes. Built with Gloo only; no_gloo.cpp registers the backend's refusal otherwise.
#include <climits>
#include <cstdlib>

#include <ember/distributed/backends/net.h>
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_hierarchical.h>
#include <ember/distributed/detail/environment.h>
#include <ember/distributed/init.h>

namespace ember::dist {

namespace {

// A hierarchical group (process_group_hierarchical.h) when the ranks span several nodes and
// one node has several ranks, unless EMBER_GLOO_HIERARCHICAL=0; null otherwise. Every rank
// publishes its node key and its switch, so all take the same branch even when their
// environments differ (one rank's 0 turns it off for all).
std::shared_ptr<ProcessGroup> make_gloo_hierarchical(const BackendArgs& a,
                                                     const ProcessGroupGloo::GlooOptions& o) {
  const bool wanted = detail::int_from_env("EMBER_GLOO_HIERARCHICAL", 0, 1,
                                           "1: reduce inside each node, then between node "
                                           "leaders, 0: one flat ring of all ranks")
                          .value_or(1) == 1;
  bool all_want = false;
  const NodeLayout layout =
      exchange_node_keys(*a.store, a.rank, a.size, local_node_key(), wanted, &all_want, a.timeout);
  if (!all_want || !layout.pays()) return nullptr;
  ProcessGroupHierarchical::HierarchicalOptions ho;
  ho.gloo = o;
  return std::make_shared<ProcessGroupHierarchical>(a.store, a.rank, a.size, layout, ho);
}

// Which address gloo listens on, unless EMBER_GLOO_HOSTNAME or GLOO_SOCKET_IFNAME says: loopback
// when rank 0 is on this machine's loopback; otherwise the address of the interface that
// reaches rank 0 (torch resolves the machine's hostname instead, which on many machines, and
// in network namespaces, gives 127.0.1.1 or the wrong interface and makes peers fail to connect).
std::shared_ptr<ProcessGroup> make_gloo(const BackendArgs& a) {
  if (a.rank < 0) return nullptr;  // not a member of this group
  ProcessGroupGloo::GlooOptions o;
  o.timeout = a.timeout;
  if (auto t = detail::int_from_env("EMBER_GLOO_THREADS", 1, 64, "the gloo worker threads")) {
    o.threads = *t;
  }
  if (auto t = detail::int_from_env("EMBER_GLOO_SHM", 0, 1, "1: allreduce through shared memory "
                                    "among ranks on one machine, 0: always over TCP")) {
    o.shared_memory = *t == 1;
  }
  if (auto b = detail::int_from_env("EMBER_GLOO_RECEIVES_FIRST_BYTES", 1, INT_MAX,
                                    "the smallest TCP message of alltoall and allgather "
                                    "posted receives first")) {
    o.receives_first_bytes = static_cast<size_t>(*b);
  }
  if (!std::getenv("EMBER_GLOO_HOSTNAME") && !std::getenv("GLOO_SOCKET_IFNAME")) {
    if (net::is_loopback(a.master_addr)) {
      o.hostname = "127.0.0.1";  // every rank is on this machine: stay on loopback
    } else if (!a.master_addr.empty()) {
      o.hostname = net::local_address_towards(a.master_addr);  // "" keeps gloo's hostname default
    }
  }
  if (a.size > 1) {
    if (auto pg = make_gloo_hierarchical(a, o)) return pg;
  }
  return std::make_shared<ProcessGroupGloo>(a.store, a.rank, a.size, o);
}

const bool kGlooRegistered = [] {
  register_backend("gloo", make_gloo);
  return true;
}();

}  // namespace

}  // namespace ember::dist
