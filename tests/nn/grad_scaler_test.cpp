// GradScaler (nn/amp/grad_scaler.h) against PyTorch 1.13's GradScaler. torch 1.13's scaler
// runs on CUDA only, so the expectations are derived by hand from its documented algorithm
// (torch/cuda/amp/grad_scaler.py and _amp_update_scale_): scale sequences, skipped steps, the
// errors it raises, state_dict keys; plus the fused unscale kernel (tensor/ops/amp.h) per dtype.
#include <ember/nn/amp/grad_scaler.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <ember/nn/amp/autocast.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/tensor/gpu/cuda_graph.h>
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

// A refused unscale_ divides nothing: the float16 gradient came after a float32 one, which was
// divided before the refusal, and the retry through step() divided it again.
TEST(GradScaler, ARefusedUnscaleLeavesEveryGradientAsItWas) {
  Tensor a = tensor({1.0f, 1.0f}).requires_grad_();
  Tensor b = tensor({1.0f}).to(kFloat16).requires_grad_();
  optim::SGD opt({a, b}, {.lr = 1.0});
  GradScaler s;  // scale 65536
  a.set_grad(tensor({65536.0f, 65536.0f}));
  b.set_grad(tensor({1.0f}).to(kFloat16));
  expect_throw_with([&] { s.unscale_(opt); }, "Attempting to unscale FP16 gradients");
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{65536, 65536}));
  b.set_grad(Tensor());
  EXPECT_TRUE(s.step(opt));
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{1, 1}));  // divided once
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{0, 0}));
}

// No gradient at all: step() says so, as torch's assertion does, instead of counting a clean
// iteration (which grew the scale). Under found_inf_sync the rank still takes part in the sync,
// which its peers wait for, with a clear flag on its parameters' device.
TEST(GradScaler, NoGradientsIsAnErrorExceptUnderASync) {
  Fixture f;
  GradScaler s({.growth_interval = 1});
  expect_throw_with([&] { s.step(f.opt); }, "No inf checks were recorded for this optimizer");
  int calls = 0;
  GradScaler synced({.growth_interval = 1, .found_inf_sync = [&](Tensor& found) {
                       ++calls;
                       EXPECT_EQ(found.device(), f.w.device());
                       EXPECT_EQ(found.item<float>(), 0.0f);
                     }});
  EXPECT_TRUE(synced.step(f.opt));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(f.w.to_vector<float>(), (std::vector<float>{1, 2}));  // nothing stepped
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

// A user's loop on one parameter: loss = sum(w * x) scaled, backward, step, update. An inf in x
// makes the gradient inf, so the step is skipped and the scale backs off.
void scaled_step(const Tensor& w, optim::Optimizer& opt, GradScaler& scaler, const Tensor& x) {
  opt.zero_grad();
  scaler.scale((w * x).sum()).backward();
  scaler.step(opt);
  scaler.update();
}

Tensor step_input(int s, const Device& device) {
  const float inf = std::numeric_limits<float>::infinity();
  const bool bad = s == 2 || s == 3 || s == 7;
  return tensor({0.5f + 0.1f * s, bad ? inf : -1.0f, 2.0f - 0.2f * s}).to(device);
}

TEST(GradScaler, CapturableKeepsItsStateOnTheDeviceAndSkipsAsTheHostScaler) {
  GradScalerOptions host_options{.init_scale = 1024.0, .growth_interval = 2};
  GradScalerOptions dev_options = host_options;
  dev_options.capturable = true;
  Tensor w_host = tensor({1.0f, 2.0f, 3.0f}).requires_grad_();
  Tensor w_dev = tensor({1.0f, 2.0f, 3.0f}).requires_grad_();
  optim::AdamW opt_host({w_host}, {.lr = 0.1});
  optim::AdamW opt_dev({w_dev}, {.lr = 0.1, .capturable = true});
  GradScaler host(host_options), dev(dev_options);
  EXPECT_FALSE(dev.scale_tensor().defined());
  EXPECT_EQ(dev.get_scale(), 1024.0);  // from the options until the first scale()
  for (int s = 0; s < 9; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    scaled_step(w_host, opt_host, host, step_input(s, kCPU));
    scaled_step(w_dev, opt_dev, dev, step_input(s, kCPU));
    EXPECT_EQ(dev.get_scale(), host.get_scale());
    EXPECT_EQ(dev.growth_tracker(), host.growth_tracker());
    EXPECT_EQ(w_dev.to_vector<float>(), w_host.to_vector<float>());
  }
  // Three skipped steps of nine: AdamW counted six, in both.
  EXPECT_EQ(opt_dev.state(w_dev).front().second.item<float>(), 6.0f);
  EXPECT_EQ(opt_host.state(w_host).front().second.item<float>(), 6.0f);
  ASSERT_TRUE(dev.scale_tensor().defined());
  EXPECT_EQ(dev.scale_tensor().dtype(), kFloat32);
  EXPECT_EQ(dev.growth_tracker_tensor().dtype(), kInt32);
  EXPECT_EQ(dev.state_dict(), host.state_dict());

  // update(new_scale) and load_state_dict write the device state.
  dev.update(8.0);
  EXPECT_EQ(dev.scale_tensor().item<float>(), 8.0f);
  auto sd = host.state_dict();
  sd["scale"] = 32.0;
  sd["_growth_tracker"] = 1.0;
  dev.load_state_dict(sd);
  EXPECT_EQ(dev.scale_tensor().item<float>(), 32.0f);
  EXPECT_EQ(dev.growth_tracker_tensor().item<int32_t>(), 1);
  // A state loaded before the first scale() seeds the device state.
  GradScaler fresh(dev_options);
  fresh.load_state_dict(sd);
  const Tensor scaled = fresh.scale(tensor({1.0f}));
  EXPECT_EQ(scaled.item<float>(), 32.0f);
  EXPECT_EQ(fresh.growth_tracker(), 1);
}

TEST(GradScaler, CapturableStepReturnsTrueAndLeavesTheSkipToTheOptimizer) {
  Tensor w = tensor({1.0f, 2.0f}).requires_grad_();
  optim::Adam opt({w}, {.lr = 0.1, .capturable = true});
  GradScaler scaler({.capturable = true});
  const float inf = std::numeric_limits<float>::infinity();
  opt.zero_grad();
  scaler.scale((w * tensor({1.0f, inf})).sum()).backward();
  EXPECT_TRUE(scaler.step(opt));  // queued; the update itself did nothing
  scaler.update();
  EXPECT_EQ(w.to_vector<float>(), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, CapturableRefusesAnOptimizerThatCannotSkipOnTheDevice) {
  Fixture f;
  GradScaler scaler({.capturable = true});
  f.opt.zero_grad();
  scaler.scale((f.w * tensor({1.0f, 1.0f})).sum()).backward();
  expect_throw_with([&] { scaler.step(f.opt); }, "SGD does not support");
  // The float16-gradient and order errors are those of the host scaler.
  scaler.unscale_(f.opt);
  expect_throw_with([&] { scaler.unscale_(f.opt); }, "already been called");
}

TEST(AmpUpdateScale, FollowsTorchsRuleAndChecksItsArguments) {
  Tensor scale = full({}, 4.0, kFloat32), tracker = zeros({}, kInt32), found = zeros({1});
  detail::amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 4.0f);
  EXPECT_EQ(tracker.item<int32_t>(), 1);
  detail::amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 8.0f);
  EXPECT_EQ(tracker.item<int32_t>(), 0);
  found.fill_(1.0);
  detail::amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2);
  EXPECT_EQ(scale.item<float>(), 4.0f);
  // A growth to inf is refused.
  Tensor big = full({}, 3e38, kFloat32), t1 = full({}, 1.0, kInt32);
  detail::amp_update_scale_(big, t1, zeros({1}), 2.0, 0.5, 2);
  EXPECT_EQ(big.item<float>(), 3e38f);
  EXPECT_EQ(t1.item<int32_t>(), 0);
  expect_throw_with([&] { detail::amp_update_scale_(scale, zeros({}), found, 2.0, 0.5, 2); },
                    "growth_tracker to be a int32");
  expect_throw_with([&] { detail::amp_update_scale_(scale, tracker, zeros({2}), 2.0, 0.5, 2); },
                    "found_inf");
}

TEST(AmpUnscale, TakesTheFactorFromATensor) {
  Tensor g = tensor({2.0f, -4.0f}), found = zeros({1});
  detail::amp_unscale_(g, found, full({}, 0.5, kFloat32));
  EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(found.item<float>(), 0.0f);
  expect_throw_with([&] { detail::amp_unscale_(g, found, full({}, 0.5, kFloat64)); },
                    "inv_scale to be a float32");
}

TEST(GradScalerCuda, CapturedStepSkipsAndBacksOffAsEagerSteps) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Device dev = cuda_device();
  GradScalerOptions options{.init_scale = 1024.0, .growth_interval = 2};
  GradScaler eager(options);
  options.capturable = true;
  GradScaler graphed(options);
  Tensor w_eager = tensor({1.0f, 2.0f, 3.0f}).to(dev).requires_grad_();
  Tensor w_graph = tensor({1.0f, 2.0f, 3.0f}).to(dev).requires_grad_();
  optim::AdamW opt_eager({w_eager}, {.lr = 0.1});
  optim::AdamW opt_graph({w_graph}, {.lr = 0.1, .capturable = true});
  Tensor x = step_input(0, dev);  // the graph's static input
  for (int s = 0; s < 2; ++s) {   // warm-up: the optimizer's and the scaler's state exist
    x.copy_(step_input(s, dev));
    scaled_step(w_eager, opt_eager, eager, x);
    scaled_step(w_graph, opt_graph, graphed, x);
  }
  cuda::CUDAGraph graph;
  cuda::graph(graph, [&] { scaled_step(w_graph, opt_graph, graphed, x); });
  for (int s = 2; s < 9; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    x.copy_(step_input(s, dev));
    scaled_step(w_eager, opt_eager, eager, x);
    graph.replay();
    EXPECT_EQ(graphed.get_scale(), eager.get_scale());
    EXPECT_EQ(graphed.growth_tracker(), eager.growth_tracker());
    const std::vector<float> a = w_graph.cpu().to_vector<float>(),
                             b = w_eager.cpu().to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6) << i;
  }
}

}  // namespace
}  // namespace ember::nn::amp
