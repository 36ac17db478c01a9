// ProcessGroupThreads: ranks as threads of one process. Every collective, dtype and reduce op
// against closed forms at 1-8 ranks, on the CPU and (skipped without a GPU) with every rank on
// one CUDA device with its own stream; the same through DelayingGroup; async completion,
// timeouts, aborts and mismatches; and DelayingGroup catching a missing wait.
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/init.h>

#include <gtest/gtest.h>

#include <cmath>
#include <future>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include "tests/distributed/backends/allreduce_closed_forms.h"
#include "tests/distributed/backends/collective_options.h"
#include "tests/distributed/backends/p2p_checks.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::ar;
using test::bc;
using test::ga;
using test::rd;
using test::require;
using test::rs;
using test::sc;
using test::ThreadsSetup;
using ember::detail::str_cat;

const Dtype kDtypes[] = {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8};
const ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min,
                         ReduceOp::Max};

std::vector<double> values(const Tensor& t) {
  if (t.numel() == 0) return {};
  return t.cpu().to(kFloat64).reshape({-1}).to_vector<double>();
}

/// `len` elements f(i) as dtype d on device dev.
Tensor make(int64_t len, const std::function<double(int64_t)>& f, Dtype d, Device dev) {
  std::vector<double> v(len);
  for (int64_t i = 0; i < len; ++i) v[i] = f(i);
  if (len == 0) return empty({0}, TensorOptions(d).device(dev));
  return from_vector(v).to(d).to(dev);
}

// Throws naming the case, the first differing index and both values.
void require_values(const std::string& what, const Tensor& got,
                    const std::function<double(int64_t)>& want, int64_t len) {
  const std::vector<double> g = values(got);
  require(static_cast<int64_t>(g.size()) == len,
          str_cat(what, ": got ", g.size(), " elements, want ", len));
  for (int64_t i = 0; i < len; ++i) {
    const double w = want(i);
    require(std::fabs(g[i] - w) <= 1e-6 * (1 + std::fabs(w)),
            str_cat(what, ": index ", i, " got ", g[i], " want ", w));
  }
}

// ---- closed forms: rank r's allreduce input at index i is r + 1 + i % 2 ----------------------

using test::expected;
using test::input;

using Checks = std::function<void(ProcessGroup&, int rank, int n, Device dev)>;

// Products of 8 ranks overflow uint8 and float16: the dtype sweep runs at up to 4 ranks.
void check_allreduce(ProcessGroup& pg, int rank, int n, Device dev) {
  for (Dtype d : kDtypes) {
    for (ReduceOp op : kOps) {
      for (int64_t len : {0, 5, 1003}) {
        Tensor t = make(len, [&](int64_t i) { return input(rank, i); }, d, dev);
        WorkPtr w = pg.allreduce(t, ar(op));
        require(w->wait(), "wait");
        require_values(str_cat("allreduce ", d, " ", to_string(op), " len ", len, " rank ", rank),
                       t, [&](int64_t i) { return expected(op, n, i, d); }, len);
      }
    }
  }
}

// Tensors of several shapes (an empty one among them) reduced where they lie.
void check_coalesced(ProcessGroup& pg, int rank, int n, Device dev) {
  for (Dtype d : {kFloat32, kInt64, kBFloat16}) {
    std::vector<Tensor> ts;
    for (int64_t len : {3, 0, 7}) ts.push_back(make(len, [&](int64_t i) { return input(rank, i); }, d, dev));
    ts[2] = ts[2].view({7, 1});
    pg.allreduce_coalesced(ts, ar(ReduceOp::Sum))->wait();
    for (size_t k = 0; k < ts.size(); ++k) {
      require_values(str_cat("allreduce_coalesced ", d, " tensors[", k, "] rank ", rank), ts[k],
                     [&](int64_t i) { return expected(ReduceOp::Sum, n, i, d); }, ts[k].numel());
    }
  }
}

// Broadcast, reduce and the allgathers from every root; value at index i of rank r: 10 r + i.
void check_rooted(ProcessGroup& pg, int rank, int n, Device dev) {
  const int64_t len = 5;
  auto of = [&](int r) { return [r](int64_t i) { return 10.0 * r + static_cast<double>(i); }; };
  for (Dtype d : {kFloat32, kInt64, kFloat16}) {
    for (int root = 0; root < n; ++root) {
      Tensor t = make(len, of(rank), d, dev);
      pg.broadcast(t, bc(root))->wait();
      require_values(str_cat("broadcast root ", root, " rank ", rank), t, of(root), len);

      Tensor s = make(len, of(rank), d, dev);
      pg.reduce(s, rd(root, ReduceOp::Max))->wait();
      if (rank == root) require_values(str_cat("reduce root ", root), s, of(n - 1), len);

      std::vector<Tensor> outs;
      if (rank == root) {
        for (int r = 0; r < n; ++r) outs.push_back(make(len, of(-1), d, dev));
      }
      pg.gather(outs, make(len, of(rank), d, dev), ga(root))->wait();
      for (int r = 0; r < static_cast<int>(outs.size()); ++r) {
        require_values(str_cat("gather root ", root, " outputs[", r, "]"), outs[r], of(r), len);
      }

      std::vector<Tensor> ins;
      if (rank == root) {
        for (int r = 0; r < n; ++r) ins.push_back(make(len, of(r + root), d, dev));
      }
      Tensor out = make(len, of(-1), d, dev);
      pg.scatter(out, ins, sc(root))->wait();
      require_values(str_cat("scatter root ", root, " rank ", rank), out, of(rank + root), len);
    }
    Tensor flat = make(n * len, of(-1), d, dev);
    pg.allgather_into_tensor(flat, make(len, of(rank), d, dev))->wait();
    require_values(str_cat("allgather_into_tensor rank ", rank), flat,
                   [&](int64_t j) { return of(static_cast<int>(j / len))(j % len); }, n * len);
    std::vector<Tensor> outs;
    for (int r = 0; r < n; ++r) outs.push_back(make(len, of(-1), d, dev));
    pg.allgather(outs, make(len, of(rank), d, dev))->wait();
    for (int r = 0; r < n; ++r) {
      require_values(str_cat("allgather outputs[", r, "] rank ", rank), outs[r], of(r), len);
    }
  }
}

// reduce_scatter, alltoall (sizes differing per pair), barrier and a send/recv ring.
void check_exchanges(ProcessGroup& pg, int rank, int n, Device dev) {
  const int64_t len = 4;
  // reduce_scatter: rank r's inputs[k][i] = r + k + i; rank k gets sum_r (r + k + i).
  std::vector<Tensor> ins;
  for (int k = 0; k < n; ++k) ins.push_back(make(len, [&](int64_t i) { return rank + k + i; }, kFloat32, dev));
  Tensor out = make(len, [](int64_t) { return -1.0; }, kFloat32, dev);
  pg.reduce_scatter(out, ins, rs(ReduceOp::Sum))->wait();
  require_values(str_cat("reduce_scatter rank ", rank), out,
                 [&](int64_t i) { return n * (n - 1) / 2.0 + n * (rank + static_cast<double>(i)); }, len);

  // alltoall: rank s sends rank r (r + 1) elements 100 s + r.
  std::vector<Tensor> sends, recvs;
  for (int r = 0; r < n; ++r) {
    sends.push_back(make(r + 1, [&](int64_t) { return 100.0 * rank + r; }, kInt64, dev));
    recvs.push_back(make(rank + 1, [](int64_t) { return -1.0; }, kInt64, dev));
  }
  pg.alltoall(recvs, sends)->wait();
  for (int s = 0; s < n; ++s) {
    require_values(str_cat("alltoall from ", s, " rank ", rank), recvs[s],
                   [&](int64_t) { return 100.0 * s + rank; }, rank + 1);
  }
  pg.barrier()->wait();
  if (n == 1) return;
  // A ring, twice with different tags in opposite orders: messages match by (src, dst, tag).
  Tensor a = make(len, [&](int64_t i) { return rank * 10.0 + i; }, kFloat64, dev);
  Tensor b = make(len, [&](int64_t i) { return rank * 20.0 + i; }, kFloat64, dev);
  Tensor ra = make(len, [](int64_t) { return -1.0; }, kFloat64, dev), rb = ra.clone();
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  WorkPtr s1 = pg.send(a, next, 1);
  WorkPtr s2 = pg.send(b, next, 2);
  WorkPtr r2 = pg.recv(rb, prev, 2);
  WorkPtr r1 = pg.recv(ra, prev, 1);
  for (const WorkPtr& w : {s1, s2, r1, r2}) w->wait();
  require_values(str_cat("recv tag 1 rank ", rank), ra, [&](int64_t i) { return prev * 10.0 + i; }, len);
  require_values(str_cat("recv tag 2 rank ", rank), rb, [&](int64_t i) { return prev * 20.0 + i; }, len);
}

void check_all(ProcessGroup& pg, int rank, int n, Device dev) {
  require(pg.rank() == rank && pg.size() == n, "rank and size");
  if (n <= 4) check_allreduce(pg, rank, n, dev);
  check_coalesced(pg, rank, n, dev);
  check_rooted(pg, rank, n, dev);
  check_exchanges(pg, rank, n, dev);
}

struct Case {
  int n;
  bool delayed;
};
// gtest would otherwise print the struct's bytes, padding included, into ctest's test names.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.n << " ranks" << (c.delayed ? ", delayed" : "");
}
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "n" + std::to_string(info.param.n) + (info.param.delayed ? "_delayed" : "");
}
ThreadsSetup setup(const Case& c, Device dev) {
  ThreadsSetup s;
  s.n = c.n;
  s.device = dev;
  if (c.delayed) s.delay = DelayOptions{.cycles = 1'000'000, .cpu_delay = 0ms, .scale = 1.0};
  return s;
}

class ThreadsWorld : public ::testing::TestWithParam<Case> {};

TEST_P(ThreadsWorld, EveryCollectiveOnCpu) {
  test::run_threads(setup(GetParam(), kCPU), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    check_all(*pg, rank, GetParam().n, kCPU);
  });
}

TEST_P(ThreadsWorld, EveryCollectiveOnOneCudaDevice) {
  EMBER_REQUIRE_CUDA();
  test::run_threads(setup(GetParam(), cuda_device(0)),
                    [&](std::shared_ptr<ProcessGroup> pg, int rank) {
                      check_all(*pg, rank, GetParam().n, cuda_device(0));
                    });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ThreadsWorld,
                         ::testing::Values(Case{1, false}, Case{2, false}, Case{3, false},
                                           Case{4, false}, Case{8, false}, Case{3, true}),
                         case_name);

// ---- asynchrony, futures ---------------------------------------------------------------------

// The Work of the first rank completes only once the last rank has called (ordered by a
// promise, not by time), and then() callbacks see the reduced value.
TEST(Threads, WorkCompletesWhenTheLastRankArrives) {
  auto world = ThreadWorld::create(2);
  std::promise<void> first_issued;
  auto issued = first_issued.get_future();
  run_rank_threads(world, [&](int rank) {
    ProcessGroupThreads pg(world, rank);
    Tensor t = full({3}, static_cast<double>(rank + 1));
    if (rank == 1) require(issued.wait_for(60s) == std::future_status::ready, "rank 0 issued");
    WorkPtr w = pg.allreduce(t);
    auto doubled = w->future()->then([](Future& f) { return std::vector<Tensor>{f.value()[0] * 2}; });
    if (rank == 0) {
      require(!w->is_completed(), "completed before rank 1 called allreduce");
      first_issued.set_value();
    }
    w->wait();
    require(t.to_vector<float>() == std::vector<float>(3, 3.0f), "sum");
    require(doubled->value()[0].to_vector<float>() == std::vector<float>(3, 6.0f), "then()");
  });
}

// The k-th group a rank makes pairs with every other rank's k-th; groups do not interfere
// even when their collectives interleave differently on different ranks.
TEST(Threads, TwoGroupsOnOneWorldAreIndependent) {
  auto world = ThreadWorld::create(2);
  run_rank_threads(world, [&](int rank) {
    ProcessGroupThreads a(world, rank), b(world, rank);
    Tensor x = full({2}, 1.0 + rank), y = full({2}, 10.0 * (1 + rank));
    WorkPtr wa, wb;
    if (rank == 0) {
      wa = a.allreduce(x);
      wb = b.allreduce(y);
    } else {
      wb = b.allreduce(y);
      wa = a.allreduce(x);
    }
    wa->wait();
    wb->wait();
    require(x.to_vector<float>()[0] == 3.0f && y.to_vector<float>()[0] == 30.0f, "sums");
  });
}

// ---- failures ---------------------------------------------------------------------------------

using test::message_of;

TEST(Threads, ARankThatNeverCallsTimesTheOthersOut) {
  auto world = ThreadWorld::create(3);
  run_rank_threads(world, [&](int rank) {
    ProcessGroupThreads pg(world, rank, ProcessGroup::Options{200ms});
    if (rank == 2) return;  // never calls
    Tensor t = full({2}, 1.0);
    WorkPtr w = pg.allreduce(t);
    EXPECT_THROW(w->wait(), DistTimeoutError);
    const std::string msg = message_of([&] { w->wait(); });
    EXPECT_NE(msg.find(str_cat("[threads] allreduce #0 on rank ", rank, " of 3 timed out after 200 ms")),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("rank(s) 2 did not call it"), std::string::npos) << "[" << msg << "]";
  });
}

TEST(Threads, ARecvWithoutSendTimesOut) {
  auto world = ThreadWorld::create(2);
  run_rank_threads(world, [&](int rank) {
    ProcessGroupThreads pg(world, rank, ProcessGroup::Options{100ms});
    if (rank == 0) return;
    Tensor t = zeros({2});
    const std::string msg = message_of([&] { pg.recv(t, 0, 7)->wait(); });
    EXPECT_NE(msg.find("[threads] recv #0 on rank 1 of 2 from rank 0 (tag 7) timed out"),
              std::string::npos)
        << msg;
  });
}

// A rank that throws aborts the world: the others (with a 30-minute timeout) fail at once, and
// run_rank_threads rethrows the first failure with its rank.
TEST(Threads, ARankThatThrowsAbortsTheOthers) {
  auto world = ThreadWorld::create(4);
  try {
    run_rank_threads(world, [&](int rank) {
      ProcessGroupThreads pg(world, rank);
      if (rank == 1) throw std::runtime_error("boom");
      Tensor t = full({2}, 1.0);
      pg.allreduce(t)->wait();
    });
    FAIL() << "expected RankThreadError";
  } catch (const RankThreadError& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("[threads] rank 1 of 4 failed: boom"), std::string::npos)
        << e.what();
  }
}

// ProcessGroup::abort on a threads group (a pipeline step that threw): the peer waiting in it
// fails at once, under a 30-minute timeout, naming the rank and the first reason, and so do
// later calls; a group made from it goes on, as a rank's other gloo groups do.
TEST(Threads, AbortBreaksThatGroupOnlyAndWakesThePeer) {
  std::vector<std::string> msgs(2);
  std::vector<float> sums(2);
  run_rank_threads(
      2,
      [&](int rank) {
        std::shared_ptr<ProcessGroup> whole = default_group();
        std::shared_ptr<ProcessGroup> sub = new_group({0, 1});
        Tensor t = full({2}, 1.0);
        if (rank == 0) {
          require(whole->abort("the stage ran out of memory"), "abort() returned false");
          whole->abort("a second reason");  // the first stands
          msgs[0] = message_of([&] { whole->allreduce(t)->wait(); });
        } else {
          msgs[1] = message_of([&] { whole->recv(t, 0)->wait(); });
        }
        sub->allreduce(t)->wait();
        sums[rank] = t.to_vector<float>()[0];
      },
      30min);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(msgs[r].find("rank 0 aborted the group: the stage ran out of memory"),
              std::string::npos)
        << "rank " << r << ": " << msgs[r];
    EXPECT_EQ(sums[r], 2.0f) << "rank " << r;
  }
}

TEST(Threads, RunRankThreadsRethrowsTheTimeoutWithItsType) {
  auto world = ThreadWorld::create(2);
  try {
    run_rank_threads(world, [&](int rank) {
      ProcessGroupThreads pg(world, rank, ProcessGroup::Options{100ms});
      if (rank == 0) pg.barrier()->wait();
    });
    FAIL() << "expected RankThreadError";
  } catch (const RankThreadError& e) {
    EXPECT_EQ(e.rank(), 0);
    EXPECT_THROW(std::rethrow_exception(e.cause()), DistTimeoutError);
  }
}

// Destroying the world (with its last group) fails what is still pending instead of leaving it
// to time out.
TEST(Threads, DestroyingTheWorldFailsPendingCollectives) {
  WorkPtr w;
  {
    auto world = ThreadWorld::create(2);
    ProcessGroupThreads pg(world, 0);
    Tensor t = full({2}, 1.0);
    w = pg.allreduce(t);  // rank 1 never comes
  }
  const std::string msg = message_of([&] { w->wait(5s); });
  EXPECT_NE(msg.find("[threads] allreduce #0 on rank 0 of 2 failed: the world was destroyed"),
            std::string::npos) << msg;
  EXPECT_THROW(w->wait(5s), DistBackendError);
}

TEST(Threads, MismatchesNameTheCollectiveAndBothRanks) {
  auto world = ThreadWorld::create(2);
  run_rank_threads(world, [&](int rank) {
    ProcessGroupThreads pg(world, rank);
    Tensor shape = zeros({rank == 0 ? 2 : 3});
    std::string msg = message_of([&] { pg.allreduce(shape)->wait(); });
    EXPECT_NE(msg.find(str_cat("[threads] allreduce #0 on rank ", rank,
                               " of 2: rank 1 passed [float32 [3]] but rank 0 passed [float32 [2]]")),
              std::string::npos) << msg;
    Tensor dtype = zeros({2}, rank == 0 ? kFloat32 : kInt64);
    msg = message_of([&] { pg.broadcast(dtype)->wait(); });
    EXPECT_NE(msg.find("rank 1 passed [int64 [2]] but rank 0 passed [float32 [2]]"),
              std::string::npos) << msg;
    Tensor t = zeros({2});
    msg = message_of([&] { (rank == 0 ? pg.allreduce(t) : pg.broadcast(t))->wait(); });
    EXPECT_NE(msg.find("rank 1 called broadcast but rank 0 called allreduce"), std::string::npos)
        << msg;
    msg = message_of([&] { pg.broadcast(t, bc(rank))->wait(); });
    EXPECT_NE(msg.find("rank 1 passed root 1 but rank 0 root 0"), std::string::npos) << msg;
    // alltoall: rank 0's outputs are checked too (a [1] into a [4] was broadcast into it).
    std::vector<Tensor> in = {full({1}, 10.0 * rank), full({1}, 10.0 * rank + 1)};
    std::vector<Tensor> out = {zeros({1}), zeros({rank == 0 ? 4 : 1})};
    msg = message_of([&] { pg.alltoall(out, in)->wait(); });
    EXPECT_NE(msg.find("rank 0's outputs[1] is [float32 [4]] but rank 1's inputs[0] is "
                       "[float32 [1]]"),
              std::string::npos)
        << msg;
    // The group is still usable afterwards.
    Tensor ok = full({2}, 1.0);
    pg.allreduce(ok)->wait();
    EXPECT_EQ(ok.to_vector<float>()[0], 2.0f);
  });
}

// recv_with_shape refuses a header that no send_with_shape wrote, naming the sender and tag: a
// dtype code past the table (it indexed the dtype table out of bounds) or a negative size.
TEST(Threads, RecvWithShapeRefusesAHeaderItDidNotWrite) {
  test::run_threads({.n = 2}, [](std::shared_ptr<ProcessGroup> pg, int rank) {
    std::vector<int64_t> dtype_code(2 + kMaxP2pDims, 0), negative(2 + kMaxP2pDims, 0);
    dtype_code[0] = 200;
    dtype_code[1] = 1;
    dtype_code[2] = 3;
    negative[0] = static_cast<int64_t>(kFloat32);
    negative[1] = 1;
    negative[2] = -5;
    if (rank == 0) {
      pg->send(from_vector(dtype_code), 1, 4)->wait();
      pg->send(from_vector(negative), 1, 5)->wait();
    } else {
      test::expect_error([&] { recv_with_shape(*pg, 0, 4); },
                         {"[recv_with_shape] rank 0 sent a header with dtype code 200 on tag 4",
                          "not a send_with_shape"});
      test::expect_error([&] { recv_with_shape(*pg, 0, 5); },
                         {"[recv_with_shape] rank 0 sent a header with size -5 at dim 0 on tag 5"});
    }
  });
}

// batch_isend_irecv (through the free function) and learned shapes at 2 and 3 ranks; a batch
// that is empty or names two groups is refused.
TEST(Threads, BatchIsendIrecvAndLearnedShapes) {
  for (int n : {2, 3}) {
    test::run_threads({.n = n}, [n](std::shared_ptr<ProcessGroup> pg, int rank) {
      test::check_batch_p2p(*pg, rank, n);
      const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      Tensor out = full({2}, rank * 1.0), in = zeros({2});
      for (const WorkPtr& w : batch_isend_irecv({P2POp::irecv(in, prev, 0, pg),
                                                 P2POp::isend(out, next, 0, pg)})) {
        w->wait();
      }
      require(in.to_vector<float>()[0] == prev, "the free batch_isend_irecv");
    });
  }
  test::expect_error([] { batch_isend_irecv({}); },
                     {"[batch_isend_irecv] expected at least one P2POp, got none"});
  auto a = std::make_shared<ProcessGroupThreads>(ThreadWorld::create(2), 0);
  auto b = std::make_shared<ProcessGroupThreads>(ThreadWorld::create(2), 0);
  Tensor t = zeros({1});
  test::expect_error([&] { batch_isend_irecv({P2POp::isend(t, 1, 0, a), P2POp::irecv(t, 1, 0, b)}); },
                     {"[batch_isend_irecv] every P2POp must use the same group: op 1"});
}

TEST(Threads, BadArgumentsThrowAtTheCall) {
  auto world = ThreadWorld::create(2);
  ProcessGroupThreads pg(world, 0);
  Tensor t = zeros({2});
  EXPECT_THROW(pg.broadcast(t, bc(2)), ValueError);
  EXPECT_THROW(pg.send(t, 0), ValueError);
  EXPECT_THROW(pg.recv(t, 5), ValueError);
  Tensor small = zeros({3});
  EXPECT_THROW(pg.allgather_into_tensor(small, t), ValueError);
  std::vector<Tensor> one{t};
  EXPECT_THROW(pg.alltoall(one, one), ValueError);
  EXPECT_THROW(ProcessGroupThreads(world, 2), ValueError);
  EXPECT_THROW(ProcessGroupThreads(nullptr, 0), ValueError);
  EXPECT_THROW(ThreadWorld::create(0), ValueError);
}

// ---- DelayingGroup ----------------------------------------------------------------------------

// Reading the result without waiting for the Work gives a wrong number (the collective, or at
// least its scaling, has not happened yet); waiting gives the scaled sum.
void check_missing_wait_is_caught(Device dev) {
  ThreadsSetup s;
  s.n = 2;
  s.device = dev;
  // CPU: the completion is held back far longer than the read right after the call takes.
  s.delay = DelayOptions{.cycles = 200'000'000, .cpu_delay = 500ms, .scale = 3.0};
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Tensor t = full({1000}, static_cast<double>(rank + 1), TensorOptions(kFloat32).device(dev));
    WorkPtr w = pg->allreduce(t);
    const std::vector<double> early = values(t);  // the deliberately missing wait
    w->wait();
    const std::vector<double> late = values(t);
    require(late == std::vector<double>(1000, 9.0), str_cat("after wait: ", late[0]));
    require(early != late, "reading without a wait saw the final value: the delay did not work");
  });
}

TEST(DelayingGroup, CatchesAMissingWaitOnCpu) { check_missing_wait_is_caught(kCPU); }

TEST(DelayingGroup, CatchesAMissingStreamWaitOnCuda) {
  EMBER_REQUIRE_CUDA();
  check_missing_wait_is_caught(cuda_device(0));
}

TEST(DelayingGroup, ScalesEveryOutputButNotSendsOrIntegers) {
  ThreadsSetup s;
  s.n = 2;
  s.delay = DelayOptions{.cycles = 0, .cpu_delay = 0ms, .scale = 2.0};
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Tensor f = full({2}, 1.0), i = full({2}, 1, kInt64);
    pg->allreduce(f)->wait();
    pg->allreduce(i)->wait();
    require(f.to_vector<float>()[0] == 4.0f, "float sum scaled");
    require(i.to_vector<int64_t>()[0] == 2, "int sum not scaled");
    Tensor msg = full({2}, 5.0);
    if (rank == 0) {
      pg->send(msg, 1)->wait();
      require(msg.to_vector<float>()[0] == 5.0f, "the sent tensor is left alone");
    } else {
      Tensor got = zeros({2});
      pg->recv(got, 0)->wait();
      require(got.to_vector<float>()[0] == 10.0f, "received and scaled");
    }
  });
}

// Rank threads meet on the host, which a CUDA graph's replay would skip: a collective issued
// while the thread captures is refused, naming the backend and the way out (nccl), the capture is
// reset, and the group works on (Note [NCCL in a CUDA graph]).
TEST(ThreadsCuda, CollectiveInACaptureIsRefusedNamingTheBackend) {
  EMBER_REQUIRE_CUDA();
  ThreadsSetup s;
  s.n = 1;
  test::run_threads(s, [&](std::shared_ptr<ProcessGroup> pg, int) {
    Tensor t = ones({4}, cuda_device(0));
    cuda::CUDAGraph graph;
    std::string error;
    try {
      cuda::graph(graph, [&] { pg->allreduce(t); });
    } catch (const ValueError& e) {
      error = e.what();
    }
    require(error.find("[threads] allreduce on rank 0 of 1: cannot be captured in a CUDA graph") !=
                    std::string::npos &&
                error.find("nccl backend") != std::string::npos,
            "the capture refused, got: " + error);
    require(!graph.ready(), "the failed capture was reset");
    pg->allreduce(t)->wait();
    require(t.cpu().to_vector<float>()[0] == 1.0f, "the group works after the failed capture");
  });
}

// A future's CUDA value made on one stream (a collective's, a callback's) and waited for on
// another: wait() records the value on the waiting stream, so once the consumer drops it, its
// memory is not handed out on the producing stream while the consumer's stream, still busy,
// may read it (PyTorch's Future.wait records the storages the same way).
TEST(FutureCuda, AValueWaitedForIsNotReusedWhileTheWaitingStreamRuns) {
  EMBER_REQUIRE_CUDA();
  cuda::set_device(0);
  const cuda::Stream producer = cuda::Stream::create(0), consumer = cuda::Stream::create(0);
  auto f = std::make_shared<Future>();
  void* first = nullptr;
  {
    cuda::StreamGuard on(producer);
    Tensor v = ones({1 << 20}, cuda_device(0));
    first = v.storage()->data();
    auto ready = std::make_shared<cuda::Event>();
    ready->record(producer);
    f->set_value({v}, {ready});
  }
  {
    cuda::StreamGuard on(consumer);
    cuda::spin(int64_t{1} << 31);  // the consumer's stream stays busy past the checks below
    f->wait();
    f.reset();  // the last reference to the value: its block is freed
  }
  cuda::StreamGuard on(producer);
  Tensor next = empty({1 << 20}, cuda_device(0));
  EXPECT_NE(next.storage()->data(), first)
      << "the block was handed out again while the waiting stream may still read it";
  consumer.synchronize();
}

}  // namespace
}  // namespace ember::dist
