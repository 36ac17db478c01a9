// GradScaler (nn/amp/grad_scaler.h) against PyTorch 1.13's GradScaler. torch 1.13's scaler
// runs on CUDA only, so the expectations are derived by hand from its documented algorithm
// (torch/cuda/amp/grad_scaler.py and _amp_update_scale_): scale sequences, skipped steps, the
// errors it raises, state_dict keys; plus the fused unscale kernel (tensor/ops/amp.h) per dtype.
#include <ember/nn/amp/grad_scaler.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <ember/nn/amp/autocast.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/ops/amp.h>
#include <ember/tensor/ops.h>

namespace ember::nn::amp {
namespace {

template <typename F>
void expect_throw_with(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// One parameter w (float32, [2]) and an SGD optimizer with lr 1; set_grad gives it a gradient.
struct Fixture {
  Tensor w = tensor({1.0f, 2.0f}).requires_grad_();
  optim::SGD opt{{w}, {.lr = 1.0}};
  void set_grad(float a, float b) { w.set_grad(tensor({a, b})); }
};

TEST(GradScaler, TorchDefaults) {
  GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0);
  EXPECT_EQ(s.get_growth_factor(), 2.0);
  EXPECT_EQ(s.get_backoff_factor(), 0.5);
  EXPECT_EQ(s.get_growth_interval(), 2000);
  EXPECT_TRUE(s.is_enabled());
  const auto sd = s.state_dict();
  std::vector<std::string> keys;
  for (const auto& [k, v] : sd) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"_growth_tracker", "backoff_factor", "growth_factor",
                                            "growth_interval", "scale"}));
  EXPECT_EQ(sd.at("scale"), 65536.0);
  EXPECT_EQ(sd.at("_growth_tracker"), 0.0);
}

TEST(GradScaler, ScaleMultipliesAndPromotesLowPrecisionLosses) {
  GradScaler s({.init_scale = 1024.0});
  EXPECT_EQ(s.scale(tensor({3.0f})).item<float>(), 3072.0f);
  // 100 * 1024 overflows float16; torch's float32 scale tensor promotes, so does Ember.
  const Tensor half_loss = tensor({100.0f}).to(kFloat16);
  const Tensor scaled = s.scale(half_loss);
  EXPECT_EQ(scaled.dtype(), kFloat32);
  EXPECT_EQ(scaled.item<float>(), 102400.0f);
}

TEST(GradScaler, UnscaleDividesGradsAndStepUpdates) {
  Fixture f;
  GradScaler s({.init_scale = 4.0});
  f.set_grad(8.0f, -4.0f);
  s.unscale_(f.opt);
  EXPECT_EQ(f.w.grad().to_vector<float>(), (std::vector<float>{2.0f, -1.0f}));
  EXPECT_TRUE(s.step(f.opt));  // does not unscale again
  EXPECT_EQ(f.w.to_vector<float>(), (std::vector<float>{-1.0f, 3.0f}));
  s.update();
  EXPECT_EQ(s.get_scale(), 4.0);
  EXPECT_EQ(s.growth_tracker(), 1);
}

TEST(GradScaler, InfOrNanGradientSkipsTheStepAndBacksOff) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Fixture f;
    GradScaler s({.init_scale = 4.0});
    f.set_grad(bad, 1.0f);
    EXPECT_FALSE(s.step(f.opt));
    EXPECT_EQ(f.w.to_vector<float>(), (std::vector<float>{1.0f, 2.0f})) << "step must be skipped";
    s.update();
    EXPECT_EQ(s.get_scale(), 2.0);
    EXPECT_EQ(s.growth_tracker(), 0);
  }
}

// Hand-derived from torch's _amp_update_scale_: backoff and reset on inf; on a clean step the
// tracker counts up and at growth_interval the scale grows and the tracker resets.
TEST(GradScaler, ScaleSequenceMatchesTorchsAlgorithm) {
  Fixture f;
  GradScaler s({.init_scale = 8.0, .growth_interval = 3});
  const std::vector<bool> inf = {false, false, false, true,  false, false,
                                 true,  false, false, false, false};
  const std::vector<double> want_scale = {8, 8, 16, 8, 8, 8, 4, 4, 4, 8, 8};
  const std::vector<int64_t> want_tracker = {1, 2, 0, 0, 1, 2, 0, 1, 2, 0, 1};
  for (size_t i = 0; i < inf.size(); ++i) {
    f.opt.zero_grad();
    Tensor loss = s.scale((f.w * (inf[i] ? std::numeric_limits<float>::infinity() : 1.0f)).sum());
    loss.backward();
    EXPECT_EQ(s.step(f.opt), !inf[i]) << "iteration " << i;
    s.update();
    EXPECT_EQ(s.get_scale(), want_scale[i]) << "iteration " << i;
    EXPECT_EQ(s.growth_tracker(), want_tracker[i]) << "iteration " << i;
  }
}

TEST(GradScaler, GrowthThatWouldOverflowFloat32IsRefused) {
  Fixture f;
  GradScaler s({.init_scale = std::ldexp(1.0, 127), .growth_interval = 1});
  f.set_grad(1.0f, 1.0f);
  s.step(f.opt);
  s.update();
  EXPECT_EQ(s.get_scale(), std::ldexp(1.0, 127));
  EXPECT_EQ(s.growth_tracker(), 0);
}

TEST(GradScaler, TorchsErrors) {
  Fixture f;
  GradScaler s;
  expect_throw_with([&] { s.update(); }, "No inf checks were recorded");
  f.set_grad(1.0f, 1.0f);
  s.unscale_(f.opt);
  expect_throw_with([&] { s.unscale_(f.opt); }, "already been called on this optimizer");
  s.step(f.opt);
  expect_throw_with([&] { s.step(f.opt); }, "step() has already been called");
  expect_throw_with([&] { s.unscale_(f.opt); }, "after step()");
  s.update();
  s.unscale_(f.opt);  // a new iteration may unscale again
  expect_throw_with([] { GradScaler bad({.growth_factor = 1.0}); }, "growth_factor");
  expect_throw_with([] { GradScaler bad({.backoff_factor = 1.5}); }, "backoff_factor");
  expect_throw_with([] { GradScaler bad({.growth_interval = 0}); }, "growth_interval");

  Tensor h = tensor({1.0f}).to(kFloat16).requires_grad_();
  optim::SGD opt16({h}, {.lr = 1.0});
  h.set_grad(tensor({1.0f}).to(kFloat16));
  expect_throw_with([&] { GradScaler().unscale_(opt16); }, "Attempting to unscale FP16 gradients");
}

TEST(GradScaler, StateDictRoundTrip) {
  GradScaler a({.init_scale = 8.0, .growth_interval = 3});
  Fixture f;
  f.set_grad(1.0f, 1.0f);
  a.step(f.opt);
  a.update();
  GradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.state_dict(), a.state_dict());
  EXPECT_EQ(b.get_growth_interval(), 3);
  EXPECT_EQ(b.growth_tracker(), 1);
  expect_throw_with([&] { b.load_state_dict({}); }, "disabled instance");
  expect_throw_with([&] { b.load_state_dict({{"scale", 2.0}}); }, "growth_factor");
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Fixture f;
  GradScaler s({.enabled = false});
  const Tensor loss = tensor({3.0f});
  EXPECT_TRUE(s.scale(loss).is_same(loss));
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_TRUE(s.state_dict().empty());
  f.set_grad(std::numeric_limits<float>::infinity(), 0.0f);
  EXPECT_TRUE(s.step(f.opt));  // no inf check at all, as in torch
  s.update();
}

TEST(GradScaler, FoundInfSyncDecidesTheStep) {
  Fixture f;
  int calls = 0;
  GradScaler s({.init_scale = 2.0, .found_inf_sync = [&](Tensor& found) {
                  ++calls;
                  found.fill_(1.0);  // as if another rank saw an inf
                }});
  f.set_grad(1.0f, 1.0f);
  EXPECT_FALSE(s.step(f.opt));
  EXPECT_EQ(calls, 1);
  s.update();
  EXPECT_EQ(s.get_scale(), 1.0);
}

TEST(GradScaler, AutocastAliasAndAFullIterationInBf16) {
  Tensor w = tensor({0.5f, -0.5f, 0.25f, 1.0f}).view({2, 2}).requires_grad_();
  optim::SGD opt({w}, {.lr = 0.1});
  GradScaler s;
  Tensor loss;
  {
    autocast amp(kCPU, kBFloat16);
    loss = mm(ones({1, 2}), w).sum();
  }
  EXPECT_EQ(loss.dtype(), kFloat32);  // sum runs in float32
  s.scale(loss).backward();
  EXPECT_EQ(w.grad().dtype(), kFloat32);
  EXPECT_TRUE(s.step(opt));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{1, 1, 1, 1}));
}

TEST(AmpUnscale, EveryFloatingDtypeAndLayout) {
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    const Tensor found = zeros({1});
    Tensor g = tensor({2.0f, -4.0f, 8.0f, 0.0f, 6.0f}).to(dt);
    detail::amp_unscale_(g, found, 0.5);
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1, -2, 4, 0, 3})) << dt;
    EXPECT_EQ(found.item<float>(), 0.0f) << dt;
    // A non-finite element anywhere sets the flag; the rest are still unscaled.
    Tensor bad = tensor({2.0f, 2.0f, -std::numeric_limits<float>::infinity(), 2.0f}).to(dt);
    detail::amp_unscale_(bad, found, 0.5);
    EXPECT_EQ(found.item<float>(), 1.0f) << dt;
    EXPECT_EQ(bad.to_vector<float>()[3], 1.0f) << dt;
    detail::amp_unscale_(g, found, 1.0);  // a clean tensor never clears the flag
    EXPECT_EQ(found.item<float>(), 1.0f) << dt;
  }
  // A strided (transposed) gradient is unscaled in place through a copy.
  Tensor base = arange(0, 6, 1, kFloat32).view({2, 3});
  Tensor t = base.t();
  const Tensor found = zeros({1});
  detail::amp_unscale_(t, found, 2.0);
  EXPECT_EQ(base.to_vector<float>(), (std::vector<float>{0, 2, 4, 6, 8, 10}));
  // Empty gradients and NaN.
  Tensor empty = zeros({0});
  detail::amp_unscale_(empty, found, 2.0);
  const Tensor f2 = zeros({1});
  Tensor nan = tensor({std::nanf("")});
  detail::amp_unscale_(nan, f2, 2.0);
  EXPECT_EQ(f2.item<float>(), 1.0f);
}

TEST(AmpUnscale, RejectsABadFlag) {
  Tensor g = zeros({2});
  expect_throw_with([&] { detail::amp_unscale_(g, zeros({2}), 1.0); }, "found_inf");
  expect_throw_with([&] { detail::amp_unscale_(g, zeros({1}, kFloat64), 1.0); }, "float32");
}

TEST(AmpUnscale, CudaMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  for (Dtype dt : {kFloat32, kFloat16, kBFloat16}) {
    Tensor cpu = tensor({2.0f, -4.0f, std::numeric_limits<float>::infinity(), 6.0f}).to(dt);
    Tensor gpu = cpu.cuda();
    const Tensor fc = zeros({1}), fg = zeros({1}, cuda_device());
    detail::amp_unscale_(cpu, fc, 0.25);
    detail::amp_unscale_(gpu, fg, 0.25);
    EXPECT_EQ(gpu.cpu().to_vector<float>(), cpu.to_vector<float>()) << dt;
    EXPECT_EQ(fg.item<float>(), 1.0f) << dt;
    Tensor clean = ones({1000}, TensorOptions(dt).device(cuda_device()));
    const Tensor f0 = zeros({1}, cuda_device());
    detail::amp_unscale_(clean, f0, 0.5);
    EXPECT_EQ(f0.item<float>(), 0.0f) << dt;
    EXPECT_EQ(clean.sum().item<float>(), 500.0f) << dt;
  }
}

}  // namespace
}  // namespace ember::nn::amp
