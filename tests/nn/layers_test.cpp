// Layers: forward and backward of every layer against PyTorch 1.13 (tests/nn/nn_reference.h,
// made by tests/nn/make_reference.py with the same lcg weights and inputs), in float32 and
// float64; default initialisations; train/eval; buffers and state_dict names; printing;
// containers; gradcheck of the functional forms; error messages.
#include <ember/nn/layers.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/functional.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/autograd/grad_util.h"
#include "tests/nn/nn_reference.h"

namespace ember::nn {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;
namespace F = functional;

std::vector<std::string> names(const NamedTensors& v) {
  std::vector<std::string> r;
  for (const auto& [n, t] : v) r.push_back(n);
  return r;
}

/// Overwrites a parameter with lcg values (the reference script's T(shape, seed)).
void set(Tensor& p, uint64_t seed) {
  NoGradGuard no_grad;
  p.copy_(rand_t(p.shape(), kFloat64, seed));
}

// ---- against PyTorch, per dtype ---------------------------------------------------------------

class LayerRef : public ::testing::TestWithParam<Dtype> {
 protected:
  Dtype dt() const { return GetParam(); }
  /// Relative tolerance: float64 results must agree to rounding, float32 to a few ulps of
  /// accumulated error.
  double tol() const { return dt() == kFloat64 ? 1e-10 : 3e-5; }
  Tensor in(IntList shape, uint64_t seed, double scale = 1.0) const {
    return rand_t(shape, dt(), seed) * scale;
  }
  /// y = m(x) and backward with the lcg gradient `gseed`; checks y and dx against the reference
  /// `want_y`, `want_dx`. Returns y.
  Tensor run(Module& m, const Tensor& x0, uint64_t gseed, const std::vector<double>& want_y,
             const std::vector<double>& want_dx, const std::string& what) {
    Tensor x = x0.detach().clone();
    x.requires_grad_();
    Tensor y = m(x);
    EXPECT_EQ(y.dtype(), dt()) << what;
    y.backward(rand_t(y.shape(), dt(), gseed));
    expect_close(y, want_y, tol(), what + " output");
    expect_close(x.grad(), want_dx, tol(), what + " input grad");
    return y;
  }
};

TEST_P(LayerRef, Linear) {
  auto lin = std::make_shared<Linear>(5, 3);
  lin->to(dt());
  set(lin->weight, 11);
  set(lin->bias, 12);
  Tensor y = run(*lin, in({4, 5}, 13), 14, test::ref::kLinearY, test::ref::kLinearDx, "Linear");
  EXPECT_EQ(y.shape(), Shape({4, 3}));
  expect_close(lin->weight.grad(), test::ref::kLinearDweight, tol(), "Linear weight grad");
  expect_close(lin->bias.grad(), test::ref::kLinearDbias, tol(), "Linear bias grad");
  lin->zero_grad();
  y = run(*lin, in({2, 2, 5}, 15), 16, test::ref::kLinear3dY, test::ref::kLinear3dDx, "Linear 3d");
  EXPECT_EQ(y.shape(), Shape({2, 2, 3}));
}

TEST_P(LayerRef, Conv2d) {
  auto a = std::make_shared<Conv2d>(4, 6, 3, Conv2dOptions{.stride = 2, .padding = 1, .groups = 2});
  a->to(dt());
  set(a->weight, 21);
  set(a->bias, 22);
  run(*a, in({2, 4, 7, 6}, 23), 24, test::ref::kConvAY, test::ref::kConvADx, "Conv2d groups");
  expect_close(a->weight.grad(), test::ref::kConvADweight, tol(), "Conv2d groups weight grad");
  expect_close(a->bias.grad(), test::ref::kConvADbias, tol(), "Conv2d groups bias grad");

  auto b = std::make_shared<Conv2d>(
      3, 2, Size2(2, 3),
      Conv2dOptions{.stride = {1, 2}, .padding = {1, 0}, .dilation = {2, 1}, .bias = false});
  b->to(dt());
  set(b->weight, 25);
  EXPECT_FALSE(b->bias.defined());
  run(*b, in({1, 3, 5, 6}, 26), 27, test::ref::kConvBY, test::ref::kConvBDx, "Conv2d dilated");
  expect_close(b->weight.grad(), test::ref::kConvBDweight, tol(), "Conv2d dilated weight grad");

  // Unbatched input [C, H, W] gives [C_out, H', W'] with the same values.
  NoGradGuard no_grad;
  const Tensor x = in({1, 3, 5, 6}, 26);
  EXPECT_TRUE(allclose((*b)(x[0]), (*b)(x)[0]));
}

TEST_P(LayerRef, BatchNorm1d) {
  auto bn = std::make_shared<BatchNorm1d>(3);
  bn->to(dt());
  set(bn->weight, 31);
  set(bn->bias, 32);
  run(*bn, in({4, 3, 5}, 33, 2.0), 34, test::ref::kBn1dY, test::ref::kBn1dDx, "BatchNorm1d");
  expect_close(bn->weight.grad(), test::ref::kBn1dDweight, tol(), "BatchNorm1d weight grad");
  expect_close(bn->bias.grad(), test::ref::kBn1dDbias, tol(), "BatchNorm1d bias grad");
  expect_close(bn->running_mean, test::ref::kBn1dMean1, tol(), "running_mean after 1 batch");
  expect_close(bn->running_var, test::ref::kBn1dVar1, tol(), "running_var after 1 batch");
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_FALSE(bn->running_mean.requires_grad());
  (*bn)(in({6, 3}, 35, 3.0));  // 2-d input [N, C]
  expect_close(bn->running_mean, test::ref::kBn1dMean2, tol(), "running_mean after 2 batches");
  expect_close(bn->running_var, test::ref::kBn1dVar2, tol(), "running_var after 2 batches");
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2);
  bn->eval();
  expect_close((*bn)(in({2, 3}, 36)), test::ref::kBn1dEvalY, tol(), "BatchNorm1d eval");
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2) << "eval does not count batches";

  auto cum = std::make_shared<BatchNorm1d>(3, BatchNormOptions{.momentum = std::nullopt});
  cum->to(dt());
  (*cum)(in({4, 3, 5}, 33, 2.0));
  (*cum)(in({6, 3}, 35, 3.0));
  expect_close(cum->running_mean, test::ref::kBn1dCumMean, tol(), "cumulative running_mean");
  expect_close(cum->running_var, test::ref::kBn1dCumVar, tol(), "cumulative running_var");

  auto plain = std::make_shared<BatchNorm1d>(
      3, BatchNormOptions{.affine = false, .track_running_stats = false});
  plain->to(dt());
  EXPECT_TRUE(plain->parameters().empty());
  EXPECT_TRUE(plain->buffers().empty());
  run(*plain, in({4, 3}, 37), 38, test::ref::kBn1dPlainY, test::ref::kBn1dPlainDx,
      "BatchNorm1d without affine or running stats");
  plain->eval();  // no running stats: batch statistics in eval mode too
  NoGradGuard no_grad;
  expect_close((*plain)(in({4, 3}, 37)), test::ref::kBn1dPlainY, tol(), "untracked eval");
}

TEST_P(LayerRef, BatchNorm2d) {
  auto bn = std::make_shared<BatchNorm2d>(2);
  bn->to(dt());
  set(bn->weight, 41);
  set(bn->bias, 42);
  run(*bn, in({3, 2, 4, 5}, 43, 2.0), 44, test::ref::kBn2dY, test::ref::kBn2dDx, "BatchNorm2d");
  expect_close(bn->weight.grad(), test::ref::kBn2dDweight, tol(), "BatchNorm2d weight grad");
  expect_close(bn->bias.grad(), test::ref::kBn2dDbias, tol(), "BatchNorm2d bias grad");
  expect_close(bn->running_mean, test::ref::kBn2dMean, tol(), "BatchNorm2d running_mean");
  expect_close(bn->running_var, test::ref::kBn2dVar, tol(), "BatchNorm2d running_var");
  bn->eval();
  run(*bn, in({1, 2, 2, 3}, 45), 46, test::ref::kBn2dEvalY, test::ref::kBn2dEvalDx,
      "BatchNorm2d eval");
}

TEST_P(LayerRef, LayerNorm) {
  auto ln = std::make_shared<LayerNorm>(std::vector<int64_t>{4, 5});
  ln->to(dt());
  set(ln->weight, 51);
  set(ln->bias, 52);
  run(*ln, in({3, 4, 5}, 53, 2.0), 54, test::ref::kLnY, test::ref::kLnDx, "LayerNorm");
  expect_close(ln->weight.grad(), test::ref::kLnDweight, tol(), "LayerNorm weight grad");
  expect_close(ln->bias.grad(), test::ref::kLnDbias, tol(), "LayerNorm bias grad");
  auto plain = std::make_shared<LayerNorm>(5, LayerNormOptions{.elementwise_affine = false});
  EXPECT_TRUE(plain->parameters().empty());
  run(*plain, in({2, 3, 5}, 55), 56, test::ref::kLnPlainY, test::ref::kLnPlainDx,
      "LayerNorm without affine");
}

TEST_P(LayerRef, Embedding) {
  auto emb = std::make_shared<Embedding>(10, 3, /*padding_idx=*/4);
  emb->to(dt());
  set(emb->weight, 61);
  const Tensor idx = tensor({1, 2, 4, 4, 3, 9}).reshape({2, 3});
  Tensor y = (*emb)(idx);
  EXPECT_EQ(y.shape(), Shape({2, 3, 3}));
  y.backward(rand_t(y.shape(), dt(), 62));
  expect_close(y, test::ref::kEmbY, tol(), "Embedding output");
  expect_close(emb->weight.grad(), test::ref::kEmbDweight, tol(),
               "Embedding weight grad (padding row gets none)");
  // int32 indices work too.
  NoGradGuard no_grad;
  EXPECT_TRUE(equal((*emb)(idx.to(kInt32)), y.detach()));
}

TEST_P(LayerRef, Pooling) {
  const Tensor x = in({2, 3, 7, 6}, 71);
  MaxPool2d max_a(3, {.stride = 2, .padding = 1});
  run(max_a, x, 72, test::ref::kMaxPoolY, test::ref::kMaxPoolDx, "MaxPool2d");
  MaxPool2d max_b({2, 3}, {.stride = Size2(2, 1), .dilation = {1, 2}, .ceil_mode = true});
  run(max_b, x, 75, test::ref::kMaxPoolBY, test::ref::kMaxPoolBDx, "MaxPool2d dilated ceil");
  AvgPool2d avg_a(3, {.stride = 2, .padding = 1, .ceil_mode = true, .count_include_pad = false});
  run(avg_a, x, 73, test::ref::kAvgPoolY, test::ref::kAvgPoolDx, "AvgPool2d");
  AvgPool2d avg_b(2);
  run(avg_b, x, 76, test::ref::kAvgPoolBY, test::ref::kAvgPoolBDx, "AvgPool2d(2)");
  AdaptiveAvgPool2d ada({3, 2});
  Tensor y = run(ada, x, 74, test::ref::kAdaPoolY, test::ref::kAdaPoolDx, "AdaptiveAvgPool2d");
  EXPECT_EQ(y.shape(), Shape({2, 3, 3, 2}));
  NoGradGuard no_grad;
  EXPECT_TRUE(allclose(max_a(x[1]), max_a(x)[1])) << "unbatched [C, H, W] input";
  EXPECT_EQ(AdaptiveAvgPool2d(1)(x).shape(), Shape({2, 3, 1, 1}));
}

TEST_P(LayerRef, Activations) {
  const Tensor x = in({3, 4}, 81, 3.0);
  struct Case {
    std::shared_ptr<Module> m;
    const std::vector<double>& y;
    const std::vector<double>& dx;
  };
  const std::vector<Case> cases = {
      {std::make_shared<ReLU>(), test::ref::kReluY, test::ref::kReluDx},
      {std::make_shared<GELU>(), test::ref::kGeluY, test::ref::kGeluDx},
      {std::make_shared<GELU>("tanh"), test::ref::kGeluTanhY, test::ref::kGeluTanhDx},
      {std::make_shared<SiLU>(), test::ref::kSiluY, test::ref::kSiluDx},
      {std::make_shared<Tanh>(), test::ref::kTanhY, test::ref::kTanhDx},
      {std::make_shared<Sigmoid>(), test::ref::kSigmoidY, test::ref::kSigmoidDx},
      {std::make_shared<Softmax>(1), test::ref::kSoftmax1Y, test::ref::kSoftmax1Dx},
      {std::make_shared<Softmax>(0), test::ref::kSoftmax0Y, test::ref::kSoftmax0Dx},
      {std::make_shared<LogSoftmax>(1), test::ref::kLogSoftmaxY, test::ref::kLogSoftmaxDx},
  };
  for (const Case& c : cases) run(*c.m, x, 82, c.y, c.dx, c.m->str());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LayerRef, ::testing::Values(kFloat32, kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- default initialisation -------------------------------------------------------------------

/// Checks that t's values lie in [-bound, bound] and have the mean and std of U(-bound, bound).
void expect_uniform(const Tensor& t, double bound, const std::string& what) {
  const double n = static_cast<double>(t.numel());
  EXPECT_LE(t.abs().max().item<double>(), bound) << what;
  EXPECT_GE(t.abs().max().item<double>(), 0.95 * bound) << what;
  EXPECT_NEAR(t.mean().item<double>(), 0.0, 5 * bound / std::sqrt(3 * n)) << what;
  EXPECT_NEAR(ember::std(t.detach()).item<double>(), bound / std::sqrt(3.0), 0.03 * bound) << what;
}

TEST(LayerInit, LinearAndConvMatchPyTorchDefaults) {
  manual_seed(0);
  Linear lin(400, 300);
  // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / 6), bound = gain * sqrt(3 / fan_in) =
  // 1 / sqrt(fan_in); the bias uses the same bound.
  expect_uniform(lin.weight, 1.0 / std::sqrt(400.0), "Linear weight");
  expect_uniform(lin.bias, 1.0 / std::sqrt(400.0), "Linear bias");
  EXPECT_TRUE(lin.weight.requires_grad() && lin.weight.is_leaf());
  EXPECT_EQ(lin.weight.dtype(), kFloat32);

  Conv2d conv(16, 32, 3, {.groups = 2});
  EXPECT_EQ(conv.weight.shape(), Shape({32, 8, 3, 3}));
  expect_uniform(conv.weight, 1.0 / std::sqrt(8 * 9.0), "Conv2d weight");
  EXPECT_LE(conv.bias.abs().max().item<double>(), 1.0 / std::sqrt(72.0));

  // Reproducible from the global generator.
  manual_seed(7);
  Linear a(5, 4);
  manual_seed(7);
  Linear b(5, 4);
  EXPECT_TRUE(equal(a.weight, b.weight));
  EXPECT_TRUE(equal(a.bias, b.bias));
  EXPECT_FALSE(equal(a.weight, Linear(5, 4).weight));
}

TEST(LayerInit, EmbeddingAndNorms) {
  manual_seed(1);
  Embedding emb(1000, 64, /*padding_idx=*/-1);
  EXPECT_EQ(*emb.padding_idx, 999);
  EXPECT_EQ(emb.weight[999].abs().sum().item<double>(), 0.0);
  const Tensor w = emb.weight.detach().narrow(0, 0, 999);
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(ember::std(w).item<double>(), 1.0, 0.01);

  BatchNorm2d bn(4);
  EXPECT_TRUE(equal(bn.weight, ones({4})));
  EXPECT_TRUE(equal(bn.bias, zeros({4})));
  EXPECT_TRUE(equal(bn.running_mean, zeros({4})));
  EXPECT_TRUE(equal(bn.running_var, ones({4})));
  EXPECT_EQ(bn.num_batches_tracked.dtype(), kInt64);
  EXPECT_EQ(bn.num_batches_tracked.dim(), 0);
  LayerNorm ln({2, 3});
  EXPECT_TRUE(equal(ln.weight, ones({2, 3})));
  EXPECT_TRUE(equal(ln.bias, zeros({2, 3})));

  bn(rand_t({5, 4, 2, 2}, kFloat32, 3));
  set(bn.weight, 9);
  bn.reset_parameters();
  EXPECT_TRUE(equal(bn.weight, ones({4})));
  EXPECT_TRUE(equal(bn.running_mean, zeros({4})));
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 0);
}

// ---- modes, buffers, state_dict, printing -----------------------------------------------------

TEST(Layers, BatchNormBuffersAndConversion) {
  auto bn = std::make_shared<BatchNorm2d>(3);
  EXPECT_EQ(names(bn->state_dict()),
            (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                      "num_batches_tracked"}));
  EXPECT_EQ(names(bn->named_parameters()), (std::vector<std::string>{"weight", "bias"}));
  bn->to(kFloat64);
  EXPECT_EQ(bn->running_var.dtype(), kFloat64);
  EXPECT_EQ(bn->num_batches_tracked.dtype(), kInt64) << "integral buffer keeps its dtype";
  bn->forward(rand_t({2, 3, 2, 2}, kFloat64, 1));
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 1);

  // eval uses the running statistics: with running_mean = 0 and running_var = 1 the output is
  // x / sqrt(1 + eps) * weight + bias.
  auto fresh = std::make_shared<BatchNorm2d>(3);
  fresh->eval();
  const Tensor x = rand_t({2, 3, 2, 2}, kFloat32, 2);
  expect_close(fresh->forward(x), (x / std::sqrt(1 + 1e-5)).to_vector<double>(), 1e-6,
               "eval with initial stats");
  EXPECT_EQ(fresh->num_batches_tracked.item<int64_t>(), 0);
  EXPECT_TRUE(equal(fresh->running_mean, zeros({3}))) << "eval leaves the running stats alone";
}

TEST(Layers, SequentialNamesForwardAndPrint) {
  auto net = std::make_shared<Sequential>(
      std::make_shared<Linear>(2, 3), std::make_shared<BatchNorm1d>(3), std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(3, 1));
  EXPECT_EQ(net->size(), 4u);
  // PyTorch: list(nn.Sequential(nn.Linear(2,3), nn.BatchNorm1d(3), nn.ReLU(),
  //                             nn.Linear(3,1)).state_dict().keys())
  EXPECT_EQ(
      names(net->state_dict()),
      (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                "1.running_var", "1.num_batches_tracked", "3.weight", "3.bias"}));
  const Tensor x = rand_t({4, 2}, kFloat32, 5);
  net->eval();
  const Tensor y = net->forward(x);
  Tensor want = x;
  for (const auto& m : *net) want = m->forward(want);
  EXPECT_TRUE(equal(y, want));
  EXPECT_EQ(y.shape(), Shape({4, 1}));
  EXPECT_EQ(net->at<Linear>(-1)->in_features, 3);
  EXPECT_EQ((*net)[2]->name(), "ReLU");
  expect_error<IndexError>([&] { (*net)[4]; }, {"Sequential", "index 4", "4 modules"});
  expect_error<TypeError>([&] { net->at<Linear>(2); }, {"Sequential::at", "ReLU"});
  expect_error([&] { net->push_back(nullptr); }, {"push_back", "null"});
  EXPECT_TRUE(equal(Sequential().forward(x), x)) << "empty Sequential is the identity";

  // Nested containers prefix their children's names.
  auto outer = std::make_shared<Sequential>(net, std::make_shared<Dropout>());
  EXPECT_EQ(names(outer->named_parameters()).front(), "0.0.weight");
}

TEST(Layers, ModuleList) {
  auto list = std::make_shared<ModuleList>();
  list->push_back(std::make_shared<Linear>(2, 2));
  list->push_back(std::make_shared<ReLU>());
  EXPECT_EQ(list->size(), 2u);
  EXPECT_EQ(names(list->named_parameters()), (std::vector<std::string>{"0.weight", "0.bias"}));
  int n = 0;
  for (const auto& m : *list) n += m != nullptr;
  EXPECT_EQ(n, 2);
  EXPECT_EQ(list->at<Linear>(0)->out_features, 2);
  EXPECT_EQ((*list)[-1]->name(), "ReLU");
  expect_error<NotImplementedError>([&] { list->forward(ones({1, 2})); }, {"ModuleList"});
  expect_error<IndexError>([&] { (*list)[-3]; }, {"ModuleList", "-3"});
  EXPECT_EQ(
      list->str(),
      "ModuleList(\n  (0): Linear(in_features=2, out_features=2, bias=true)\n  (1): ReLU()\n)");
}

TEST(Layers, PrintsLikePyTorch) {
  // The expected text is print(nn.Sequential(...)) from PyTorch 1.13 for the same model, with
  // True/False written as true/false.
  Sequential net;
  net.push_back(std::make_shared<Conv2d>(3, 16, 3, Conv2dOptions{.padding = 1}));
  net.push_back(std::make_shared<BatchNorm2d>(16));
  net.push_back(std::make_shared<ReLU>());
  net.push_back(std::make_shared<MaxPool2d>(2));
  net.push_back(std::make_shared<Conv2d>(
      16, 32, Size2(3, 5),
      Conv2dOptions{.stride = 2, .dilation = {2, 1}, .groups = 4, .bias = false}));
  net.push_back(std::make_shared<AvgPool2d>(3, AvgPool2dOptions{.stride = 2, .padding = 1}));
  net.push_back(std::make_shared<AdaptiveAvgPool2d>(1));
  net.push_back(std::make_shared<Flatten>());
  net.push_back(std::make_shared<Dropout>(0.25));
  net.push_back(std::make_shared<Linear>(32, 10, false));
  net.push_back(std::make_shared<GELU>());
  net.push_back(std::make_shared<GELU>("tanh"));
  net.push_back(std::make_shared<SiLU>());
  net.push_back(std::make_shared<Tanh>());
  net.push_back(std::make_shared<Sigmoid>());
  net.push_back(std::make_shared<Softmax>(1));
  net.push_back(std::make_shared<LogSoftmax>(1));
  net.push_back(std::make_shared<LayerNorm>(10));
  net.push_back(std::make_shared<LayerNorm>(
      std::vector<int64_t>{4, 5}, LayerNormOptions{.eps = 1e-6, .elementwise_affine = false}));
  net.push_back(std::make_shared<BatchNorm1d>(
      10,
      BatchNormOptions{.momentum = std::nullopt, .affine = false, .track_running_stats = false}));
  net.push_back(std::make_shared<Embedding>(10, 3));
  net.push_back(std::make_shared<Embedding>(10, 3, -1));
  net.push_back(std::make_shared<MaxPool2d>(Size2(2, 3),
                                            MaxPool2dOptions{.stride = Size2(1, 2), .padding = 1}));
  net.push_back(std::make_shared<AdaptiveAvgPool2d>(Size2(5, 7)));
  net.push_back(std::make_shared<Identity>());
  net.push_back(std::make_shared<BatchNorm1d>(4, BatchNormOptions{.eps = 1e-3, .momentum = 0.01}));
  EXPECT_EQ(
      net.str(),
      "Sequential(\n"
      "  (0): Conv2d(3, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))\n"
      "  (1): BatchNorm2d(16, eps=1e-05, momentum=0.1, affine=true, track_running_stats=true)\n"
      "  (2): ReLU()\n"
      "  (3): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=false)\n"
      "  (4): Conv2d(16, 32, kernel_size=(3, 5), stride=(2, 2), dilation=(2, 1), groups=4, "
      "bias=false)\n"
      "  (5): AvgPool2d(kernel_size=3, stride=2, padding=1)\n"
      "  (6): AdaptiveAvgPool2d(output_size=1)\n"
      "  (7): Flatten(start_dim=1, end_dim=-1)\n"
      "  (8): Dropout(p=0.25, inplace=false)\n"
      "  (9): Linear(in_features=32, out_features=10, bias=false)\n"
      "  (10): GELU(approximate='none')\n"
      "  (11): GELU(approximate='tanh')\n"
      "  (12): SiLU()\n"
      "  (13): Tanh()\n"
      "  (14): Sigmoid()\n"
      "  (15): Softmax(dim=1)\n"
      "  (16): LogSoftmax(dim=1)\n"
      "  (17): LayerNorm((10,), eps=1e-05, elementwise_affine=true)\n"
      "  (18): LayerNorm((4, 5), eps=1e-06, elementwise_affine=false)\n"
      "  (19): BatchNorm1d(10, eps=1e-05, momentum=None, affine=false, "
      "track_running_stats=false)\n"
      "  (20): Embedding(10, 3)\n"
      "  (21): Embedding(10, 3, padding_idx=9)\n"
      "  (22): MaxPool2d(kernel_size=(2, 3), stride=(1, 2), padding=1, dilation=1, "
      "ceil_mode=false)\n"
      "  (23): AdaptiveAvgPool2d(output_size=(5, 7))\n"
      "  (24): Identity()\n"
      "  (25): BatchNorm1d(4, eps=0.001, momentum=0.01, affine=true, "
      "track_running_stats=true)\n"
      ")");
}

TEST(Layers, ReprDouble) {
  // Python's repr(float).
  EXPECT_EQ(detail::repr_double(0.5), "0.5");
  EXPECT_EQ(detail::repr_double(1e-5), "1e-05");
  EXPECT_EQ(detail::repr_double(1e-4), "0.0001");
  EXPECT_EQ(detail::repr_double(1.0), "1.0");
  EXPECT_EQ(detail::repr_double(0.0), "0.0");
  EXPECT_EQ(detail::repr_double(123456.75), "123456.75");
  EXPECT_EQ(detail::repr_double(1e16), "1e+16");
  EXPECT_EQ(detail::repr_double(-2.5e-7), "-2.5e-07");
  EXPECT_EQ(detail::repr_double(0.1), "0.1");
}

// ---- dropout ----------------------------------------------------------------------------------

TEST(Layers, DropoutTrainAndEval) {
  Dropout drop(0.3);
  manual_seed(3);
  Tensor x = full({200, 100}, 2.0f);
  x.requires_grad_();
  const Tensor y = drop(x);
  const std::vector<float> v = y.to_vector<float>();
  int64_t zeros_n = 0;
  for (float e : v) {
    if (e == 0.0f) {
      ++zeros_n;
    } else {
      ASSERT_FLOAT_EQ(e, 2.0f / 0.7f) << "survivors are scaled by 1 / (1 - p)";
    }
  }
  // 20000 Bernoulli(0.3) draws: std of the fraction ~0.0032.
  EXPECT_NEAR(static_cast<double>(zeros_n) / 20000.0, 0.3, 0.02);
  y.sum().backward();
  // d y / d x is the scaled mask: zero exactly where the output is zero.
  EXPECT_TRUE(equal(eq(x.grad(), 0.0), eq(y.detach(), 0.0)));

  manual_seed(3);
  EXPECT_TRUE(equal(drop(x).detach(), y.detach())) << "the global generator makes it reproducible";

  drop.eval();
  EXPECT_TRUE(drop(x).is_same(x)) << "identity in eval mode";
  drop.train();
  EXPECT_TRUE(Dropout(0.0)(x).is_same(x));
  EXPECT_EQ(Dropout(1.0)(x).abs().sum().item<float>(), 0.0f);
  NoGradGuard no_grad;
  Tensor z = ones({4, 4});
  Tensor r = Dropout(0.5, /*inplace=*/true)(z);
  EXPECT_EQ(r.data_ptr(), z.data_ptr());
  EXPECT_TRUE(equal(logical_or(eq(z, 0.0), eq(z, 2.0)), ones({4, 4}, kBool)));
}

// ---- gradcheck of the functional forms (float64) ----------------------------------------------

TEST(LayerGradcheck, Functional) {
  using test::expect_gradcheck;
  using test::leaf;
  {
    SCOPED_TRACE("linear");
    expect_gradcheck([](const auto& v) { return F::linear(v[0], v[1], v[2]); },
                     {leaf({2, 3, 4}, 1), leaf({5, 4}, 2), leaf({5}, 3)});
  }
  {
    SCOPED_TRACE("batch_norm training");
    expect_gradcheck(
        [](const auto& v) { return F::batch_norm(v[0], {}, {}, v[1], v[2], true, 0.1, 1e-5); },
        {leaf({3, 2, 2, 3}, 4), leaf({2}, 5), leaf({2}, 6)});
  }
  {
    SCOPED_TRACE("batch_norm eval");
    const Tensor rm = rand_t({2}, kFloat64, 7), rv = rand_t({2}, kFloat64, 8).abs() + 0.5;
    expect_gradcheck(
        [&](const auto& v) { return F::batch_norm(v[0], rm, rv, v[1], v[2], false, 0.1, 1e-5); },
        {leaf({3, 2, 4}, 9), leaf({2}, 10), leaf({2}, 11)});
  }
  {
    SCOPED_TRACE("layer_norm");
    expect_gradcheck(
        [](const auto& v) {
          return F::layer_norm(v[0], {3, 4}, v[1], v[2]);
        },
        {leaf({2, 3, 4}, 12), leaf({3, 4}, 13), leaf({3, 4}, 14)});
  }
  {
    // (With padding_idx the padding row's gradient is zero by definition, which finite
    // differences cannot see; LayerRef.Embedding checks it against PyTorch.)
    SCOPED_TRACE("embedding");
    const Tensor idx = tensor({0, 2, 2, 1, 3}).reshape({5, 1});
    expect_gradcheck([&](const auto& v) { return F::embedding(idx, v[0]); }, {leaf({4, 3}, 15)});
  }
  {
    SCOPED_TRACE("Conv2d with groups, padding, stride");
    expect_gradcheck(
        [&](const auto& v) {
          return conv2d(v[0], v[1], v[2], {.stride = {2, 2}, .padding = {1, 1}, .groups = 2});
        },
        {leaf({1, 4, 5, 4}, 16), leaf({2, 2, 3, 3}, 17), leaf({2}, 18)});
  }
}

TEST(LayerGradcheck, LayerNormDoubleBackward) {
  // layer_norm is a custom function whose backward is made of recorded tensor ops.
  const Tensor g = rand_t({2, 3, 4}, kFloat64, 23);
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& v) {
        EnableGradGuard grad;
        const Tensor y = F::layer_norm(v[0], {3, 4}, v[1], v[2]);
        const auto d =
            autograd::grad({(y * y * g).sum()}, {v[0], v[1], v[2]}, {}, std::nullopt, true);
        return d[0].sum() * 0.5 + (d[0] * d[0]).sum() + (d[1] * g[0]).sum() + (d[2] * d[2]).sum();
      },
      {test::leaf({2, 3, 4}, 20), test::leaf({3, 4}, 21), test::leaf({3, 4}, 22)});
  // Gradients reach only the inputs that need them; weight and bias may be absent.
  Tensor x = test::leaf({2, 5}, 24);
  Tensor w = test::leaf({5}, 25);
  F::layer_norm(x.detach(), {5}, w).sum().backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_FALSE(x.grad().defined());
  test::expect_gradcheck([](const auto& v) { return F::layer_norm(v[0], {5}); },
                         {test::leaf({3, 5}, 26)});
}

TEST(LayerGradcheck, BatchNormModuleDoubleBackward) {
  // Second derivatives flow through the composite batch norm (e.g. for gradient penalties).
  auto bn = std::make_shared<BatchNorm1d>(3);
  bn->to(kFloat64);
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& v) {
        EnableGradGuard grad;
        const Tensor y = (*bn)(v[0]);
        return autograd::grad({(y * y * y).sum()}, {v[0]}, {}, std::nullopt, true)[0];
      },
      {test::leaf({4, 3}, 19)});
}

// ---- errors -----------------------------------------------------------------------------------

TEST(Layers, Errors) {
  Linear lin(4, 3);
  expect_error([&] { lin(ones({2, 5})); }, {"[linear]", "[2, 5]", "[3, 4]"});
  Conv2d conv(3, 4, 3);
  expect_error([&] { conv(ones({1, 2, 5, 5})); }, {"[Conv2d]", "3 channels", "[1, 2, 5, 5]"});
  expect_error([&] { conv(ones({5, 5})); }, {"[Conv2d]", "[5, 5]"});
  expect_error([] { Conv2d(3, 4, 3, {.groups = 2}); }, {"[Conv2d]", "in_channels", "groups=2"});
  BatchNorm1d bn(3);
  expect_error([&] { bn(ones({2, 3, 4, 5})); }, {"[BatchNorm1d]", "2D or 3D", "4D"});
  expect_error(
      [&] {
        bn(ones({1, 3}));
      },
      {"[batch_norm]", "more than 1 value per channel", "[1, 3]"});
  expect_error([&] { bn(ones({2, 4})); }, {"[BatchNorm1d]", "3 channels", "[2, 4]"});
  expect_error([&] { BatchNorm2d(2)(ones({2, 2, 3})); }, {"[BatchNorm2d]", "4D", "3D"});
  expect_error(
      [] {
        F::batch_norm(ones({2, 3}), {}, {}, {}, {}, false);
      },
      {"[batch_norm]", "running_mean", "not training"});
  LayerNorm ln({4, 5});
  expect_error([&] { ln(ones({2, 5, 4})); }, {"[layer_norm]", "[*, 4, 5]", "[2, 5, 4]"});
  Embedding emb(5, 2);
  expect_error<TypeError>([&] { emb(ones({3})); }, {"[embedding]", "int64", "float32"});
  expect_error<IndexError>([&] { emb(tensor({0, 5})); }, {"5"});
  expect_error([] { Embedding(5, 2, 5); }, {"[Embedding]", "padding_idx", "5"});
  expect_error([] { GELU("fast"); }, {"[GELU]", "fast"});
  expect_error([] { Dropout(1.5); }, {"[Dropout]", "between 0 and 1", "1.5"});
  expect_error([] { F::dropout(ones({2}), -0.1); }, {"[dropout]", "-0.1"});
  expect_error([] { MaxPool2d(2, {.padding = 2}); }, {"[MaxPool2d]", "half", "padding=2"});
  expect_error([&] { MaxPool2d(2)(ones({2, 2})); }, {"[MaxPool2d]", "[2, 2]"});
  expect_error<TypeError>([] { F::dropout(ones({2}, kInt64), 0.5); }, {"[dropout]", "int64"});
}

}  // namespace
}  // namespace ember::nn

namespace ember::nn {
namespace {

TEST(LayerNormPaths, FusedCpuKernelsMatchTheTensorOpPath) {
  // A contiguous float input takes the fused kernels; the same values in a non-contiguous
  // tensor take the tensor-op path. Outputs and all gradients must agree.
  for (Dtype dt : {kFloat32, kFloat64}) {
    const Tensor base = test::rand_t({6, 8, 16}, dt, 71);
    Tensor w = test::rand_t({8, 16}, dt, 72).requires_grad_();
    Tensor b = test::rand_t({8, 16}, dt, 73).requires_grad_();
    Tensor x1 = base.clone().requires_grad_();
    Tensor x2 = base.transpose(0, 2).contiguous().transpose(0, 2).requires_grad_();
    ASSERT_FALSE(x2.is_contiguous());
    const Tensor g = test::rand_t({6, 8, 16}, dt, 74);
    const Tensor y1 = functional::layer_norm(x1, {8, 16}, w, b);
    (y1 * g).sum().backward();
    const Tensor gw1 = w.grad(), gb1 = b.grad();
    w.set_grad({});
    b.set_grad({});
    const Tensor y2 = functional::layer_norm(x2, {8, 16}, w, b);
    (y2 * g).sum().backward();
    const double tol = dt == kFloat32 ? 1e-5 : 1e-12;
    EXPECT_TRUE(allclose(y1, y2, tol, tol)) << dt;
    EXPECT_TRUE(allclose(x1.grad(), x2.grad(), tol, tol)) << dt;
    EXPECT_TRUE(allclose(gw1, w.grad(), tol, tol)) << dt;
    EXPECT_TRUE(allclose(gb1, b.grad(), tol, tol)) << dt;
  }
}

// The fused CUDA kernels (tensor/cuda/norm.cu) against the fused CPU ones: odd row lengths
// (under and over a warp's 32 lanes), two normalized dims, enough rows that the weight and bias
// sums are split over blocks, and each combination of affine parameters and wanted gradients.
TEST(LayerNormCuda, FusedKernelsMatchCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  struct Case {
    std::vector<int64_t> shape, normalized;
  };
  const std::vector<Case> cases = {
      {{3, 5}, {5}}, {{37, 100}, {100}}, {{2000, 384}, {384}}, {{4, 3, 70}, {3, 70}}};
  for (Dtype dt : {kFloat32, kFloat64}) {
    for (const Case& c : cases) {
      // affine: 0 none, 1 weight and bias both trained, 2 bias frozen (dweight only)
      for (int affine : {0, 1, 2}) {
        SCOPED_TRACE(::testing::Message() << dt << " shape " << c.shape.size() << "-d, first "
                                          << c.shape[0] << ", affine " << affine);
        const Tensor base = test::rand_t(c.shape, dt, 81) * 3 + 0.5;
        const Tensor g = test::rand_t(c.shape, dt, 82);
        const Tensor w0 = test::rand_t(c.normalized, dt, 83), b0 = test::rand_t(c.normalized, dt, 84);
        std::vector<Tensor> grads[2], outs;
        for (const Device dev : {Device("cpu"), cuda_device(0)}) {
          // detach(): on the CPU to() returns the tensor itself, and making it a leaf that
          // requires grad would make the CUDA copies non-leaves without a .grad().
          Tensor x = base.to(dev).detach().requires_grad_();
          Tensor w, b;
          if (affine > 0) {
            w = w0.to(dev).detach().requires_grad_();
            b = b0.to(dev).detach().requires_grad_(affine == 1);
          }
          const Tensor y = functional::layer_norm(x, c.normalized, w, b);
          (y * g.to(dev)).sum().backward();
          outs.push_back(y.cpu());
          auto& gr = grads[outs.size() - 1];
          gr.push_back(x.grad().cpu());
          if (affine > 0) gr.push_back(w.grad().cpu());
          if (affine == 1) gr.push_back(b.grad().cpu());
          if (affine == 2) {
            EXPECT_FALSE(b.grad().defined());
          }
        }
        const double tol = dt == kFloat32 ? 1e-4 : 1e-10;
        EXPECT_TRUE(allclose(outs[1], outs[0], tol, tol)) << "y";
        ASSERT_EQ(grads[0].size(), grads[1].size());
        for (size_t i = 0; i < grads[0].size(); ++i) {
          EXPECT_TRUE(allclose(grads[1][i], grads[0][i], tol, tol)) << "gradient " << i;
        }
      }
    }
  }
}

// Softmax and log_softmax on CUDA: the warp kernel (rows up to 1024, in registers: sizes under,
// at and over each register bucket), the block kernel (longer rows), a non-last dim (the
// strided kernel, composite backward) and a transposed input; forward and the fused backward
// over the last dim against the float64 CPU result. Softmax rows get -inf entries as a causal
// mask gives them along the last dim (never a whole row).
TEST(SoftmaxCuda, ForwardAndBackwardMatchFloat64Cpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  const double inf = std::numeric_limits<double>::infinity();
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    const double tol = dt == kFloat64 ? 1e-12 : dt == kFloat32 ? 1e-5 : dt == kFloat16 ? 4e-3 : 2e-2;
    for (int64_t D : {1, 5, 32, 33, 256, 300, 1000, 1024, 1025, 3000}) {
      for (bool log : {false, true}) {
        for (int64_t dim : {1, 0}) {
          for (bool transposed : {false, true}) {
            SCOPED_TRACE(::testing::Message() << dt << " D " << D << (log ? " log" : "")
                                              << " dim " << dim << (transposed ? " transposed" : ""));
            Tensor x64 = test::rand_t({7, D}, kFloat64, 91 + D) * 4;
            if (!log && D > 1 && dim == 1) {
              // row r masks its columns after r (row 0 keeps column 0 only)
              Tensor col = arange(0, D, 1, TensorOptions(kInt64)).unsqueeze(0);
              Tensor row = arange(0, 7, 1, TensorOptions(kInt64)).unsqueeze(1);
              x64 = masked_fill(x64, gt(col, row), -inf);
            }
            // the same values in the low precision, for both sides
            x64 = x64.to(dt).to(kFloat64);
            if (transposed) x64 = x64.t().contiguous().t();
            const Tensor gy = test::rand_t({7, D}, dt, 191 + D).to(kFloat64);
            Tensor want_x = x64.clone().requires_grad_();
            const Tensor want = log ? log_softmax(want_x, dim) : softmax(want_x, dim);
            want.backward(gy);
            // x64 holds the transposed layout already; the device copy takes the same strides
            const Tensor got_x = (transposed ? x64.t().contiguous().to(cuda_device(0), dt).t()
                                             : x64.to(cuda_device(0), dt))
                                     .detach()
                                     .requires_grad_();
            if (D > 1) {
              ASSERT_EQ(got_x.is_contiguous(), !transposed);
            }
            const Tensor got = log ? log_softmax(got_x, dim) : softmax(got_x, dim);
            got.backward(gy.to(cuda_device(0), dt));
            EXPECT_TRUE(allclose(got.cpu().to(kFloat64), want, tol, tol)) << "forward";
            EXPECT_TRUE(allclose(got_x.grad().cpu().to(kFloat64), want_x.grad(), tol, tol))
                << "backward";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ember::nn
