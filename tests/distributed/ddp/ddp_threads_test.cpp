// DistributedDataParallel on ProcessGroupThreads at 2, 4 and 8 ranks (threads of this process),
// through a DelayingGroup with a scale of 1, so a missing wait in DDP reads unreduced gradients
// and fails the comparison instead of passing by luck. Every check compares against one process
// training on the whole batch, computed on the main thread before the ranks start (models and
// batches are made there too: the default random generator is shared by the threads).
// CUDA variants put every rank on device 0 with its own stream; they skip without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/powersgd.h>
#include <ember/distributed/ddp/sync_batch_norm.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/flatten.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>
#include <ember/nn/optim/sgd.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::Batch;
using test::loss_of;
using test::require;
using test::require_close;
using test::require_same_on_all_ranks;
using test::slice;
using test::to_device;

constexpr int64_t kBatch = 24;  // divisible by 2, 4 and 8 ranks
constexpr int64_t kIn = 5;
constexpr int64_t kOut = 3;
constexpr int kSteps = 3;

struct DdpCase {
  int n;
  bool cuda;
};
// gtest would otherwise print the struct's bytes, padding included, into ctest's test names.
void PrintTo(const DdpCase& c, std::ostream* os) {
  *os << c.n << " ranks on " << (c.cuda ? "cuda" : "cpu");
}
std::string case_name(const ::testing::TestParamInfo<DdpCase>& info) {
  return "n" + std::to_string(info.param.n) + (info.param.cuda ? "_cuda" : "_cpu");
}
Device device_of(const DdpCase& c) { return c.cuda ? cuda_device(0) : kCPU; }

test::ThreadsSetup setup_of(const DdpCase& c) {
  test::ThreadsSetup s;
  s.n = c.n;
  s.device = device_of(c);
  s.delay = DelayOptions{.cycles = 5'000'000, .cpu_delay = 1ms, .scale = 1.0};
  return s;
}

std::shared_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(kIn, 16), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(16, 8), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(8, kOut));
}

Batch make_batch(uint64_t seed, int64_t rows = kBatch) {
  manual_seed(seed);
  return {randn({rows, kIn}), randn({rows, kOut})};
}

/// Different initial weights on every rank (DDP broadcasts rank 0's).
std::vector<std::shared_ptr<nn::Sequential>> replicas(int n) {
  std::vector<std::shared_ptr<nn::Sequential>> models;
  for (int r = 0; r < n; ++r) models.push_back(make_model(100 + r));
  return models;
}

/// Throws unless m's parameters equal want's (same names, on the CPU) within tol.
void require_params(const std::string& what, const nn::Module& m, const nn::NamedTensors& want,
                    double tol) {
  const auto got = m.named_parameters();
  require(got.size() == want.size(), what + ": parameter count");
  for (size_t i = 0; i < got.size(); ++i) {
    require_close(what + " " + got[i].first, got[i].second.detach().cpu(), want[i].second, tol);
  }
}

/// What varies between the training checks.
struct Training {
  std::string name;
  DDPOptions options;
  bool in_place = false;                                  // ProcessGroupThreads' option
  std::function<void(DistributedDataParallel&)> configure;  // e.g. register a hook
  double tol = 1e-4;
};

DDPOptions small_buckets(bool bucket_view = false) {
  DDPOptions o;
  o.bucket_cap_mb = 200.0 / (1024 * 1024);  // several buckets
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  o.gradient_as_bucket_view = bucket_view;
  return o;
}

// kSteps of SGD with momentum on each rank's slice equal one process on the whole batches, and
// every rank holds bitwise the same parameters.
// `or_throw`: rethrow the first rank's failure instead of failing the test.
void train_like_one_process(const DdpCase& c, const Training& t, bool or_throw = false) {
  auto models = replicas(c.n);
  std::vector<Batch> batches;
  for (int s = 0; s < kSteps; ++s) batches.push_back(make_batch(50 + s));
  auto ref = make_model(100);
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (const Batch& b : batches) {
    ref_opt.zero_grad();
    loss_of(*ref, b).backward();
    ref_opt.step();
  }
  const nn::NamedTensors want = ref->named_parameters();
  test::ThreadsSetup setup = setup_of(c);
  setup.in_place_coalesced = t.in_place;
  const Device dev = device_of(c);
  auto body = [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[rank];
    model->to(dev);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, t.options);
    if (t.configure) t.configure(*ddp);
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (const Batch& b : batches) {
      opt.zero_grad();
      loss_of(*ddp, to_device(slice(b, rank, c.n), dev)).backward();
      opt.step();
    }
    require_same_on_all_ranks(*pg, *model);
    require_params(t.name + " rank " + std::to_string(rank), *model, want, t.tol);
  };
  if (or_throw) {
    test::run_threads_or_throw(setup, body);
  } else {
    test::run_threads(setup, body);
  }
}

class DDPThreads : public ::testing::TestWithParam<DdpCase> {
 protected:
  void SetUp() override {
    if (GetParam().cuda && !cuda::is_available()) {
      GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
    }
  }
};

TEST_P(DDPThreads, BucketsTrainLikeOneProcess) {
  train_like_one_process(GetParam(), {"flat buckets", small_buckets(), false, nullptr});
  train_like_one_process(GetParam(), {"bucket views", small_buckets(true), false, nullptr});
  train_like_one_process(GetParam(), {"in place", small_buckets(), true, nullptr});
  train_like_one_process(GetParam(), {"one bucket", DDPOptions{}, false, nullptr});
}

TEST_P(DDPThreads, EveryBuiltInHookTrainsLikeOneProcess) {
  auto hook = [](CommHook h) { return [h](DistributedDataParallel& d) { d.register_comm_hook(h); }; };
  // A full-rank approximation (rank >= every matrix side) compressing every matrix is exact
  // up to rounding, so PowerSGD is checked against the reference too.
  PowerSGDOptions exact;
  exact.matrix_approximation_rank = 16;
  exact.start_powerSGD_iter = 1;
  exact.min_compression_rate = 0;
  auto powersgd = [exact](bool batched) {
    return [exact, batched](DistributedDataParallel& d) {
      auto state = std::make_shared<PowerSGDState>(exact);
      if (batched) {
        d.register_comm_hook(state, batched_powersgd_hook);
      } else {
        d.register_comm_hook(state, powersgd_hook);
      }
    };
  };
  const std::vector<Training> cases = {
      {"allreduce_hook", small_buckets(), false, hook(allreduce_hook)},
      {"fp16_compress_hook", small_buckets(), false, hook(fp16_compress_hook), 3e-3},
      {"bf16_compress_hook", small_buckets(), false, hook(bf16_compress_hook), 2e-2},
      {"fp16_compress_wrapper", small_buckets(true), false,
       hook(fp16_compress_wrapper(allreduce_hook)), 3e-3},
      {"bf16_compress_wrapper", small_buckets(), true, hook(bf16_compress_wrapper(allreduce_hook)),
       2e-2},
      {"powersgd_hook", small_buckets(), false, powersgd(false), 1e-3},
      {"batched_powersgd_hook", small_buckets(), false, powersgd(true), 1e-3},
  };
  for (const Training& t : cases) train_like_one_process(GetParam(), t);
}

// The check can fail: a hook that returns before its all-reduce has been waited for (a
// deliberately missing wait) makes DDP read the local gradients, which the delaying wrapper
// keeps in place until long after; the parameters then differ from the reference.
TEST_P(DDPThreads, AHookThatSkipsTheWaitIsCaught) {
  Training t{"hook without a wait", small_buckets(), false, [](DistributedDataParallel& d) {
               d.register_comm_hook([](GradBucket& b) {
                 Tensor buffer = b.buffer();
                 AllreduceOptions avg;
                 avg.op = ReduceOp::Avg;
                 (void)b.process_group().allreduce(buffer, avg);  // its Work is dropped
                 return completed_future({buffer});
               });
             }};
  EXPECT_THROW(train_like_one_process(GetParam(), t, /*or_throw=*/true), RankThreadError);
}

// no_sync accumulates locally; the next synchronised backward averages the sum.
TEST_P(DDPThreads, NoSyncThenSyncEqualsBothBatches) {
  const DdpCase c = GetParam();
  auto models = replicas(c.n);
  const Batch b1 = make_batch(11), b2 = make_batch(12);
  auto ref = make_model(100);
  loss_of(*ref, b1).backward();
  loss_of(*ref, b2).backward();
  nn::NamedTensors want;
  for (const auto& [name, p] : ref->named_parameters()) want.emplace_back(name, p.grad());
  const Device dev = device_of(c);
  test::run_threads(setup_of(c), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[rank];
    model->to(dev);
    DistributedDataParallel ddp(model, pg, small_buckets());
    {
      auto guard = ddp.no_sync();
      loss_of(ddp, to_device(slice(b1, rank, c.n), dev)).backward();
    }
    loss_of(ddp, to_device(slice(b2, rank, c.n), dev)).backward();
    nn::NamedTensors grads;
    for (const auto& [name, p] : model->named_parameters()) grads.emplace_back(name, p.grad());
    for (size_t i = 0; i < grads.size(); ++i) {
      require_close("rank " + std::to_string(rank) + " grad of " + grads[i].first,
                    grads[i].second.cpu(), want[i].second, 1e-5);
    }
  });
}

std::shared_ptr<nn::Sequential> make_bn_model(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Linear>(kIn, 6), std::make_shared<nn::BatchNorm1d>(6),
      std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(6, kOut));
}

// DDP + SyncBatchNorm on slices = one process with BatchNorm on the whole batch: parameters
// and running statistics.
TEST_P(DDPThreads, SyncBatchNormTrainsLikeOneProcess) {
  const DdpCase c = GetParam();
  std::vector<std::shared_ptr<nn::Module>> models;
  for (int r = 0; r < c.n; ++r) models.push_back(make_bn_model(5));
  std::vector<Batch> batches;
  for (int s = 0; s < kSteps; ++s) batches.push_back(make_batch(40 + s));
  auto ref = make_bn_model(5);
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (const Batch& b : batches) {
    ref_opt.zero_grad();
    loss_of(*ref, b).backward();
    ref_opt.step();
  }
  const nn::NamedTensors want = ref->state_dict();
  const Device dev = device_of(c);
  test::run_threads(setup_of(c), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = convert_sync_batchnorm(models[rank], pg);
    model->to(dev);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, small_buckets());
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (const Batch& b : batches) {
      opt.zero_grad();
      loss_of(*ddp, to_device(slice(b, rank, c.n), dev)).backward();
      opt.step();
    }
    const auto got = model->state_dict();
    require(got.size() == want.size(), "state_dict size");
    for (size_t i = 0; i < got.size(); ++i) {
      require_close("rank " + std::to_string(rank) + " " + got[i].first, got[i].second.cpu(),
                    want[i].second, 1e-4);
    }
  });
}

// Uneven inputs: rank r has 1 + r % 3 batches inside join(); every rank ends with the
// parameters of one process applying at step t the gradient of the summed mean losses of the
// ranks that still have a batch t, divided by the world size.
TEST_P(DDPThreads, JoinWithUnevenInputsTrainsLikeOneProcess) {
  const DdpCase c = GetParam();
  constexpr int64_t kRows = 3;
  auto count = [](int r) { return 1 + r % 3; };
  auto models = replicas(c.n);
  std::vector<std::vector<Batch>> batches(c.n);
  for (int r = 0; r < c.n; ++r) {
    for (int t = 0; t < count(r); ++t) batches[r].push_back(make_batch(1000 + 37 * r + t, kRows));
  }
  auto ref = make_model(100);
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});
  const int most = std::min(c.n, 3);
  for (int t = 0; t < most; ++t) {
    ref_opt.zero_grad();
    Tensor loss;
    for (int r = 0; r < c.n; ++r) {
      if (count(r) <= t) continue;
      Tensor l = loss_of(*ref, batches[r][t]);
      loss = loss.defined() ? loss + l : l;
    }
    (loss / c.n).backward();
    ref_opt.step();
  }
  const nn::NamedTensors want = ref->named_parameters();
  const Device dev = device_of(c);
  test::run_threads(setup_of(c), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[rank];
    model->to(dev);
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg, small_buckets());
    nn::optim::SGD opt(ddp->parameters(), {.lr = 0.1});
    ddp->join([&] {
      for (const Batch& b : batches[rank]) {
        opt.zero_grad();
        loss_of(*ddp, to_device(b, dev)).backward();
        opt.step();
      }
    });
    require_same_on_all_ranks(*pg, *model);
    require_params("after join, rank " + std::to_string(rank), *model, want, 1e-4);
  });
}

// A model of two inputs and two outputs, as PyTorch users write them: features masked by a
// per-example mask, the logits and an auxiliary penalty on the features.
struct MaskedNet : nn::Module {
  explicit MaskedNet(uint64_t seed) {
    manual_seed(seed);
    enc = register_module("enc", std::make_shared<nn::Linear>(kIn, 8));
    head = register_module("head", std::make_shared<nn::Linear>(8, kOut));
  }
  std::vector<Tensor> forward_many(const std::vector<Tensor>& in) override {
    Tensor h = tanh((*enc)(in[0])) * in[1];
    return {(*head)(h), (h * h).mean()};
  }
  std::shared_ptr<nn::Linear> enc, head;
};

Tensor masked_loss(const std::vector<Tensor>& out, const Tensor& y) {
  return nn::functional::mse_loss(out.at(0), y) + out.at(1) * 0.5;
}

// ddp(x, mask) with a tuple output trains like one process calling model(x, mask) on the whole
// batch; a wrong count of inputs is refused naming the module.
TEST_P(DDPThreads, ForwardWithAMaskAndATupleOutput) {
  const DdpCase c = GetParam();
  std::vector<Batch> batches;
  std::vector<Tensor> masks;
  for (int s = 0; s < kSteps; ++s) {
    batches.push_back(make_batch(70 + s));
    masks.push_back(gt(rand({kBatch, 1}), 0.3).to(kFloat32));
  }
  auto ref = std::make_shared<MaskedNet>(100);
  nn::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    masked_loss((*ref)(batches[s].x, masks[s]), batches[s].y).backward();
    ref_opt.step();
  }
  const nn::NamedTensors want = ref->named_parameters();
  const Device dev = device_of(c);
  // Made here, not on the rank threads: the default generator is shared, so a rank seeding it
  // while another initialises its weights would give rank 0 weights from neither seed.
  std::vector<std::shared_ptr<MaskedNet>> models;
  for (int r = 0; r < c.n; ++r) models.push_back(std::make_shared<MaskedNet>(100 + r));
  test::run_threads(setup_of(c), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    auto model = models[rank];
    model->to(dev);
    DistributedDataParallel ddp(model, pg, small_buckets());
    nn::optim::SGD opt(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
    const int64_t per = kBatch / c.n;
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = to_device(slice(batches[s], rank, c.n), dev);
      const Tensor mask = masks[s].narrow(0, rank * per, per).to(dev);
      opt.zero_grad();
      const std::vector<Tensor> out = ddp(b.x, mask);
      require(out.size() == 2, "two outputs");
      masked_loss(out, b.y).backward();
      opt.step();
    }
    require_same_on_all_ranks(*pg, *model);
    require_params("masked rank " + std::to_string(rank), *model, want, 1e-4);
    bool refused = false;
    try {
      (void)ddp.forward(Tensor(ones({per, kIn}).to(dev)));  // MaskedNet has no forward(Tensor)
    } catch (const NotImplementedError&) {
      refused = true;
    }
    require(refused, "a one-tensor forward of a two-input module is refused");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DDPThreads,
                         ::testing::Values(DdpCase{2, false}, DdpCase{4, false},
                                           DdpCase{8, false}, DdpCase{2, true}, DdpCase{4, true},
                                           DdpCase{8, true}),
                         case_name);

}  // namespace
}  // namespace ember::dist
