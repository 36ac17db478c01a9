// nn::checkpoint: the same loss and gradients as without it (dropout included, through the
// restored generator state), less peak memory on a stack of transformer layers, and the edge
// cases (several inputs and outputs, inputs without grad, no-grad mode, misuse).
#include <ember/nn/activation_checkpoint.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <atomic>
#include <memory>
#include <vector>

#include <ember/nn/layers/container.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/transformer.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops/random.h>
#include "tests/autograd/grad_util.h"

namespace ember::nn {
namespace {

using test::expect_error;
using test::rand_t;

/// A stack of transformer encoder layers whose forward checkpoints each layer (or not).
class Stack : public Module {
 public:
  Stack(int n, int64_t d, int64_t heads, int64_t ff, double dropout, Dtype dtype) {
    for (int i = 0; i < n; ++i) {
      layers_.push_back(register_module(
          std::to_string(i),
          std::make_shared<TransformerEncoderLayer>(
              d, heads, TransformerEncoderLayerOptions{.dim_feedforward = ff,
                                                       .dropout = dropout,
                                                       .batch_first = true,
                                                       .norm_first = true})));
    }
    to(dtype);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (const auto& l : layers_) h = use_checkpoint ? checkpoint(l, h, preserve_rng) : l->forward(h);
    return h;
  }
  bool use_checkpoint = false;
  bool preserve_rng = true;

 private:
  std::vector<std::shared_ptr<TransformerEncoderLayer>> layers_;
};

/// Copies every parameter of `from` into `to` (same architecture).
void copy_params(const Module& from, Module& to) {
  NoGradGuard no_grad;
  auto a = from.parameters(), b = to.parameters();
  for (size_t i = 0; i < a.size(); ++i) Tensor(b[i]).copy_(a[i]);
}

struct StepResult {
  Tensor loss;
  std::vector<Tensor> grads;  ///< the input's, then every parameter's
};

/// loss = sum(stack(x) * w) after seeding the global generator with `seed`.
StepResult run(Stack& m, const Tensor& x0, uint64_t seed) {
  m.zero_grad();
  Tensor x = x0.detach().clone().requires_grad_();
  manual_seed(seed);
  Tensor y = m.forward(x);
  Tensor loss = (y * rand_t(y.shape(), y.dtype(), 99).to(y.device())).sum();
  loss.backward();
  StepResult r{loss.detach(), {x.grad()}};
  for (const Tensor& p : m.parameters()) r.grads.push_back(p.grad());
  return r;
}

double max_diff(const Tensor& a, const Tensor& b) {
  return (a.to(kFloat64) - b.to(kFloat64)).abs().max().item<double>();
}

double max_grad_diff(const StepResult& a, const StepResult& b) {
  double d = 0;
  EXPECT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "gradient " << i;
    d = std::max(d, max_diff(a.grads[i], b.grads[i]));
  }
  return d;
}

TEST(ActivationCheckpoint, SameLossAndGradsWithDropout) {
  for (Dtype dt : {kFloat64, kFloat32}) {
    manual_seed(1);
    Stack plain(3, 16, 2, 32, 0.2, dt), ckpt(3, 16, 2, 32, 0.2, dt);
    copy_params(plain, ckpt);
    ckpt.use_checkpoint = true;
    const Tensor x = rand_t({2, 6, 16}, dt, 2);
    const StepResult a = run(plain, x, 7), b = run(ckpt, x, 7);
    // the same ops on the same values in the same order: equal to the last bit
    EXPECT_EQ(a.loss.item<double>(), b.loss.item<double>()) << dtype_name(dt);
    EXPECT_EQ(max_grad_diff(a, b), 0.0) << dtype_name(dt);
  }
}

// The recomputation runs under the autocast state of the forward call, even though backward
// runs outside the autocast scope: bf16 products again, so the same gradients as without
// checkpointing (a float32 recomputation would give different ones).
TEST(ActivationCheckpoint, RecomputesUnderTheForwardsAutocastState) {
  manual_seed(1);
  Stack plain(2, 16, 2, 32, 0.0, kFloat32), ckpt(2, 16, 2, 32, 0.0, kFloat32);
  copy_params(plain, ckpt);
  ckpt.use_checkpoint = true;
  const Tensor x0 = rand_t({2, 6, 16}, kFloat32, 2);
  auto step = [&](Stack& m) {
    m.zero_grad();
    Tensor x = x0.detach().clone().requires_grad_();
    Tensor loss;
    {
      AutocastGuard amp(kCPU, kBFloat16);
      loss = m.forward(x).to(kFloat32).pow(2).sum();
    }
    loss.backward();  // outside the scope, as docs/mixed_precision.md recommends
    StepResult r{loss.detach(), {x.grad()}};
    for (const Tensor& p : m.parameters()) r.grads.push_back(p.grad());
    return r;
  };
  const StepResult a = step(plain), b = step(ckpt);
  EXPECT_EQ(a.loss.item<double>(), b.loss.item<double>());
  EXPECT_EQ(max_grad_diff(a, b), 0.0);
  for (const Tensor& g : b.grads) EXPECT_EQ(g.dtype(), kFloat32);
}

TEST(ActivationCheckpoint, SameGradsWithDropoutOnCuda) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  // Ember's one generator drives CUDA dropout too, so restoring it replays the device masks.
  manual_seed(1);
  Stack plain(2, 16, 2, 32, 0.2, kFloat32), ckpt(2, 16, 2, 32, 0.2, kFloat32);
  copy_params(plain, ckpt);
  plain.to(cuda_device(0));
  ckpt.to(cuda_device(0));
  ckpt.use_checkpoint = true;
  const Tensor x = rand_t({2, 6, 16}, kFloat32, 2).to(cuda_device(0));
  const StepResult a = run(plain, x, 7), b = run(ckpt, x, 7);
  EXPECT_EQ(a.loss.item<double>(), b.loss.item<double>());
  EXPECT_EQ(max_grad_diff(a, b), 0.0);
}

TEST(ActivationCheckpoint, WithoutPreservingTheRngStateDropoutMasksDiffer) {
  manual_seed(1);
  Stack plain(2, 16, 2, 32, 0.2, kFloat64), ckpt(2, 16, 2, 32, 0.2, kFloat64);
  copy_params(plain, ckpt);
  ckpt.use_checkpoint = true;
  ckpt.preserve_rng = false;
  const Tensor x = rand_t({2, 6, 16}, kFloat64, 2);
  const StepResult a = run(plain, x, 7), b = run(ckpt, x, 7);
  EXPECT_EQ(a.loss.item<double>(), b.loss.item<double>());  // forward is the same
  EXPECT_GT(max_grad_diff(a, b), 1e-6);                      // recomputation drew new masks
}

TEST(ActivationCheckpoint, BackwardLeavesTheGeneratorWhereItWas) {
  manual_seed(3);
  Tensor x = rand_t({4, 8}, kFloat64, 1).requires_grad_();
  Tensor y = checkpoint([](const Tensor& t) { return functional::dropout(t, 0.5) * 2.0; }, x);
  const uint64_t offset = default_generator().offset();
  y.sum().backward();
  EXPECT_EQ(default_generator().offset(), offset);
  // the recomputed mask is the forward's: grad is 2 / (1 - p) exactly where y kept x
  const auto g = x.grad().to_vector<double>(), yv = y.detach().to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], yv[i] == 0.0 ? 0.0 : 4.0) << i;
}

// Another thread drawing from the shared generator meanwhile (a data loader's worker with a
// random augmentation): the recomputation still draws the forward's mask (Note [Checkpoint
// generators]); rewinding the shared generator used to shift the forward's numbers away from
// the recomputation's in about a fifth of the steps.
TEST(ActivationCheckpoint, AnotherThreadDrawingMeanwhileLeavesTheMasksAlike) {
  manual_seed(4);
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop) rand({64});
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() {
      stop = true;
      t.join();
    }
  } join{stop, other};
  int bad = 0;
  for (int i = 0; i < 60; ++i) {
    Tensor x = ones({4096}, kFloat64).requires_grad_();
    Tensor y = checkpoint(
        [](const Tensor& a) {
          Tensor h = a;
          for (int k = 0; k < 20; ++k) h = h * 1.0 + 0.0;
          return functional::dropout(h, 0.5, true);
        },
        x);
    y.sum().backward();
    // dropout keeps x * 2 where the mask keeps it: the gradient is the output itself.
    if ((x.grad() - y.detach()).abs().max().item<double>() != 0) ++bad;
  }
  EXPECT_EQ(bad, 0);
}

TEST(ActivationCheckpoint, PeakMemoryDropsOnATransformerStack) {
  // Peak bytes of one training step, from the CPU allocator's high-water mark (which counts
  // blocks of 128 KiB and more: every activation here is at least that).
  auto peak_of = [](Stack& m, const Tensor& x) {
    // The mark only moves when `allocated` passes it: first raise `allocated` to the old mark
    // with an untouched ballast block, so the mark then rises by exactly this step's own peak.
    const AllocatorStats s = cpu_allocator_stats();
    const Tensor ballast = empty({s.peak_allocated - s.allocated + (1 << 20)}, kUInt8);
    const int64_t base = cpu_allocator_stats().allocated;
    EXPECT_GE(base, s.peak_allocated);
    run(m, x, 5);
    return cpu_allocator_stats().peak_allocated - base;
  };
  manual_seed(1);
  Stack m(4, 64, 2, 256, 0.1, kFloat32);
  const Tensor x = rand_t({4, 128, 64}, kFloat32, 3);
  const int64_t plain = peak_of(m, x);
  m.use_checkpoint = true;
  const int64_t ckpt = peak_of(m, x);
  RecordProperty("peak_bytes_plain", std::to_string(plain));
  RecordProperty("peak_bytes_checkpointed", std::to_string(ckpt));
  EXPECT_GT(ckpt, 0);
  // Four layers keep their attention scores, feed-forward activations and norms without
  // checkpointing; with it, one layer's at a time plus the four inputs.
  EXPECT_LT(ckpt, plain / 2) << "plain " << plain << " bytes, checkpointed " << ckpt;
}

TEST(ActivationCheckpoint, SeveralInputsAndOutputsSomeWithoutGrad) {
  Tensor a = test::leaf({3}, 1), b = test::leaf({3}, 2);
  const Tensor c = rand_t({3}, kFloat64, 3);  // no grad
  auto fn = [](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{in[0] * in[1], in[1] * in[2], ge(in[2], 0.0)};
  };
  auto out = checkpoint(fn, {a, b, c});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[0].requires_grad());
  EXPECT_FALSE(out[2].requires_grad());
  EXPECT_EQ(std::string(out[0].grad_fn()->name()), "CheckpointBackward");
  (out[0].sum() + 3.0 * out[1].sum()).backward();
  EXPECT_EQ(max_diff(a.grad(), b.detach()), 0.0);
  EXPECT_EQ(max_diff(b.grad(), a.detach() + 3.0 * c), 0.0);
}

TEST(ActivationCheckpoint, GradcheckThroughACheckpointedLayer) {
  manual_seed(4);
  auto lin = std::make_shared<Linear>(3, 2);
  lin->to(kFloat64);
  // gradcheck differentiates with autograd::grad, which sees only the checkpoint's inputs
  // (the captured parameters' gradients go to their grad()): both tensors are inputs here.
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        auto f = [&](const std::vector<Tensor>& t) {
          return std::vector<Tensor>{lin->forward(t[0]).tanh() * t[1]};
        };
        return checkpoint(f, in)[0];
      },
      {test::leaf({4, 3}, 5), test::leaf({4, 2}, 6)});
}

TEST(ActivationCheckpoint, DoubleBackwardIsRefused) {
  Tensor x = test::leaf({4}, 7);
  Tensor y = checkpoint([](const Tensor& t) { return t * t * t; }, x);
  expect_error<NotImplementedError>(
      [&] { autograd::grad({y.sum()}, {x}, {}, true, /*create_graph=*/true); },
      {"checkpoint", "double backward"});
  // a plain backward still works afterwards
  y.sum().backward();
  EXPECT_LT(max_diff(x.grad(), 3.0 * x.detach() * x.detach()), 1e-12);
}

TEST(ActivationCheckpoint, NoGradModeAndInputsWithoutGradJustRun) {
  manual_seed(5);
  auto lin = std::make_shared<Linear>(3, 2);
  const Tensor x = rand_t({4, 3}, kFloat32, 1);
  {
    NoGradGuard no_grad;
    EXPECT_FALSE(checkpoint(lin, x).requires_grad());
  }
  // no input requires grad: the parameters must still get their gradients
  checkpoint(lin, x).sum().backward();
  ASSERT_TRUE(lin->weight.grad().defined());
  EXPECT_GT(lin->weight.grad().abs().sum().item<double>(), 0.0);
}

TEST(ActivationCheckpoint, ParametersGetTheirGradientsAndHooksRunOnce) {
  manual_seed(6);
  auto lin = std::make_shared<Linear>(3, 2);
  int fired = 0;
  auto handle = lin->weight.register_post_accumulate_grad_hook([&](const Tensor&) { ++fired; });
  Tensor x = test::leaf({4, 3}, 1, kFloat32);
  checkpoint(lin, x).sum().backward();
  EXPECT_EQ(fired, 1);
  const Tensor want = x.detach().sum(IntList{0}).unsqueeze(0).expand({2, 3});
  EXPECT_LT(max_diff(lin->weight.grad(), want), 1e-6);
  EXPECT_LT(max_diff(lin->bias.grad(), full({2}, 4.0)), 1e-6);
  (void)handle;
}

TEST(ActivationCheckpoint, Misuse) {
  Tensor x = test::leaf({3}, 1);
  expect_error<ValueError>([&] { checkpoint(CheckpointFunction(), {x}); }, {"checkpoint"});
  expect_error<ValueError>([&] { checkpoint(std::shared_ptr<Module>(), x); }, {"module"});
  // a function that returns a different number of tensors the second time
  int calls = 0;
  auto fickle = [&](const std::vector<Tensor>& in) {
    return ++calls == 1 ? std::vector<Tensor>{in[0] * 2.0}
                        : std::vector<Tensor>{in[0] * 2.0, in[0]};
  };
  auto out = checkpoint(fickle, {x});
  expect_error<ValueError>([&] { out[0].sum().backward(); }, {"recomputation", "2", "1"});
  // a tensor with history captured instead of passed as an input
  Tensor h = x * 2.0;
  Tensor c = checkpoint([&](const Tensor& t) { return t * h; }, x);
  expect_error<ValueError>([&] { c.sum().backward(); }, {"MulBackward", "inputs"});
  // an input modified in place after forward
  Tensor y = x.detach().clone().requires_grad_();
  Tensor z = y * 1.0;
  Tensor w = checkpoint([](const Tensor& t) { return t * t; }, z);
  {
    NoGradGuard no_grad;
    z.add_(1.0);
  }
  EXPECT_THROW(w.sum().backward(), autograd::AutogradError);
}

}  // namespace
}  // namespace ember::nn
