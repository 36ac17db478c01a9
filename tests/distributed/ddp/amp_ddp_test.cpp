// GradScaler under DistributedDataParallel (nn/amp/grad_scaler.h, distributed/ddp/amp.h), 2 ranks on
// ProcessGroupThreads: with a comm hook that leaves gradients local, only the rank that saw an
// inf would skip its step unless found_inf_allreduce makes the decision global; the fp16 and
// bf16 compression hooks compose with scaling (a scaled gradient beyond float16's range becomes
// inf in the hook and every rank skips, never a silently clipped step). Expected values are
// closed forms: for y = sum(W x) the gradient of W is x (scaled by the loss scale).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <ember/distributed/ddp/amp.h>
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/nn/amp/autocast.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using test::require;

// A bias-free Linear(2, 1) with weight [1, 1] on every rank, wrapped in DDP with `hook`.
struct Replica {
  std::shared_ptr<nn::Linear> model = std::make_shared<nn::Linear>(2, 1, /*bias=*/false);
  std::shared_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<nn::optim::SGD> opt;
  Replica(std::shared_ptr<ProcessGroup> pg, CommHook hook) {
    {
      NoGradGuard no_grad;
      model->weight.fill_(1.0);
    }
    ddp = std::make_shared<DistributedDataParallel>(model, std::move(pg));
    ddp->register_comm_hook(std::move(hook));
    opt = std::make_unique<nn::optim::SGD>(model->parameters(), nn::optim::SGDOptions{.lr = 1.0});
  }
  // One iteration: forward under bf16 autocast, scaled backward, step, update. Returns whether
  // the step ran.
  bool iterate(nn::amp::GradScaler& scaler, const Tensor& x) {
    opt->zero_grad();
    Tensor loss;
    {
      nn::amp::autocast amp(kCPU, kBFloat16);
      loss = ddp->forward(x).sum();
    }
    scaler.scale(loss).backward();
    const bool stepped = scaler.step(*opt);
    scaler.update();
    return stepped;
  }
  std::vector<float> weight() const { return model->weight.to_vector<float>(); }
};

constexpr float kInf = std::numeric_limits<float>::infinity();

// noop_hook keeps each rank's local gradient (standing in for any hook whose result may differ
// per rank). Rank 1's input holds an inf, so only rank 1's gradient is non-finite.
void run_local_inf(bool sync, std::vector<int>& stepped, std::vector<double>& scales) {
  test::run_threads({.n = 2}, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Replica r(pg, noop_hook);
    nn::amp::GradScalerOptions o{.init_scale = 4.0};
    if (sync) o.found_inf_sync = found_inf_allreduce(pg);
    nn::amp::GradScaler scaler(o);
    const Tensor x = rank == 1 ? tensor({kInf, 1.0f}).view({1, 2}) : ones({1, 2});
    stepped[rank] = r.iterate(scaler, x);
    scales[rank] = scaler.get_scale();
  });
}

TEST(AmpDdp, WithoutSyncOnlyTheRankWithTheInfSkips) {
  std::vector<int> stepped(2);
  std::vector<double> scales(2);
  run_local_inf(/*sync=*/false, stepped, scales);
  EXPECT_EQ(stepped, (std::vector<int>{1, 0})) << "the replicas diverge: why the option exists";
  EXPECT_EQ(scales, (std::vector<double>{4.0, 2.0}));
}

TEST(AmpDdp, FoundInfAllreduceMakesEveryRankSkip) {
  std::vector<int> stepped(2);
  std::vector<double> scales(2);
  run_local_inf(/*sync=*/true, stepped, scales);
  EXPECT_EQ(stepped, (std::vector<int>{0, 0}));
  EXPECT_EQ(scales, (std::vector<double>{2.0, 2.0}));
}

// fp16_compress_hook casts the scaled gradients to float16. Rank 0's gradient is x0 = 0.5,
// rank 1's x1 = 2 (times the scale). Scale 65536: 2 * 65536 = 131072 > 65504 becomes inf in the
// hook, the sum is inf on both ranks, both skip and back off. Scale 32768: 65536 still rounds to
// inf. Scale 16384: 32768 and 8192 fit; the average 20480 unscales to 1.25 = (0.5 + 2) / 2, and
// SGD with lr 1 moves the weight from 1 to -0.25.
TEST(AmpDdp, Fp16CompressionOverflowIsAnInfOnEveryRank) {
  test::run_threads({.n = 2}, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Replica r(pg, fp16_compress_hook);
    nn::amp::GradScaler scaler;
    const float xv = rank == 0 ? 0.5f : 2.0f;
    const Tensor x = full({1, 2}, xv);
    const std::vector<double> want_scale = {32768, 16384, 16384};
    const std::vector<bool> want_step = {false, false, true};
    for (size_t i = 0; i < want_step.size(); ++i) {
      const bool stepped = r.iterate(scaler, x);
      require(stepped == want_step[i], "rank " + std::to_string(rank) + " iteration " +
                                           std::to_string(i) + ": stepped " +
                                           std::to_string(stepped));
      require(scaler.get_scale() == want_scale[i], "rank " + std::to_string(rank) + " iteration " +
                                                       std::to_string(i) + ": scale " +
                                                       std::to_string(scaler.get_scale()));
    }
    require(r.model->weight.grad().to_vector<float>() == std::vector<float>{1.25f, 1.25f},
            "unscaled average gradient should be 1.25");
    require(r.weight() == std::vector<float>{-0.25f, -0.25f}, "weight after one step");
  });
}

// bfloat16 has float32's range: the same scaled gradients compress without overflow, and the
// unscaled average is exact for these values.
TEST(AmpDdp, Bf16CompressionComposesWithScaling) {
  test::run_threads({.n = 2}, [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Replica r(pg, bf16_compress_hook);
    nn::amp::GradScaler scaler;
    require(r.iterate(scaler, full({1, 2}, rank == 0 ? 0.5f : 2.0f)), "the step must run");
    require(r.model->weight.grad().to_vector<float>() == std::vector<float>{1.25f, 1.25f},
            "unscaled average gradient should be 1.25");
    require(scaler.get_scale() == 65536.0, "no backoff");
  });
}

}  // namespace
}  // namespace ember::dist
