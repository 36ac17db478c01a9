// ProcessGroupNccl: world size 1 in this process (every collective, dtype and reduce op,
// streams, Futures, argument errors, a rendezvous nobody joins), and two real processes on two
// devices (every collective against closed-form values, send/recv, a stalled rank timing out).
// Without NCCL or without a CUDA device the tests skip, saying why; what can run without a
// device (the stub, "no CUDA device" errors, the backend registration) does.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "tests/distributed/backends/collective_options.h"
#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sharding/detail/fsdp_arena.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/store/file_store.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/sharding/fsdp_test_model.h"
#include "tests/distributed/store/store_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;

#define EMBER_REQUIRE_NCCL_DEVICE()                                                  \
  if (!nccl_available()) GTEST_SKIP() << "built without nccl (EMBER_WITH_NCCL=OFF)"; \
  if (!ember::cuda::is_available())                                                  \
  GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason()

const Dtype kDtypes[] = {kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8};
const ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min,
                         ReduceOp::Max};

using test::ar;
using test::bc;
using test::rd;
using test::ga;
using test::sc;
using test::rs;

/// values on cuda:device as dtype d.
Tensor make(const std::vector<double>& v, Dtype d, int device) {
  if (v.empty()) return empty({0}, TensorOptions(d).device(cuda_device(device)));
  return from_vector(v).to(cuda_device(device), d);
}

std::vector<double> values(const Tensor& t) {
  if (t.numel() == 0) return {};
  return t.cpu().to(kFloat64).reshape({-1}).to_vector<double>();
}

/// "" if got holds want, else what differed (first index, both values).
std::string differs(const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = values(got);
  if (g.size() != want.size()) {
    return "got " + std::to_string(g.size()) + " elements, want " + std::to_string(want.size());
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] != want[i]) {
      return "index " + std::to_string(i) + ": got " + std::to_string(g[i]) + ", want " +
             std::to_string(want[i]);
    }
  }
  return "";
}

/// base + (i mod 64) for i < n: small integers, exact in every dtype (uint8 and bfloat16
/// included) as long as base < 128.
std::vector<double> seq(int n, double base) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = base + i % 64;
  return v;
}

std::shared_ptr<ProcessGroupNccl> world_of_one(Duration timeout = 60s) {
  ProcessGroupNccl::NcclOptions o;
  o.timeout = timeout;
  o.device = 0;
  return std::make_shared<ProcessGroupNccl>(std::make_shared<HashStore>(), 0, 1, o);
}

// ---- without NCCL or without a device ----------------------------------------------------------

TEST(NcclStub, ThrowsWhenBuiltWithoutNccl) {
  if (nccl_available()) GTEST_SKIP() << "this build has nccl";
  EXPECT_THROW(
      {
        try {
          ProcessGroupNccl pg(std::make_shared<HashStore>(), 0, 1);
        } catch (const NotImplementedError& e) {
          EXPECT_NE(std::string(e.what()).find("nccl is not available: built with "
                                               "EMBER_WITH_NCCL=OFF"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      NotImplementedError);
}

TEST(NcclNoDevice, ConstructorSaysWhy) {
  if (!nccl_available()) GTEST_SKIP() << "built without nccl (EMBER_WITH_NCCL=OFF)";
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  try {
    ProcessGroupNccl pg(std::make_shared<HashStore>(), 0, 1);
    ADD_FAILURE() << "expected NotImplementedError";
  } catch (const NotImplementedError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("[nccl] rank 0 of 1: no CUDA device"), std::string::npos) << m;
    EXPECT_NE(m.find(cuda::unavailable_reason()), std::string::npos) << m;
  }
}

// The backend registers itself (a static initializer in process_group_nccl.cpp): without a
// device, init_process_group reaches the constructor's error rather than "unknown backend".
TEST(NcclNoDevice, InitProcessGroupFindsTheBackend) {
  if (!nccl_available()) GTEST_SKIP() << "built without nccl (EMBER_WITH_NCCL=OFF)";
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  InitOptions o;
  o.backend = "nccl";
  o.store = std::make_shared<HashStore>();
  o.rank = 0;
  o.world_size = 1;
  o.timeout = 10s;
  try {
    init_process_group(o);
    destroy_process_group();
    ADD_FAILURE() << "expected NotImplementedError";
  } catch (const NotImplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(is_initialized());
}

// ---- world size 1 --------------------------------------------------------------------------

TEST(NcclWorldOne, EveryCollectiveEveryDtype) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  EXPECT_EQ(pg->backend_name(), "nccl");
  EXPECT_EQ(pg->device(), 0);
  for (Dtype d : kDtypes) {
    for (int n : {0, 1, 7, 1000}) {
      const std::string where = "dtype " + std::string(dtype_name(d)) + ", n " + std::to_string(n);
      const std::vector<double> x = seq(n, 3);
      for (ReduceOp op : kOps) {
        Tensor t = make(x, d, 0);
        pg->allreduce(t, ar(op))->wait();
        EXPECT_EQ(differs(t, x), "") << "allreduce " << to_string(op) << ", " << where;
        Tensor r = make(x, d, 0);
        pg->reduce(r, rd(0, op))->wait();
        EXPECT_EQ(differs(r, x), "") << "reduce " << to_string(op) << ", " << where;
        Tensor out = make(seq(n, 0), d, 0);
        std::vector<Tensor> ins{make(x, d, 0)};
        pg->reduce_scatter(out, ins, rs(op))->wait();
        EXPECT_EQ(differs(out, x), "") << "reduce_scatter " << to_string(op) << ", " << where;
        Tensor out_t = make(seq(n, 0), d, 0);
        pg->reduce_scatter_tensor(out_t, make(x, d, 0), rs(op))->wait();
        EXPECT_EQ(differs(out_t, x), "") << "reduce_scatter_tensor " << to_string(op) << ", "
                                         << where;
      }
      Tensor b = make(x, d, 0);
      pg->broadcast(b, bc(0))->wait();
      EXPECT_EQ(differs(b, x), "") << "broadcast, " << where;

      Tensor in = make(x, d, 0);
      Tensor gathered = make(seq(n, 50), d, 0);
      pg->allgather_into_tensor(gathered, in)->wait();
      EXPECT_EQ(differs(gathered, x), "") << "allgather_into_tensor, " << where;

      std::vector<Tensor> list{make(seq(n, 50), d, 0)};
      pg->allgather(list, in)->wait();
      EXPECT_EQ(differs(list[0], x), "") << "allgather, " << where;

      std::vector<Tensor> outs{make(seq(n, 9), d, 0)};
      std::vector<Tensor> ins{make(x, d, 0)};
      pg->alltoall(outs, ins)->wait();
      EXPECT_EQ(differs(outs[0], x), "") << "alltoall, " << where;
    }
  }
  pg->barrier()->wait();
}

TEST(NcclWorldOne, WorkFutureAndSequenceNumbers) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  const uint64_t seq0 = pg->sequence_number();
  Tensor t = make(seq(4, 1), kFloat32, 0);
  WorkPtr w = pg->allreduce(t);
  EXPECT_EQ(pg->sequence_number(), seq0 + 1);
  EXPECT_NE(w->describe().find("[nccl] allreduce #" + std::to_string(seq0) + " on rank 0 of 1"),
            std::string::npos)
      << w->describe();
  auto doubled = w->future()->then([](Future& f) {
    std::vector<Tensor> v = f.value();
    return std::vector<Tensor>{v.at(0) * 2};
  });
  EXPECT_TRUE(w->wait());
  EXPECT_TRUE(w->is_success());
  ASSERT_EQ(w->result().size(), 1u);
  EXPECT_TRUE(w->result()[0].is_same(t));
  doubled->wait(60s);
  EXPECT_EQ(differs(doubled->value().at(0), {2, 4, 6, 8}), "");
  WorkPtr bar = pg->barrier();
  EXPECT_NE(bar->describe().find("barrier #" + std::to_string(seq0 + 1)), std::string::npos);
  bar->wait();
  EXPECT_TRUE(bar->is_completed());
}

// A Future callback may drop the last reference to the group (it runs on the issuing thread:
// the Future completes when the collective is queued), and the Work outlives the group.
TEST(NcclWorldOne, CallbackMayDropTheLastReference) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto holder = std::make_shared<std::shared_ptr<ProcessGroupNccl>>(world_of_one());
  Tensor t = make(seq(8, 1), kFloat32, 0);
  WorkPtr w = (*holder)->allreduce(t);
  auto dropped = std::make_shared<std::atomic<bool>>(false);
  w->future()->add_done_callback([holder, dropped](Future&) {
    holder->reset();
    *dropped = true;
  });
  holder.reset();  // the callback now holds the only reference
  w->wait();
  EXPECT_TRUE(test::eventually([&] { return dropped->load(); }));
  EXPECT_EQ(differs(t, seq(8, 1)), "");
}

// About 2 s of cuda::spin on a 2 GHz GPU: far longer than the host needs to get past the calls
// a test makes while it runs, so "still running" is not a race the host can lose.
constexpr int64_t kSpinCycles = 4'000'000'000;

// Note [NCCL stream-ordered work]: the Future completes when the collective is queued (while a
// spin the collective waits for still runs), and a then() callback, run on another current
// stream, still sees the collective's result; so does the caller, through value().
TEST(NcclWorldOne, ThenCallbackIsOrderedAfterTheCollective) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  const int64_t n = 1 << 20;
  const TensorOptions f32 = TensorOptions(kFloat32).device(cuda_device(0));
  Tensor in = full({n}, 3.0, f32);
  Tensor out = zeros({n}, f32);
  cuda::synchronize(0);
  cuda::Stream issuing = cuda::Stream::create(0);
  cuda::Stream later = cuda::Stream::create(0);
  WorkPtr w;
  auto spun = std::make_shared<cuda::Event>();
  {
    cuda::StreamGuard guard(issuing);
    cuda::spin(kSpinCycles);  // the collective waits for it
    spun->record();
    w = pg->allgather_into_tensor(out, in);
  }
  EXPECT_TRUE(w->future()->completed())
      << "the Future should complete once the collective is queued";
  EXPECT_FALSE(spun->query()) << "the spin finished before the host got here: lengthen it";
  EXPECT_FALSE(w->is_completed()) << "is_completed() is completion on the device";
  std::shared_ptr<Future> doubled;
  {
    // `later` has nothing queued: unless then() orders it after the collective, the callback's
    // product runs at once and reads zeros.
    cuda::StreamGuard guard(later);
    doubled = w->future()->then([](Future& f) {
      return std::vector<Tensor>{f.value().at(0) * 2};
    });
  }
  EXPECT_EQ(differs(doubled->value().at(0), std::vector<double>(n, 6.0)), "");
  EXPECT_EQ(differs(out, std::vector<double>(n, 3.0)), "");
  w->wait();
  cuda::synchronize(0);
  EXPECT_TRUE(w->is_completed());
  EXPECT_TRUE(w->is_success());
}

// The two waits that block the host until the device is done: wait(timeout) given an explicit
// timeout (DistTimeoutError when it passes first, the collective staying queued) and barrier()'s.
TEST(NcclWorldOne, ExplicitTimeoutAndBarrierWaitOnTheHost) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  Tensor t = make(seq(4, 1), kFloat32, 0);
  cuda::synchronize(0);
  cuda::spin(kSpinCycles);
  cuda::Event spun;
  spun.record();
  WorkPtr w = pg->allreduce(t);
  test::expect_error<DistTimeoutError>(
      [&] { w->wait(1ms); },
      {"[nccl] allreduce #0 on rank 0 of 1 timed out after 1 ms (still running on the device)"});
  EXPECT_FALSE(w->is_completed());
  EXPECT_TRUE(w->wait(120s));
  EXPECT_TRUE(spun.query()) << "wait(timeout) returned before the device got there";
  EXPECT_TRUE(w->is_completed());
  EXPECT_TRUE(w->is_success());
  EXPECT_EQ(differs(t, seq(4, 1)), "");

  cuda::spin(kSpinCycles);
  cuda::Event spun_again;
  spun_again.record();
  pg->barrier()->wait();
  EXPECT_TRUE(spun_again.query()) << "barrier()'s wait() returned before the device got there";
}

// Note [comm hook ordering]: a collective issued from a Future callback is refused (without
// taking a sequence number), naming the backend, collective and rank.
TEST(NcclWorldOne, CollectiveFromACallbackIsRefused) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  Tensor t = make(seq(4, 1), kFloat32, 0);
  const uint64_t seq0 = pg->sequence_number();
  auto next = pg->allreduce(t)->future()->then([pg, t](Future&) mutable {
    pg->broadcast(t);
    return std::vector<Tensor>{t};
  });
  test::expect_error<ValueError>(
      [&] { next->wait(60s); },
      {"[nccl] broadcast on rank 0 of 1: collectives cannot be issued from a Future callback",
       "GradBucket::defer"});
  EXPECT_EQ(pg->sequence_number(), seq0 + 1);
  pg->allreduce(t)->wait();  // the group still works
  EXPECT_EQ(differs(t, seq(4, 1)), "");
}

// The issue's DDP check: at world size 1 a comm hook forces DDP through its communication path
// (reducer.cpp: without a hook or bucket views it skips it), and at step 2 the last bucket's
// hook spins the stream before it communicates. backward() must return while the spin still
// runs (nothing in the step, the hook's deferred rounds included, blocks the host on
// communication), and the gradients must equal those of the same DDP and hook without the spin
// (a missing stream wait would read them before the delayed collective wrote them).
void expect_backward_does_not_wait(const std::function<CommHook()>& make_hook) {
  const Device gpu = cuda_device(0);
  struct Delay {
    bool on = false;
    std::shared_ptr<cuda::Event> spun;
  };
  auto delay = std::make_shared<Delay>();
  auto make = [&](bool delayed) {
    auto model = test::make_cnn(5);
    model->to(gpu);
    DDPOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;  // one bucket per parameter
    auto ddp = std::make_shared<DistributedDataParallel>(model, world_of_one(), o);
    ddp->register_comm_hook([delay, delayed, hook = make_hook()](GradBucket& b) {
      if (delayed && delay->on && b.is_last()) {
        cuda::spin(kSpinCycles);
        delay->spun = std::make_shared<cuda::Event>();
        delay->spun->record();
      }
      return hook(b);
    });
    return std::make_pair(model, ddp);
  };
  auto [model, ddp] = make(true);
  auto [ref_model, ref] = make(false);
  for (int step = 0; step < 3; ++step) {  // the buckets are rebuilt before step 1
    SCOPED_TRACE("step " + std::to_string(step));
    const test::Batch b = test::to_device(test::cnn_batch(70 + step, 6), gpu);
    model->zero_grad();
    ref_model->zero_grad();
    cuda::synchronize(0);
    delay->on = step == 2;
    test::loss_of(*ddp, b).backward();
    if (delay->on) {
      ASSERT_NE(delay->spun, nullptr) << "the last bucket's hook did not run";
      EXPECT_FALSE(delay->spun->query())
          << "backward() returned only after the device finished: something in DDP's step "
             "blocked the host on the collective";
    }
    test::loss_of(*ref, b).backward();
    cuda::synchronize(0);
    const auto got = model->named_parameters();
    const auto want = ref_model->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      try {
        test::require_close(got[i].first, got[i].second.grad(), want[i].second.grad(), 1e-6);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }
  }
}

TEST(NcclWorldOne, DdpBackwardDoesNotWaitForTheDevice) {
  EMBER_REQUIRE_NCCL_DEVICE();
  expect_backward_does_not_wait([] { return CommHook(allreduce_hook); });
}

// PowerSGD's rounds (GradBucket::defer) chain on the stream: no round blocks the host.
TEST(NcclWorldOne, DdpPowerSGDBackwardDoesNotWaitForTheDevice) {
  EMBER_REQUIRE_NCCL_DEVICE();
  expect_backward_does_not_wait([] {
    PowerSGDOptions o;
    o.start_powerSGD_iter = 0;  // compress from the first step
    return bind_hook(std::make_shared<PowerSGDState>(o), powersgd_hook);
  });
}

// Writes queued on the caller's stream before the call are seen by the collective, and
// Work::wait orders later work on the caller's stream after it.
TEST(NcclWorldOne, OrdersWithTheCallersStream) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  cuda::Stream side = cuda::Stream::create(0);
  cuda::StreamGuard guard(side);
  Tensor t = zeros({1 << 20}, TensorOptions(kFloat32).device(cuda_device(0)));
  t.fill_(5.0);  // queued on `side`
  std::vector<Tensor> outs{empty({1 << 20}, TensorOptions(kFloat32).device(cuda_device(0)))};
  std::vector<Tensor> ins{t};
  pg->alltoall(outs, ins)->wait();
  outs[0].add_(1.0);  // on `side`, after the wait
  const std::vector<double> v = values(outs[0]);
  ASSERT_EQ(v.size(), size_t{1} << 20);
  EXPECT_EQ(v.front(), 6.0);
  EXPECT_EQ(v.back(), 6.0);
}

TEST(NcclWorldOne, BadArgumentsNameTheOpAndValues) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  Tensor cpu = ones({3});
  test::expect_error<ValueError>([&] { pg->allreduce(cpu); }, {"[nccl] allreduce expects CUDA "
                                                               "tensors on cuda:0"});
  Tensor nc = zeros({4, 4}, TensorOptions(kFloat32).device(cuda_device(0))).t();
  test::expect_error<ValueError>([&] { pg->broadcast(nc); }, {"non-contiguous"});
  Tensor b = zeros({2}, TensorOptions(kBool).device(cuda_device(0)));
  test::expect_error<TypeError>([&] { pg->allreduce(b); }, {"got tensor of dtype bool"});
  Tensor f = zeros({2}, TensorOptions(kFloat32).device(cuda_device(0)));
  test::expect_error<ValueError>([&] { pg->broadcast(f, bc(1)); }, {"root 1 is not a rank"});
  test::expect_error<ValueError>([&] { pg->send(f, 0); }, {"dst 0 must be another rank"});
  test::expect_error<ValueError>([&] { pg->recv(f, 3); }, {"src 3 must be another rank"});
  Tensor wrong = zeros({3}, TensorOptions(kFloat32).device(cuda_device(0)));
  test::expect_error<ValueError>([&] { pg->allgather_into_tensor(wrong, f); },
                                 {"expects an output of 1 x 2 = 2 elements"});
  std::vector<Tensor> none;
  test::expect_error<ValueError>([&] { pg->reduce_scatter(f, none); },
                                 {"expected 1 input tensors (one per rank), got 0"});
  // Failed validation uses no sequence number.
  const uint64_t s = pg->sequence_number();
  test::expect_error<ValueError>([&] { pg->allreduce(cpu); }, {"[nccl] allreduce"});
  EXPECT_EQ(pg->sequence_number(), s);
}

// Rank 0 of 2 whose peer never comes: creating the communicator times out, naming the rank.
TEST(NcclWorldOne, CreationTimesOutWhenAPeerNeverJoins) {
  EMBER_REQUIRE_NCCL_DEVICE();
  ProcessGroupNccl::NcclOptions o;
  o.timeout = 3s;
  o.device = 0;
  const auto start = std::chrono::steady_clock::now();
  test::expect_error<DistTimeoutError>(
      [&] { ProcessGroupNccl pg(std::make_shared<HashStore>(), 0, 2, o); },
      {"[nccl] rank 0 of 2: creating the communicator on cuda:0 did not complete within 3000 ms"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s);
  // Rank 1 waits for rank 0's ncclUniqueId first.
  test::expect_error<DistTimeoutError>(
      [&] { ProcessGroupNccl pg(std::make_shared<HashStore>(), 1, 2, o); },
      {"[nccl] rank 1 of 2: rank 0 did not publish its ncclUniqueId within 3000 ms"});
}

// DDP over NCCL at world size 1: a CNN on the GPU, one bucket per parameter, trains as the same
// model does without DDP (with and without gradient_as_bucket_view), and its parameters and
// gradients stay on the GPU.
TEST(NcclWorldOne, DdpTrainsAsWithoutDdp) {
  EMBER_REQUIRE_NCCL_DEVICE();
  const Device gpu = cuda_device(0);
  for (bool view : {false, true}) {
    SCOPED_TRACE(view ? "gradient_as_bucket_view" : "gradients copied");
    auto model = test::make_cnn(5);
    model->to(gpu);
    auto ref = test::make_cnn(5);
    ref->to(gpu);
    DDPOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;
    o.gradient_as_bucket_view = view;
    auto ddp = std::make_shared<DistributedDataParallel>(model, world_of_one(), o);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05, .momentum = 0.9});
    nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.05, .momentum = 0.9});
    for (int step = 0; step < 4; ++step) {
      const test::Batch b = test::to_device(test::cnn_batch(70 + step, 6), gpu);
      opt.zero_grad();
      ref_opt.zero_grad();
      test::loss_of(*ddp, b).backward();
      test::loss_of(*ref, b).backward();
      opt.step();
      ref_opt.step();
    }
    const auto a = model->named_parameters();
    const auto r = ref->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(a[i].second.is_cuda() && a[i].second.grad().is_cuda()) << a[i].first;
      try {
        test::require_close(a[i].first, a[i].second, r[i].second, 1e-5);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }
  }
}

// ---- CUDA graphs (Note [NCCL in a CUDA graph]) -----------------------------------------------

// A collective captured in a graph runs at every replay, on what its tensors hold then, and its
// Future's callback (queued at capture) runs with it.
TEST(NcclWorldOne, CapturedCollectivesRunAtEachReplay) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  Tensor in = make(seq(6, 1), kFloat32, 0);
  Tensor gathered = make(seq(6, 50), kFloat32, 0);
  Tensor doubled;
  cuda::CUDAGraph graph;
  cuda::graph(graph, [&] {
    WorkPtr w = pg->allgather_into_tensor(gathered, in);
    auto next =
        w->future()->then([](Future& f) { return std::vector<Tensor>{f.value().at(0) * 2}; });
    doubled = next->value().at(0);  // joins the group's stream back into the capture
  });
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    in.copy_(make(seq(6, 10 * r), kFloat32, 0));
    graph.replay();
    cuda::synchronize(0);
    EXPECT_EQ(differs(gathered, seq(6, 10 * r)), "");
    std::vector<double> twice = seq(6, 10 * r);
    for (double& v : twice) v *= 2;
    EXPECT_EQ(differs(doubled, twice), "");
  }
  // Eager collectives still work beside the graph.
  Tensor t = make(seq(4, 1), kFloat32, 0);
  pg->allreduce(t)->wait();
  EXPECT_EQ(differs(t, seq(4, 1)), "");
}

// A captured collective's Work, used as eager code uses it: wait() inside the capture joins the
// group's stream back (the capture ends cleanly) and a timed wait is refused; after the capture
// the Work reports no failure and its wait() is a no-op, while each replay runs the collective.
TEST(NcclWorldOne, CapturedWorkWaitsInsideTheCaptureAndAnswersAfterIt) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  Tensor t = make(seq(5, 1), kFloat32, 0);
  Tensor out;
  WorkPtr kept;
  cuda::CUDAGraph graph;
  cuda::graph(graph, [&] {
    kept = pg->allreduce(t);
    test::expect_error<ValueError>([&] { kept->wait(std::chrono::seconds(1)); },
                                   {"allreduce", "captured in a CUDA graph", "without a timeout"});
    EXPECT_TRUE(kept->wait());
    out = t * 3;
  });
  EXPECT_TRUE(kept->is_completed());
  EXPECT_EQ(kept->exception(), nullptr);
  EXPECT_TRUE(kept->wait());
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    t.copy_(make(seq(5, 10 * r), kFloat32, 0));
    graph.replay();
    cuda::synchronize(0);
    std::vector<double> thrice = seq(5, 10 * r);
    for (double& v : thrice) v *= 3;
    EXPECT_EQ(differs(out, thrice), "");
  }
}

// What cannot be captured is refused clearly, and the stream works on after the failed capture:
// barrier() (its wait blocks the host), a collective whose Work is never waited on inside the
// capture (the group's stream is not joined back), and replaying a graph whose group is gone.
TEST(NcclWorldOne, WhatCannotBeCapturedIsRefusedClearly) {
  EMBER_REQUIRE_NCCL_DEVICE();
  auto pg = world_of_one();
  cuda::CUDAGraph graph;
  test::expect_error<ValueError>([&] { cuda::graph(graph, [&] { pg->barrier(); }); },
                                 {"barrier", "cannot be captured in a CUDA graph"});
  EXPECT_FALSE(graph.ready());
  Tensor t = make(seq(4, 1), kFloat32, 0);
  test::expect_error<CudaError>([&] { cuda::graph(graph, [&] { pg->allreduce(t); }); },
                                {"was not joined back", "wait()"});
  pg->allreduce(t)->wait();  // the group and the stream work on
  EXPECT_EQ(differs(t, seq(4, 1)), "");

  auto doomed = world_of_one();
  cuda::CUDAGraph orphan;
  cuda::graph(orphan, [&] { doomed->allreduce(t)->wait(); });
  orphan.replay();
  cuda::synchronize(0);
  doomed.reset();
  test::expect_error<DistError>([&] { orphan.replay(); },
                                {"allreduce", "process group has been destroyed"});
}

// DDP over NCCL with a communication hook (so the bucket's collective runs at world size 1) and a
// capturable AdamW: the whole step captured once and replayed trains as the same step run
// eagerly. The hook halves the reduced gradient in a Future callback, so a replay that skipped
// the hook's chain would drift from the eager run.
TEST(NcclWorldOne, DdpStepCapturedInACudaGraphTrainsAsEagerSteps) {
  EMBER_REQUIRE_NCCL_DEVICE();
  const Device gpu = cuda_device(0);
  struct Run {
    std::shared_ptr<nn::Module> model;
    std::shared_ptr<DistributedDataParallel> ddp;
    std::shared_ptr<nn::optim::AdamW> opt;
    void step(const test::Batch& b) {
      opt->zero_grad();
      test::loss_of(*ddp, b).backward();
      opt->step();
    }
  };
  auto make = [&](bool capturable) {
    auto model = test::make_cnn(5);
    model->to(gpu);
    DDPOptions o;
    o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-6;  // several buckets, several collectives
    auto ddp = std::make_shared<DistributedDataParallel>(model, world_of_one(), o);
    ddp->register_comm_hook([](GradBucket& b) {
      return allreduce_hook(b)->then([](Future& f) {
        Tensor g = f.value().at(0);
        g.mul_(0.5);
        return std::vector<Tensor>{g};
      });
    });
    auto opt = std::make_shared<nn::optim::AdamW>(
        ddp->parameters(), nn::optim::AdamWOptions{.lr = 0.01, .capturable = capturable});
    return Run{model, ddp, opt};
  };
  Run run = make(true), ref = make(false);
  test::Batch in = test::to_device(test::cnn_batch(70, 6), gpu);  // the graph's static batch
  cuda::CUDAGraph graph;
  for (int s = 0; s < 7; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const test::Batch b = test::to_device(test::cnn_batch(70 + s, 6), gpu);
    in.x.copy_(b.x);
    in.y.copy_(b.y);
    ref.step(b);
    if (s < 3) {  // eager: DDP rebuilds its buckets, the optimizer makes its state
      run.step(in);
    } else {
      if (!graph.ready()) cuda::graph(graph, [&] { run.step(in); });
      graph.replay();
    }
  }
  cuda::synchronize(0);
  const auto a = run.model->named_parameters();
  const auto r = ref.model->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    try {
      test::require_close(a[i].first, a[i].second, r[i].second, 1e-5);
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

// FSDP over NCCL at world size 1, as scripts/gpu_check.sh's GPT-2 124M run uses it: every block
// and the root sharded, resharding after forward, float32 and bf16 parameters; 10 steps of Adam
// end where DDP over NCCL ends, and the arenas give their memory back.
TEST(NcclWorldOne, FsdpTrainsAsDdp) {
  EMBER_REQUIRE_NCCL_DEVICE();
  const Device gpu = cuda_device(0);
  const auto bs = test::fsdp_batches(10, 7);
  auto ref = test::make_fsdp_net(3);
  ref->to(gpu);
  {
    auto ddp = std::make_shared<DistributedDataParallel>(ref, world_of_one());
    nn::optim::Adam opt(ddp->parameters(), test::fsdp_adam());
    for (const test::Batch& b : bs) {
      opt.zero_grad();
      test::fsdp_loss(*ddp, test::to_device(b, gpu)).backward();
      opt.step();
    }
  }
  const nn::NamedTensors want = ref->state_dict();
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 parameters" : "float32");
    auto model = test::make_fsdp_net(3);
    model->to(gpu);
    FullyShardOptions o{.group = world_of_one(), .reshard_after_forward = true};
    if (bf16) o.mp_policy = {.param_dtype = kBFloat16, .reduce_dtype = kFloat32};
    for (auto& blk : model->blocks) fully_shard(blk, o);
    fully_shard(model, o);
    nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
    for (const test::Batch& b : bs) {
      opt.zero_grad();
      const test::Batch m = test::to_device(b, gpu);
      nn::functional::mse_loss((*model)(m.x).to(kFloat32), m.y).backward();
      opt.step();
    }
    const nn::NamedTensors got = full_state_dict(*model);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].first, want[i].first);
      try {
        test::require_close(got[i].first, got[i].second.cpu(), want[i].second.cpu(),
                            bf16 ? 0.05 : 1e-4);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }
    detail::flush_released_cuda_arenas(0);
    EXPECT_EQ(detail::cuda_arena_held_bytes(0), 0) << "arena memory held after the last step";
  }
}

// A sharded step whose reshards fit in what may be pending (Note [CUDA arenas]: one block and
// the root) queued behind a spinning stream returns before the device gets to it: the gathers,
// the reduce-scatter, the releases and Adam's update wait on the device, not on the host.
TEST(NcclWorldOne, FsdpStepDoesNotWaitForTheDevice) {
  EMBER_REQUIRE_NCCL_DEVICE();
  const Device gpu = cuda_device(0);
  auto model = test::make_fsdp_net(1);
  model->to(gpu);
  FullyShardOptions o{.group = world_of_one(), .reshard_after_forward = true};
  fully_shard(model->blocks[0], o);
  fully_shard(model, o);
  nn::optim::Adam opt(fsdp_parameters(*model), test::fsdp_adam());
  const auto bs = test::fsdp_batches(3, 7);
  for (size_t i = 0; i < bs.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    const test::Batch m = test::to_device(bs[i], gpu);
    cuda::synchronize(0);
    std::shared_ptr<cuda::Event> spun;
    if (i + 1 == bs.size()) {  // the earlier steps warm the allocator and the communicator
      cuda::spin(kSpinCycles);
      spun = std::make_shared<cuda::Event>();
      spun->record();
    }
    opt.zero_grad();
    test::fsdp_loss(*model, m).backward();
    opt.step();
    if (spun) {
      EXPECT_FALSE(spun->query())
          << "the step returned only after the device finished: something in it waited on "
             "the host";
    }
  }
  cuda::synchronize(0);
  detail::flush_released_cuda_arenas(0);
}

TEST(NcclWorldOne, InitProcessGroupUsesTheBackend) {
  EMBER_REQUIRE_NCCL_DEVICE();
  InitOptions o;
  o.backend = "nccl";
  o.store = std::make_shared<HashStore>();
  o.rank = 0;
  o.world_size = 1;
  o.timeout = 60s;
  auto pg = init_process_group(o);
  EXPECT_EQ(pg->backend_name(), "nccl");
  Tensor t = make({1, 2}, kFloat32, 0);
  pg->allreduce(t)->wait();
  EXPECT_EQ(differs(t, {1, 2}), "");
  destroy_process_group();
}

// ---- two processes -------------------------------------------------------------------------
//
// The parent re-runs this binary twice (fork + exec, so the children start with a fresh CUDA
// context whatever this process has done) with --gtest_filter naming NcclTwoRanks.Child and the
// rank, case and store path in the environment; each child exits 0 when its test passed.

constexpr const char* kChildRank = "EMBER_NCCL_TEST_RANK";
constexpr const char* kChildStore = "EMBER_NCCL_TEST_STORE";
constexpr const char* kChildCase = "EMBER_NCCL_TEST_CASE";

/// Runs the child test in 2 processes; returns one line per child that failed.
std::vector<std::string> run_children(const std::string& which, const std::string& store_path,
                                      int timeout_s) {
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) return {"fork failed"};
    if (pid == 0) {
      ::setenv(kChildRank, std::to_string(r).c_str(), 1);
      ::setenv(kChildStore, store_path.c_str(), 1);
      ::setenv(kChildCase, which.c_str(), 1);
      ::execl("/proc/self/exe", "nccl_test_child", "--gtest_filter=NcclTwoRanks.Child",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<std::string> errors;
  std::vector<int> status(pids.size(), -1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  const bool all_exited = test::eventually(
      [&] {
        bool all = true;
        for (size_t i = 0; i < pids.size(); ++i) {
          if (status[i] != -1) continue;
          int st = 0;
          if (::waitpid(pids[i], &st, WNOHANG) == pids[i]) {
            status[i] = st;
          } else {
            all = false;
          }
        }
        return all;
      },
      static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                           deadline - std::chrono::steady_clock::now())
                           .count()));
  for (size_t i = 0; i < pids.size(); ++i) {
    if (status[i] == -1) {
      ::kill(pids[i], SIGKILL);
      ::waitpid(pids[i], nullptr, 0);
      errors.push_back("rank " + std::to_string(i) + ": still running after " +
                       std::to_string(timeout_s) + " s (killed)");
    } else if (!WIFEXITED(status[i]) || WEXITSTATUS(status[i]) != 0) {
      errors.push_back("rank " + std::to_string(i) + ": exited with status " +
                       std::to_string(status[i]) + " (its gtest output is above)");
    }
  }
  (void)all_exited;
  return errors;
}

void two_rank_test(const std::string& which) {
  if (!nccl_available()) GTEST_SKIP() << "built without nccl (EMBER_WITH_NCCL=OFF)";
  if (cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, found " << cuda::device_count()
                 << (cuda::is_available() ? "" : std::string(": ") + cuda::unavailable_reason());
  }
  test::TempDir dir;
  for (const std::string& e : run_children(which, dir.file("store"), 300)) ADD_FAILURE() << e;
}

TEST(NcclTwoRanks, EveryCollectiveEveryDtype) { two_rank_test("collectives"); }
TEST(NcclTwoRanks, StalledRankTimesOutAndAborts) { two_rank_test("timeout"); }

// rank r's input: (r + 1) + i.
void child_collectives(ProcessGroupNccl& pg, int rank) {
  const int n = 6;
  auto in = [&](int r) { return seq(n, r + 1); };
  for (Dtype d : kDtypes) {
    const std::string where = "rank " + std::to_string(rank) + ", " + std::string(dtype_name(d));
    const bool integral = d == kInt32 || d == kInt64 || d == kUInt8;
    for (ReduceOp op : kOps) {
      std::vector<double> want(n);
      for (int i = 0; i < n; ++i) {
        const double a = 1 + i, b = 2 + i;
        switch (op) {
          case ReduceOp::Sum:
            want[i] = a + b;
            break;
          case ReduceOp::Avg:
            want[i] = integral ? std::trunc((a + b) / 2) : (a + b) / 2;
            break;
          case ReduceOp::Product:
            want[i] = a * b;
            break;
          case ReduceOp::Min:
            want[i] = a;
            break;
          case ReduceOp::Max:
            want[i] = b;
            break;
        }
      }
      Tensor t = make(in(rank), d, pg.device());
      pg.allreduce(t, ar(op))->wait();
      EXPECT_EQ(differs(t, want), "") << "allreduce " << to_string(op) << ", " << where;
      Tensor r = make(in(rank), d, pg.device());
      pg.reduce(r, rd(1, op))->wait();
      if (rank == 1) {
        EXPECT_EQ(differs(r, want), "") << "reduce " << to_string(op) << ", " << where;
      }
    }
    // reduce_scatter: rank r's inputs[j] = r + j + i; rank j gets sum_r = 1 + 2j + 2i.
    Tensor out = make(seq(n, 0), d, pg.device());
    std::vector<Tensor> ins{make(seq(n, rank + 0), d, pg.device()),
                            make(seq(n, rank + 1), d, pg.device())};
    pg.reduce_scatter(out, ins, rs(ReduceOp::Sum))->wait();
    std::vector<double> want_rs(n);
    for (int i = 0; i < n; ++i) want_rs[i] = 1 + 2 * rank + 2 * i;
    EXPECT_EQ(differs(out, want_rs), "") << "reduce_scatter, " << where;
    // reduce_scatter_tensor: the same two blocks, concatenated in one input.
    std::vector<double> both = seq(n, rank + 0), second = seq(n, rank + 1);
    both.insert(both.end(), second.begin(), second.end());
    Tensor out_t = make(seq(n, 0), d, pg.device());
    pg.reduce_scatter_tensor(out_t, make(both, d, pg.device()), rs(ReduceOp::Sum))->wait();
    EXPECT_EQ(differs(out_t, want_rs), "") << "reduce_scatter_tensor, " << where;

    Tensor b = make(in(rank), d, pg.device());
    pg.broadcast(b, bc(1))->wait();
    EXPECT_EQ(differs(b, in(1)), "") << "broadcast, " << where;

    Tensor g = make(seq(2 * n, 0), d, pg.device());
    pg.allgather_into_tensor(g, make(in(rank), d, pg.device()))->wait();
    std::vector<double> want_g = in(0);
    for (double v : in(1)) want_g.push_back(v);
    EXPECT_EQ(differs(g, want_g), "") << "allgather_into_tensor, " << where;

    // alltoall: rank r's inputs[j] = 10r + j + i (sizes differ per peer: n + j);
    // rank r's outputs[q] = 10q + r + i.
    std::vector<Tensor> a_in, a_out;
    for (int j = 0; j < 2; ++j) {
      a_in.push_back(make(seq(n + j, 10 * rank + j), d, pg.device()));
      a_out.push_back(make(seq(n + rank, 0), d, pg.device()));
    }
    pg.alltoall(a_out, a_in)->wait();
    for (int q = 0; q < 2; ++q) {
      EXPECT_EQ(differs(a_out[q], seq(n + rank, 10 * q + rank)), "")
          << "alltoall from rank " << q << ", " << where;
    }

    Tensor p2p = make(rank == 0 ? seq(n, 7) : seq(n, 0), d, pg.device());
    if (rank == 0) {
      pg.send(p2p, 1)->wait();
    } else {
      pg.recv(p2p, 0)->wait();
      EXPECT_EQ(differs(p2p, seq(n, 7)), "") << "send/recv, " << where;
    }
  }
  pg.barrier()->wait();
}

// Rank 1 stops issuing collectives; rank 0's allreduce times out, the communicator is
// aborted, and later calls fail with that first error.
void child_timeout(ProcessGroupNccl& pg, int rank, Store& store) {
  Tensor t = make({1, 2, 3}, kFloat32, pg.device());
  pg.allreduce(t)->wait();  // both ranks: the communicator works
  if (rank == 1) {
    // Stalled, not dead: alive (its communicator too) until rank 0 has seen the timeout.
    store.get("rank0_done", 120s);
    return;
  }
  AllreduceOptions o;
  o.timeout = 2s;
  WorkPtr w = pg.allreduce(t, o);
  // Stream-ordered: wait() returns at once; the watchdog finds the timeout and aborts, and the
  // error reaches the caller at its next wait() or collective.
  w->wait();
  ASSERT_TRUE(test::eventually([&] { return w->is_completed(); }, 60000))
      << "the watchdog did not abort within 60 s";
  EXPECT_FALSE(w->is_success());
  const std::string timed_out =
      "[nccl] allreduce #1 on rank 0 of 2 timed out after 2000 ms; the communicator was aborted";
  test::expect_error<DistTimeoutError>([&] { w->wait(); }, {timed_out});
  test::expect_error<DistBackendError>([&] { pg.allreduce(t); },
                                       {"[nccl] allreduce #2 on rank 0 of 2 failed: the group is "
                                        "unusable after an earlier failure: ", timed_out});
  test::expect_error<DistBackendError>([&] { pg.barrier(); },
                                       {"unusable after an earlier failure"});
  store.set("rank0_done", Bytes{1});
}

TEST(NcclTwoRanks, Child) {
  const char* r = std::getenv(kChildRank);
  const char* path = std::getenv(kChildStore);
  const char* which = std::getenv(kChildCase);
  if (r == nullptr || path == nullptr || which == nullptr) {
    GTEST_SKIP() << "runs only as a child process of the other NcclTwoRanks tests";
  }
  const int rank = std::atoi(r);
  ProcessGroupNccl::NcclOptions o;
  o.timeout = 120s;
  o.device = rank;
  auto store = std::make_shared<FileStore>(path, 2);
  ProcessGroupNccl pg(std::make_shared<PrefixStore>("nccl", store), rank, 2, o);
  EXPECT_EQ(pg.device(), rank);
  if (std::string(which) == "collectives") {
    child_collectives(pg, rank);
  } else {
    child_timeout(pg, rank, *store);
  }
}

}  // namespace
}  // namespace ember::dist
