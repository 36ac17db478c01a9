// Autocast with autograd and the nn layer (tensor/autocast.h, nn/amp/autocast.h): the policy of
// linear, layer_norm and the losses, gradients flowing back to float32 leaves in float32, the
// per-scope cast cache, and a small MLP trained under bf16 autocast reaching the float32 run's
// loss. The tensor ops' policy and the guard's scoping: tests/tensor/autocast_test.cpp.
#include <ember/nn/amp/autocast.h>

#include <gtest/gtest.h>

#include <cmath>

#include <ember/nn/functional.h>
#include <ember/nn/layers.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/ops.h>

namespace ember::nn {
namespace {

namespace F = functional;
using amp::autocast;

Tensor randn_f32(IntList shape, uint64_t seed) {
  manual_seed(seed);
  return randn(shape);
}

TEST(AutocastNn, LayerPolicy) {
  autocast amp(kCPU, kBFloat16);
  const Tensor x = randn_f32({4, 8}, 1);
  Linear lin(8, 6);
  const Tensor y = lin.forward(x);
  EXPECT_EQ(y.dtype(), kBFloat16);  // the bias is cast too, so nothing promotes back
  EXPECT_EQ(F::linear(randn_f32({8}, 2), lin.weight, lin.bias).dtype(), kBFloat16);
  EXPECT_EQ(F::linear(randn_f32({2, 3, 8}, 2), lin.weight, Tensor()).dtype(), kBFloat16);
  LayerNorm ln(6);
  EXPECT_EQ(ln.forward(y).dtype(), kFloat32);
  EXPECT_EQ(gelu(y, "tanh").dtype(), kBFloat16);
  const Tensor target = tensor({0.0f, 1.0f, 2.0f, 3.0f}).to(kInt64);
  EXPECT_EQ(F::cross_entropy(y, target).dtype(), kFloat32);
  EXPECT_EQ(F::nll_loss(log_softmax(y, 1), target).dtype(), kFloat32);
  EXPECT_EQ(F::mse_loss(y, zeros({4, 6})).dtype(), kFloat32);
  EXPECT_EQ(F::binary_cross_entropy_with_logits(y, zeros({4, 6})).dtype(), kFloat32);
}

TEST(AutocastNn, GradientsReachFloat32LeavesInFloat32) {
  const Tensor x = randn_f32({5, 4}, 1).requires_grad_();
  const Tensor w = randn_f32({4, 3}, 2).requires_grad_();
  Tensor out;
  {
    autocast amp(kCPU);
    out = mm(x, w);
  }
  EXPECT_EQ(out.dtype(), kBFloat16);
  out.sum().backward();  // backward outside the scope, as torch recommends
  ASSERT_EQ(x.grad().dtype(), kFloat32);
  ASSERT_EQ(w.grad().dtype(), kFloat32);
  // d(sum(x @ w))/dw = x^T @ ones, computed by the backward in bfloat16 then cast up.
  const Tensor want = mm(x.detach().to(kBFloat16).t(), ones({5, 3}, kBFloat16)).to(kFloat32);
  EXPECT_EQ(w.grad().to_vector<float>(), want.to_vector<float>());
}

TEST(AutocastNn, WeightUsedTwiceIsCastOnceAndTheCacheDiesWithTheScope) {
  const Tensor w = randn_f32({4, 4}, 1).requires_grad_();
  const Tensor x = randn_f32({2, 4}, 2);
  {
    autocast amp(kCPU);
    Tensor h = mm(x, w);
    EXPECT_EQ(detail::autocast_cache_size(), 1u);
    {
      autocast inner(kCPU);  // nested scopes share the outer scope's cache
      h = mm(h, w);
    }
    EXPECT_EQ(detail::autocast_cache_size(), 1u);
    mm(x, x.t());  // x does not require grad: cast every time, never cached
    EXPECT_EQ(detail::autocast_cache_size(), 1u);
    h.sum().backward();
  }
  EXPECT_EQ(detail::autocast_cache_size(), 0u);
  // Both uses sent their gradient through the one cached cast into w.
  const Tensor wb = w.detach().to(kBFloat16), xb = x.to(kBFloat16);
  const Tensor g1 = mm(xb.t(), mm(ones({2, 4}, kBFloat16), wb.t()));
  const Tensor g2 = mm(mm(xb, wb).t(), ones({2, 4}, kBFloat16));
  const std::vector<float> got = w.grad().to_vector<float>();
  const std::vector<float> want = (g1.to(kFloat32) + g2.to(kFloat32)).to_vector<float>();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 0.02 * (1 + std::abs(want[i]))) << "index " << i;
  }
}

TEST(AutocastNn, CacheSeesInPlaceUpdatesAndGradMode) {
  Tensor w = ones({2, 2}).requires_grad_();
  const Tensor x = ones({1, 2});
  autocast amp(kCPU);
  {
    NoGradGuard no_grad;  // a cast made without history...
    EXPECT_EQ(mm(x, w).sum().item<float>(), 4.0f);
    w.mul_(2.0);  // ...and an in-place update of the weight
  }
  const Tensor y = mm(x, w);  // recast: new values, with history
  EXPECT_EQ(y.sum().item<float>(), 8.0f);
  y.sum().backward();
  EXPECT_TRUE(w.grad().defined());
}

TEST(AutocastNn, CacheCanBeDisabled) {
  const Tensor w = ones({2, 2}).requires_grad_();
  autocast amp(kCPU, kBFloat16, true, /*cache_enabled=*/false);
  mm(ones({1, 2}), w);
  EXPECT_EQ(detail::autocast_cache_size(), 0u);
}

// A 2-layer MLP on a fixed classification task (labels from a random teacher), trained with
// AdamW from the same initial weights in float32 and under bf16 autocast.
double train_mlp(bool bf16) {
  manual_seed(7);
  const Tensor x = randn({256, 16});
  const Tensor teacher = randn({16, 4});
  const Tensor y = argmax(mm(x, teacher), 1);
  manual_seed(11);
  auto model = std::make_shared<Sequential>(
      std::make_shared<Linear>(16, 64), std::make_shared<GELU>(), std::make_shared<Linear>(64, 4));
  optim::AdamW opt(model->parameters(), {.lr = 1e-2});
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    Tensor loss;
    {
      autocast amp(kCPU, kBFloat16, bf16);
      loss = F::cross_entropy(model->forward(x), y);
    }
    loss.backward();
    opt.step();
  }
  NoGradGuard no_grad;
  return F::cross_entropy(model->forward(x), y).item<float>();
}

TEST(AutocastNn, MlpTrainedUnderBf16ReachesTheFloat32Loss) {
  const double f32 = train_mlp(false);
  const double bf16 = train_mlp(true);
  std::printf("[ AMP      ] final loss float32 %.4f, bf16 autocast %.4f\n", f32, bf16);
  EXPECT_LT(f32, 0.7) << "the float32 run should learn the task (chance is ln 4 = 1.39)";
  // bfloat16 keeps 8 bits of mantissa: allow 0.01 absolute or 5% relative, whichever is larger.
  EXPECT_NEAR(bf16, f32, std::max(0.01, 0.05 * f32));
}

}  // namespace
}  // namespace ember::nn
