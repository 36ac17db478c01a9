// ProcessGroupHierarchical: reduce inside nodes, all-reduce between node leaders, broadcast back.
//
// HierarchicalForced*: plain processes on this machine made into "nodes" by their node keys
// (NodeLayout given directly, or EMBER_NODE_KEY through init_process_group): the local groups
// use shared memory and the leaders TCP on loopback. HierarchicalNetns: two network namespaces
// joined by a veth pair (tests/launcher/netns.h) are two real nodes found by their keys; skipped,
// with the reason, where namespaces cannot be created (not root).
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fcntl.h>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_hierarchical.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include "tests/distributed/backends/allreduce_closed_forms.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/launcher/netns.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;

std::shared_ptr<TCPStore> client(const std::string& host, int port) {
  TCPStoreOptions o;
  o.timeout = std::chrono::seconds(60);
  return std::make_shared<TCPStore>(host, static_cast<uint16_t>(port), o);
}

/// Node keys for `per_node` ranks on each node: {2, 2} -> "n0" "n0" "n1" "n1".
std::vector<std::string> keys_for(const std::vector<int>& per_node) {
  std::vector<std::string> keys;
  for (size_t n = 0; n < per_node.size(); ++n) {
    for (int i = 0; i < per_node[n]; ++i) keys.push_back(std::string("n").append(std::to_string(n)));
  }
  return keys;
}

/// FNV-1a of the tensor's bytes: ranks compare results bitwise through the store.
std::string digest(const Tensor& t) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return std::to_string(h);
}

/// Every rank's `value` under `key` equals rank 0's (a barrier through the store).
void require_same_everywhere(Store& store, const std::string& key, int rank, int n,
                             const std::string& value) {
  store.set(key + "/" + std::to_string(rank), value);
  for (int r = 0; r < n; ++r) {
    const std::string other = store.get_string(key + "/" + std::to_string(r), 60s);
    require(other == value, key + ": rank " + std::to_string(rank) + " has " + value +
                                ", rank " + std::to_string(r) + " has " + other);
  }
}

/// Allreduce with every op of several dtypes and sizes (odd ones and ones that move in many
/// pieces): the closed forms on every rank, and bitwise the same random-valued sums.
void check_allreduce(ProcessGroup& pg, Store& store, int rank, int n) {
  for (Dtype d : {kFloat32, kInt64, kFloat16, kFloat64}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min,
                        ReduceOp::Product}) {
      for (int64_t numel : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{100003}}) {
        std::vector<double> in(static_cast<size_t>(numel));
        for (int64_t i = 0; i < numel; ++i) in[i] = test::input(rank, i);
        Tensor t = from_vector(in).to(d);
        pg.allreduce(t, {op})->wait();
        const std::vector<double> got = t.to(kFloat64).to_vector<double>();
        for (int64_t i = 0; i < numel; ++i) {
          const double want = test::expected(op, n, i, d);
          if (got[i] != want) {
            throw std::runtime_error(detail::str_cat(
                "allreduce ", to_string(op), " of ", numel, " ", d, " on rank ", rank,
                ": index ", i, " got ", got[i], " want ", want));
          }
        }
      }
    }
  }
  Tensor r = randn({300001}, kFloat32).mul_(Scalar(rank + 1.0));
  pg.allreduce(r)->wait();
  require_same_everywhere(store, "randn_sum", rank, n, digest(r));
}

/// The collectives other than allreduce, on any layout.
void check_others(ProcessGroup& pg, int rank, int n) {
  for (int root = 0; root < n; ++root) {
    Tensor b = full({20001}, rank == root ? 5.0 + root : -1.0, kFloat32);
    pg.broadcast(b, {root})->wait();
    require(b.to(kFloat64).to_vector<double>() == std::vector<double>(20001, 5.0 + root),
            "broadcast from " + std::to_string(root) + " on rank " + std::to_string(rank));
  }
  std::vector<Tensor> parts = {full({3}, 1.0 * rank, kInt64), full({5}, 2.0 * rank, kInt64)};
  pg.allreduce_coalesced(parts)->wait();
  const double s = n * (n - 1) / 2.0;
  require(parts[0].to(kFloat64).to_vector<double>() == std::vector<double>(3, s) &&
              parts[1].to(kFloat64).to_vector<double>() == std::vector<double>(5, 2 * s),
          "allreduce_coalesced on rank " + std::to_string(rank));
  Tensor all = empty({n * 2}, kFloat32);
  pg.allgather_into_tensor(all, full({2}, 1.0 * rank, kFloat32))->wait();
  for (int r = 0; r < n; ++r) {
    require(all[2 * r].item<float>() == r, "allgather_into_tensor on rank " + std::to_string(rank));
  }
  std::vector<Tensor> ins;
  for (int r = 0; r < n; ++r) ins.push_back(full({4}, 1.0 * (rank + r), kFloat32));
  Tensor out = empty({4}, kFloat32);
  pg.reduce_scatter(out, ins)->wait();
  require(out[0].item<float>() == s + n * rank, "reduce_scatter on rank " + std::to_string(rank));
  pg.barrier()->wait();
}

using Body = std::function<void(ProcessGroupHierarchical&, Store&, int rank, int n)>;

void check_all(ProcessGroupHierarchical& pg, Store& store, int rank, int n) {
  check_allreduce(pg, store, rank, n);
  check_others(pg, rank, n);
}

void run_forced(const std::vector<int>& per_node, size_t pipeline_bytes,
                const Body& body = check_all) {
  const std::vector<std::string> keys = keys_for(per_node);
  const int n = static_cast<int>(keys.size());
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client("127.0.0.1", std::stoi(port));
    ProcessGroupHierarchical::HierarchicalOptions o;
    o.gloo.timeout = 60s;
    o.gloo.hostname = "127.0.0.1";
    o.pipeline_bytes = pipeline_bytes;
    o.flat_below_bytes = 0;  // small collectives take the hierarchical path too
    ProcessGroupHierarchical pg(std::make_shared<PrefixStore>("pg", store), rank, n,
                                NodeLayout(keys), o);
    require(pg.layout().nodes() == static_cast<int>(per_node.size()), pg.layout().describe());
    const int node = pg.layout().node_of(rank);
    require(pg.node() == node, "node()");
    require(pg.local_uses_shared_memory() == (per_node[node] > 1),
            "rank " + std::to_string(rank) + ": local_uses_shared_memory() is wrong");
    body(pg, *store, rank, n);
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

TEST(HierarchicalForced, TwoNodesOfTwoRanks) {
  EMBER_REQUIRE_GLOO();
  run_forced({2, 2}, 64 << 10);
}

TEST(HierarchicalForced, UnevenThreePlusOne) {
  EMBER_REQUIRE_GLOO();
  run_forced({3, 1}, 64 << 10);
}

TEST(HierarchicalForced, ThreeNodesInOnePieceEach) {
  EMBER_REQUIRE_GLOO();
  run_forced({1, 2, 1}, 0);
}

// CUDA tensors go through a host copy (as over ProcessGroupGloo), in and out of every step.
TEST(HierarchicalForced, CudaTensorsAreStagedThroughHostMemory) {
  EMBER_REQUIRE_GLOO();
  const std::string no_cuda = test::cuda_unusable_in_children();
  if (!no_cuda.empty()) GTEST_SKIP() << "no CUDA device in a child process: " << no_cuda;
  run_forced({2, 2}, 64 << 10, [](ProcessGroupHierarchical& pg, Store&, int rank, int n) {
    const Device gpu("cuda");
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      Tensor t = full({100003}, 0.0, kFloat32);
      for (int64_t i = 0; i < 2; ++i) t[i].fill_(test::input(rank, i));
      t = t.to(gpu);
      pg.allreduce(t, {op})->wait();
      require(t.is_cuda(), "allreduce result stays on the GPU");
      const Tensor host = t.to(kCPU);
      for (int64_t i = 0; i < 2; ++i) {
        require(host[i].item<float>() == test::expected(op, n, i, kFloat32),
                detail::str_cat("cuda allreduce ", to_string(op), " on rank ", rank, " index ", i));
      }
    }
    Tensor b = full({30000}, rank + 1.0, kFloat32).to(gpu);
    pg.broadcast(b, {n - 1})->wait();
    require(b.is_cuda() && b.to(kCPU)[29999].item<float>() == n, "cuda broadcast");
  });
}

TEST(HierarchicalForced, NodeLayoutOrdersNodesByLowestRank) {
  const NodeLayout l({"b", "a", "b", "c", "a"});
  EXPECT_EQ(l.nodes(), 3);
  EXPECT_EQ(l.members(0), (std::vector<int>{0, 2}));
  EXPECT_EQ(l.members(1), (std::vector<int>{1, 4}));
  EXPECT_EQ(l.members(2), (std::vector<int>{3}));
  EXPECT_EQ(l.leaders(), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(l.describe(), "3 nodes: [0, 2] [1, 4] [3]");
  EXPECT_TRUE(l.pays());
  EXPECT_FALSE(NodeLayout({"a", "a", "a"}).pays());  // one node
  EXPECT_FALSE(NodeLayout({"a", "b", "c"}).pays());  // a node per rank: a flat ring already
}

TEST(HierarchicalForced, NodeKeyExchangeNamesTheMissingRank) {
  HashStore store;
  std::string msg = test::message_of(
      [&] { exchange_node_keys(store, 0, 3, "a", true, nullptr, Duration(50)); });
  EXPECT_NE(msg.find("on rank 0: rank 1 did not publish its node key within 50 ms"),
            std::string::npos) << msg;
  HashStore other;
  msg = test::message_of(
      [&] { exchange_node_keys(other, 2, 3, "a", true, nullptr, Duration(50)); });
  EXPECT_NE(msg.find("on rank 2: rank 0 did not publish the ranks' node keys"), std::string::npos)
      << msg;
  // A lone rank (world of one) gets its own key back, and the switch.
  HashStore solo;
  bool all = false;
  const NodeLayout l = exchange_node_keys(solo, 0, 1, "", true, &all, Duration(50));
  EXPECT_EQ(l.nodes(), 1);
  EXPECT_TRUE(all);
}

// Without the boot id the node key is unknown (a node of its own): the network namespace alone
// made machines whose /proc hides it one node (the host's namespace has one inode everywhere).
// A child with /dev/null mounted over boot_id in a mount namespace of its own.
TEST(HierarchicalForced, NoBootIdGivesNoNodeKey) {
  ASSERT_FALSE(local_node_key().empty());
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const char* boot = "/proc/sys/kernel/random/boot_id";
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("/dev/null", boot, nullptr, MS_BIND, nullptr) != 0) {
      ::_exit(77);  // not allowed here
    }
    ::_exit(local_node_key().empty() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot make a mount namespace here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a key without the boot id";
}

// init_process_group's gloo backend picks the group from the node keys and the switch.
struct InitCase {
  const char* name;
  std::vector<int> per_node;
  const char* switch_on_rank1;  // EMBER_GLOO_HIERARCHICAL on rank 1 only (null: unset)
  bool hierarchical;
};
void PrintTo(const InitCase& c, std::ostream* os) { *os << c.name; }
class HierarchicalInit : public ::testing::TestWithParam<InitCase> {};

TEST_P(HierarchicalInit, ChoosesFromNodesAndSwitch) {
  EMBER_REQUIRE_GLOO();
  const InitCase c = GetParam();
  const std::vector<std::string> keys = keys_for(c.per_node);
  const int n = static_cast<int>(keys.size());
  test::Children kids(n, [&](int rank, const std::string& port) {
    ::setenv("EMBER_NODE_KEY", keys[rank].c_str(), 1);
    ::setenv("EMBER_GLOO_HOSTNAME", "127.0.0.1", 1);
    if (c.switch_on_rank1 && rank == 1) ::setenv("EMBER_GLOO_HIERARCHICAL", c.switch_on_rank1, 1);
    InitOptions o;
    o.backend = "gloo";
    o.store = client("127.0.0.1", std::stoi(port));
    o.rank = rank;
    o.world_size = n;
    o.timeout = 60s;
    auto pg = init_process_group(o);
    const bool hier = dynamic_cast<ProcessGroupHierarchical*>(pg.get()) != nullptr;
    require(hier == c.hierarchical, "rank " + std::to_string(rank) + ": got a " +
                                        (hier ? "hierarchical" : "flat") + " group");
    require(hier || dynamic_cast<ProcessGroupGloo*>(pg.get()) != nullptr, "not a gloo group");
    Tensor t = full({5}, rank + 1.0, kFloat32);
    pg->allreduce(t)->wait();
    require(t[4].item<float>() == n * (n + 1) / 2.0f, "allreduce");
    // Groups made later choose for themselves: the first two ranks are one node.
    auto sub = new_group({0, 1});
    if (rank < 2) {
      require(dynamic_cast<ProcessGroupGloo*>(sub.get()) != nullptr || !c.hierarchical,
              "new_group of one node should be flat");
    }
    destroy_process_group();
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, HierarchicalInit,
    ::testing::Values(InitCase{"TwoByTwo", {2, 2}, nullptr, true},
                      InitCase{"ThreePlusOne", {3, 1}, nullptr, true},
                      InitCase{"SwitchedOffOnOneRank", {2, 2}, "0", false},
                      InitCase{"SwitchedOn", {2, 2}, "1", true},
                      InitCase{"OneNode", {4}, nullptr, false},
                      InitCase{"OneRankPerNode", {1, 1, 1}, nullptr, false}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(HierarchicalInit, BadSwitchIsNamed) {
  EMBER_REQUIRE_GLOO();
  ::setenv("EMBER_GLOO_HIERARCHICAL", "yes", 1);
  InitOptions o;
  o.backend = "gloo";
  o.store = std::make_shared<HashStore>();
  o.rank = 0;
  o.world_size = 2;
  const std::string msg = test::message_of([&] { init_process_group(o); });
  ::unsetenv("EMBER_GLOO_HIERARCHICAL");
  EXPECT_NE(msg.find("EMBER_GLOO_HIERARCHICAL='yes' is not an integer"), std::string::npos)
      << msg;
}

// ---- failures -----------------------------------------------------------------------------------

/// Where the ranks of a test run: the forced layout on loopback, or network namespaces.
struct Placement {
  /// Run first in each child (enter its namespace).
  std::function<void(int rank)> enter = [](int) {};
  /// The address rank's gloo groups listen on.
  std::function<std::string(int rank)> hostname = [](int) { return std::string("127.0.0.1"); };
  /// In the parent once the children are forked: starts what they need (a store server) and
  /// returns it, with the message for go() in *message.
  std::function<std::shared_ptr<void>(std::string* message)> start;
  /// In a child: its store client, given go()'s message.
  std::function<std::shared_ptr<Store>(int rank, const std::string& message)> connect;
};

Placement loopback_placement() {
  Placement p;
  p.start = [](std::string* message) {
    TCPStoreServerOptions so;
    so.host = "127.0.0.1";
    auto server = std::make_shared<TCPStoreServer>(so);
    *message = std::to_string(server->port());
    return std::shared_ptr<void>(server);
  };
  p.connect = [](int, const std::string& port) { return client("127.0.0.1", std::stoi(port)); };
  return p;
}

// Four ranks as two nodes of two; after one good allreduce the victim dies (SIGKILL) while the
// others run a large allreduce. They must fail, well before their own timeout would make them,
// with an error naming the collective, their rank, the step and a peer.
void victim_test(const Placement& where, int victim) {
  constexpr auto kTimeout = 20000ms;
  const int n = 4;
  test::Children kids(n, [&](int rank, const std::string& message) {
    where.enter(rank);
    auto store = where.connect(rank, message);
    ProcessGroupHierarchical::HierarchicalOptions o;
    o.gloo.timeout = kTimeout;
    o.gloo.hostname = where.hostname(rank);
    o.pipeline_bytes = 256 << 10;
    ProcessGroupHierarchical pg(std::make_shared<PrefixStore>("pg", store), rank, n,
                                NodeLayout(keys_for({2, 2})), o);
    Tensor t = full({1 << 20}, 1.0, kFloat32);
    pg.allreduce(t)->wait();
    if (rank == victim) ::kill(::getpid(), SIGKILL);
    const auto start = std::chrono::steady_clock::now();
    std::string msg;
    try {
      pg.allreduce(t)->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    require(!msg.empty(), "rank " + std::to_string(rank) + ": allreduce #1 did not fail");
    const std::string want = "[gloo] allreduce #1 on rank " + std::to_string(rank) + " of 4";
    require(msg.find(want) != std::string::npos, "message lacks '" + want + "': " + msg);
    require(msg.find("failed in the ") != std::string::npos, "message lacks the step: " + msg);
    bool names_a_peer = msg.find("gave up") != std::string::npos;
    for (int k = 0; k < n; ++k) {
      names_a_peer |= msg.find("rank " + std::to_string(k) + " (") != std::string::npos;
    }
    require(names_a_peer, "message names no peer: " + msg);
    require(took < kTimeout / 2,
            "took " +
                std::to_string(
                    std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                " ms: " + msg);
    std::string again;
    try {
      pg.allreduce(t)->wait();
    } catch (const DistError& e) {
      again = e.what();
    }
    require(again.find("unusable after an earlier failure") != std::string::npos,
            "after the failure: " + again);
  });
  std::string message;
  std::shared_ptr<void> held = where.start(&message);
  kids.go(message);
  std::vector<std::string> errors = kids.join(120000);
  ASSERT_FALSE(errors.empty()) << "the victim should have died without a report";
  EXPECT_NE(errors.back().find("child " + std::to_string(victim) + ": died"), std::string::npos)
      << errors.back();
  errors.pop_back();
  test::expect_children_ok(errors);
}

TEST(HierarchicalForcedFailure, KilledMemberFailsTheOthers) {
  EMBER_REQUIRE_GLOO();
  victim_test(loopback_placement(), 3);
}

TEST(HierarchicalForcedFailure, KilledLeaderFailsTheOthers) {
  EMBER_REQUIRE_GLOO();
  victim_test(loopback_placement(), 2);
}

// ProcessGroup::abort on the hierarchical group (a pipeline step that threw): the ranks waiting
// on the aborting rank, in a receive from it or a small allreduce (both over the flat group),
// fail naming it and the reason, under a 60-second timeout they would otherwise wait out; the
// aborting rank stays alive (no exit closes its sockets) until they have.
TEST(HierarchicalForcedFailure, AbortFailsThePeersNamingTheRankAndReason) {
  EMBER_REQUIRE_GLOO();
  const Placement where = loopback_placement();
  const int n = 4;
  test::Children kids(n, [&](int rank, const std::string& message) {
    auto store = where.connect(rank, message);
    ProcessGroupHierarchical::HierarchicalOptions o;
    o.gloo.timeout = 60000ms;
    o.gloo.hostname = where.hostname(rank);
    ProcessGroupHierarchical pg(std::make_shared<PrefixStore>("pg", store), rank, n,
                                NodeLayout(keys_for({2, 2})), o);
    Tensor t = full({1000}, 1.0, kFloat32);
    pg.allreduce(t)->wait();
    if (rank == 3) {
      require(pg.abort("the stage ran out of memory"), "abort() returned false");
      store->wait({"reported0", "reported1", "reported2"}, 120s);
      return;
    }
    std::string msg;
    try {
      if (rank == 2) {
        pg.recv(t, 3)->wait();
      } else {
        pg.allreduce(t)->wait();
      }
    } catch (const DistError& e) {
      msg = e.what();
    }
    store->set("reported" + std::to_string(rank), Bytes{1});
    require(msg.find("rank 3 aborted the group: the stage ran out of memory") != std::string::npos,
            "rank " + std::to_string(rank) + ": " + msg);
  });
  std::string message;
  std::shared_ptr<void> held = where.start(&message);
  kids.go(message);
  test::expect_children_ok(kids.join(120000));
}

// ---- two network namespaces ---------------------------------------------------------------------

class HierarchicalNetns : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gloo_available()) GTEST_SKIP() << "built without gloo (EMBER_WITH_GLOO=OFF)";
    std::string why;
    net_ = emberrun_test::NetnsNodes::create(2, &why);
    if (!net_) GTEST_SKIP() << why;
  }
  void TearDown() override { net_.reset(); }  // kills leftovers, deletes the namespaces

  /// Moves this (child) process into namespace i.
  void enter(int i) const {
    const std::string path = "/var/run/netns/" + net_->ns[i];
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd >= 0 && ::setns(fd, CLONE_NEWNET) == 0, "cannot enter " + path);
    ::close(fd);
  }

  /// Ranks 0..per_node[0]-1 in namespace 0, the others in namespace 1; each runs
  /// init_process_group over tcp:// (rank 0 serves the store in namespace 0), then body.
  void run(const std::vector<int>& per_node, const std::vector<std::string>& env,
           const std::function<void(ProcessGroup&, Store&, int, int)>& body) {
    const int n = per_node[0] + per_node[1];
    test::Children kids(n, [&](int rank, const std::string&) {
      enter(rank < per_node[0] ? 0 : 1);
      for (const std::string& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
      InitOptions o;
      o.backend = "gloo";
      o.init_method = "tcp://" + net_->addr[0] + ":29400";
      o.rank = rank;
      o.world_size = n;
      o.timeout = 60s;
      auto pg = init_process_group(o);
      body(*pg, *default_store(), rank, n);
      pg->barrier()->wait();  // rank 0 serves the store: it leaves after every rank is done
      destroy_process_group();
    });
    kids.go("");
    test::expect_children_ok(kids.join());
  }

  std::unique_ptr<emberrun_test::NetnsNodes> net_;
};

void require_hierarchical(ProcessGroup& pg, int rank, bool want) {
  auto* h = dynamic_cast<ProcessGroupHierarchical*>(&pg);
  require((h != nullptr) == want, "rank " + std::to_string(rank) + ": got a " +
                                      (h ? "hierarchical" : "flat") + " group");
  if (h) {
    require(h->layout().nodes() == 2, h->layout().describe());
    require(h->local_uses_shared_memory() == (h->layout().members(h->node()).size() > 1),
            "rank " + std::to_string(rank) + ": the local group is not on shared memory");
  }
}

TEST_F(HierarchicalNetns, TwoNodesOfTwoRanks) {
  run({2, 2}, {}, [](ProcessGroup& pg, Store& store, int rank, int n) {
    require_hierarchical(pg, rank, true);
    check_allreduce(pg, store, rank, n);
    check_others(pg, rank, n);
  });
}

TEST_F(HierarchicalNetns, UnevenThreePlusOne) {
  run({3, 1}, {}, [](ProcessGroup& pg, Store& store, int rank, int n) {
    require_hierarchical(pg, rank, true);
    check_allreduce(pg, store, rank, n);
  });
}

TEST_F(HierarchicalNetns, SwitchedOffGivesTheFlatRing) {
  run({2, 2}, {"EMBER_GLOO_HIERARCHICAL=0"}, [](ProcessGroup& pg, Store&, int rank, int n) {
    require_hierarchical(pg, rank, false);
    Tensor t = full({1001}, rank + 1.0, kFloat32);
    pg.allreduce(t)->wait();
    require(t[1000].item<float>() == n * (n + 1) / 2.0f, "allreduce");
  });
}

TEST_F(HierarchicalNetns, KilledRankFailsTheOthers) {
  Placement p;
  p.enter = [this](int rank) { enter(rank / 2); };
  p.hostname = [this](int rank) { return net_->addr[rank / 2]; };
  p.start = [](std::string* message) {
    *message = "";
    return std::shared_ptr<void>();
  };
  p.connect = [this](int rank, const std::string&) -> std::shared_ptr<Store> {
    TCPStoreOptions o;
    o.is_server = rank == 0;
    o.world_size = 4;
    o.timeout = 60s;
    return std::make_shared<TCPStore>(net_->addr[0], 29401, o);
  };
  victim_test(p, 3);
}

}  // namespace
}  // namespace ember::dist
