// DDP communication hooks, PowerSGD and the bucket rebuild, over gloo with 1, 2 and 4 real
// processes on 127.0.0.1. Expected values come from a DDP without a hook or a single-process
// reference computed in the same rank, or from closed forms (element counts from the shapes,
// an exactly rank-1 average).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <map>
#include <numeric>
#include <mutex>
#include <thread>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops/random.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/composite_group.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::require;
using test::require_close;
using test::require_same_on_all_ranks;
using test::Batch;
using test::slice;
using test::loss_of;

constexpr int64_t kBatch = 12;  // divisible by 1, 2 and 4 ranks
constexpr int64_t kIn = 24;
constexpr int64_t kOut = 4;

// Counts what the wrapped group all-reduces and which thread issued each collective.
class CountingGroup : public test::CompositeGroup {
 public:
  using CompositeGroup::CompositeGroup;
  WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
    note(t.numel(), t.nbytes());
    return inner_->allreduce(t, o);
  }
  WorkPtr broadcast(Tensor& t, const BroadcastOptions& o) override {
    note(-1, 0);
    return inner_->broadcast(t, o);
  }
  WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in,
                                const CollectiveOptions& o) override {
    note(-2, 0);
    return inner_->allgather_into_tensor(out, in, o);
  }

  /// All-reduced element counts since the last take(); throws if a collective came from
  /// another thread than `owner`.
  std::vector<int64_t> take(std::thread::id owner) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto id : threads_) require(id == owner, "a collective was issued from another thread");
    threads_.clear();
    std::vector<int64_t> out;
    for (int64_t n : log_)
      if (n >= 0) out.push_back(n);
    log_.clear();
    bytes_ = 0;
    return out;
  }
  /// Broadcasts since the last take() (without clearing the log).
  int64_t broadcasts() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::count(log_.begin(), log_.end(), int64_t{-1});
  }
  /// Bytes all-reduced since the last take().
  int64_t bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }

 private:
  void note(int64_t n, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back(n);
    bytes_ += bytes;
    threads_.push_back(std::this_thread::get_id());
  }
  std::mutex mu_;
  std::vector<int64_t> log_;
  std::vector<std::thread::id> threads_;
  int64_t bytes_ = 0;
};

void run_group(int n, const std::function<void(std::shared_ptr<CountingGroup>, int)>& body) {
  test::run_gloo_ranks(n, [&](std::shared_ptr<ProcessGroupGloo> pg, int rank) { body(std::make_shared<CountingGroup>(pg), rank); });
}

// An MLP whose weights PowerSGD compresses at rank 1: [32, 24], [16, 32], [4, 16].
std::shared_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(kIn, 32), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(32, 16), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(16, kOut));
}
// Elements of make_model's parameters, and what rank-1 PowerSGD sends for them: the biases
// (32 + 16 + 4) plus (n + m) per weight.
constexpr int64_t kModelNumel = 32 * 24 + 32 + 16 * 32 + 16 + 4 * 16 + 4;           // 1396
constexpr int64_t kCompressedNumel = (32 + 16 + 4) + (32 + 24) + (16 + 32) + (4 + 16);  // 176

std::shared_ptr<nn::Sequential> clone_model(const nn::Module& m) {
  auto c = make_model(999);
  c->load_state_dict(m.state_dict());
  return c;
}

Batch fixed_batch(uint64_t seed, int64_t in = kIn) {
  manual_seed(seed);
  return {randn({kBatch, in}), randn({kBatch, kOut})};
}

// A bucket cap in MiB from bytes.
double mib(double bytes) { return bytes / (1024 * 1024); }


void require_grads_close(const std::string& what, const nn::Module& got, const nn::Module& ref,
                         double tol) {
  const auto a = got.named_parameters();
  const auto b = ref.named_parameters();
  require(a.size() == b.size(), what + ": parameter count");
  for (size_t i = 0; i < a.size(); ++i)
    require_close(what + " grad of " + a[i].first, a[i].second.grad(), b[i].second.grad(), tol);
}

// Gathers a vector of int64 from every rank; throws unless all ranks hold the same values.
void require_same_ints(ProcessGroup& pg, const std::string& what, std::vector<int64_t> mine) {
  const int64_t k = static_cast<int64_t>(mine.size());
  Tensor lens = zeros({pg.size()}, kInt64);
  Tensor len = from_vector(std::vector<int64_t>{k});
  pg.allgather_into_tensor(lens, len)->wait();
  for (int64_t l : lens.to_vector<int64_t>())
    require(l == k, what + ": ranks hold different numbers of values");
  if (k == 0) return;
  Tensor all = zeros({pg.size() * k}, kInt64);
  pg.allgather_into_tensor(all, from_vector(mine))->wait();
  const auto v = all.to_vector<int64_t>();
  for (int r = 1; r < pg.size(); ++r)
    for (int64_t i = 0; i < k; ++i)
      require(v[r * k + i] == v[i], what + ": value " + std::to_string(i) + " differs: rank 0 " +
                                        std::to_string(v[i]) + ", rank " + std::to_string(r) +
                                        " " + std::to_string(v[r * k + i]));
}

// Throws unless every rank's parameters hold identical bits.

std::vector<int64_t> flatten(const std::vector<std::vector<size_t>>& buckets) {
  std::vector<int64_t> out;
  for (const auto& b : buckets) {
    out.push_back(-static_cast<int64_t>(b.size()) - 1);  // a separator that encodes the size
    for (size_t k : b) out.push_back(static_cast<int64_t>(k));
  }
  return out;
}

double sum_of(const std::vector<int64_t>& v) {
  double s = 0;
  for (int64_t x : v) s += static_cast<double>(x);
  return s;
}

class Hooks : public ::testing::TestWithParam<int> {};

// Several iterations (new batches, same weights) on a DDP with `hook` and one without: the
// hook's gradients must be within `tol` of the plain average.
void compare_with_plain(std::shared_ptr<CountingGroup> pg, int rank, int n, const CommHook& hook,
                        double tol, int steps = 3) {
  auto model = make_model(10 + rank);
  auto plain_model = make_model(10 + rank);
  DDPOptions o;
  o.bucket_cap_mb = mib(1500);  // a few buckets
  DistributedDataParallel ddp(model, pg, o);
  DistributedDataParallel plain(plain_model, pg, o);
  ddp.register_comm_hook(hook);
  for (int step = 0; step < steps; ++step) {
    const Batch b = fixed_batch(20 + step);
    model->zero_grad();
    plain_model->zero_grad();
    loss_of(ddp, slice(b, rank, n)).backward();
    loss_of(plain, slice(b, rank, n)).backward();
    require_grads_close("step " + std::to_string(step), *model, *plain_model, tol);
  }
}

TEST_P(Hooks, AllreduceHookIsIdenticalToNoHook) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    compare_with_plain(pg, rank, n, allreduce_hook, 0.0);
  });
}

// float16 keeps 11 significant bits, bfloat16 8: each cast and the pre-division round once.
TEST_P(Hooks, Fp16CompressWithinHalfTolerance) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    compare_with_plain(pg, rank, n, fp16_compress_hook, 4e-3);
  });
}

TEST_P(Hooks, Bf16CompressWithinBfloat16Tolerance) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    compare_with_plain(pg, rank, n, bf16_compress_hook, 3e-2);
  });
}

TEST_P(Hooks, CompressWrappersAroundAllreduce) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    compare_with_plain(pg, rank, n, fp16_compress_wrapper(allreduce_hook), 4e-3, 2);
  });
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    compare_with_plain(pg, rank, n, bf16_compress_wrapper(allreduce_hook), 3e-2, 2);
  });
}

// fp16 all-reduces half the bytes: the hook's all-reduce runs on float16 tensors.
TEST_P(Hooks, Fp16CompressSendsHalves) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    auto model = make_model(3);
    DistributedDataParallel ddp(model, pg);
    std::vector<Dtype> seen;
    ddp.register_comm_hook([&seen](GradBucket& b) {
      auto f = fp16_compress_hook(b);
      f->wait();
      seen.push_back(b.buffer().dtype());
      return f;
    });
    (void)pg->take(std::this_thread::get_id());
    loss_of(ddp, slice(fixed_batch(1), rank, n)).backward();
    const int64_t bytes = pg->bytes();
    const auto sent = pg->take(std::this_thread::get_id());
    require(sum_of(sent) == kModelNumel, "fp16 hook all-reduced " +
                                             std::to_string(sum_of(sent)) + " elements");
    require(bytes == 2 * kModelNumel, "fp16 hook all-reduced " + std::to_string(bytes) + " bytes");
    require(seen.size() == 1 && seen[0] == kFloat32, "the bucket itself stays float32");
  });
}

// noop: every rank keeps its local gradient.
TEST_P(Hooks, NoopHookLeavesLocalGradients) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    auto model = make_model(30);
    DistributedDataParallel ddp(model, pg);
    ddp.register_comm_hook(noop_hook);
    auto local = clone_model(*model);
    const Batch b = slice(fixed_batch(31), rank, n);
    (void)pg->take(std::this_thread::get_id());
    loss_of(ddp, b).backward();
    loss_of(*local, b).backward();
    require(pg->take(std::this_thread::get_id()).empty(), "noop_hook communicated");
    require_grads_close("noop", *model, *local, 0.0);
  });
}

// A user-written stateful hook: the sum over ranks instead of the average, with a counter in
// its state (torch's (state, hook) registration).
struct SumState {
  int calls = 0;
};
std::shared_ptr<Future> sum_hook(SumState& state, GradBucket& bucket) {
  ++state.calls;
  Tensor buffer = bucket.buffer();
  AllreduceOptions o;
  o.op = ReduceOp::Sum;
  return bucket.process_group().allreduce(buffer, o)->future();
}

TEST_P(Hooks, UserHookSumsInsteadOfAveraging) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    auto model = make_model(40 + rank);
    DDPOptions o;
    o.bucket_cap_mb = mib(1500);
    DistributedDataParallel ddp(model, pg, o);
    auto state = std::make_shared<SumState>();
    ddp.register_comm_hook(state, sum_hook);
    auto ref = clone_model(*model);
    const Batch b = fixed_batch(41);
    loss_of(ddp, slice(b, rank, n)).backward();
    loss_of(*ref, b).backward();  // the full-batch mean: the average of the ranks' gradients
    for (const Tensor& p : ref->parameters()) {
      Tensor g = p.grad();
      g.mul_(n);
    }
    require_grads_close("sum hook", *model, *ref, 1e-5);
    require(state->calls == static_cast<int>(ddp.bucket_indices().size()),
            "hook calls: " + std::to_string(state->calls));
  });
}

TEST_P(Hooks, RegisterErrors) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    auto message = [](const std::function<void()>& f) {
      try {
        f();
      } catch (const ValueError& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    {
      DistributedDataParallel ddp(make_model(1), pg);
      ddp.register_comm_hook(allreduce_hook);
      const std::string twice = message([&] { ddp.register_comm_hook(noop_hook); });
      require(twice.find("already registered") != std::string::npos, "twice: '" + twice + "'");
      const std::string null = message([&] { ddp.register_comm_hook(CommHook()); });
      require(null.find("got null") != std::string::npos, "null: '" + null + "'");
    }
    DistributedDataParallel ddp(make_model(1), pg);
    loss_of(ddp, slice(fixed_batch(2), rank, n)).backward();
    const std::string late = message([&] { ddp.register_comm_hook(allreduce_hook); });
    require(late.find("[DistributedDataParallel] register_comm_hook must be called before the "
                      "first backward pass") != std::string::npos,
            "late: '" + late + "'");
  });
}

// Hooks that return a wrong-sized result are named.
TEST_P(Hooks, WrongSizedHookResultIsAnError) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    DistributedDataParallel ddp(make_model(1), pg);
    ddp.register_comm_hook([](GradBucket&) { return completed_future({zeros({3})}); });
    std::string msg;
    try {
      loss_of(ddp, slice(fixed_batch(2), rank, n)).backward();
    } catch (const ValueError& e) {
      msg = e.what();
    }
    require(msg.find("bucket 0 must hold a tensor of 1396 elements, got 3 elements") !=
                std::string::npos,
            "message: '" + msg + "'");
  });
}

// ---- PowerSGD ---------------------------------------------------------------------------------

// Several buckets, several steps: no hang, identical parameters on every rank, the statistics
// equal the closed form, and the all-reduced element counts equal what the state reports. Every
// collective comes from this thread, in the same sequence on every rank.
void powersgd_training(std::shared_ptr<CountingGroup> pg, int rank, int n, bool batched,
                       bool warm_start = true, bool error_feedback = true) {
  auto model = make_model(50 + rank);
  DDPOptions o;
  o.bucket_cap_mb = mib(300);  // [4.*, 2.bias], [2.weight], [0.*]
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
  auto state = std::make_shared<PowerSGDState>(
      PowerSGDOptions{.matrix_approximation_rank = 1,
                      .start_powerSGD_iter = 2,
                      .min_compression_rate = 2,
                      .use_error_feedback = error_feedback,
                      .warm_start = warm_start});
  if (batched) {
    ddp->register_comm_hook(state, batched_powersgd_hook);
  } else {
    ddp->register_comm_hook(state, powersgd_hook);
  }
  nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05});
  const auto me = std::this_thread::get_id();
  std::vector<int64_t> sequence;
  int64_t sent_compressed = 0;
  for (int step = 0; step < 6; ++step) {
    const Batch b = fixed_batch(60 + step);
    opt.zero_grad();
    (void)pg->take(me);
    loss_of(*ddp, slice(b, rank, n)).backward();
    const auto sent = pg->take(me);
    sequence.insert(sequence.end(), sent.begin(), sent.end());
    if (step < 2) {
      require(sum_of(sent) == kModelNumel, "vanilla step sent " + std::to_string(sum_of(sent)));
    } else {
      sent_compressed += static_cast<int64_t>(sum_of(sent));
    }
    opt.step();
  }
  require(ddp->bucket_indices().size() >= 3,
          "want several buckets, got " + std::to_string(ddp->bucket_indices().size()));
  require(state->iteration() == 6, "iteration " + std::to_string(state->iteration()));
  const auto stats = state->compression_stats();
  require(stats.numel_after == sent_compressed,
          "state reports " + std::to_string(stats.numel_after) + " elements sent, the group saw " +
              std::to_string(sent_compressed));
  require(stats.numel_before == 4 * kModelNumel, "numel_before " + std::to_string(stats.numel_before));
  if (!batched) {
    require(stats.numel_after == 4 * kCompressedNumel,
            "numel_after " + std::to_string(stats.numel_after));
    require(std::fabs(stats.rate - double(kModelNumel) / kCompressedNumel) < 1e-12, "rate");
  } else {
    require(stats.rate > 1.5, "batched rate " + std::to_string(stats.rate));
  }
  require_same_ints(*pg, "collective sequence", sequence);
  require_same_on_all_ranks(*pg, *model);
  size_t errors = 0, qs = 0;
  for (const auto& [name, t] : state->state_dict()) {
    errors += name.rfind("error.", 0) == 0;
    qs += name.rfind("q.", 0) == 0;
  }
  require((errors > 0) == error_feedback && (qs > 0) == warm_start,
          "state entries: " + std::to_string(errors) + " errors, " + std::to_string(qs) + " Qs");
  for (const Tensor& p : model->parameters()) {
    for (float v : p.detach().reshape({-1}).to_vector<float>())
      require(std::isfinite(v), "non-finite parameter");
  }
}

TEST_P(Hooks, PowerSGDSeveralBucketsRanksAgree) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    powersgd_training(pg, rank, n, false);
  });
}

TEST_P(Hooks, PowerSGDWithoutWarmStartOrErrorFeedback) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    powersgd_training(pg, rank, n, false, /*warm_start=*/false, /*error_feedback=*/false);
  });
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    powersgd_training(pg, rank, n, true, /*warm_start=*/false, /*error_feedback=*/true);
  });
}

TEST_P(Hooks, BatchedPowerSGDSeveralBucketsRanksAgree) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    powersgd_training(pg, rank, n, true);
  });
}

// torch's defaults: a 1 MiB first bucket, then 25 MiB. This model makes two buckets
// ([4.*, 2.*] reaches 1 MiB, then [0.*]).
TEST_P(Hooks, PowerSGDDefaultBucketSizes) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    manual_seed(70 + rank);
    auto model = std::make_shared<nn::Sequential>(
        std::make_shared<nn::Linear>(512, 600), std::make_shared<nn::Tanh>(),
        std::make_shared<nn::Linear>(600, 600), std::make_shared<nn::Tanh>(),
        std::make_shared<nn::Linear>(600, kOut));
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
    const auto buckets = ddp->bucket_indices();
    require(flatten(buckets) == std::vector<int64_t>{-5, 5, 4, 3, 2, -3, 1, 0},
            "default buckets");
    auto state = std::make_shared<PowerSGDState>(
        PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 1});
    ddp->register_comm_hook(fp16_compress_wrapper(bind_hook(state, powersgd_hook)));
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.01});
    for (int step = 0; step < 2; ++step) {  // one plain iteration, one compressed
      const Batch b = fixed_batch(80 + step, 512);
      opt.zero_grad();
      loss_of(*ddp, slice(b, rank, n)).backward();
      opt.step();
    }
    require(state->iteration() == 2, "iteration");
    const int64_t r = 2;
    const int64_t before = 512 * 600 + 600 + 600 * 600 + 600 + 600 * kOut + kOut;
    // The biases, P and Q of the two big weights; [4, 600] does not pay at rank 2 (2416 > 2400).
    const int64_t after = 600 + 600 + kOut + (600 + 512) * r + (600 + 600) * r + kOut * 600;
    require(state->compression_stats().numel_before == before, "numel_before");
    require(state->compression_stats().numel_after == after, "numel_after");
    require_same_on_all_ranks(*pg, *model);
  });
}

// Every rank's gradient is u v_r^T: the average u (mean v)^T has rank 1, so rank-1 PowerSGD
// reproduces it (one power iteration suffices). A full-rank gradient is not reproduced and
// leaves its error in the state. Runs the hook on a GradBucket made outside DDP.
TEST_P(Hooks, PowerSGDRankOneGradientIsExact) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    const int64_t rows = 6, cols = 5;
    Tensor u = arange(1.0, rows + 1.0).reshape({rows, 1});  // [6, 1]
    auto v_of = [&](int r) { return (arange(0.0, double(cols)) * (r + 1) - 2.0).reshape({1, cols}); };
    Tensor mean_v = zeros({1, cols});
    for (int r = 0; r < n; ++r) mean_v = mean_v + v_of(r) / double(n);
    Tensor want = mm(u, mean_v);
    Tensor bias = full({rows}, double(rank));  // uncompressed: plain average (n - 1) / 2

    Tensor w = zeros({rows, cols}).requires_grad_();
    Tensor b = zeros({rows}).requires_grad_();
    Tensor buffer = cat({mm(u, v_of(rank)).reshape({-1}), bias}, 0).contiguous();
    PowerSGDState state(PowerSGDOptions{.start_powerSGD_iter = 0});
    GradBucket bucket(0, 1, buffer, {w, b}, {0, 1}, pg);
    auto fut = powersgd_hook(state, bucket);
    fut->wait();
    const Tensor out = fut->value()[0];
    require_close("rank-1 average", out.narrow(0, 0, rows * cols).reshape({rows, cols}), want,
                  1e-5);
    require_close("bias average", out.narrow(0, rows * cols, rows), full({rows}, (n - 1) / 2.0),
                  1e-6);
    const auto stats = state.compression_stats();
    require(stats.numel_before == rows * cols + rows && stats.numel_after == rows + rows + cols,
            "stats");

    // Full rank (identity plus rank-dependent noise): not exact, the error is remembered.
    manual_seed(5);
    Tensor full_rank = eye(rows, cols) * 3.0 + randn({rows, cols}) * 0.1 * double(rank + 1);
    Tensor buffer2 = cat({full_rank.reshape({-1}), bias}, 0).contiguous();
    GradBucket bucket2(0, 1, buffer2, {w, b}, {0, 1}, pg);
    auto fut2 = powersgd_hook(state, bucket2);
    fut2->wait();
    double err = 0;
    for (const auto& [name, t] : state.state_dict())
      if (name == "error.0") err = t.abs().sum().item<float>();
    require(err > 0.1, "a full-rank gradient must leave an error, got " + std::to_string(err));

    // With r = min(n, m) = 5 the approximation P P^T M is exact if, and only if, the
    // Gram-Schmidt step makes P's 5 columns orthonormal (min_compression_rate 0.5 lets a 6 x 5
    // matrix be "compressed" at rank 5).
    PowerSGDState full_state(PowerSGDOptions{
        .matrix_approximation_rank = 8, .start_powerSGD_iter = 0, .min_compression_rate = 0.5});
    Tensor want_full = zeros({rows, cols});
    for (int r = 0; r < n; ++r) {
      manual_seed(5);
      want_full = want_full +
                  (eye(rows, cols) * 3.0 + randn({rows, cols}) * 0.1 * double(r + 1)) / double(n);
    }
    Tensor buffer3 = cat({full_rank.reshape({-1}), bias}, 0).contiguous();
    GradBucket bucket3(0, 1, buffer3, {w, b}, {0, 1}, pg);
    auto fut3 = powersgd_hook(full_state, bucket3);
    require_close("full-rank approximation", fut3->value()[0].narrow(0, 0, rows * cols).reshape({rows, cols}),
                  want_full, 1e-4);
    require(full_state.compression_stats().numel_after == rows + (rows + cols) * cols,
            "rank capped at min(n, m)");
  });
}

// Under fp16_compress_wrapper PowerSGD runs in half precision, where squaring P's small entries
// (about 1e-4 here) underflows to zero: the column norms must not be taken from those squares,
// or every column is zeroed and the whole gradient goes into the error (PyTorch's norm
// accumulates in float32). The same rank-1 gradient as above, scaled by 1e-5.
TEST_P(Hooks, PowerSGDInHalfPrecisionKeepsSmallGradients) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    const int64_t rows = 6, cols = 5;
    const double scale = 1e-5;
    Tensor u = arange(1.0, rows + 1.0).reshape({rows, 1});
    auto v_of = [&](int r) {
      return (arange(0.0, double(cols)) * (r + 1) - 2.0).reshape({1, cols});
    };
    Tensor mean_v = zeros({1, cols});
    for (int r = 0; r < n; ++r) mean_v = mean_v + v_of(r) / double(n);
    Tensor w = zeros({rows, cols}).requires_grad_();
    Tensor buffer = (mm(u, v_of(rank)) * scale).reshape({-1}).contiguous();
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 0});
    GradBucket bucket(0, 1, buffer, {w}, {0}, pg);
    auto fut = fp16_compress_wrapper(bind_hook(state, powersgd_hook))(bucket);
    fut->wait();
    const Tensor out = fut->value()[0].to(kFloat32).reshape({rows, cols}) / scale;
    require_close("rank-1 average in half precision", out, mm(u, mean_v), 2e-2);
  });
}

// The state survives a restart: train K steps, save model + PowerSGD state (safetensors, one
// file per rank),
// train J more; a fresh process-local model/DDP/state loaded from the file and trained the same
// J steps ends at the same weights (its buckets differ until its own rebuild: the state is
// keyed by parameter). Without the loaded state it ends elsewhere (the check can fail).
TEST_P(Hooks, PowerSGDStateSaveLoadContinuesIdentically) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  test::TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  run_group(n, [n, path](std::shared_ptr<CountingGroup> pg, int rank) {
    const PowerSGDOptions opts{.matrix_approximation_rank = 1, .start_powerSGD_iter = 2};
    DDPOptions o;
    o.bucket_cap_mb = mib(1000);
    auto train = [&](DistributedDataParallel& ddp, int from, int to) {
      nn::optim::SGD opt(ddp.parameters(), {.lr = 0.05});
      for (int step = from; step < to; ++step) {
        opt.zero_grad();
        loss_of(ddp, slice(fixed_batch(90 + step), rank, n)).backward();
        opt.step();
      }
    };
    auto model = make_model(90);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    auto state = std::make_shared<PowerSGDState>(opts);
    ddp->register_comm_hook(state, powersgd_hook);
    train(*ddp, 0, 4);
    // The error feedback is local to each rank: every rank saves its own file.
    const std::string mine = path + "." + std::to_string(rank);
    nn::NamedTensors all = model->state_dict();
    for (auto& [k, t] : state->state_dict()) all.emplace_back("powersgd." + k, t);
    nn::save_safetensors(mine, all);
    train(*ddp, 4, 7);

    auto restore = [&](bool with_state) {
      const auto file = nn::load_safetensors(mine);
      nn::NamedTensors weights, hook_state;
      for (const auto& [k, t] : file.tensors()) {
        if (k.rfind("powersgd.", 0) == 0) {
          hook_state.emplace_back(k.substr(9), t);
        } else {
          weights.emplace_back(k, t);
        }
      }
      auto m = make_model(1234);
      m->load_state_dict(weights);
      auto d = std::make_shared<DistributedDataParallel>(m, pg, o);
      auto s = std::make_shared<PowerSGDState>(PowerSGDOptions{});
      if (with_state) {
        s->load_state_dict(hook_state);
      } else {
        s = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powerSGD_iter = 0});
      }
      require(!with_state || s->iteration() == 4, "restored iteration");
      require(!with_state || s->options().start_powerSGD_iter == 2, "restored options");
      d->register_comm_hook(s, powersgd_hook);
      train(*d, 4, 7);
      return m;
    };
    auto resumed = restore(true);
    const auto a = model->named_parameters();
    const auto r = resumed->named_parameters();
    for (size_t i = 0; i < a.size(); ++i)
      require_close("resumed " + a[i].first, r[i].second, a[i].second, 1e-5);

    auto cold = restore(false);
    double diff = 0;
    const auto c = cold->named_parameters();
    for (size_t i = 0; i < a.size(); ++i)
      diff = std::max(diff, (c[i].second - a[i].second).abs().max().item<float>() * 1.0);
    require(diff > 1e-4, "a restart without the state should differ, max diff " +
                             std::to_string(diff));
  });
}

// Deferred steps run in rounds, in bucket order: bucket 0's second stage runs before bucket 1's
// second stage, and third stages after every second stage.
TEST_P(Hooks, DeferredStepsRunInRoundsInBucketOrder) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    auto model = make_model(5);
    DDPOptions o;
    o.bucket_cap_mb = mib(300);
    DistributedDataParallel ddp(model, pg, o);
    auto log = std::make_shared<std::vector<std::string>>();
    ddp.register_comm_hook([log](GradBucket& b) {
      const std::string id = std::to_string(b.index());
      log->push_back("launch" + id);
      Tensor buffer = b.buffer();
      AllreduceOptions sum;
      sum.op = ReduceOp::Sum;
      auto first = b.process_group().allreduce(buffer, sum)->future();
      return b.defer(first, [b, log, id](Future&) {
        log->push_back("second" + id);
        Tensor buffer = b.buffer();
        auto next = completed_future({buffer});
        return b.defer(next, [b, log, id](Future&) mutable {
          log->push_back("third" + id);
          Tensor out = b.buffer();
          out.div_(b.process_group().size());
          return completed_future({out});
        });
      });
    });
    auto ref = clone_model(*model);
    const Batch batch = fixed_batch(6);
    loss_of(ddp, slice(batch, rank, n)).backward();
    loss_of(*ref, batch).backward();
    require_grads_close("deferred average", *model, *ref, 1e-5);
    const size_t k = ddp.bucket_indices().size();
    require(k >= 3, "several buckets");
    std::vector<std::string> want;
    for (const char* stage : {"launch", "second", "third"})
      for (size_t i = 0; i < k; ++i) want.push_back(stage + std::to_string(i));
    require(*log == want, "deferred steps ran out of order");
  });
}

// ---- the user-written hook of docs/ddp.md (keep the two identical) ----------------------------

// Top-k sparsification with error feedback: each rank sends only the k entries of largest
// magnitude of its bucket (plus their indices); what it did not send is added to its next
// gradient, so nothing is lost, only delayed.
struct TopKState {
  double fraction = 0.01;               // share of each bucket's entries a rank sends
  std::map<std::string, Tensor> error;  // what was not sent yet, by GradBucket::key()
};

std::shared_ptr<dist::Future> topk_hook(TopKState& state, dist::GradBucket& bucket) {
  NoGradGuard no_grad;
  dist::ProcessGroup& pg = bucket.process_group();
  Tensor grad = bucket.buffer();  // this rank's gradients, not averaged
  Tensor& error = state.error[bucket.key()];
  if (error.defined()) grad.add_(error);
  const int64_t n = grad.numel();
  const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(n * state.fraction), 1, n);
  // The k entries of largest magnitude (found on the CPU, for brevity).
  const std::vector<float> magnitude = grad.abs().to(kFloat32).to_vector<float>();
  std::vector<int64_t> top(n);
  std::iota(top.begin(), top.end(), int64_t{0});
  std::partial_sort(top.begin(), top.begin() + k, top.end(),
                    [&](int64_t a, int64_t b) { return magnitude[a] > magnitude[b]; });
  top.resize(k);
  Tensor index = from_vector(top);
  Tensor values = index_select(grad, 0, index).contiguous();
  error = grad.clone();
  index_add_(error, 0, index, values, -1);  // the sent entries leave the error
  // Every rank sends k (index, value) pairs: two all-gathers, issued here on DDP's thread.
  const int world = pg.size();
  Tensor all_index = zeros({world * k}, kInt64);
  Tensor all_values = zeros({world * k}, grad.dtype());
  auto gather_index = pg.allgather_into_tensor(all_index, index);
  auto gather_values = pg.allgather_into_tensor(all_values, values);
  // Decoding needs both results: a deferred step waits for them on DDP's thread rather than
  // blocking a backend thread inside Future::then.
  return bucket.defer(gather_values->future(), [=](dist::Future&) mutable {
    gather_index->wait();
    NoGradGuard no_grad;
    grad.zero_();
    index_add_(grad, 0, all_index, all_values);  // entries several ranks chose add up
    grad.div_(world);
    return dist::completed_future({grad});
  });
}

TEST_P(Hooks, TopKUserHookExample) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    // g_r[i] = +-(1 + (7 i + 3 r) mod 20) / 4: distinct magnitudes on each rank, so rank r's
    // top 4 are the entries whose (7 i + 3 r) mod 20 >= 16.
    const int64_t len = 20;
    auto g_of = [&](int r) {
      std::vector<float> v(len);
      for (int64_t i = 0; i < len; ++i)
        v[i] = (i % 2 ? -1.0f : 1.0f) * static_cast<float>(1 + (7 * i + 3 * r) % 20) / 4;
      return v;
    };
    std::vector<float> want(len, 0.0f), want_error = g_of(rank);
    for (int r = 0; r < n; ++r) {
      const auto g = g_of(r);
      for (int64_t i = 0; i < len; ++i) {
        if ((7 * i + 3 * r) % 20 < 16) continue;
        want[i] += g[i] / n;
        if (r == rank) want_error[i] = 0;
      }
    }
    Tensor w = zeros({4, 5});
    TopKState state;
    state.fraction = 0.2;
    GradBucket bucket(0, 1, from_vector(g_of(rank)), {w}, {0}, pg);
    auto fut = topk_hook(state, bucket);
    require_close("top-k average", fut->value()[0], from_vector(want), 1e-6);
    require_close("top-k error", state.error.at("0"), from_vector(want_error), 0);

    // In DDP, with several buckets: the ranks stay identical.
    auto model = make_model(110 + rank);
    DDPOptions o;
    o.bucket_cap_mb = mib(300);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
    auto topk = std::make_shared<TopKState>();
    topk->fraction = 0.1;
    ddp->register_comm_hook(topk, topk_hook);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.05});
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      loss_of(*ddp, slice(fixed_batch(120 + step), rank, n)).backward();
      opt.step();
    }
    require(topk->error.size() >= 3, "one error per bucket");
    require_same_on_all_ranks(*pg, *model);
  });
}

// Note [comm hook ordering]: a collective issued from a Future callback (then() or
// add_done_callback()) is refused on every backend (ProcessGroup::next_op_label), naming the
// backend, the collective and the rank and pointing at GradBucket::defer. It takes no sequence
// number (nor a shared-memory ticket), so the ranks stay in step and the group keeps working.
TEST_P(Hooks, CollectiveFromACallbackIsRefused) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    const std::string want = "[gloo] allreduce on rank " + std::to_string(rank) + " of " +
                             std::to_string(n) +
                             ": collectives cannot be issued from a Future callback";
    auto check = [&](const std::string& where, const std::string& msg) {
      require(msg.find(want) != std::string::npos &&
                  msg.find("GradBucket::defer") != std::string::npos,
              where + ": expected a refusal, got '" + msg + "'");
    };
    auto allreduce_from_callback = [pg] {
      Tensor u = ones({3});
      pg->allreduce(u, AllreduceOptions{});
    };
    Tensor t = ones({4});
    auto next = pg->allreduce(t, AllreduceOptions{})->future()->then([=](Future&) {
      allreduce_from_callback();
      return std::vector<Tensor>{};
    });
    try {
      next->wait(60s);
      require(false, "then(): the collective was issued");
    } catch (const ValueError& e) {
      check("then()", e.what());
    }
    // add_done_callback swallows what a callback throws: this one reports what it caught.
    auto caught = std::make_shared<std::promise<std::string>>();
    WorkPtr second = pg->allreduce(t, AllreduceOptions{});
    second->future()->add_done_callback([=](Future&) {
      try {
        allreduce_from_callback();
        caught->set_value("(issued)");
      } catch (const ValueError& e) {
        caught->set_value(e.what());
      }
    });
    std::future<std::string> got = caught->get_future();
    require(got.wait_for(60s) == std::future_status::ready,
            "add_done_callback's callback never ran");
    check("add_done_callback()", got.get());
    second->wait();
    // The group still works, and the refused calls took no place in its order.
    pg->allreduce(t, AllreduceOptions{})->wait();
    const double want_value = std::pow(static_cast<double>(n), 3);
    for (double v : t.to_vector<float>()) {
      require(v == want_value, "after the refusals: got " + std::to_string(v) + ", want " +
                                   std::to_string(want_value));
    }
  });
}

// Note [coalesced broadcast]: DDP sends its buffers before a training forward as one broadcast
// per dtype (BatchNorm's float32 running statistics together, its int64 batch count apart), not
// one per buffer, and every rank ends with rank 0's. Momentum 0 keeps the running statistics at
// the broadcast values through the forward.
TEST_P(Hooks, BuffersAreBroadcastCoalesced) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    manual_seed(3);
    auto bn = std::make_shared<nn::BatchNorm1d>(8, nn::BatchNormOptions{.momentum = 0.0});
    auto model = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(kIn, 8), bn,
                                                  std::make_shared<nn::Linear>(8, kOut));
    auto differ = [&] {  // every rank's buffers differ; rank 0's are (1, 2, 5)
      NoGradGuard no_grad;
      bn->running_mean.fill_(rank + 1.0);
      bn->running_var.fill_(rank + 2.0);
      bn->num_batches_tracked.fill_(rank + 5);
    };
    auto require_rank0s = [&](const std::string& when, int64_t batches) {
      for (float v : bn->running_mean.to_vector<float>())
        require(v == 1.0f, when + ": running_mean " + std::to_string(v) + ", want rank 0's 1");
      for (float v : bn->running_var.to_vector<float>())
        require(v == 2.0f, when + ": running_var " + std::to_string(v) + ", want rank 0's 2");
      const int64_t got = bn->num_batches_tracked.item<int64_t>();
      require(got == batches, when + ": num_batches_tracked " + std::to_string(got) + ", want " +
                                  std::to_string(batches));
    };
    differ();
    DistributedDataParallel ddp(model, pg, DDPOptions{});
    require_rank0s("after construction", 5);
    (void)pg->take(std::this_thread::get_id());
    differ();
    {
      NoGradGuard no_grad;  // training mode still broadcasts the buffers
      (void)ddp.forward(fixed_batch(4).x);
    }
    const int64_t want = n > 1 ? 2 : 0;  // float32 and int64; none at world size 1
    require(pg->broadcasts() == want, "broadcasts before a training forward: " +
                                          std::to_string(pg->broadcasts()) + ", want " +
                                          std::to_string(want));
    if (n > 1) require_rank0s("after a training forward", 6);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Hooks, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// ---- bucket layout and rebuild ----------------------------------------------------------------

// The first bucket closes at first_bucket_cap_mb, the rest at bucket_cap_mb.
TEST(DDPBuckets, FirstBucketCap) {
  EMBER_REQUIRE_GLOO();
  run_group(1, [](std::shared_ptr<CountingGroup> pg, int) {
    // Reverse order: 4.bias 16 B, 4.weight 256 B, 2.bias 64 B, 2.weight 2048 B, 0.bias 128 B,
    // 0.weight 3072 B.
    DDPOptions o;
    o.first_bucket_cap_mb = mib(200);
    o.bucket_cap_mb = mib(2100);
    DistributedDataParallel ddp(make_model(1), pg, o);
    require(flatten(ddp.bucket_indices()) == std::vector<int64_t>{-3, 5, 4, -3, 3, 2, -3, 1, 0},
            "layout with a small first bucket");
    o.first_bucket_cap_mb = 1;  // larger than bucket_cap_mb: capped at it
    DistributedDataParallel ddp2(make_model(1), pg, o);
    require(flatten(ddp2.bucket_indices()) ==
                std::vector<int64_t>{-5, 5, 4, 3, 2, -3, 1, 0},
            "first bucket capped at bucket_cap_mb");
  });
}

// Registered head, a, b; the forward runs a and b (in a rank-dependent order) before head, so
// gradients arrive head first, then a and b in an order that differs between ranks.
struct Branchy : nn::Module {
  explicit Branchy(bool swap) : swap(swap) {
    head = register_module("head", std::make_shared<nn::Linear>(6, kOut));
    a = register_module("a", std::make_shared<nn::Linear>(kIn, 6));
    b = register_module("b", std::make_shared<nn::Linear>(kIn, 6));
  }
  Tensor forward(const Tensor& x) override {
    Tensor ha, hb;
    if (swap) {
      hb = b->forward(x * 0.5);
      ha = a->forward(x);
    } else {
      ha = a->forward(x);
      hb = b->forward(x * 0.5);
    }
    return head->forward(tanh(ha + hb));
  }
  bool swap;
  std::shared_ptr<nn::Linear> head, a, b;
};

// After the first iteration the buckets follow rank 0's gradient order on every rank (rank 1's
// order differs, so a rank-local rebuild would disagree), and training still equals a single
// process on the full batch, with and without gradient_as_bucket_view.
void rebuild_test(std::shared_ptr<CountingGroup> pg, int rank, int n, bool as_view,
                  bool with_hook) {
  manual_seed(7);
  auto model = std::make_shared<Branchy>(rank % 2 == 1);
  manual_seed(7);
  auto ref = std::make_shared<Branchy>(false);
  // Record this rank's arrival order, to check the test's premise.
  std::vector<int64_t> arrival;
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    params[i].register_post_accumulate_grad_hook(
        [&arrival, i](const Tensor&) { arrival.push_back(static_cast<int64_t>(i)); });
  DDPOptions o;
  o.bucket_cap_mb = mib(200);  // a.weight alone is 576 B
  o.gradient_as_bucket_view = as_view;
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
  if (with_hook) ddp->register_comm_hook(allreduce_hook);
  const auto initial = ddp->bucket_indices();
  // b.bias 24 B + b.weight 576 B, a.bias + a.weight, head.bias 16 B + head.weight 96 B.
  require(flatten(initial) == std::vector<int64_t>{-3, 5, 4, -3, 3, 2, -3, 1, 0},
          "initial layout (reverse registration)");
  nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1});
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});
  for (int step = 0; step < 4; ++step) {
    const Batch batch = fixed_batch(100 + step);
    opt.zero_grad(!as_view);
    ref_opt.zero_grad();
    loss_of(*ddp, slice(batch, rank, n)).backward();
    loss_of(*ref, batch).backward();
    require(ddp->buckets_rebuilt() == (step > 0), "rebuilt at step " + std::to_string(step));
    require_grads_close("step " + std::to_string(step), *model, *ref, 1e-5);
    if (as_view && step > 0) {
      // grad() is a view into the current buckets: each bucket's grads lie back to back.
      for (const auto& bucket : ddp->bucket_indices()) {
        for (size_t j = 1; j < bucket.size(); ++j) {
          const Tensor& prev = params[bucket[j - 1]];
          const char* want = static_cast<const char*>(prev.grad().data_ptr()) + prev.nbytes();
          require(params[bucket[j]].grad().data_ptr() == want &&
                      params[bucket[j]].grad().storage() == prev.grad().storage(),
                  "grad() is not a view into its bucket after the rebuild");
        }
      }
    }
    if (step == 0) {
      std::vector<int64_t> mine = arrival;
      require(mine.size() == params.size(), "arrival order incomplete");
      require(mine[0] == 0 || mine[0] == 1, "head first");
      // Rank 0's order is what every rank uses.
      Tensor t = from_vector(mine);
      pg->broadcast(t, BroadcastOptions{})->wait();
      const auto rank0 = t.to_vector<int64_t>();
      if (n > 1 && rank == 1) require(rank0 != mine, "premise: rank 1's order differs");
    }
    opt.step();
    ref_opt.step();
  }
  const auto rebuilt = ddp->bucket_indices();
  require(rebuilt != initial, "the layout did not change");
  require(rebuilt[0][0] == 0 || rebuilt[0][0] == 1, "head's parameters first after the rebuild");
  require_same_ints(*pg, "rebuilt layout", flatten(rebuilt));
  require_same_on_all_ranks(*pg, *model);
}

class Rebuild : public ::testing::TestWithParam<int> {};

TEST_P(Rebuild, FollowsRankZeroGradientOrder) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    rebuild_test(pg, rank, n, false, false);
  });
}

TEST_P(Rebuild, GradientAsBucketViewRepointsGrads) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    rebuild_test(pg, rank, n, true, false);
  });
}

TEST_P(Rebuild, WithCommHook) {
  EMBER_REQUIRE_GLOO();
  const int n = GetParam();
  run_group(n, [n](std::shared_ptr<CountingGroup> pg, int rank) {
    rebuild_test(pg, rank, n, false, true);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Rebuild, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace ember::dist
