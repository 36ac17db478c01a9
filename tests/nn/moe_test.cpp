// The mixture-of-experts layer (nn/layers/moe.h) against a dense computation written here: every
// expert over every token, each token's output the gate-weighted sum of its top-k experts'
// outputs. Forward, every gradient, the balance loss and the error messages.
#include <ember/nn/layers/moe.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/random.h>

namespace ember::nn {
namespace {

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const double err = (got.to(kFloat64) - want.to(kFloat64)).abs().max().item<double>();
  EXPECT_LE(err, tol) << what;
}

// The layer's output by the definition: gates [N, E] zero but at each token's top-k experts.
Tensor dense_moe(const Tensor& x, const Tensor& router, const Tensor& w1, const Tensor& w3,
                 const Tensor& w2, int64_t k, bool normalize) {
  const Tensor t = x.reshape({-1, x.size(-1)});
  const Tensor probs = softmax(matmul(t, router.t()).to(kFloat32), -1);
  auto [w, idx] = topk(probs, k, -1);
  if (normalize) w = w / w.sum({-1}, true);
  const Tensor gates = scatter_add(zeros(probs.shape(), probs.options()), 1, idx, w);
  Tensor y = zeros(t.shape(), t.options());
  for (int64_t e = 0; e < w1.size(0); ++e) {
    const Tensor h = silu(matmul(t, w1.select(0, e))) * matmul(t, w3.select(0, e));
    y = y + matmul(h, w2.select(0, e)) * gates.select(1, e).unsqueeze(1).to(t.dtype());
  }
  return y.reshape(x.shape());
}

struct Grads {
  Tensor y, x, router, w1, w3, w2;
};

Grads grads_of(const std::function<Tensor(const Tensor&)>& f, const Tensor& x0, MoE& moe,
               const Tensor& w) {
  moe.zero_grad();
  Tensor x = x0.detach().requires_grad_();
  Grads g;
  g.y = f(x);
  (g.y * w).sum().backward();
  g.y = g.y.detach();
  g.x = x.grad();
  g.router = moe.router->weight.grad();
  g.w1 = moe.w1.grad();
  g.w3 = moe.w3.grad();
  g.w2 = moe.w2.grad();
  return g;
}

TEST(MoE, MatchesTheDenseDefinitionForwardAndBackward) {
  for (int64_t k : {1, 2, 3}) {
    for (bool normalize : {true, false}) {
      manual_seed(11);
      MoE moe({.dim = 6, .hidden = 10, .experts = 5, .top_k = k, .normalize_weights = normalize});
      moe.to(kFloat64);
      const Tensor x = randn({3, 7, 6}, kFloat64), w = randn({3, 7, 6}, kFloat64);
      const std::string what = "k " + std::to_string(k) + (normalize ? " normalized" : "");
      const Grads got = grads_of([&](const Tensor& in) { return moe.forward(in); }, x, moe, w);
      const Grads want = grads_of(
          [&](const Tensor& in) {
            return dense_moe(in, moe.router->weight, moe.w1, moe.w3, moe.w2, k, normalize);
          },
          x, moe, w);
      expect_close(got.y, want.y, 1e-12, what + " y");
      expect_close(got.x, want.x, 1e-12, what + " dx");
      expect_close(got.router, want.router, 1e-6, what + " drouter");  // float32 probabilities
      expect_close(got.w1, want.w1, 1e-12, what + " dw1");
      expect_close(got.w3, want.w3, 1e-12, what + " dw3");
      expect_close(got.w2, want.w2, 1e-12, what + " dw2");
      int64_t total = 0;
      for (int64_t c : moe.tokens_per_expert()) total += c;
      EXPECT_EQ(total, 21 * k) << what;
    }
  }
}

TEST(MoE, BalanceLossIsExpertsTimesSharesTimesMeanProbabilities) {
  manual_seed(5);
  MoE moe({.dim = 4, .hidden = 8, .experts = 4, .top_k = 2});
  const Tensor x = randn({9, 4});
  EXPECT_FALSE(moe.aux_loss().defined());
  (void)moe.forward(x);
  const Tensor probs = softmax(matmul(x, moe.router->weight.t()), -1).mean({0});
  const std::vector<int64_t>& counts = moe.tokens_per_expert();
  double want = 0;
  for (int64_t e = 0; e < 4; ++e) {
    want += static_cast<double>(counts[e]) / 18.0 * probs.select(0, e).item<float>();
  }
  EXPECT_NEAR(moe.aux_loss().item<float>(), 4 * want, 1e-6);
  // Its gradient reaches the router alone.
  moe.aux_loss().backward();
  ASSERT_TRUE(moe.router->weight.grad().defined());
  EXPECT_GT(moe.router->weight.grad().abs().sum().item<float>(), 0.0f);
  EXPECT_FALSE(moe.w1.grad().defined());
}

TEST(MoE, KeptExpertsAndUnusedOnesAndEmptyInput) {
  manual_seed(2);
  MoE moe({.dim = 4, .hidden = 3, .experts = 6, .top_k = 1});
  const Tensor w2 = moe.w2.detach().clone();
  EXPECT_EQ(moe.extra_repr(), "dim=4, hidden=3, experts=6, top_k=1");
  // An empty batch: the output is empty, nobody is routed.
  EXPECT_EQ(moe.forward(zeros({0, 4})).shape(), Shape({0, 4}));
  EXPECT_EQ(moe.tokens_per_expert(), std::vector<int64_t>(6, 0));
  moe.keep_experts(2, 3);
  EXPECT_EQ(moe.w2.shape(), Shape({3, 3, 4}));
  expect_close(moe.w2, w2.narrow(0, 2, 3), 0, "kept w2");
  EXPECT_EQ(moe.extra_repr(), "dim=4, hidden=3, experts=6, top_k=1, local_experts=2:5");
  EXPECT_EQ(moe.named_parameters().size(), 4u);
  // The kept experts run on their rows; an expert without rows is skipped.
  const Tensor rows = randn({5, 4});
  const Tensor out = moe.run_local_experts(rows, {2, 0, 3});
  const Tensor h = silu(matmul(rows.narrow(0, 2, 3), moe.w1.select(0, 2))) *
                   matmul(rows.narrow(0, 2, 3), moe.w3.select(0, 2));
  expect_close(out.narrow(0, 2, 3), matmul(h, moe.w2.select(0, 2)), 1e-6, "expert 4's rows");
}

// Under bfloat16 autocast the experts run in bfloat16 and the router's softmax in float32.
TEST(MoE, UnderAutocastTheExpertsRunIn16Bits) {
  manual_seed(4);
  MoE moe({.dim = 8, .hidden = 16, .experts = 4, .top_k = 2});
  const Tensor x = randn({12, 8});
  const Tensor want = moe.forward(x).detach();
  AutocastGuard bf16(kCPU, kBFloat16);
  Tensor leaf = x.detach().requires_grad_();
  const Tensor y = moe.forward(leaf);
  EXPECT_EQ(y.dtype(), kBFloat16);
  expect_close(y.to(kFloat32), want, 5e-2, "bf16 y");
  y.to(kFloat32).sum().backward();
  EXPECT_EQ(moe.w1.grad().dtype(), kFloat32);
  EXPECT_EQ(leaf.grad().dtype(), kFloat32);
}

// On a GPU (routing through topk's CUDA kernel, one copy of the chosen experts to the host),
// bfloat16 autocast included, against the same layer on the CPU.
TEST(MoECuda, MatchesTheCpuForwardAndBackward) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(3);
  MoE cpu({.dim = 8, .hidden = 16, .experts = 6, .top_k = 2});
  manual_seed(3);
  MoE gpu({.dim = 8, .hidden = 16, .experts = 6, .top_k = 2});
  gpu.to(cuda_device(0));
  const Tensor x = randn({5, 9, 8}), w = randn({5, 9, 8});
  const Grads want = grads_of([&](const Tensor& in) { return cpu.forward(in); }, x, cpu, w);
  const Grads got = grads_of([&](const Tensor& in) { return gpu.forward(in.to(cuda_device(0))); },
                             x, gpu, w.to(cuda_device(0)));
  expect_close(got.y.cpu(), want.y, 1e-4, "cuda y");
  expect_close(got.x.cpu(), want.x, 1e-4, "cuda dx");
  expect_close(got.router.cpu(), want.router, 1e-4, "cuda drouter");
  expect_close(got.w1.cpu(), want.w1, 1e-4, "cuda dw1");
  expect_close(got.w2.cpu(), want.w2, 1e-4, "cuda dw2");
  EXPECT_EQ(gpu.tokens_per_expert(), cpu.tokens_per_expert());
  {
    AutocastGuard bf16(cuda_device(0), kBFloat16);
    const Tensor y = gpu.forward(x.to(cuda_device(0)));
    EXPECT_EQ(y.dtype(), kBFloat16);
    expect_close(y.to(kFloat32).cpu(), want.y, 5e-2, "cuda bf16 y");
  }
}

TEST(MoE, BadArgumentsAreClearErrors) {
  auto expect_error = [](const std::function<void()>& f, const std::string& text) {
    try {
      f();
      ADD_FAILURE() << "expected an error with: " << text;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error([] { MoE({.dim = 4, .hidden = 8, .experts = 2, .top_k = 3}); },
               "[MoE] top_k=3 is more than the 2 experts");
  expect_error([] { MoE({.dim = 4, .hidden = 0}); },
               "[MoE] expected dim, hidden, experts and top_k of at least 1, got dim=4, hidden=0");
  MoE moe({.dim = 4, .hidden = 8, .experts = 4, .top_k = 2});
  expect_error([&] { moe.forward(randn({2, 5})); }, "[MoE] expected input [..., 4], got [2, 5]");
  expect_error([&] { moe.keep_experts(3, 2); },
               "[MoE] keep_experts(3, 2) is outside the experts held, 0 to 3");
  expect_error(
      [&] {
        moe.run_local_experts(randn({3, 4}), {1, 1});
      },
      "[MoE] expected a count for each of the 4 experts held, got 2");
  expect_error(
      [&] {
        moe.run_local_experts(randn({3, 4}), {1, 1, 0, 0});
      },
      "[MoE] expected [2, 4] rows for the experts, got [3, 4]");
}

}  // namespace
}  // namespace ember::nn
