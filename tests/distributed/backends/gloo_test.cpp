// ProcessGroupGloo: real multi-process groups on 127.0.0.1 (world sizes 1-4), every collective,
// dtype and reduce op against closed-form values; async Work/Future; argument errors; a rank
// that dies or stalls mid-collective.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>
#include <sys/mman.h>
#include <fcntl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

#include "tests/distributed/backends/allreduce_closed_forms.h"
#include "tests/distributed/backends/collective_options.h"
#include "tests/distributed/backends/composite_group.h"
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/shareable.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include "tests/distributed/backends/p2p_checks.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/nn/nn.h>
#include <ember/tensor/gpu/cuda.h>

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;

using test::ar;
using test::bc;
using test::rd;
using test::ga;
using test::sc;
using test::rs;
std::shared_ptr<TCPStore> client(const std::string& port) {
  TCPStoreOptions o;
  o.timeout = std::chrono::seconds(60);
  return std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), o);
}
TCPStoreServerOptions loopback_server() {
  TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  return o;
}

const Dtype kDtypes[] = {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8};

Tensor make(const std::vector<double>& v, Dtype d) {
  if (v.empty()) return empty({0}, d);
  return from_vector(v).to(d);
}

std::vector<double> values(const Tensor& t) {
  if (t.numel() == 0) return {};
  return t.to(kFloat64).reshape({-1}).to_vector<double>();
}

// Throws (in a child) naming the case, the first differing index and both values.
void require_values(const std::string& what, const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = values(got);
  require(g.size() == want.size(), what + ": got " + std::to_string(g.size()) + " elements, want " +
                                       std::to_string(want.size()));
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::fabs(g[i] - want[i]) > 1e-6 * (1 + std::fabs(want[i]))) {
      throw std::runtime_error(what + ": index " + std::to_string(i) + " got " +
                               std::to_string(g[i]) + " want " + std::to_string(want[i]));
    }
  }
}

std::string name(const char* op, Dtype d, int rank, const std::string& extra = "") {
  return ember::detail::str_cat(op, " ", d, " on rank ", rank, extra);
}

/// Runs body(pg, rank, store) in n forked ranks connected through a TCPStoreServer on an
/// OS-picked port in this process; every rank's failures are reported here.
/// `shm`: GlooOptions::shared_memory; the group must then use it (every rank is local).
void run_group(int n, const std::function<void(ProcessGroupGloo&, int, Store&)>& body,
               Duration timeout = 60s, bool shm = true);

/// A group that has only what every backend must provide (allreduce, broadcast,
/// allgather_into_tensor, barrier, send, recv: gloo's), so reduce, allgather, gather, scatter,
/// reduce_scatter and alltoall run ProcessGroup's composite versions built from them.
class CompositeOnly final : public test::CompositeGroup {
 public:
  explicit CompositeOnly(ProcessGroup& inner) : CompositeGroup(inner) {}
  std::string backend_name() const override { return "composite"; }
};

/// What a collective test checks, given any group: gloo's own, or CompositeOnly over it.
using Checks = std::function<void(ProcessGroup&, int rank, int n)>;
/// World size, whether through CompositeOnly, and whether the group uses shared memory (every
/// collective over shared memory, Note [shared-memory collectives]) or Gloo's TCP.
struct WorldCase {
  int n;
  bool composite;
  bool shm = true;
};
std::string case_name(const ::testing::TestParamInfo<WorldCase>& info) {
  const WorldCase& c = info.param;
  return "n" + std::to_string(c.n) + (c.composite ? "_composite" : "") +
         (c.n == 1 ? "" : c.shm ? "_shm" : "_tcp");
}
void run_checks(const WorldCase& c, const Checks& checks) {
  run_group(c.n, [&](ProcessGroupGloo& pg, int rank, Store&) {
    if (c.composite) {
      CompositeOnly composite(pg);
      checks(composite, rank, c.n);
    } else {
      checks(pg, rank, c.n);
    }
  }, 60s, c.shm);
}

void run_group(int n, const std::function<void(ProcessGroupGloo&, int, Store&)>& body,
               Duration timeout, bool shm) {
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    ProcessGroupGloo::GlooOptions o{timeout, "127.0.0.1"};
    o.shared_memory = shm;
    ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, n, o);
    require(pg.uses_shared_memory() == (shm && n > 1),
            "rank " + std::to_string(rank) + ": uses_shared_memory() is " +
                (pg.uses_shared_memory() ? "true" : "false"));
    body(pg, rank, *store);
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

// ---- closed forms: rank r's allreduce input at index i is r + 1 + i % 2 ----------------------

using test::expected;
using test::input;

/// World size, and whether allreduce goes through shared memory or Gloo's TCP paths.
struct GlooCase {
  int n;
  bool shm;
};
void PrintTo(const GlooCase& c, std::ostream* os) {
  *os << c.n << (c.n == 1 ? " rank" : " ranks, ") << (c.n == 1 ? "" : c.shm ? "shared memory" : "tcp");
}
class GlooWorld : public ::testing::TestWithParam<GlooCase> {};

TEST_P(GlooWorld, AllreduceEveryDtypeOpAndSize) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    require(pg.backend_name() == "gloo" && pg.rank() == rank && pg.size() == n, "identity");
    for (Dtype d : kDtypes) {
      for (ReduceOp op :
           {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max}) {
        // 70000 elements exceed the small-message path (Note [small allreduce]) for every dtype;
        // 300001 span several shared-memory chunks for the wider dtypes.
        for (int64_t len : {0, 5, 1003, 70000, 300001}) {
          std::vector<double> in(len), want(len);
          for (int64_t i = 0; i < len; ++i) {
            in[i] = input(rank, i);
            want[i] = expected(op, n, i, d);
          }
          Tensor t = make(in, d);
          WorkPtr w = pg.allreduce(t, ar(op));
          require(w->wait(), "wait");
          require_values(
              name("allreduce", d, rank, ember::detail::str_cat(" op ", to_string(op), " len ", len)), t,
              want);
        }
      }
    }
  }, 60s, shm);
}

// allreduce_coalesced: tensors of several shapes (an empty one among them) reduced as one
// buffer, over shared memory in place and over TCP packed, and through ProcessGroup's default
// (CompositeOnly); the element at position i of the concatenation follows the closed form.
TEST_P(GlooWorld, AllreduceCoalescedEveryDtype) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n, shm](ProcessGroupGloo& pg, int rank, Store&) {
    require(pg.coalesced_without_copies(kCPU) == (shm && n > 1), "coalesced_without_copies()");
    CompositeOnly composite(pg);
    for (ProcessGroup* g : {static_cast<ProcessGroup*>(&pg), static_cast<ProcessGroup*>(&composite)}) {
      for (Dtype d : {kFloat32, kBFloat16, kInt64}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
          const std::vector<Shape> shapes = {{3, 4}, {0}, {7}, {300001}, {2, 5}};
          std::vector<Tensor> ts;
          std::vector<std::vector<double>> want;
          int64_t at = 0;
          for (const Shape& s : shapes) {
            int64_t k = 1;
            for (int64_t x : s) k *= x;
            std::vector<double> in(k), w(k);
            for (int64_t i = 0; i < k; ++i) {
              in[i] = input(rank, at + i);
              w[i] = expected(op, n, at + i, d);
            }
            at += k;
            ts.push_back(k == 0 ? empty(s, d) : make(in, d).view(s));
            want.push_back(w);
          }
          std::vector<void*> where;
          for (const Tensor& t : ts) where.push_back(t.data_ptr());
          g->allreduce_coalesced(ts, ar(op))->wait();
          for (size_t j = 0; j < ts.size(); ++j) {
            require(ts[j].data_ptr() == where[j], "tensor " + std::to_string(j) + " moved");
            require_values(name("allreduce_coalesced", d, rank,
                                ember::detail::str_cat(" on ", g->backend_name(), " op ",
                                                       to_string(op), " tensor ", j)),
                           ts[j], want[j]);
          }
        }
      }
    }
    // Errors name the op and what differs (before anything is issued: no rank waits).
    auto error_of = [&](std::vector<Tensor> list) {
      try {
        pg.allreduce_coalesced(list);
      } catch (const ValueError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const std::string none = error_of({});
    require(none.find("[gloo] allreduce_coalesced expects at least one tensor") !=
                std::string::npos, "empty list: " + none);
    const std::string mixed = error_of({zeros({2}, kFloat32), zeros({2}, kInt64)});
    require(mixed.find("one dtype and device") != std::string::npos &&
                mixed.find("tensors[1] is int64") != std::string::npos, "mixed dtypes: " + mixed);
    const std::string undefined = error_of({zeros({2}, kFloat32), Tensor()});
    require(undefined.find("allreduce_coalesced: tensors[1] is undefined") != std::string::npos,
            "undefined tensor: " + undefined);
  }, 60s, shm);
}

class GlooCollectives : public ::testing::TestWithParam<WorldCase> {};

TEST_P(GlooCollectives, BroadcastAllgatherReduceEveryDtype) {
  EMBER_REQUIRE_GLOO();
  run_checks(GetParam(), [](ProcessGroup& pg, int rank, int n) {
    for (Dtype d : kDtypes) {
      // broadcast from the last rank: rank r holds r*10 + i%7.
      for (int root : {0, n - 1}) {
        std::vector<double> in(1003), want(1003);
        for (int i = 0; i < 1003; ++i) {
          in[i] = rank * 10 + i % 7;
          want[i] = root * 10 + i % 7;
        }
        Tensor t = make(in, d);
        pg.broadcast(t, bc(root))->wait();
        require_values(name("broadcast", d, rank, " root " + std::to_string(root)), t, want);
      }
      // allgather_into_tensor: rank r contributes input(r, i), 5 elements.
      {
        std::vector<double> in(5), want;
        for (int i = 0; i < 5; ++i) in[i] = input(rank, i);
        for (int r = 0; r < n; ++r) {
          for (int i = 0; i < 5; ++i) want.push_back(input(r, i));
        }
        Tensor out = empty({n * 5}, d);
        Tensor in_t = make(in, d);
        pg.allgather_into_tensor(out, in_t)->wait();
        require_values(name("allgather_into_tensor", d, rank), out, want);
      }
      // allgather (list form), shape [2, 3].
      {
        std::vector<Tensor> outs;
        for (int r = 0; r < n; ++r) outs.push_back(empty({2, 3}, d));
        Tensor in = full({2, 3}, rank + 3, d);
        pg.allgather(outs, in)->wait();
        for (int r = 0; r < n; ++r) {
          require_values(name("allgather", d, rank, " output " + std::to_string(r)), outs[r],
                         std::vector<double>(6, r + 3));
        }
      }
      // reduce (sum and max) to root n-1.
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
        std::vector<double> in(7), want(7);
        for (int i = 0; i < 7; ++i) {
          in[i] = input(rank, i);
          want[i] = expected(op, n, i, d);
        }
        Tensor t = make(in, d);
        pg.reduce(t, rd(n - 1, op))->wait();
        if (rank == n - 1) {
          require_values(name("reduce", d, rank, std::string(" op ") + to_string(op)), t, want);
        }
      }
    }
  });
}

TEST_P(GlooCollectives, GatherScatterReduceScatterAlltoallEveryDtype) {
  EMBER_REQUIRE_GLOO();
  run_checks(GetParam(), [](ProcessGroup& pg, int rank, int n) {
    for (Dtype d : kDtypes) {
      // gather to root n-1: rank r sends [r, r+1, r+2].
      {
        std::vector<Tensor> outs;
        if (rank == n - 1) {
          for (int r = 0; r < n; ++r) outs.push_back(empty({3}, d));
        }
        Tensor in = make({double(rank), rank + 1.0, rank + 2.0}, d);
        pg.gather(outs, in, ga(n - 1))->wait();
        for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
          require_values(name("gather", d, rank, " from " + std::to_string(r)), outs[r],
                         {double(r), r + 1.0, r + 2.0});
        }
      }
      // scatter from root 0: inputs[r] = [3r, 3r+1].
      {
        std::vector<Tensor> ins;
        if (rank == 0) {
          for (int r = 0; r < n; ++r) ins.push_back(make({3.0 * r, 3.0 * r + 1}, d));
        }
        Tensor out = empty({2}, d);
        pg.scatter(out, ins, sc(0))->wait();
        require_values(name("scatter", d, rank), out, {3.0 * rank, 3.0 * rank + 1});
      }
      // reduce_scatter (sum): rank r's inputs[j][i] = r + j + i%2; rank me gets
      // sum_r (r + me + i%2) = n(n-1)/2 + n*(me + i%2).
      {
        std::vector<Tensor> ins;
        for (int j = 0; j < n; ++j) {
          std::vector<double> v(5);
          for (int i = 0; i < 5; ++i) v[i] = rank + j + i % 2;
          ins.push_back(make(v, d));
        }
        Tensor out = empty({5}, d);
        pg.reduce_scatter(out, ins)->wait();
        std::vector<double> want(5);
        for (int i = 0; i < 5; ++i) want[i] = n * (n - 1) / 2.0 + n * (rank + i % 2);
        require_values(name("reduce_scatter", d, rank), out, want);
        // reduce_scatter_tensor: the same blocks concatenated, as a [n * 5] tensor.
        Tensor out_t = empty({5}, d);
        Tensor in_t = cat(ins, 0);
        pg.reduce_scatter_tensor(out_t, in_t)->wait();
        require_values(name("reduce_scatter_tensor", d, rank), out_t, want);
      }
      // alltoall: rank r's inputs[j][i] = 10r + j + i; rank me's outputs[j][i] = 10j + me + i.
      {
        std::vector<Tensor> ins, outs;
        for (int j = 0; j < n; ++j) {
          ins.push_back(make({10.0 * rank + j, 10.0 * rank + j + 1, 10.0 * rank + j + 2}, d));
          outs.push_back(empty({3}, d));
        }
        pg.alltoall(outs, ins)->wait();
        for (int j = 0; j < n; ++j) {
          require_values(name("alltoall", d, rank, " from " + std::to_string(j)), outs[j],
                         {10.0 * j + rank, 10.0 * j + rank + 1, 10.0 * j + rank + 2});
        }
      }
    }
    pg.barrier()->wait();
  });
}

// batch_isend_irecv in both directions around the ring, and shapes the receiver learns.
TEST_P(GlooWorld, BatchIsendIrecvAndLearnedShapes) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  if (n == 1) GTEST_SKIP() << "send/recv needs a peer";
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) { test::check_batch_p2p(pg, rank, n); },
            60s, GetParam().shm);
}

// A receiver that takes a later send first (waiting for it before it calls the earlier one's
// recv) gets both: one rank's sends do not wait behind each other (Note [send and receive
// threads]); two sends on one tag still arrive in order.
TEST(GlooTcp, SendsCompleteOutOfOrderButInOrderPerTag) {
  EMBER_REQUIRE_GLOO();
  for (bool shm : {false, true}) {
    run_group(2, [](ProcessGroupGloo& pg, int rank, Store&) {
      if (rank == 0) {
        std::vector<WorkPtr> w = {pg.send(full({3}, 1.0), 1, 1), pg.send(full({4}, 2.0), 1, 2),
                                  pg.send(full({2}, 3.0), 1, 5), pg.send(full({2}, 4.0), 1, 5)};
        for (auto& x : w) x->wait();
      } else {
        Tensor b = zeros({4}), a = zeros({3}), c = zeros({2}), d = zeros({2});
        pg.recv(b, 0, 2)->wait();
        pg.recv(a, 0, 1)->wait();
        pg.recv(c, 0, 5)->wait();
        pg.recv(d, 0, 5)->wait();
        require_values("tag 2 first", b, std::vector<double>(4, 2.0));
        require_values("then tag 1", a, std::vector<double>(3, 1.0));
        require_values("tag 5 in order", c, std::vector<double>(2, 3.0));
        require_values("tag 5 in order, second", d, std::vector<double>(2, 4.0));
      }
    }, 20s, shm);
  }
}

// Ranks that send and receive different numbers of times (a pipeline's middle stage twice its
// ends') still meet at their next collectives, over TCP and shared memory: sends and receives
// are numbered apart from the collectives, whose numbers Gloo's TCP collectives use as tags
// (each send once took one, so the collectives that followed waited on different tags until
// they timed out). The flight recorder marks them p2p, numbered on their own.
TEST(GlooTcp, UnevenSendsAndReceivesKeepTheCollectivesMatched) {
  EMBER_REQUIRE_GLOO();
  for (bool shm : {false, true}) {
    run_group(
        3,
        [](ProcessGroupGloo& pg, int rank, Store&) {
          Tensor t = full({4}, 1.0);
          if (rank == 0) pg.send(t, 1)->wait();
          if (rank == 1) pg.recv(t, 0)->wait();
          for (int i = 0; i < 2; ++i) {
            Tensor x = full({8}, 1.0);
            pg.allreduce(x)->wait();
            require_values("allreduce " + std::to_string(i) + " after the send", x,
                           std::vector<double>(8, 3.0));
            pg.barrier()->wait();
          }
          // Their labels: this rank's sends and receives so far, whatever the collectives.
          if (rank == 1) {
            Tensor y = zeros({4});
            WorkPtr w = pg.recv(y, 2, 9);
            require(w->describe().find("[gloo] recv #1 on rank 1 of 3 from rank 2 tag 9") !=
                        std::string::npos,
                    w->describe());
            w->wait();
          }
          if (rank == 2) {
            WorkPtr w = pg.send(t, 1, 9);
            require(w->describe().find("[gloo] send #0 on rank 2 of 3 to rank 1 tag 9") !=
                        std::string::npos,
                    w->describe());
            w->wait();
          }
        },
        20s, shm);
  }
}

TEST_P(GlooWorld, SendRecvRingEveryDtype) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  if (n == 1) GTEST_SKIP() << "send/recv needs a peer";
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    for (Dtype d : kDtypes) {
      std::vector<double> v(7), want(7);
      for (int i = 0; i < 7; ++i) {
        v[i] = rank * 10 + i;
        want[i] = prev * 10 + i;
      }
      Tensor out = make(v, d);
      Tensor in = empty({7}, d);
      // Both posted before either is waited on: no rank orders them, so no deadlock.
      WorkPtr s = pg.send(out, next, /*tag=*/3);
      WorkPtr r = pg.recv(in, prev, /*tag=*/3);
      r->wait();
      s->wait();
      require_values(name("recv", d, rank), in, want);
    }
    // Two messages on different tags, received in the opposite order.
    if (n == 2) {
      Tensor a = full({4}, rank + 1.0, kFloat32), b = full({4}, rank + 5.0, kFloat32);
      Tensor ra = empty({4}, kFloat32), rb = empty({4}, kFloat32);
      WorkPtr s1 = pg.send(a, next, 1), s2 = pg.send(b, next, 2);
      WorkPtr r2 = pg.recv(rb, prev, 2), r1 = pg.recv(ra, prev, 1);
      for (auto& w : {s1, s2, r2, r1}) w->wait();
      require_values("tagged recv 1", ra, std::vector<double>(4, prev + 1.0));
      require_values("tagged recv 2", rb, std::vector<double>(4, prev + 5.0));
    }
  }, 60s, shm);
}

TEST_P(GlooWorld, AsyncWorkAndFutures) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const uint64_t seq0 = pg.sequence_number();
    std::vector<Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 16; ++k) ts.push_back(full({1000}, rank + k, kFloat32));
    for (int k = 0; k < 16; ++k) works.push_back(pg.allreduce(ts[k]));
    require(pg.sequence_number() == seq0 + 16, "sequence numbers count collectives");
    require(works[5]->describe() ==
                ember::detail::str_cat("[gloo] allreduce #", seq0 + 5, " on rank ", rank, " of ", n),
            "describe(): " + works[5]->describe());
    // A then() chain on the last one: doubles the result.
    auto doubled = works.back()->future()->then(
        [](Future& f) { return std::vector<Tensor>{f.value()[0].mul(full({1}, 2.0, kFloat32))}; });
    for (int k = 15; k >= 0; --k) {
      works[k]->wait();
      require(works[k]->is_completed() && works[k]->is_success() && !works[k]->exception(),
              "completed");
      require_values("async allreduce " + std::to_string(k), ts[k],
                     std::vector<double>(1000, n * (n - 1) / 2.0 + n * k));
      require(works[k]->result().size() == 1, "result holds the tensor");
    }
    doubled->wait(10s);
    require_values("then()", doubled->value()[0],
                   std::vector<double>(1000, 2 * (n * (n - 1) / 2.0 + n * 15)));
    // Per-call timeout is accepted and used as the Work's timeout.
    Tensor t = full({3}, 1.0, kFloat64);
    WorkPtr w = pg.allreduce(t, AllreduceOptions{ReduceOp::Sum, 20s});
    require(w->timeout() == 20s, "per-call timeout");
    w->wait();
    require_values("timed allreduce", t, std::vector<double>(3, n));
    pg.barrier(CollectiveOptions{5s})->wait();
  }, 60s, shm);
}

// Collectives of every path (direct exchange, Gloo's ring, broadcast, allgather) in flight at
// once on the group's two worker threads, waited for in reverse order: each ends with its own
// closed-form values (each runs under its own tag, so concurrent ones never mix).
TEST_P(GlooWorld, MixedCollectivesInFlight) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const std::vector<int64_t> sizes = {1000, 300000, 50, int64_t{1} << 20, 20000};
    std::vector<Tensor> ts;
    std::vector<WorkPtr> works;
    for (size_t k = 0; k < sizes.size(); ++k) {
      ts.push_back(full({sizes[k]}, rank + 1.0 + k, kFloat32));
      works.push_back(pg.allreduce(ts.back()));
    }
    Tensor b = full({100000}, rank == n - 1 ? 7.0 : 0.0, kFloat32);
    works.push_back(pg.broadcast(b, bc(n - 1)));
    Tensor mine = full({3000}, double(rank), kFloat32);
    Tensor all = empty({n * 3000}, kFloat32);
    works.push_back(pg.allgather_into_tensor(all, mine));
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    for (size_t k = 0; k < sizes.size(); ++k) {
      require_values("allreduce of " + std::to_string(sizes[k]), ts[k],
                     std::vector<double>(sizes[k], n * (n + 1) / 2.0 + n * double(k)));
    }
    require_values("broadcast", b, std::vector<double>(100000, 7.0));
    std::vector<double> want;
    for (int r = 0; r < n; ++r) want.insert(want.end(), 3000, double(r));
    require_values("allgather_into_tensor", all, want);
  }, 60s, shm);
}

// Note [barrier and two workers]: a barrier completes only after every collective issued before
// it on this rank (they may still run on the other worker thread when the barrier is issued).
TEST_P(GlooWorld, BarrierWaitsForEarlierCollectives) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    std::vector<Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 4; ++k) {
      ts.push_back(full({int64_t{1} << 21}, rank + 1.0, kFloat32));  // 8 MiB: Gloo's ring
      works.push_back(pg.allreduce(ts.back()));
    }
    pg.barrier()->wait();
    for (int k = 0; k < 4; ++k) {
      require(works[k]->is_completed(),
              "allreduce " + std::to_string(k) + " still running after the barrier");
      require(works[k]->is_success(), "allreduce " + std::to_string(k) + " failed");
    }
    require_values("allreduce before the barrier", ts[3],
                   std::vector<double>(int64_t{1} << 21, n * (n + 1) / 2.0));
  }, 60s, shm);
}

TEST(GlooErrors, ThreadsMustBePositive) {
  EMBER_REQUIRE_GLOO();
  ProcessGroupGloo::GlooOptions o{5s, "127.0.0.1"};
  o.threads = 0;
  test::expect_error([&] { ProcessGroupGloo(nullptr, 0, 1, o); },
                     {"[gloo]", "threads must be at least 1", "got 0"});
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooWorld,
                         ::testing::Values(GlooCase{1, true}, GlooCase{2, true}, GlooCase{3, true},
                                           GlooCase{4, true}, GlooCase{2, false},
                                           GlooCase{3, false}, GlooCase{4, false}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.n) +
                                  (info.param.n == 1 ? "" : info.param.shm ? "_shm" : "_tcp");
                         });
// Each collective through gloo's native implementation, and through ProcessGroup's composites
// (what a backend without a native version gets).
INSTANTIATE_TEST_SUITE_P(
    WorldSizes, GlooCollectives,
    ::testing::Values(WorldCase{1, false}, WorldCase{2, false, true}, WorldCase{3, false, true},
                      WorldCase{4, false, true}, WorldCase{2, false, false},
                      WorldCase{3, false, false}, WorldCase{4, false, false}, WorldCase{1, true},
                      WorldCase{2, true, true}, WorldCase{3, true, true}, WorldCase{4, true, true},
                      WorldCase{2, true, false}, WorldCase{3, true, false},
                      WorldCase{4, true, false}),
    case_name);

// ---- argument errors (world size 1: no network) ------------------------------------------------

std::shared_ptr<ProcessGroupGloo> solo() {
  return std::make_shared<ProcessGroupGloo>(nullptr, 0, 1,
                                            ProcessGroupGloo::GlooOptions{5s, "127.0.0.1"});
}

// Note [CUDA tensors over gloo]: allreduce, broadcast and allgather_into_tensor stage CUDA
// tensors through host memory, so ranks sharing one GPU can run DDP over gloo.
TEST_P(GlooWorld, CudaTensorsAreStagedThroughHostMemory) {
  EMBER_REQUIRE_GLOO();
  const std::string no_cuda = test::cuda_unusable_in_children();
  if (!no_cuda.empty()) GTEST_SKIP() << "no CUDA device in a child process: " << no_cuda;
  const int n = GetParam().n;
  const bool shm = GetParam().shm;
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    const Device gpu("cuda");
    for (Dtype d : {kFloat32, kFloat64, kFloat16, kInt64}) {
      std::vector<double> in(9), want(9);
      for (int i = 0; i < 9; ++i) {
        in[i] = input(rank, i);
        want[i] = expected(ReduceOp::Sum, n, i, d);
      }
      Tensor t = make(in, d).to(gpu);
      pg.allreduce(t)->wait();
      require(t.is_cuda(), "allreduce result stays on the GPU");
      require_values(name("cuda allreduce", d, rank), t.to(kCPU), want);
      Tensor b = full({5}, rank + 1.0, d).to(gpu);
      pg.broadcast(b, bc(n - 1))->wait();
      require_values(name("cuda broadcast", d, rank), b.to(kCPU), std::vector<double>(5, n));
      Tensor out = empty({n * 2}, d).to(gpu);
      Tensor mine = full({2}, double(rank), d).to(gpu);
      pg.allgather_into_tensor(out, mine)->wait();
      std::vector<double> all;
      for (int r = 0; r < n; ++r) all.insert(all.end(), {double(r), double(r)});
      require_values(name("cuda allgather_into_tensor", d, rank), out.to(kCPU), all);
    }
    // DDP on CUDA parameters over gloo: every rank ends with the average gradient.
    auto model = std::make_shared<nn::Linear>(3, 2);
    model->to(gpu);
    auto shared = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
    dist::DistributedDataParallel ddp(model, shared);
    Tensor x = full({4, 3}, rank + 1.0, kFloat32).to(gpu);
    ddp.forward(x).sum().backward();
    // d(sum(W x + b))/dW[j][k] = sum over the batch of x[k] = 4 (rank + 1); averaged: 2 (n + 1).
    require_values(name("cuda ddp weight grad", kFloat32, rank), model->weight.grad().to(kCPU),
                   std::vector<double>(6, 2.0 * (n + 1)));
    require_values(name("cuda ddp bias grad", kFloat32, rank), model->bias.grad().to(kCPU),
                   std::vector<double>(2, 4.0));
  }, 60s, shm);
}

TEST(GlooErrors, BadArgumentsNameTheOpAndValues) {
  EMBER_REQUIRE_GLOO();
  auto pg = solo();
  Tensor nc = zeros({4, 3}, kFloat32).t();
  test::expect_error([&] { pg->allreduce(nc); }, {"[gloo] allreduce", "non-contiguous", "[3, 4]"});
  Tensor b = zeros({3}, kBool);
  test::expect_error<TypeError>([&] { pg->allreduce(b); }, {"[gloo] allreduce", "bool"});
  Tensor t = zeros({3}, kFloat32);
  test::expect_error([&] { pg->broadcast(t, bc(1)); }, {"[gloo] broadcast", "root 1", "size 1"});
  test::expect_error([&] { pg->send(t, 0); }, {"[gloo] send", "dst 0", "rank 0"});
  test::expect_error([&] { pg->recv(t, 2); }, {"[gloo] recv", "src 2"});
  Tensor out = zeros({5}, kFloat32);
  test::expect_error([&] { pg->allgather_into_tensor(out, t); },
                     {"[gloo] allgather_into_tensor", "1 x 3", "got 5"});
  std::vector<Tensor> outs{zeros({3}, kFloat32), zeros({3}, kFloat32)};
  test::expect_error([&] { pg->gather(outs, t); }, {"[gloo] gather", "expected 1", "got 2"});
  test::expect_error([&] { ProcessGroupGloo(nullptr, 0, 2); }, {"[gloo]", "store", "2 ranks"});
  test::expect_error([&] { ProcessGroupGloo(nullptr, 2, 2); }, {"rank 2", "size 2"});
}

TEST(GlooErrors, WorldSizeOneCompletesInline) {
  EMBER_REQUIRE_GLOO();
  auto pg = solo();
  Tensor t = full({4}, 3.0, kInt64);
  WorkPtr w = pg->allreduce(t, ar(ReduceOp::Avg));
  EXPECT_TRUE(w->is_completed());
  test::expect_close(t, {3, 3, 3, 3}, 0, "avg over one rank");
  EXPECT_TRUE(pg->barrier()->is_completed());
}

TEST(GlooErrors, RendezvousTimesOutWhenAPeerNeverJoins) {
  EMBER_REQUIRE_GLOO();
  const auto start = std::chrono::steady_clock::now();
  test::expect_error<DistTimeoutError>(
      [] {
        ProcessGroupGloo(std::make_shared<HashStore>(), 0, 2,
                         ProcessGroupGloo::GlooOptions{500ms, "127.0.0.1"});
      },
      {"[gloo] rank 0 of 2", "not every peer joined within 500 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(GlooStub, ThrowsWhenBuiltWithoutGloo) {
  if (ProcessGroupGloo::is_available()) GTEST_SKIP() << "this build has gloo";
  test::expect_error<NotImplementedError>([] { ProcessGroupGloo(nullptr, 0, 1); },
                                          {"gloo is not available", "EMBER_WITH_GLOO=OFF"});
}

// ---- failures: a rank dies or stalls mid-collective
// ------------------------------------------------

// Ranks 0..n-2 run allreduce #0 with the victim, then #1, which the victim never joins: it is
// killed (SIGKILL) or stalls. The others must fail within the timeout with an error naming the
// backend, the collective, its sequence number, their rank and the timeout.
// Over shared memory a killed victim is noticed by its exit (its pid), not by a closed socket.
void victim_test(int n, bool kill_victim, bool shm) {
  constexpr auto kTimeout = 3000ms;
  const int victim = n - 1;
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    ProcessGroupGloo::GlooOptions o{kTimeout, "127.0.0.1"};
    o.shared_memory = shm;
    ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, n, o);
    require(pg.uses_shared_memory() == shm, "uses_shared_memory()");
    Tensor t = full({1 << 16}, 1.0, kFloat32);
    pg.allreduce(t)->wait();
    if (rank == victim) {
      if (kill_victim) ::kill(::getpid(), SIGKILL);
      // Stall: wait for every survivor to have seen its error, then leave quietly.
      for (int r = 0; r < n - 1; ++r) store->get("seen_" + std::to_string(r), 60s);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    WorkPtr w = pg.allreduce(t);
    std::string msg;
    try {
      w->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    store->set("seen_" + std::to_string(rank), std::string("1"));
    require(!msg.empty(), "rank " + std::to_string(rank) + ": allreduce #1 did not fail");
    const std::string want =
        "[gloo] allreduce #1 on rank " + std::to_string(rank) + " of " + std::to_string(n);
    require(msg.find(want) != std::string::npos, "message lacks '" + want + "': " + msg);
    require(msg.find("3000 ms") != std::string::npos, "message lacks the timeout: " + msg);
    if (shm && kill_victim) {
      // Named by this rank, or by a survivor that saw it first and made the group give up.
      const std::string named = "rank " + std::to_string(victim) + " (pid ";
      require(msg.find(named) != std::string::npos || msg.find("gave up") != std::string::npos,
              "message names neither the dead rank nor the survivor that gave up: " + msg);
    } else if (kill_victim) {
      // Over TCP Gloo names the peer by its socket's address; the error names its rank (the
      // victim, or with more ranks possibly a survivor that gave up first and closed its
      // connections).
      bool named = false;
      for (int k = 0; k < n; ++k) {
        const bool may_close = k == victim || n > 2;
        named |= k != rank && may_close &&
                 msg.find("rank " + std::to_string(k) + " closed the connection") !=
                     std::string::npos &&
                 msg.find("rank " + std::to_string(k) + " (") != std::string::npos;
      }
      require(named, "message does not name the rank that closed the connection: " + msg);
    } else if (shm) {
      require(msg.find("shared-memory allreduce") != std::string::npos ||
                  msg.find("gave up") != std::string::npos,
              "message lacks what was awaited: " + msg);
    }
    require(
        took < kTimeout + 2s,
        "took " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
            " ms");
    require(w->is_completed() && !w->is_success() && w->exception(), "Work records the error");
    // The group is unusable afterwards, and says so.
    std::string again;
    try {
      pg.barrier()->wait();
    } catch (const DistError& e) {
      again = e.what();
    }
    require(again.find("[gloo] barrier #2") != std::string::npos, "after failure: " + again);
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  std::vector<std::string> errors = kids.join(120000);
  if (kill_victim) {
    ASSERT_FALSE(errors.empty()) << "the victim should have died without a report";
    EXPECT_NE(errors.back().find("child " + std::to_string(victim) + ": died"), std::string::npos)
        << errors.back();
    errors.pop_back();
  }
  test::expect_children_ok(errors);
}

// n ranks; the victim is killed or stalls; over shared memory or TCP.
struct VictimCase {
  int n;
  bool kill;
  bool shm;
};
void PrintTo(const VictimCase& c, std::ostream* os) {
  *os << c.n << " ranks, victim " << (c.kill ? "killed" : "stalls") << ", "
      << (c.shm ? "shared memory" : "tcp");
}
class GlooFailure : public ::testing::TestWithParam<VictimCase> {};
TEST_P(GlooFailure, PeersFailNamingTheCollective) {
  EMBER_REQUIRE_GLOO();
  victim_test(GetParam().n, GetParam().kill, GetParam().shm);
}
INSTANTIATE_TEST_SUITE_P(
    Victims, GlooFailure,
    ::testing::Values(VictimCase{2, true, true}, VictimCase{4, true, true},
                      VictimCase{3, false, true}, VictimCase{2, true, false},
                      VictimCase{4, true, false}, VictimCase{3, false, false}),
    [](const auto& info) {
      const VictimCase& c = info.param;
      return std::string(c.kill ? "Killed" : "Stalled") + "RankOf" + std::to_string(c.n) +
             (c.shm ? "_shm" : "_tcp");
    });

// ---- ranks that disagree over TCP (Note [ranks that disagree over TCP]) -------------------------

// Each rank's tensor for one allreduce: rank 0 and rank 1 pass different sizes or dtypes. Over
// TCP a peer's message longer than this rank's receive used to fail an enforcement on Gloo's
// event-loop thread, which aborted the process (std::terminate).
struct Disagreement {
  const char* name;
  int64_t numel[2];
  Dtype dtype[2];
};
void PrintTo(const Disagreement& d, std::ostream* os) { *os << d.name; }
class GlooTcpDisagreement : public ::testing::TestWithParam<Disagreement> {};

// Both ranks fail (no abort) naming the collective, its sequence number, the peer and what each
// passed; a collective that both pass alike first shows the group worked.
TEST_P(GlooTcpDisagreement, EveryRankFailsNamingTheCollectiveAndPeer) {
  EMBER_REQUIRE_GLOO();
  const Disagreement d = GetParam();
  run_group(2, [d](ProcessGroupGloo& pg, int rank, Store&) {
    Tensor same = full({3}, 1.0, kFloat32);
    pg.allreduce(same)->wait();
    Tensor t = full({d.numel[rank]}, 1.0, d.dtype[rank]);
    std::string msg;
    try {
      pg.allreduce(t)->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    const std::string me = std::to_string(rank), peer = std::to_string(1 - rank);
    require(!msg.empty(), "rank " + me + ": the disagreeing allreduce did not fail");
    const std::string label = "[gloo] allreduce #1 on rank " + me + " of 2";
    require(msg.find(label) != std::string::npos, "message lacks '" + label + "': " + msg);
    // What the peer passed, found by this rank or carried by the peer's abort record (Note
    // [abort through the store]), which then names what this rank passed.
    const std::string aborted = "rank " + peer + " aborted the group at its allreduce #1";
    const int about = msg.find(aborted) != std::string::npos ? rank : 1 - rank;
    require(msg.find("ranks disagree: rank " + std::to_string(about) + " issued allreduce (sum) of " +
                     std::to_string(d.numel[about]) + " elements of " +
                     ember::detail::str_cat(d.dtype[about])) != std::string::npos,
            "message lacks what the ranks passed: " + msg);
  }, 20s, /*shm=*/false);
}
INSTANTIATE_TEST_SUITE_P(
    Cases, GlooTcpDisagreement,
    ::testing::Values(
        Disagreement{"SmallSizes", {1000, 1001}, {kFloat32, kFloat32}},
        Disagreement{"RingSizes", {300000, 300001}, {kFloat32, kFloat32}},
        Disagreement{"SmallAndRing", {1000, 300000}, {kFloat32, kFloat32}},
        Disagreement{"EmptyAndNot", {0, 1000}, {kFloat32, kFloat32}},
        Disagreement{"Fp16HookBesidePlain", {1000, 1000}, {kFloat16, kFloat32}},
        Disagreement{"SameBytesOtherDtype", {1000, 1000}, {kInt32, kFloat32}},
        Disagreement{"RingFp16BesidePlain", {300000, 300000}, {kFloat16, kFloat32}}),
    [](const auto& info) { return std::string(info.param.name); });

// The case that was seen aborting: DDP with the fp16 compression hook on rank 0 beside a plain
// rank 1, over TCP. Backward fails on both ranks naming the dtypes instead.
TEST(GlooTcp, Fp16HookRankBesidePlainRankFailsInsteadOfAborting) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store&) {
    auto model = std::make_shared<nn::Linear>(3, 2);
    auto shared = std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
    dist::DistributedDataParallel ddp(model, shared);
    if (rank == 0) ddp.register_comm_hook(dist::fp16_compress_hook);
    std::string msg;
    try {
      Tensor x = full({4, 3}, rank + 1.0, kFloat32);
      ddp.forward(x).sum().backward();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    require(msg.find("[gloo] allreduce") != std::string::npos &&
                msg.find("ranks disagree") != std::string::npos &&
                msg.find("float16") != std::string::npos &&
                msg.find("float32") != std::string::npos,
            "rank " + std::to_string(rank) + ": " + msg);
  }, 20s, /*shm=*/false);
}

// The other collectives check too: a broadcast whose sizes differ fails on both ranks.
TEST(GlooTcp, DisagreeingBroadcastFailsOnEveryRank) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store&) {
    Tensor t = full({100 + 50 * rank}, 1.0, kFloat32);
    std::string msg;
    try {
      pg.broadcast(t)->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    // Each rank finds the disagreement itself, or first hears of it from the peer's abort
    // record (Note [abort through the store]), which carries the peer's finding.
    const std::string peer = std::to_string(1 - rank);
    require(msg.find("[gloo] broadcast #0 on rank " + std::to_string(rank)) != std::string::npos &&
                (msg.find("ranks disagree: rank " + peer) != std::string::npos ||
                 (msg.find("rank " + peer + " aborted the group at its broadcast #0") !=
                      std::string::npos &&
                  msg.find("ranks disagree") != std::string::npos)),
            "rank " + std::to_string(rank) + ": " + msg);
  }, 20s, /*shm=*/false);
}

// ---- abort through the store (Note [abort through the store]) -----------------------------------

// A failure that leaves peers waiting: rank 0's allreduce gives up after its own 2 s timeout,
// while rank 1 waits in a recv under the group's 10-minute timeout. Rank 0 stays alive (no exit
// closes its sockets for it), as a rank that catches the error would.
constexpr auto kLongGroupTimeout = std::chrono::minutes(10);
constexpr auto kPromptly = std::chrono::seconds(60);  // far below the group's timeout

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Rank 0's allreduce of `t` gives up after its own 2 s timeout while this rank (any other)
// waits in a recv from `from`, bounded for the test only; the error this rank got ("" if none).
std::string fail_on_rank_zero_while_receiving(ProcessGroupGloo& pg, int rank, Tensor& t,
                                              int from) {
  try {
    if (rank == 0) {
      AllreduceOptions o;
      o.timeout = 2s;
      pg.allreduce(t, o)->wait();
    } else {
      pg.recv(t, from)->wait(kPromptly + 30s);
    }
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}

// The peer that is blocked on rank 0 fails at once naming the rank that aborted, its
// collective and why, not "rank 0 closed the connection (did it exit or die?)".
TEST(GlooAbort, ThePeerOfARankThatTimesOutNamesTheAbortAndItsReason) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store& store) {
    Tensor t = full({1000}, 1.0, kFloat32);
    pg.allreduce(t)->wait();  // the group works
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = fail_on_rank_zero_while_receiving(pg, rank, t, 0);
    const double took = seconds_since(t0);
    store.set("reported" + std::to_string(rank), Bytes{1});
    store.wait({"reported0", "reported1"}, 120s);  // stay alive until both have failed
    const std::string me = "rank " + std::to_string(rank);
    require(took < kPromptly.count(), me + " failed only after " + std::to_string(took) +
                                          " s: " + msg);
    if (rank == 0) {
      require(msg.find("[gloo] allreduce #1 on rank 0 of 2 timed out after 2000 ms") !=
                  std::string::npos,
              me + ": " + msg);
    } else {
      require(
          msg.find("[gloo] recv #0 on rank 1 of 2 from rank 0") != std::string::npos &&
              msg.find("failed: rank 0 aborted the group at its allreduce #1: [gloo] "
                       "allreduce #1 on rank 0 of 2 timed out after 2000 ms") != std::string::npos,
          me + ": " + msg);
      // A later operation fails at once for the same reason.
      std::string later;
      try {
        pg.allreduce(t)->wait();
      } catch (const DistError& e) {
        later = e.what();
      }
      require(later.find("unusable after an earlier failure: ") != std::string::npos &&
                  later.find("rank 0 aborted the group at its allreduce #1") != std::string::npos,
              me + ", later allreduce: " + later);
    }
  }, kLongGroupTimeout, /*shm=*/false);
}

// The issue's case: two ranks over TCP issue mismatched collectives (rank 0 an allreduce, rank 1
// a broadcast of another size) under a 10-minute group timeout, and stay alive afterwards: both
// fail within seconds, each naming what the other issued.
TEST(GlooAbort, MismatchedCollectivesFailBothRanksWithinSeconds) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store& store) {
    Tensor t = full({1000 + 500 * rank}, 1.0, kFloat32);
    const auto t0 = std::chrono::steady_clock::now();
    std::string msg;
    try {
      (rank == 0 ? pg.allreduce(t) : pg.broadcast(t))->wait(kPromptly + 30s);
    } catch (const DistError& e) {
      msg = e.what();
    }
    const double took = seconds_since(t0);
    store.set("reported" + std::to_string(rank), Bytes{1});
    store.wait({"reported0", "reported1"}, 120s);
    const std::string me = "rank " + std::to_string(rank);
    require(took < kPromptly.count(), me + " failed only after " + std::to_string(took) +
                                          " s: " + msg);
    const std::string theirs = rank == 0 ? "rank 1 issued broadcast of 1500 elements"
                                         : "rank 0 issued allreduce (sum) of 1000 elements";
    require(msg.find(theirs) != std::string::npos, me + ": " + msg);
  }, kLongGroupTimeout, /*shm=*/false);
}

// ProcessGroupGloo::abort(): a rank that fails outside the group (here: its own error handler)
// breaks it, and the peer waiting on it fails naming the rank and the reason.
TEST(GlooAbort, AbortFailsThePeersNamingTheRankAndReason) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store& store) {
    Tensor t = full({1000}, 1.0, kFloat32);
    pg.allreduce(t)->wait();
    if (rank == 0) {
      pg.abort("the optimizer step ran out of memory");
      pg.abort("a second reason");  // the first stands
      std::string later;
      try {
        pg.allreduce(t)->wait();
      } catch (const DistError& e) {
        later = e.what();
      }
      require(later.find("[gloo] allreduce #1 on rank 0 of 2") != std::string::npos &&
                  later.find("unusable after an earlier failure: rank 0 aborted the group: the "
                             "optimizer step ran out of memory") != std::string::npos,
              "rank 0, later allreduce: " + later);
      store.wait({"reported1"}, 120s);  // alive: no exit closes the sockets
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::string msg;
    try {
      pg.recv(t, 0)->wait(kPromptly + 30s);
    } catch (const DistError& e) {
      msg = e.what();
    }
    const double took = seconds_since(t0);
    store.set("reported1", Bytes{1});
    require(took < kPromptly.count(), "rank 1 failed only after " + std::to_string(took) + " s");
    // The recv fails with the abort whether it was posted before rank 1 saw the abort record
    // ("failed: rank 0 aborted ...") or after ("failed: the group is unusable after an earlier
    // failure: rank 0 aborted ..."): on a loaded machine either comes first.
    require(msg.find("[gloo] recv #0 on rank 1 of 2 from rank 0") != std::string::npos &&
                msg.find("rank 0 aborted the group: the optimizer step ran out of memory") !=
                    std::string::npos,
            "rank 1: " + msg);
  }, kLongGroupTimeout, /*shm=*/false);
}

// A peer blocked on a third rank that is busy outside the group (a pipeline stage's recv from a
// stage still computing) is not woken by rank 0's closed connections; without the abort record
// it would wait out the group's 10 minutes.
class GlooAbortBusyPeer : public ::testing::TestWithParam<bool> {};
TEST_P(GlooAbortBusyPeer, APeerBlockedOnABusyRankFailsPromptly) {
  EMBER_REQUIRE_GLOO();
  run_group(3, [](ProcessGroupGloo& pg, int rank, Store& store) {
    Tensor t = full({1000}, 1.0, kFloat32);
    pg.allreduce(t)->wait();
    if (rank == 2) {  // busy elsewhere until rank 1 has failed
      store.wait({"reported1"}, 120s);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = fail_on_rank_zero_while_receiving(pg, rank, t, 2);
    const double took = seconds_since(t0);
    store.set("reported" + std::to_string(rank), Bytes{1});
    const std::string me = "rank " + std::to_string(rank);
    require(took < kPromptly.count(), me + " failed only after " + std::to_string(took) +
                                          " s: " + msg);
    if (rank == 1) {
      require(msg.find("[gloo] recv #0 on rank 1 of 3 from rank 2") != std::string::npos &&
                  msg.find("rank 0 aborted the group at its allreduce #1") != std::string::npos &&
                  msg.find("timed out after 2000 ms") != std::string::npos,
              me + ": " + msg);
    }
  }, kLongGroupTimeout, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Transports, GlooAbortBusyPeer, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "shm" : "tcp"); });

// An abort record that an earlier group with the same prefix left (a group destroyed and made
// again over the same store) does not fail the new one.
TEST(GlooAbort, AStaleRecordOfAnEarlierGroupDoesNotPoisonANewOne) {
  EMBER_REQUIRE_GLOO();
  constexpr int n = 2;
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    auto prefixed = std::make_shared<PrefixStore>("again", store);
    // What the earlier group's aborting rank 1 wrote.
    const std::string record = "1\nrank 1 aborted the group at its allreduce #4: stale";
    prefixed->set("ember_abort", Bytes(record.begin(), record.end()));
    prefixed->set("ember_abort_watch_" + std::to_string(rank), Bytes{'a', 'b', 'o', 'r', 't'});
    store->set("stale_written" + std::to_string(rank), Bytes{1});
    store->wait({"stale_written0", "stale_written1"}, 60s);
    ProcessGroupGloo::GlooOptions o{kLongGroupTimeout, "127.0.0.1"};
    o.shared_memory = false;
    ProcessGroupGloo pg(prefixed, rank, n, o);
    for (int i = 0; i < 20; ++i) {
      Tensor t = full({1000}, 1.0, kFloat32);
      pg.allreduce(t)->wait(30s);
      require_values("allreduce " + std::to_string(i) + " on rank " + std::to_string(rank), t,
                     std::vector<double>(1000, n));
    }
    pg.barrier()->wait(30s);
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

// Note [send/recv sizes]: a send and a recv of different sizes (send and recv always go over
// TCP) fail on both ranks naming both sizes, where Gloo's enforcement used to abort the receiver
// on its event-loop thread when the send was the longer; the pair's next messages on the same
// tag still arrive whole.
class GlooSendRecvSizes : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};
TEST_P(GlooSendRecvSizes, DisagreeingSizesFailOnBothRanks) {
  EMBER_REQUIRE_GLOO();
  const auto [sent, received] = GetParam();
  run_group(2, [sent, received](ProcessGroupGloo& pg, int rank, Store&) {
    auto transfer = [&](int64_t send_n, int64_t recv_n, double value) {
      Tensor t = full({rank == 0 ? send_n : recv_n}, rank == 0 ? value : -1.0, kFloat32);
      if (rank == 0) {
        pg.send(t, 1, 3)->wait();
      } else {
        pg.recv(t, 0, 3)->wait();
      }
      return t;
    };
    transfer(4, 4, 1.0);
    std::string msg;
    try {
      transfer(sent, received, 2.0);
    } catch (const DistError& e) {
      msg = e.what();
    }
    auto text = [](int64_t n) {
      return std::to_string(n) + " elements of float32 (" + std::to_string(4 * n) + " bytes)";
    };
    const std::string want =
        rank == 0 ? "[gloo] send #1 on rank 0 of 2 to rank 1 tag 3 (timeout 10000 ms) failed: "
                    "sizes disagree: rank 1 receives " + text(received) + ", but this send has " +
                        text(sent)
                  : "[gloo] recv #1 on rank 1 of 2 from rank 0 tag 3 (timeout 10000 ms) failed: "
                    "sizes disagree: rank 0 sends " + text(sent) + ", but this recv takes " +
                        text(received);
    require(msg.find(want) != std::string::npos,
            "rank " + std::to_string(rank) + ": expected '" + want + "', got '" + msg + "'");
    const Tensor after = transfer(5, 5, 3.0);
    if (rank == 1) require_values("the next recv", after, std::vector<double>(5, 3.0));
  }, 10s, /*shm=*/false);
}
INSTANTIATE_TEST_SUITE_P(Cases, GlooSendRecvSizes,
                         ::testing::Values(std::pair<int64_t, int64_t>{1000, 10},
                                           std::pair<int64_t, int64_t>{10, 1000},
                                           std::pair<int64_t, int64_t>{0, 10},
                                           std::pair<int64_t, int64_t>{10, 0}),
                         [](const auto& info) {
                           return "Send" + std::to_string(info.param.first) + "Recv" +
                                  std::to_string(info.param.second);
                         });

// Two ranks exchanging on one tag, each direction its own size: a recv's size is compared with
// the send it pairs with, not with the peer's send in the other direction, so nothing fails.
TEST(GlooTcp, ExchangeOnOneTagWithADifferentSizeEachWay) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store&) {
    const int64_t mine = rank == 0 ? 10 : 20, theirs = rank == 0 ? 20 : 10;
    for (int round = 0; round < 3; ++round) {
      Tensor out = full({mine}, rank + round, kFloat32), in = full({theirs}, -1.0, kFloat32);
      WorkPtr s = pg.send(out, 1 - rank, 7), r = pg.recv(in, 1 - rank, 7);
      s->wait();
      r->wait();
      require_values("round " + std::to_string(round) + " on rank " + std::to_string(rank), in,
                     std::vector<double>(theirs, 1 - rank + round));
    }
  }, 10s, /*shm=*/false);
}

// A recv that times out before its send is called fails naming the recv; Gloo closes the
// group's connections on that timeout, so the group is broken (Note [p2p failures end the
// group]): the late send fails naming rank 1's abort and its reason, and each rank's next
// operation fails at once saying the group is unusable and why. Neither process aborts.
TEST(GlooTcp, ASendAfterItsRecvTimedOutFailsOnBothRanksAndBreaksTheGroup) {
  EMBER_REQUIRE_GLOO();
  run_group(2, [](ProcessGroupGloo& pg, int rank, Store& store) {
    Tensor t = full({100}, 1.0, kFloat32);
    const auto failure = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const DistError& e) {
        return std::string(e.what());
      }
      return std::string("no error");
    };
    const auto expect = [rank](const std::string& msg, std::initializer_list<const char*> parts) {
      for (const char* p : parts) {
        require(msg.find(p) != std::string::npos,
                "rank " + std::to_string(rank) + ": no '" + p + "' in: " + msg);
      }
    };
    if (rank == 1) {
      expect(failure([&] { pg.recv(t, 0, 5)->wait(); }),
             {"[gloo] recv #0 on rank 1 of 2 from rank 0 tag 5", "timed out"});
      store.set("recv_failed", std::string("1"));
    } else {
      store.get("recv_failed", 30s);
      expect(failure([&] { pg.send(t, 1, 5)->wait(); }),
             {"[gloo] send #0 on rank 0 of 2 to rank 1 tag 5",
              "rank 1 aborted the group at its recv #0", "timed out"});
    }
    expect(failure([&] { pg.allreduce(t)->wait(); }),
           {"allreduce", "the group is unusable after an earlier failure",
            rank == 1 ? "recv #0 on rank 1 of 2 from rank 0 tag 5" : "send #0 on rank 0 of 2"});
    if (rank == 1) store.get("send_failed", 30s);  // alive until the late send has failed
    if (rank == 0) store.set("send_failed", std::string("1"));
  }, 1s, /*shm=*/false);
}

// ---- the shared-memory allreduce (Note [shared-memory allreduce]) ------------------------------

class GlooShm : public ::testing::TestWithParam<int> {};

// Rounding differs with the order of a sum, so bitwise agreement shows that each element was
// reduced once, by one rank, for everybody; 2.5M floats cross ten 1 MiB chunks, and the
// odd count leaves uneven shares and a short last chunk.
TEST_P(GlooShm, EveryRankGetsBitwiseTheSameResultAcrossChunks) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    constexpr int64_t kLen = 2500003;
    std::vector<float> v(kLen);
    for (int64_t i = 0; i < kLen; ++i) v[i] = 0.1f * float(rank + 1) * float(i % 977) + 1e-3f * i;
    Tensor t = from_vector(v);
    pg.allreduce(t)->wait();
    const std::vector<float> got = t.to_vector<float>();
    for (int64_t i = 0; i < kLen; i += 997) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += 0.1 * (r + 1) * double(i % 977) + 1e-3 * double(i);
      require(std::fabs(got[i] - want) <= 1e-5 * (1 + std::fabs(want)),
              "index " + std::to_string(i) + " got " + std::to_string(got[i]) + " want " +
                  std::to_string(want));
    }
    Tensor all = empty({n * kLen}, kFloat32);
    pg.allgather_into_tensor(all, t)->wait();
    const std::vector<float> every = all.to_vector<float>();
    for (int r = 0; r < n; ++r) {
      require(std::memcmp(every.data() + r * kLen, got.data(), kLen * sizeof(float)) == 0,
              "rank " + std::to_string(rank) + " and rank " + std::to_string(r) + " differ");
    }
  });
}

// The segment's name is gone once the group exists: nothing is left in /dev/shm, even if the
// ranks are killed later. Rank 0 created it under a name holding its pid.
TEST_P(GlooShm, SegmentIsUnlinkedOnceEveryRankHasIt) {
  EMBER_REQUIRE_GLOO();
  run_group(GetParam(), [](ProcessGroupGloo& pg, int rank, Store&) {
    if (rank != 0) return;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      const auto name = detail::parse_segment_name(e.path().filename().string());
      require(!(name && name->pid == ::getpid()), "left in /dev/shm: " + e.path().string());
    }
  });
}

// Outside emberrun (mpirun, Slurm), a rank 0 killed between creating its group's segment and
// every rank mapping it leaves the name; the next group made on the machine sweeps every name
// whose creator, in this PID namespace, has exited. Names of live creators, of other PID
// namespaces (their pids mean other processes) and of other forms stay.
TEST(GlooShmNames, TheNextGroupSweepsANameWhoseCreatorIsGone) {
  EMBER_REQUIRE_GLOO();
  const pid_t child = ::fork();  // a pid that is surely gone: a child that exited, reaped
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  char link[128] = {};
  ASSERT_GT(::readlink("/proc/self/ns/pid", link, sizeof(link) - 1), 0);
  const std::string text = link;  // "pid:[4026531836]"
  const std::string ns = text.substr(text.find('[') + 1, text.find(']') - text.find('[') - 1);
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  const std::string tag = "t" + std::to_string(::getpid());
  const std::vector<std::string> swept = {"ember-n" + ns + "-" + dead + "-a1",
                                          "ember-" + tag + "-n" + ns + "-" + dead + "-a2"};
  const std::vector<std::string> kept = {"ember-n" + ns + "-" + live + "-a3",
                                         "ember-n1-" + dead + "-a4",  // another PID namespace
                                         "ember-" + tag + "-" + dead + "-a5",  // no namespace
                                         "ember-n" + ns + "-" + dead + "-zz"};  // not a nonce
  struct Names {
    std::vector<std::string> all;
    ~Names() {
      for (const auto& n : all) ::shm_unlink(("/" + n).c_str());
    }
  } cleanup;
  for (const auto* list : {&swept, &kept}) {
    for (const std::string& n : *list) {
      const int fd = ::shm_open(("/" + n).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      ASSERT_GE(fd, 0) << n << ": " << std::strerror(errno);
      ::close(fd);
      cleanup.all.push_back(n);
    }
  }
  const auto parsed = detail::parse_segment_name(swept[1]);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->pid_namespace, ns);
  EXPECT_EQ(parsed->pid, child);
  EXPECT_FALSE(detail::parse_segment_name("ember-flight-recorder").has_value());
  run_group(2, [](ProcessGroupGloo& pg, int, Store&) {
    require(pg.uses_shared_memory(), "the group uses shared memory");
  });
  for (const std::string& n : swept) {
    EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + n)) << n << " was not swept";
  }
  for (const std::string& n : kept) {
    EXPECT_TRUE(std::filesystem::exists("/dev/shm/" + n)) << n << " was swept";
  }
}

// Ranks that pass different element counts fail on every rank, and the message says what each
// passed, instead of hanging or reading past a buffer.
TEST_P(GlooShm, DisagreeingCountsFailOnEveryRank) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](ProcessGroupGloo& pg, int rank, Store&) {
    Tensor t = full({1000 + rank}, 1.0, kFloat32);
    std::string msg;
    try {
      pg.allreduce(t)->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    require(msg.find("ranks disagree") != std::string::npos, "rank " + std::to_string(rank) +
                                                                 ": no disagreement error: " + msg);
    // This rank's finding names its own count; a peer's, carried by its abort record (Note
    // [abort through the store]), names that peer's and the rank it disagreed with.
    const bool heard = msg.find(" aborted the group at its allreduce #0") != std::string::npos;
    require(heard || msg.find(std::to_string(1000 + rank) + " elements of float32") !=
                         std::string::npos,
            "message lacks this rank's count: " + msg);
    require(msg.find(" elements of float32 but rank ") != std::string::npos,
            "message lacks the two counts: " + msg);
    (void)n;
  }, 10s);
}

// ---- every collective over shared memory (Note [shared-memory collectives]) -------------------

/// Runs body(shm, tcp, rank) in n forked ranks, each with two groups: one over shared memory,
/// one over Gloo's TCP.
void run_shm_and_tcp(int n,
                     const std::function<void(ProcessGroupGloo&, ProcessGroupGloo&, int)>& body) {
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    ProcessGroupGloo::GlooOptions o{60s, "127.0.0.1"};
    ProcessGroupGloo shm(std::make_shared<PrefixStore>("shm", store), rank, n, o);
    o.shared_memory = false;
    ProcessGroupGloo tcp(std::make_shared<PrefixStore>("tcp", store), rank, n, o);
    require(shm.uses_shared_memory() && !tcp.uses_shared_memory(), "uses_shared_memory()");
    body(shm, tcp, rank);
    // No rank closes its groups while a peer may still be reading its last collective's data:
    // gloo's TCP pairs can then end that read in a connection reset (seen once, rank 1 in its
    // last allreduce as rank 0 exited; pytorch/pytorch#75512 is the same behaviour in PyTorch's
    // gloo).
    tcp.barrier()->wait();
    shm.barrier()->wait();
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

/// Rank r's `numel` values for part `salt`: small integers, so that every sum is exact and any
/// reduction order gives bitwise the same result.
Tensor pattern(int64_t numel, int rank, int salt, Dtype d) {
  std::vector<double> v(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) v[static_cast<size_t>(i)] = double((i * 7 + rank * 3 + salt) % 11);
  return make(v, d);
}

/// One collective of `numel` elements per block on `pg`; returns the tensors it defined.
using Issue = std::function<std::vector<Tensor>(ProcessGroup& pg, int rank, int n,
                                                int64_t numel, Dtype d)>;
struct NamedIssue {
  const char* name;
  Issue issue;
};

std::vector<Tensor> parts(int n, int rank, int64_t numel, Dtype d) {
  std::vector<Tensor> v;
  for (int j = 0; j < n; ++j) v.push_back(pattern(numel, rank, j, d));
  return v;
}
std::vector<Tensor> empties(int n, int64_t numel, Dtype d) {
  std::vector<Tensor> v;
  for (int j = 0; j < n; ++j) v.push_back(empty({numel}, d));
  return v;
}

const std::vector<NamedIssue>& every_collective() {
  static const std::vector<NamedIssue> ops = {
      {"broadcast", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor t = pattern(m, rank, 0, d);
         pg.broadcast(t, bc(n - 1))->wait();
         return std::vector<Tensor>{t};
       }},
      {"reduce avg", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor t = pattern(m, rank, 0, d);
         pg.reduce(t, rd(1 % n, ReduceOp::Avg))->wait();
         return rank == 1 % n ? std::vector<Tensor>{t} : std::vector<Tensor>{};
       }},
      {"allgather_into_tensor", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor out = empty({n * m}, d);
         Tensor in = pattern(m, rank, 0, d);
         pg.allgather_into_tensor(out, in)->wait();
         return std::vector<Tensor>{out};
       }},
      {"allgather_into_tensor in place", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor out = empty({n * m}, d);
         Tensor in = out.narrow(0, rank * m, m);  // as FSDP does
         in.copy_(pattern(m, rank, 0, d));
         pg.allgather_into_tensor(out, in)->wait();
         return std::vector<Tensor>{out};
       }},
      {"allgather into non-contiguous outputs",
       [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         const int64_t k = m / 2;
         std::vector<Tensor> outs;
         for (int r = 0; r < n; ++r) outs.push_back(empty({2, k}, d).t());
         Tensor in = pattern(2 * k, rank, 0, d).view({k, 2});
         pg.allgather(outs, in)->wait();
         return outs;
       }},
      {"reduce_scatter max", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         std::vector<Tensor> ins = parts(n, rank, m, d);
         Tensor out = empty({m}, d);
         pg.reduce_scatter(out, ins, rs(ReduceOp::Max))->wait();
         return std::vector<Tensor>{out};
       }},
      {"reduce_scatter_tensor sum", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor in = pattern(n * m, rank, 0, d);
         Tensor out = empty({m}, d);
         pg.reduce_scatter_tensor(out, in)->wait();
         return std::vector<Tensor>{out};
       }},
      {"reduce_scatter_tensor avg, in place",
       [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         Tensor in = pattern(n * m, rank, 0, d);
         Tensor out = in.narrow(0, rank * m, m);  // as FSDP does
         pg.reduce_scatter_tensor(out, in, rs(ReduceOp::Avg))->wait();
         return std::vector<Tensor>{out.clone()};
       }},
      {"gather", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         std::vector<Tensor> outs = rank == 0 ? empties(n, m, d) : std::vector<Tensor>{};
         pg.gather(outs, pattern(m, rank, 0, d), ga(0))->wait();
         return outs;
       }},
      {"scatter", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         std::vector<Tensor> ins = rank == n - 1 ? parts(n, rank, m, d) : std::vector<Tensor>{};
         Tensor out = empty({m}, d);
         pg.scatter(out, ins, sc(n - 1))->wait();
         return std::vector<Tensor>{out};
       }},
      {"alltoall", [](ProcessGroup& pg, int rank, int n, int64_t m, Dtype d) {
         std::vector<Tensor> ins = parts(n, rank, m, d), outs = empties(n, m, d);
         pg.alltoall(outs, ins)->wait();
         return outs;
       }},
  };
  return ops;
}

void require_same_bytes(const std::string& what, const std::vector<Tensor>& a,
                        const std::vector<Tensor>& b) {
  require(a.size() == b.size(), what + ": different numbers of outputs");
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor x = a[i].contiguous(), y = b[i].contiguous();
    require(x.nbytes() == y.nbytes() &&
                (x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0),
            what + ": output " + std::to_string(i) + " differs between shared memory and tcp");
  }
}

// Each collective gives over shared memory bitwise what it gives over TCP: empty, tiny, sizes
// that divide neither by the group size nor by the chunk, and blocks larger than a 1 MiB chunk
// (and for broadcast, than all slots together) so that they move in several steps.
TEST_P(GlooShm, EveryCollectiveMatchesTcpAcrossSizesAndChunks) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_shm_and_tcp(n, [n](ProcessGroupGloo& shm, ProcessGroupGloo& tcp, int rank) {
    struct Case {
      Dtype d;
      int64_t numel;
    };
    const Case cases[] = {{kFloat32, 0},       {kFloat32, 1},      {kFloat32, 1001},
                          {kFloat32, 300007},  {kFloat16, 300007}, {kInt64, 1001},
                          {kUInt8, 1100003}};
    for (const NamedIssue& op : every_collective()) {
      for (const Case& c : cases) {
        const std::string what = name(op.name, c.d, rank, " of " + std::to_string(c.numel));
        require_same_bytes(what, op.issue(shm, rank, n, c.numel, c.d),
                           op.issue(tcp, rank, n, c.numel, c.d));
      }
    }
    const std::string big = name("broadcast", kFloat32, rank, " of 1100003");
    require_same_bytes(big, every_collective()[0].issue(shm, rank, n, 1100003, kFloat32),
                       every_collective()[0].issue(tcp, rank, n, 1100003, kFloat32));
  });
}

// Note [receives first over TCP]: alltoall and allgather_into_tensor posting receives first
// (for every size here, receives_first_bytes = 1) give bitwise what shared memory gives, at
// every size including one- and three-byte segments (an empty half); so do ranks that disagree
// on the threshold (odd ranks keep Gloo's order for everything).
TEST_P(GlooShm, ReceivesFirstOverTcpGivesWhatGloosOrderGives) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    ProcessGroupGloo::GlooOptions o{60s, "127.0.0.1"};
    ProcessGroupGloo shm(std::make_shared<PrefixStore>("shm", store), rank, n, o);
    o.shared_memory = false;
    o.receives_first_bytes = 1;
    ProcessGroupGloo first(std::make_shared<PrefixStore>("first", store), rank, n, o);
    o.receives_first_bytes = rank % 2 == 0 ? 1 : SIZE_MAX;
    ProcessGroupGloo mixed(std::make_shared<PrefixStore>("mixed", store), rank, n, o);
    struct Case {
      Dtype d;
      int64_t numel;
    };
    const Case cases[] = {{kUInt8, 0}, {kUInt8, 1}, {kUInt8, 3}, {kFloat32, 1001},
                          {kFloat16, 300007}, {kUInt8, 1100003}};
    for (const NamedIssue& op : every_collective()) {
      const std::string name_of = op.name;
      if (name_of.find("allgather_into_tensor") == std::string::npos && name_of != "alltoall") {
        continue;
      }
      for (const Case& c : cases) {
        const std::string what = name(op.name, c.d, rank, " of " + std::to_string(c.numel));
        const auto want = op.issue(shm, rank, n, c.numel, c.d);
        require_same_bytes(what + ", receives first", want, op.issue(first, rank, n, c.numel, c.d));
        require_same_bytes(what + ", mixed orders", want, op.issue(mixed, rank, n, c.numel, c.d));
      }
    }
    mixed.barrier()->wait();
    first.barrier()->wait();
    shm.barrier()->wait();
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

// The reductions over tensors from empty_shareable() (Note [mapped reductions]) give bitwise
// what TCP gives, as a user calls them: allreduce, reduce, reduce_scatter of a list and in place
// (FSDP's), and they took the mapped path.
TEST_P(GlooShm, ShareableTensorsReduceInPlaceOfTheirPeers) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_shm_and_tcp(n, [n](ProcessGroupGloo& shm, ProcessGroupGloo& tcp, int rank) {
    const int64_t m = 300007;  // above the mapped reductions' threshold in float32
    const auto shareable = [](const Tensor& t) {
      Tensor s = empty_shareable(t.shape(), t.dtype());
      s.copy_(t);
      return s;
    };
    uint64_t issued = 0;
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min}) {
      const std::string what = name("allreduce", kFloat32, rank, " " + std::string(to_string(op)));
      Tensor a = shareable(pattern(m, rank, 0, kFloat32)), b = pattern(m, rank, 0, kFloat32);
      shm.allreduce(a, AllreduceOptions{op})->wait();
      tcp.allreduce(b, AllreduceOptions{op})->wait();
      require_same_bytes(what, {a}, {b});
      ++issued;
    }
    Tensor r = shareable(pattern(m, rank, 1, kFloat32)), keep = r.clone();
    shm.reduce(r, rd(1, ReduceOp::Sum))->wait();
    Tensor r2 = pattern(m, rank, 1, kFloat32);
    tcp.reduce(r2, rd(1, ReduceOp::Sum))->wait();
    require_same_bytes(name("reduce", kFloat32, rank), {rank == 1 ? r2 : keep}, {r});
    ++issued;
    std::vector<Tensor> ins;
    for (const Tensor& t : parts(n, rank, m, kFloat32)) ins.push_back(shareable(t));
    Tensor out = empty({m}, kFloat32), out2 = empty({m}, kFloat32);
    shm.reduce_scatter(out, ins, rs(ReduceOp::Max))->wait();
    std::vector<Tensor> ins2 = parts(n, rank, m, kFloat32);
    tcp.reduce_scatter(out2, ins2, rs(ReduceOp::Max))->wait();
    require_same_bytes(name("reduce_scatter", kFloat32, rank), {out}, {out2});
    ++issued;
    Tensor flat = shareable(pattern(n * m, rank, 2, kFloat32)), flat2 = pattern(n * m, rank, 2, kFloat32);
    Tensor mine = flat.narrow(0, rank * m, m), mine2 = flat2.narrow(0, rank * m, m);
    shm.reduce_scatter_tensor(mine, flat, rs(ReduceOp::Avg))->wait();
    tcp.reduce_scatter_tensor(mine2, flat2, rs(ReduceOp::Avg))->wait();
    require_same_bytes(name("reduce_scatter_tensor in place", kFloat32, rank), {mine}, {mine2});
    ++issued;
    require(shm.shared_memory_stats().mapped_reductions == issued,
            name("mapped reductions", kFloat32, rank) + ": " +
                std::to_string(shm.shared_memory_stats().mapped_reductions) + " of " +
                std::to_string(issued));
    require(tcp.shared_memory_stats().mapped_reductions == 0, "mapped reductions over TCP");
    // zeros_for_collectives: shareable zeros over shared memory, ordinary ones over TCP.
    Tensor z = shm.zeros_for_collectives({3, 5}, kFloat32);
    require(is_shareable(z) && z.shape() == Shape({3, 5}) && z.abs().sum().item<float>() == 0,
            "zeros_for_collectives over shared memory");
    require(!is_shareable(tcp.zeros_for_collectives({3, 5}, kFloat32)),
            "zeros_for_collectives over TCP is shareable");
  });
}

// Ranks that disagree on a collective's kind, element count, dtype, reduce op or root fail on
// every rank, and the message says what each rank passed.
struct ShmMismatch {
  const char* name;
  std::function<WorkPtr(ProcessGroup&, int rank)> issue;
  const char* label[2];  // each rank's collective
  const char* passed[2];  // what each rank passed, as the error says
};
void PrintTo(const ShmMismatch& m, std::ostream* os) { *os << m.name; }
class GlooShmMismatch : public ::testing::TestWithParam<ShmMismatch> {};
TEST_P(GlooShmMismatch, EveryRankFailsNamingWhatEachPassed) {
  EMBER_REQUIRE_GLOO();
  const ShmMismatch m = GetParam();
  run_group(2, [&m](ProcessGroupGloo& pg, int rank, Store&) {
    std::string msg;
    try {
      m.issue(pg, rank)->wait();
    } catch (const DistError& e) {
      msg = e.what();
    }
    const std::string me = std::to_string(rank);
    require(msg.find(std::string("[gloo] ") + m.label[rank] + " #0 on rank " + me) !=
                    std::string::npos &&
                msg.find("ranks disagree") != std::string::npos,
            "rank " + me + ": " + msg);
    for (int r = 0; r < 2; ++r) {
      require(msg.find(std::string("rank ") + std::to_string(r) + " passed " + m.passed[r]) !=
                  std::string::npos,
              "rank " + me + ": message lacks what rank " + std::to_string(r) + " passed (" +
                  m.passed[r] + "): " + msg);
    }
  }, 20s);
}
INSTANTIATE_TEST_SUITE_P(
    Cases, GlooShmMismatch,
    ::testing::Values(
        ShmMismatch{"Count",
                    [](ProcessGroup& pg, int rank) {
                      Tensor out = empty({100 + rank}, kFloat32);
                      Tensor in = zeros({2 * (100 + rank)}, kFloat32);
                      return pg.reduce_scatter_tensor(out, in);
                    },
                    {"reduce_scatter_tensor", "reduce_scatter_tensor"},
                    {"reduce_scatter (sum) of 100 elements of float32",
                     "reduce_scatter (sum) of 101 elements of float32"}},
        // An empty tensor took TCP while its peer waited in shared memory: the timeout.
        ShmMismatch{"EmptyBesideNonEmpty",
                    [](ProcessGroup& pg, int rank) {
                      Tensor t = zeros({10 * rank}, kFloat32);
                      return pg.allreduce(t);
                    },
                    {"allreduce", "allreduce"},
                    {"allreduce (sum) of 0 elements of float32",
                     "allreduce (sum) of 10 elements of float32"}},
        ShmMismatch{"EmptyCoalescedBesideNonEmpty",
                    [](ProcessGroup& pg, int rank) {
                      std::vector<Tensor> ts = {zeros({0}, kFloat32), zeros({3 * rank}, kFloat32)};
                      return pg.allreduce_coalesced(ts);
                    },
                    {"allreduce_coalesced", "allreduce_coalesced"},
                    {"allreduce (sum) of 0 elements of float32",
                     "allreduce (sum) of 3 elements of float32"}},
        ShmMismatch{"Root",
                    [](ProcessGroup& pg, int rank) {
                      Tensor t = zeros({10}, kFloat32);
                      return pg.broadcast(t, bc(rank));
                    },
                    {"broadcast", "broadcast"},
                    {"broadcast of 10 elements of float32 with root 0",
                     "broadcast of 10 elements of float32 with root 1"}},
        ShmMismatch{"ReduceOp",
                    [](ProcessGroup& pg, int rank) {
                      Tensor t = zeros({10}, kFloat32);
                      return pg.reduce(t, rd(0, rank == 0 ? ReduceOp::Sum : ReduceOp::Max));
                    },
                    {"reduce", "reduce"},
                    {"reduce (sum) of 10 elements of float32 with root 0",
                     "reduce (max) of 10 elements of float32 with root 0"}},
        ShmMismatch{"Kind",
                    [](ProcessGroup& pg, int rank) {
                      Tensor t = zeros({10}, kFloat32);
                      if (rank == 1) return pg.broadcast(t, bc(0));
                      Tensor out = empty({20}, kFloat32);
                      return pg.allgather_into_tensor(out, t);
                    },
                    {"allgather_into_tensor", "broadcast"},
                    {"allgather of 10 elements of float32",
                     "broadcast of 10 elements of float32 with root 0"}},
        ShmMismatch{"Dtype",
                    [](ProcessGroup& pg, int rank) {
                      const Dtype d = rank == 0 ? kFloat32 : kInt32;
                      std::vector<Tensor> ins = {zeros({3}, d), zeros({3}, d)};
                      std::vector<Tensor> outs = {empty({3}, d), empty({3}, d)};
                      return pg.alltoall(outs, ins);
                    },
                    {"alltoall", "alltoall"},
                    {"alltoall of 3 elements of float32", "alltoall of 3 elements of int32"}}),
    [](const auto& info) { return std::string(info.param.name); });

// A rank killed while the others run a collective over shared memory is named by them (its pid
// is gone) or they report the survivor that gave up first: not a timeout. The victim issues the
// collective and dies at once; the survivors issue it twice, so the second fails even if the
// first could finish.
class GlooShmVictim : public ::testing::TestWithParam<size_t> {};
TEST_P(GlooShmVictim, KilledRankIsNamed) {
  EMBER_REQUIRE_GLOO();
  constexpr int n = 3, victim = 2;
  const NamedIssue& op = every_collective()[GetParam()];
  test::Children kids(n, [&](int rank, const std::string& port) {
    auto store = client(port);
    ProcessGroupGloo pg(std::make_shared<PrefixStore>("pg", store), rank, n,
                        ProcessGroupGloo::GlooOptions{60s, "127.0.0.1"});
    require(pg.uses_shared_memory(), "uses_shared_memory()");
    if (rank == victim) {
      std::thread([&] { op.issue(pg, rank, n, 1 << 20, kFloat32); }).detach();
      store->get("go", 60s);  // every survivor has issued its first
      ::kill(::getpid(), SIGKILL);
    }
    std::string msg;
    for (int k = 0; k < 2 && msg.empty(); ++k) {
      if (k == 0 && store->add("issued", 1) == n - 1) store->set("go", std::string("1"));
      try {
        op.issue(pg, rank, n, 1 << 20, kFloat32);
      } catch (const DistError& e) {
        msg = e.what();
      }
    }
    require(!msg.empty(), "rank " + std::to_string(rank) + ": " + op.name + " did not fail");
    require(msg.find("rank 2 (pid ") != std::string::npos || msg.find("gave up") != std::string::npos,
            "message names neither the dead rank nor a survivor that gave up: " + msg);
  });
  TCPStoreServer server(loopback_server());
  kids.go(std::to_string(server.port()));
  std::vector<std::string> errors = kids.join(120000);
  ASSERT_FALSE(errors.empty()) << "the victim should have died without a report";
  EXPECT_NE(errors.back().find("child 2: died"), std::string::npos) << errors.back();
  errors.pop_back();
  test::expect_children_ok(errors);
}
INSTANTIATE_TEST_SUITE_P(Collectives, GlooShmVictim,
                         ::testing::Range(size_t{0}, every_collective().size()),
                         [](const auto& info) {
                           std::string s = every_collective()[info.param].name;
                           for (char& c : s) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return s;
                         });

// reduce_scatter_tensor's input must hold one block of output's size per rank, of its dtype.
TEST(GlooErrors, ReduceScatterTensorNamesBothShapes) {
  EMBER_REQUIRE_GLOO();
  auto pg = solo();
  Tensor out = empty({4}, kFloat32), in = zeros({5}, kFloat32);
  test::expect_error([&] { pg->reduce_scatter_tensor(out, in); },
                     {"[gloo] reduce_scatter_tensor", "1 x 4 = 4 elements of float32", "got 5"});
  run_group(2, [](ProcessGroupGloo& pg, int, Store&) {
    Tensor out = empty({4}, kFloat32), in = zeros({8}, kInt32);
    test::expect_error([&] { pg.reduce_scatter_tensor(out, in); },
                       {"[gloo] reduce_scatter_tensor", "2 x 4 = 8 elements of float32",
                        "got 8", "int32"});
  }, 20s);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooShm, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
}  // namespace ember::dist
