// Losses: values and gradients against PyTorch 1.13 (tests/nn/nn_reference.h, made by
// tests/nn/make_reference.py) in float32 and float64, for every reduction and for weight,
// ignore_index and label smoothing and their combinations; gradcheck; modules; errors.
#include <ember/nn/loss.h>

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/tensor/autocast.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include "tests/autograd/grad_util.h"
#include "tests/nn/nn_reference.h"

namespace ember::nn {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;
namespace F = functional;
using LossFn = std::function<Tensor(const std::vector<Tensor>&)>;

class LossRef : public ::testing::TestWithParam<Dtype> {
 protected:
  Dtype dt() const { return GetParam(); }
  double tol() const { return dt() == kFloat64 ? 1e-10 : 3e-5; }
  Tensor in(IntList shape, uint64_t seed, double scale = 1.0) const {
    return rand_t(shape, dt(), seed) * scale;
  }
  /// The make_reference.py loss_case: out = fn(inputs); backward with no gradient for a scalar
  /// and the lcg gradient `gseed` otherwise; checks out against want and each input's grad
  /// against want_grads.
  void check(const std::string& what, const LossFn& fn, std::vector<Tensor> inputs,
             const std::vector<double>& want, const std::vector<std::vector<double>>& want_grads,
             uint64_t gseed = 0) {
    SCOPED_TRACE(what);
    for (Tensor& t : inputs) {
      t = t.detach().clone();
      t.requires_grad_();
    }
    const Tensor out = fn(inputs);
    EXPECT_EQ(out.dtype(), dt());
    if (out.dim() == 0) {
      out.backward();
    } else {
      out.backward(rand_t(out.shape(), dt(), gseed));
    }
    expect_close(out, want, tol(), what);
    for (size_t i = 0; i < want_grads.size(); ++i) {
      expect_close(inputs[i].grad(), want_grads[i], tol(), what + " grad " + std::to_string(i));
    }
  }
  Tensor x() const { return in({5, 4}, 91, 2.0); }
  Tensor w() const { return tensor({0.5, 1.0, 2.0, 1.5}).to(dt()); }
};

const Tensor kT = tensor({1, 0, 3, 3, 2});
const Tensor kTIgn = tensor({1, 0, -100, 3, 2});

TEST_P(LossRef, CrossEntropyReductionsWeightIgnore) {
  using namespace test::ref;
  const auto ce = [](F::CrossEntropyOptions o, Tensor t = kT) {
    return [o, t](const std::vector<Tensor>& v) { return F::cross_entropy(v[0], t, o); };
  };
  check("mean", ce({}), {x()}, kCeMean, {kCeMeanD0});
  check("sum", ce({.reduction = "sum"}), {x()}, kCeSum, {kCeSumD0});
  check("none", ce({.reduction = "none"}), {x()}, kCeNone, {kCeNoneD0}, 101);
  check("weight", ce({.weight = w()}), {x()}, kCeWeight, {kCeWeightD0});
  check("ignore -100", ce({}, kTIgn), {x()}, kCeIgnore, {kCeIgnoreD0});
  check("ignore_index 3", ce({.ignore_index = 3}), {x()}, kCeIgnore0, {kCeIgnore0D0});
  check("label smoothing", ce({.label_smoothing = 0.1}), {x()}, kCeSmooth, {kCeSmoothD0});
}

TEST_P(LossRef, CrossEntropyLabelSmoothingWithWeightAndIgnore) {
  using namespace test::ref;
  // PyTorch's exact combination: the smoothing term is weighted per class, zero at ignored
  // targets, and "mean" divides it by the summed weights of the counted targets.
  const std::vector<
      std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>>
      cases = {{"mean", {&kCeAllMean, &kCeAllMeanD0}},
               {"sum", {&kCeAllSum, &kCeAllSumD0}},
               {"none", {&kCeAllNone, &kCeAllNoneD0}}};
  for (const auto& [red, want] : cases) {
    const F::CrossEntropyOptions o{
        .weight = w(), .ignore_index = -100, .reduction = red, .label_smoothing = 0.2};
    check(
        std::string("all options, ") + red,
        [&](const std::vector<Tensor>& v) { return F::cross_entropy(v[0], kTIgn, o); }, {x()},
        *want.first, {*want.second}, 102);
  }
}

TEST_P(LossRef, CrossEntropyShapes) {
  using namespace test::ref;
  const Tensor tk = tensor({0, 2, 1, -100, 2, 2, 0, 1}).reshape({2, 2, 2});
  const Tensor wk = tensor({1.0, 0.25, 3.0}).to(dt());
  check("[N, C, d1, d2] with weight, smoothing, ignore",
        [&](const std::vector<Tensor>& v) {
          return F::cross_entropy(v[0], tk, {.weight = wk, .label_smoothing = 0.1});
        },
        {in({2, 3, 2, 2}, 92, 2.0)}, kCeKdim, {kCeKdimD0});
  check(
      "[N, C, d1, d2] none",
      [&](const std::vector<Tensor>& v) {
        return F::cross_entropy(v[0], tk, {.reduction = "none"});
      },
      {in({2, 3, 2, 2}, 92, 2.0)}, kCeKdimNone, {kCeKdimNoneD0}, 103);
  check("unbatched [C]",
        [&](const std::vector<Tensor>& v) {
          return F::cross_entropy(v[0], scalar_tensor(2, kInt64), {.label_smoothing = 0.3});
        },
        {in({4}, 93)}, kCeUnbatched, {kCeUnbatchedD0});
}

TEST_P(LossRef, CrossEntropyProbabilities) {
  using namespace test::ref;
  const Tensor probs = softmax(in({5, 4}, 94, 2.0), 1);
  check("probabilities with weight and smoothing",
        [&](const std::vector<Tensor>& v) {
          return F::cross_entropy(v[0], v[1], {.weight = w(), .label_smoothing = 0.1});
        },
        {x(), probs}, kCeProb, {kCeProbD0, kCeProbD1});
  check(
      "probabilities none",
      [&](const std::vector<Tensor>& v) {
        return F::cross_entropy(v[0], v[1], {.reduction = "none"});
      },
      {x(), probs}, kCeProbNone, {kCeProbNoneD0, kCeProbNoneD1}, 104);
}

TEST_P(LossRef, NllLoss) {
  using namespace test::ref;
  const Tensor logp = log_softmax(x(), 1);
  const auto nll = [&](F::NLLLossOptions o, Tensor t) {
    return [o, t](const std::vector<Tensor>& v) { return F::nll_loss(v[0], t, o); };
  };
  check("weighted mean", nll({.weight = w()}, kTIgn), {logp}, kNllMean, {kNllMeanD0});
  check("weighted sum", nll({.weight = w(), .reduction = "sum"}, kTIgn), {logp}, kNllSum,
        {kNllSumD0});
  check("weighted none", nll({.weight = w(), .reduction = "none"}, kTIgn), {logp}, kNllNone,
        {kNllNoneD0}, 105);
  check("plain", nll({}, kT), {logp}, kNllPlain, {kNllPlainD0});
}

TEST_P(LossRef, MseLoss) {
  using namespace test::ref;
  const std::vector<Tensor> ab = {in({3, 4}, 95), in({3, 4}, 96)};
  check("mean", [](const auto& v) { return F::mse_loss(v[0], v[1]); }, ab, kMseMean,
        {kMseMeanD0, kMseMeanD1});
  check("sum", [](const auto& v) { return F::mse_loss(v[0], v[1], "sum"); }, ab, kMseSum,
        {kMseSumD0, kMseSumD1});
  check(
      "none", [](const auto& v) { return F::mse_loss(v[0], v[1], "none"); }, ab, kMseNone,
      {kMseNoneD0, kMseNoneD1}, 106);
}

TEST_P(LossRef, BceWithLogits) {
  using namespace test::ref;
  // Logits of +-100 and 0 among them: the loss stays finite and the gradients exact.
  Tensor xb = in({3, 4}, 97, 4.0);
  {
    NoGradGuard no_grad;
    xb[0][0].fill_(100.0);
    xb[0][1].fill_(-100.0);
    xb[1][2].fill_(0.0);
  }
  const Tensor tb = (in({3, 4}, 98) + 1) / 2;
  const Tensor wb = in({4}, 99).abs() + 0.5;
  const Tensor pw = tensor({0.5, 1.0, 2.0, 3.0}).to(dt());
  check("plain mean", [](const auto& v) { return F::binary_cross_entropy_with_logits(v[0], v[1]); },
        {xb, tb}, kBceMean, {kBceMeanD0, kBceMeanD1});
  const std::vector<std::pair<const char*, std::vector<const std::vector<double>*>>> cases = {
      {"mean", {&kBceAllMean, &kBceAllMeanD0, &kBceAllMeanD1}},
      {"sum", {&kBceAllSum, &kBceAllSumD0, &kBceAllSumD1}},
      {"none", {&kBceAllNone, &kBceAllNoneD0, &kBceAllNoneD1}}};
  for (const auto& [red, want] : cases) {
    check(
        std::string("weight and pos_weight, ") + red,
        [&](const auto& v) {
          return F::binary_cross_entropy_with_logits(
              v[0], v[1], {.weight = wb, .pos_weight = pw, .reduction = red});
        },
        {xb, tb}, *want[0], {*want[1], *want[2]}, 107);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LossRef, ::testing::Values(kFloat32, kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- semantics not covered by the reference values ---------------------------------------------

TEST(Loss, AllIgnoredMeanIsNaN) {
  // PyTorch 1.13: 0 / 0.
  const Tensor x = rand_t({2, 3}, kFloat32, 1);
  const Tensor t = tensor({-100, -100});
  EXPECT_TRUE(std::isnan(F::cross_entropy(x, t).item<float>()));
  EXPECT_EQ(F::cross_entropy(x, t, {.reduction = "sum"}).item<float>(), 0.0f);
  EXPECT_TRUE(std::isnan(F::nll_loss(x, t).item<float>()));
}

TEST(Loss, IgnoredPositionsPassNoGradientEvenWithInfiniteLogits) {
  Tensor x = tensor({1.0f, 2.0f, 3.0f, -INFINITY, 0.0f, 0.0f}).reshape({2, 3});
  x.requires_grad_();
  // Row 1's target is ignored; its -inf at class 0 (where ignored targets are read) must not
  // turn into NaN.
  const Tensor loss = F::nll_loss(x, tensor({2, -100}), {.reduction = "sum"});
  loss.backward();
  EXPECT_EQ(loss.item<float>(), -3.0f);
  expect_close(x.grad(), {0, 0, -1, 0, 0, 0}, 0, "nll grad");
}

TEST(Loss, Gradcheck) {
  using test::expect_gradcheck;
  using test::leaf;
  const Tensor t = tensor({1, 0, -100, 3, 2});
  const Tensor w = tensor({0.5, 1.0, 2.0, 1.5});
  for (const char* red : {"mean", "sum", "none"}) {
    SCOPED_TRACE(red);
    expect_gradcheck(
        [&](const auto& v) {
          return F::cross_entropy(v[0], t,
                                  {.weight = w, .reduction = red, .label_smoothing = 0.15});
        },
        {leaf({5, 4}, 1)});
    expect_gradcheck(
        [&](const auto& v) { return F::nll_loss(v[0], t, {.weight = w, .reduction = red}); },
        {leaf({5, 4}, 2)});
    expect_gradcheck([&](const auto& v) { return F::mse_loss(v[0], v[1], red); },
                     {leaf({3, 2}, 3), leaf({3, 2}, 4)});
    expect_gradcheck(
        [&](const auto& v) {
          return F::binary_cross_entropy_with_logits(
              v[0], v[1], {.weight = v[2], .pos_weight = v[3], .reduction = red});
        },
        {leaf({3, 4}, 5), leaf({3, 4}, 6), leaf({4}, 7), leaf({4}, 8)});
  }
  SCOPED_TRACE("probability targets with smoothing");
  expect_gradcheck(
      [&](const auto& v) {
        return F::cross_entropy(v[0], softmax(v[1], 1), {.weight = w, .label_smoothing = 0.2});
      },
      {leaf({5, 4}, 9), leaf({5, 4}, 10)});
}

TEST(Loss, CrossEntropyDoubleBackward) {
  // Second derivatives (Hessian-vector products) flow through the composite loss.
  const Tensor t = tensor({1, 0, 2});
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& v) {
        EnableGradGuard grad;
        const Tensor l = F::cross_entropy(v[0], t, {.label_smoothing = 0.1});
        return autograd::grad({l}, {v[0]}, {}, std::nullopt, true)[0];
      },
      {test::leaf({3, 4}, 11)});
}

TEST(Loss, Modules) {
  auto ce = std::make_shared<CrossEntropyLoss>(
      F::CrossEntropyOptions{.weight = tensor({1.0f, 2.0f, 3.0f}), .label_smoothing = 0.1});
  EXPECT_EQ(ce->str(), "CrossEntropyLoss()");
  ASSERT_EQ(ce->state_dict().size(), 1u);
  EXPECT_EQ(ce->state_dict()[0].first, "weight");
  const Tensor x = rand_t({4, 3}, kFloat32, 1);
  const Tensor t = tensor({0, 2, 1, 1});
  EXPECT_TRUE(equal((*ce)(x, t), F::cross_entropy(x, t, ce->options)));
  ce->to(kFloat64);
  EXPECT_EQ(ce->options.weight.dtype(), kFloat64) << "the weight buffer follows to()";
  EXPECT_EQ((*ce)(x.to(kFloat64), t).dtype(), kFloat64);
  expect_error<NotImplementedError>([&] { static_cast<Module&>(*ce).forward(x); },
                                    {"CrossEntropyLoss"});

  NLLLoss nll({.reduction = "sum"});
  EXPECT_TRUE(nll.state_dict().empty());
  EXPECT_TRUE(equal(nll(x, t), F::nll_loss(x, t, {.reduction = "sum"})));
  MSELoss mse("none");
  EXPECT_EQ(mse(x, x * 2).shape(), Shape({4, 3}));
  BCEWithLogitsLoss bce({.pos_weight = tensor({1.0f, 2.0f, 3.0f})});
  EXPECT_EQ(bce.state_dict()[0].first, "pos_weight");
  EXPECT_TRUE(equal(
      bce(x, sigmoid(x)),
      F::binary_cross_entropy_with_logits(x, sigmoid(x), {.pos_weight = bce.options.pos_weight})));
  expect_error([] { MSELoss("avg"); }, {"[MSELoss]", "'avg'"});
  expect_error([] { CrossEntropyLoss({.reduction = "Mean"}); }, {"[CrossEntropyLoss]", "Mean"});
}

TEST(Loss, Errors) {
  const Tensor x = rand_t({3, 4}, kFloat32, 1);
  expect_error<TypeError>(
      [&] {
        F::cross_entropy(x, tensor({1, 2, 3}).to(kInt32));
      },
      {"[cross_entropy]", "int64", "int32"});
  expect_error(
      [&] {
        F::cross_entropy(x, tensor({1, 2}));
      },
      {"[cross_entropy]", "target of shape [3]", "[3, 4]", "got [2]"});
  expect_error<IndexError>(
      [&] {
        F::cross_entropy(x, tensor({1, 4, 0}));
      },
      {"[cross_entropy]", "target 4", "flat index 1", "[0, 4)"});
  expect_error<IndexError>(
      [&] {
        F::nll_loss(x, tensor({-1, 0, 0}));
      },
      {"[nll_loss]", "target -1", "ignore_index (-100)"});
  expect_error(
      [&] {
        F::cross_entropy(x, tensor({1, 2, 3}), {.weight = ones({3})});
      },
      {"[cross_entropy]", "weight", "[4]", "[3]"});
  expect_error(
      [&] {
        F::cross_entropy(x, tensor({1, 2, 3}), {.reduction = "avg"});
      },
      {"[cross_entropy]", "'avg'"});
  expect_error(
      [&] {
        F::cross_entropy(x, tensor({1, 2, 3}), {.label_smoothing = 1.5});
      },
      {"[cross_entropy]", "label_smoothing", "1.5"});
  expect_error(
      [&] {
        F::cross_entropy(x, ones({3, 3}));
      },
      {"[cross_entropy]", "probabilities", "[3, 4]", "[3, 3]"});
  expect_error(
      [&] {
        F::cross_entropy(x, ones({3, 4}), {.ignore_index = 0});
      },
      {"[cross_entropy]", "ignore_index", "0"});
  expect_error<TypeError>(
      [&] {
        F::cross_entropy(tensor({1, 2}), tensor({0}));
      },
      {"[cross_entropy]", "floating", "int64"});
  expect_error([&] { F::mse_loss(x, ones({4})); }, {"[mse_loss]", "[3, 4]", "[4]"});
  expect_error([&] { F::binary_cross_entropy_with_logits(x, ones({3})); },
               {"[binary_cross_entropy_with_logits]", "[3]", "[3, 4]"});
  expect_error<TypeError>(
      [&] {
        F::binary_cross_entropy_with_logits(x, zeros({3, 4}, kInt64));
      },
      {"[binary_cross_entropy_with_logits]", "target", "int64"});
}

}  // namespace
}  // namespace ember::nn

namespace ember::nn {
namespace {

// The fused 2-d cross_entropy (Note [Fused cross_entropy]) against the composite path, which a
// 3-d input [N, C, 1] takes: values, gradients and double backward (create_graph).
TEST(Loss, FusedCrossEntropyMatchesComposite) {
  namespace F = functional;
  const Tensor t = tensor({1, 0, -100, 3, 2});
  const Tensor w = tensor({0.5, 1.0, 2.0, 1.5}).to(kFloat64);
  for (const char* red : {"mean", "sum", "none"}) {
    for (double ls : {0.0, 0.2}) {
      for (bool weighted : {false, true}) {
        const std::string what = std::string(red) + " ls=" + std::to_string(ls) +
                                 (weighted ? " weighted" : "");
        F::CrossEntropyOptions o{.weight = weighted ? w : Tensor(), .ignore_index = -100,
                                 .reduction = red, .label_smoothing = ls};
        auto run = [&](bool fused) {
          Tensor x = test::rand_t({5, 4}, kFloat64, 7).mul_(3.0).requires_grad_();
          Tensor in = fused ? x : x.unsqueeze(2);
          Tensor tt = fused ? t : t.unsqueeze(1);
          Tensor loss = F::cross_entropy(in, tt, o).sum();
          Tensor g = autograd::grad({loss}, {x}, {}, /*retain_graph=*/true,
                                    /*create_graph=*/true)[0];
          (g * g).sum().backward();
          return std::vector<Tensor>{loss.detach(), g.detach(), x.grad()};
        };
        const auto a = run(true), b = run(false);
        const char* names[] = {"loss", "grad", "double backward"};
        for (int k = 0; k < 3; ++k) {
          test::expect_close(a[k], b[k].to_vector<double>(), 1e-10, what + " " + names[k]);
        }
      }
    }
  }
}

// The row kernels (forward's lse, backward's one pass) on `dev` against the CPU's composite
// [N, C, 1] path, first order: every reduction, label smoothing, class weights, ignored rows, a
// transposed (non-contiguous) input, rows wider than one vector block, rows of a multiple of 8
// (CUDA's 16-byte loads) and not, and float64/float32/bfloat16.
void expect_row_kernels_match_composite(const Device dev) {
  namespace F = functional;
  for (const Dtype dt : {kFloat64, kFloat32, kBFloat16}) {
    for (const int64_t classes : {int64_t{4}, int64_t{1100}, int64_t{9000}}) {
      for (const char* red : {"mean", "sum", "none"}) {
        for (double ls : {0.0, 0.1}) {
          for (bool weighted : {false, true}) {
            for (bool transposed : {false, true}) {
              const std::string what = dev.str() + " " + std::string(dtype_name(dt)) +
                                       " C=" + std::to_string(classes) + " " + red +
                                       " ls=" + std::to_string(ls) + (weighted ? " weighted" : "") +
                                       (transposed ? " transposed" : "");
              const int64_t n = 6;
              std::vector<int64_t> tv = {1, 0, -100, 3, 2, classes - 1};
              const Tensor t = from_vector(tv);
              const Tensor w =
                  weighted ? (test::rand_t({classes}, kFloat32, 3) + 0.5).to(dt) : Tensor();
              auto run = [&](bool fused) {
                const Device on = fused ? dev : Device("cpu");
                F::CrossEntropyOptions o{.weight = w.defined() ? w.to(on) : Tensor(),
                                         .ignore_index = -100,
                                         .reduction = red,
                                         .label_smoothing = ls};
                Tensor base = test::rand_t({classes, n}, kFloat32, 11).mul_(4.0).to(dt).to(on);
                Tensor x = (transposed ? base.t() : base.t().contiguous()).detach();
                x.requires_grad_();
                Tensor loss = fused ? F::cross_entropy(x, t.to(on), o)
                                    : F::cross_entropy(x.unsqueeze(2), t.unsqueeze(1), o);
                loss.sum().backward();
                return std::vector<Tensor>{loss.detach().to(kFloat64).reshape({-1}).cpu(),
                                           x.grad().to(kFloat64).cpu()};
              };
              const auto a = run(true), b = run(false);
              const double tol = dt == kBFloat16 ? 2e-2 : dt == kFloat32 ? 1e-5 : 1e-12;
              test::expect_close(a[0], b[0].to_vector<double>(), tol, what + " loss");
              test::expect_close(a[1], b[1].to_vector<double>(), tol, what + " grad");
            }
          }
        }
      }
    }
  }
}

TEST(Loss, FusedCrossEntropyRowKernelsMatchComposite) {
  expect_row_kernels_match_composite(Device("cpu"));
}
TEST(LossCuda, FusedCrossEntropyRowKernelsMatchComposite) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  expect_row_kernels_match_composite(Device("cuda"));
}

// Under autocast on `dev` a bfloat16 (or, on CUDA, float16) input goes to the row kernels as it
// is: no cast node between it and the loss, a float32 loss as torch's, a gradient in the input's
// dtype, and the values of the float32 path (the cast it saves is exact).
void expect_autocast_reads_low_precision_logits(const Device dev) {
  namespace F = functional;
  std::vector<Dtype> dtypes{kBFloat16};
  if (dev.is_cuda()) dtypes.push_back(kFloat16);
  for (const Dtype dt : dtypes) {
    for (double ls : {0.0, 0.1}) {
      for (bool weighted : {false, true}) {
        const std::string what = dev.str() + " " + std::string(dtype_name(dt)) +
                                 " ls=" + std::to_string(ls) + (weighted ? " weighted" : "");
        const int64_t classes = 1104;
        const Tensor t = from_vector(std::vector<int64_t>{7, 0, -100, 1103}).to(dev);
        const Tensor w = weighted ? (test::rand_t({classes}, kFloat32, 3) + 0.5).to(dev) : Tensor();
        F::CrossEntropyOptions o{.weight = w, .ignore_index = -100, .label_smoothing = ls};
        Tensor x = (test::rand_t({4, classes}, kFloat32, 5) * 4.0).to(dt).to(dev);
        x.requires_grad_();
        Tensor loss;
        {
          AutocastGuard amp(dev, dt);
          loss = F::cross_entropy(x, t, o);
        }
        EXPECT_EQ(loss.dtype(), kFloat32) << what;
        ASSERT_NE(loss.grad_fn(), nullptr) << what;
        EXPECT_EQ(std::string(loss.grad_fn()->name()), "CrossEntropyBackward") << what;
        EXPECT_EQ(std::string(loss.grad_fn()->next_edge(0).fn->name()), "AccumulateGrad")
            << what << ": a node between the logits and the loss";
        loss.backward();
        EXPECT_EQ(x.grad().dtype(), dt) << what;

        Tensor x32 = x.detach().to(kFloat32).requires_grad_();
        const Tensor ref = F::cross_entropy(x32, t, o);
        ref.backward();
        test::expect_close(loss.cpu(), ref.to(kFloat64).cpu().to_vector<double>(), 1e-6,
                           what + " loss");
        // Rounded once from float32 values equal up to their last bits: at most one step of
        // the low-precision type apart.
        test::expect_close(x.grad().to(kFloat64).cpu(),
                           x32.grad().to(kFloat64).cpu().to_vector<double>(),
                           dt == kBFloat16 ? 8e-3 : 1e-3, what + " grad");
      }
    }
  }
}

TEST(Loss, CrossEntropyUnderAutocastReadsLowPrecisionLogitsAsTheyAre) {
  expect_autocast_reads_low_precision_logits(Device("cpu"));
}
TEST(LossCuda, CrossEntropyUnderAutocastReadsLowPrecisionLogitsAsTheyAre) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  expect_autocast_reads_low_precision_logits(Device("cuda"));
}

// With class weights and label smoothing nothing of cross_entropy's forward or backward reads the
// device on the host (the weights' sum stays there), so the pair captures in a CUDA graph and each
// replay gives the eager loss and gradient of its inputs.
TEST(LossCuda, WeightedSmoothedCrossEntropyCapturesInACudaGraph) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  namespace F = functional;
  const Device dev("cuda");
  const Tensor t = from_vector(std::vector<int64_t>{3, 0, -100, 9}).to(dev);
  const Tensor w = (rand_t({10}, kFloat32, 2) + 0.5).to(dev);
  const F::CrossEntropyOptions o{.weight = w, .label_smoothing = 0.1};
  Tensor x = rand_t({4, 10}, kFloat32, 3).to(dev);
  auto loss_and_grad = [&](const Tensor& in) {
    Tensor v = in.detach().requires_grad_();
    Tensor l = F::cross_entropy(v, t, o);
    return std::make_pair(l, autograd::grad({l}, {v})[0]);
  };
  (void)loss_and_grad(x);  // warm-up, outside the capture
  std::pair<Tensor, Tensor> captured;
  cuda::CUDAGraph graph;
  cuda::graph(graph, [&] { captured = loss_and_grad(x); });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    x.copy_(rand_t({4, 10}, kFloat32, 10 + r).to(dev));
    graph.replay();
    const auto [loss, grad] = loss_and_grad(x);
    expect_close(captured.first.cpu(), loss.to(kFloat64).cpu().to_vector<double>(), 1e-6, "loss");
    expect_close(captured.second.cpu(), grad.to(kFloat64).cpu().to_vector<double>(), 1e-6, "grad");
  }
}

// On CUDA a target outside [0, C) is found by the row kernel's device-side check and reported
// by the next index op (or cross_entropy) once the device got there, naming the op, the index
// and the class count; the call itself does not wait for the device (Note [CUDA index checks]).
TEST(LossCuda, BadTargetIsReportedByTheNextIndexOp) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  namespace F = functional;
  const Device dev("cuda");
  const Tensor x = test::rand_t({3, 4}, kFloat32, 1).to(dev);
  const Tensor good = F::cross_entropy(x, tensor({1, 3, 0}).to(dev));
  EXPECT_NEAR(good.item<float>(), F::cross_entropy(x.cpu(), tensor({1, 3, 0})).item<float>(),
              1e-6);
  F::cross_entropy(x, tensor({1, 4, 0}).to(dev));  // class 4 of 4
  cuda::synchronize();
  expect_error<IndexError>(
      [&] {
        F::cross_entropy(x, tensor({1, 3, 0}).to(dev));
      },
      {"[cross_entropy]", "index 4 is out of bounds", "size 4", "checked on the device"});
  // With class weights too: the row kernel's check is queued before the weights' gather.
  const Tensor w = tensor({1.0, 2.0, 0.5, 1.0}).to(kFloat32).to(dev);
  F::cross_entropy(x, tensor({1, 4, 0}).to(dev), {.weight = w});
  cuda::synchronize();
  expect_error<IndexError>(
      [&] {
        F::cross_entropy(x, tensor({1, 3, 0}).to(dev), {.weight = w});
      },
      {"[cross_entropy]", "index 4 is out of bounds", "size 4", "checked on the device"});
  // Ignored positions are not bad indices.
  EXPECT_NO_THROW({
    F::cross_entropy(x, tensor({1, -100, 0}).to(dev));
    cuda::synchronize();
    F::cross_entropy(x, tensor({1, 3, 0}).to(dev));
  });
}

}  // namespace
}  // namespace ember::nn
