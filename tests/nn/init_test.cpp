// nn::init: fans and gains against PyTorch 1.13's values, and the statistics of every
// initialiser (bounds, mean, std) on large tensors; seeding, dtypes, no autograd history, errors.
#include <ember/nn/init.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "tests/tensor/test_util.h"

namespace ember::nn {
namespace {

using test::expect_error;

TEST(Init, FanInFanOutLikePyTorch) {
  // torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape)).
  using P = std::pair<int64_t, int64_t>;
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({3, 5})), P(5, 3));
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({16, 3, 3, 5})), P(45, 240));
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({4, 2, 3})), P(6, 12));
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({7, 0})), P(0, 7));
  EXPECT_EQ(init::calculate_fan_in_and_fan_out(empty({0, 4, 2})), P(8, 0));
  expect_error([] { init::calculate_fan_in_and_fan_out(empty({5})); },
               {"calculate_fan_in_and_fan_out", "fewer than 2 dimensions", "[5]"});
}

TEST(Init, GainLikePyTorch) {
  // torch.nn.init.calculate_gain(nonlinearity, param), printed with repr().
  EXPECT_EQ(init::calculate_gain("linear"), 1.0);
  EXPECT_EQ(init::calculate_gain("conv2d"), 1.0);
  EXPECT_EQ(init::calculate_gain("conv_transpose2d"), 1.0);
  EXPECT_EQ(init::calculate_gain("sigmoid"), 1.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain("tanh"), 1.6666666666666667);
  EXPECT_DOUBLE_EQ(init::calculate_gain("relu"), 1.4142135623730951);
  EXPECT_DOUBLE_EQ(init::calculate_gain("leaky_relu"), 1.4141428569978354);
  EXPECT_DOUBLE_EQ(init::calculate_gain("leaky_relu", 0.2), 1.3867504905630728);
  EXPECT_DOUBLE_EQ(init::calculate_gain("leaky_relu", std::sqrt(5.0)), 0.5773502691896257);
  EXPECT_DOUBLE_EQ(init::calculate_gain("selu"), 0.75);
  expect_error([] { init::calculate_gain("swish"); }, {"calculate_gain", "'swish'"});
}

/// Mean and (population) std of t.
std::pair<double, double> stats(const Tensor& t) {
  return {t.mean().item<double>(), ember::std(t, {}, 0).item<double>()};
}

/// Expects t ~ U(-bound, bound): all values inside, the extremes near the bounds, and mean
/// and std within a few standard errors.
void expect_uniform(const Tensor& t, double lo, double hi, const std::string& what) {
  SCOPED_TRACE(what);
  const double n = static_cast<double>(t.numel());
  // The bounds are rounded to float32 like the samples (as in PyTorch), hence the slack.
  const double slack = 1e-6 * std::max(std::fabs(lo), std::fabs(hi));
  EXPECT_GE(t.min().item<double>(), lo - slack);
  EXPECT_LE(t.max().item<double>(), hi + slack);
  EXPECT_LT(t.min().item<double>(), lo + 0.01 * (hi - lo));
  EXPECT_GT(t.max().item<double>(), hi - 0.01 * (hi - lo));
  const auto [mean, std] = stats(t);
  const double want_std = (hi - lo) / std::sqrt(12.0);
  EXPECT_NEAR(mean, (lo + hi) / 2, 5 * want_std / std::sqrt(n));
  EXPECT_NEAR(std, want_std, 0.02 * want_std);
}

void expect_normal(const Tensor& t, double mean_want, double std_want, const std::string& what) {
  SCOPED_TRACE(what);
  const double n = static_cast<double>(t.numel());
  const auto [mean, std] = stats(t);
  EXPECT_NEAR(mean, mean_want, 5 * std_want / std::sqrt(n));
  EXPECT_NEAR(std, std_want, 0.02 * std_want);
}

TEST(Init, UniformNormalConstant) {
  manual_seed(0);
  Tensor t = empty({200, 300});
  expect_uniform(init::uniform_(t, -2.0, 3.0), -2.0, 3.0, "uniform_(-2, 3)");
  expect_uniform(init::uniform_(t), 0.0, 1.0, "uniform_()");
  expect_normal(init::normal_(t, 1.5, 0.25), 1.5, 0.25, "normal_(1.5, 0.25)");
  EXPECT_TRUE(equal(init::constant_(t, 0.5), full({200, 300}, 0.5f)));
  EXPECT_TRUE(equal(init::zeros_(t), zeros({200, 300})));
  EXPECT_TRUE(equal(init::ones_(t), ones({200, 300})));
  Tensor d = empty({1000}, kFloat64);
  expect_normal(init::normal_(d), 0.0, 1.0, "float64 normal_");
}

TEST(Init, XavierAndKaiming) {
  manual_seed(1);
  // fan_in = 50 * 9 = 450, fan_out = 64 * 9 = 576.
  Tensor w = empty({64, 50, 3, 3});
  const double fan_in = 450, fan_out = 576;
  double a = std::sqrt(6.0 / (fan_in + fan_out));
  expect_uniform(init::xavier_uniform_(w), -a, a, "xavier_uniform_");
  a = 2.0 * std::sqrt(6.0 / (fan_in + fan_out));
  expect_uniform(init::xavier_uniform_(w, 2.0), -a, a, "xavier_uniform_(gain 2)");
  expect_normal(init::xavier_normal_(w, 0.5), 0.0, 0.5 * std::sqrt(2.0 / (fan_in + fan_out)),
                "xavier_normal_(gain 0.5)");

  // bound = gain * sqrt(3 / fan).
  // PyTorch passes a (default 0) as leaky_relu's slope, so the default gain is sqrt(2).
  double b = std::sqrt(2.0) * std::sqrt(3.0 / fan_in);
  expect_uniform(init::kaiming_uniform_(w), -b, b, "kaiming_uniform_ (leaky_relu, fan_in)");
  b = std::sqrt(2.0) * std::sqrt(3.0 / fan_out);
  expect_uniform(init::kaiming_uniform_(w, 0, "fan_out", "relu"), -b, b,
                 "kaiming_uniform_ (relu, fan_out)");
  b = 1.0 / std::sqrt(fan_in);  // a = sqrt(5), Linear's and Conv2d's default: gain sqrt(1/3)
  expect_uniform(init::kaiming_uniform_(w, std::sqrt(5.0)), -b, b,
                 "kaiming_uniform_ (a = sqrt(5))");
  expect_normal(init::kaiming_normal_(w, 0, "FAN_OUT", "relu"), 0.0,
                std::sqrt(2.0) / std::sqrt(fan_out), "kaiming_normal_ (relu, FAN_OUT)");
  expect_normal(init::kaiming_normal_(w, 0.2), 0.0, std::sqrt(2.0 / 1.04) / std::sqrt(fan_in),
                "kaiming_normal_ (leaky 0.2)");
  expect_normal(init::kaiming_normal_(w, 0, "fan_in", "tanh"), 0.0, 5.0 / 3 / std::sqrt(fan_in),
                "kaiming_normal_ (tanh)");
}

TEST(Init, SeededNoHistoryAnyDtype) {
  Tensor p = empty({30, 20});
  p.requires_grad_();
  manual_seed(42);
  init::kaiming_uniform_(p);  // a leaf that requires grad, filled without recording
  EXPECT_TRUE(p.is_leaf());
  EXPECT_TRUE(p.requires_grad());
  EXPECT_EQ(p.grad_fn(), nullptr);
  const Tensor first = p.detach().clone();
  manual_seed(42);
  init::kaiming_uniform_(p);
  EXPECT_TRUE(equal(p, first)) << "the global generator makes init reproducible";
  Generator gen(5);
  init::xavier_normal_(p, 1.0, &gen);
  Generator gen2(5);
  Tensor q = empty({30, 20});
  init::xavier_normal_(q, 1.0, &gen2);
  EXPECT_TRUE(equal(p, q)) << "an explicit generator";

  Tensor h = empty({64, 64}, kFloat16);
  init::xavier_uniform_(h);
  EXPECT_LE(h.abs().max().item<double>(), std::sqrt(6.0 / 128) * 1.001);

  Tensor none = empty({0, 5});
  init::kaiming_normal_(none);  // no elements: left as it is, as PyTorch
  EXPECT_EQ(none.numel(), 0);
}

TEST(Init, Errors) {
  Tensor w = empty({4, 3});
  expect_error([&] { init::kaiming_uniform_(w, 0, "fan_avg"); },
               {"kaiming_uniform_", "fan_in", "'fan_avg'"});
  expect_error([&] { init::kaiming_normal_(w, 0, "fan_in", "softplus"); },
               {"calculate_gain", "'softplus'"});
  Tensor v = empty({4});
  expect_error([&] { init::xavier_uniform_(v); }, {"fewer than 2 dimensions", "[4]"});
  Tensor i = zeros({3, 3}, kInt64);
  expect_error<TypeError>([&] { init::normal_(i); }, {"normal_", "floating", "int64"});
  expect_error([&] { init::uniform_(w, 1.0, 0.0); }, {"uniform_"});
}

}  // namespace
}  // namespace ember::nn
