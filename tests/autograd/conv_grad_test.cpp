// Backward rules of convolution and pooling (tensor/ops/conv.h, autograd/functions_conv.cpp):
// gradcheck in float64, the error for double backward (the backward kernels are not
// differentiable), values against PyTorch, float32 gradients, and CUDA against CPU.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include <ember/tensor/gpu/cudnn.h>
#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::edge_is_leaf;
using test::expect_close;
using test::expect_cuda_grads_match_cpu;
using test::expect_error;
using test::expect_gradcheck;
using test::GradCase;
using test::leaf;
using test::name_of;
using test::noncontig_leaf;
using test::rand_t;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// ---- conv2d -----------------------------------------------------------------------------------

Conv2dParams conv_params(Pair stride, Pair padding, Pair dilation, int64_t groups) {
  Conv2dParams p;
  p.stride = stride;
  p.padding = padding;
  p.dilation = dilation;
  p.groups = groups;
  return p;
}

TEST(Conv2dGrad, GradcheckOverParams) {
  struct Case {
    const char* name;
    Shape x, w;
    Conv2dParams p;
  };
  const Case cases[] = {
      {"plain", {2, 3, 5, 5}, {4, 3, 3, 3}, {}},
      {"stride 2, padding 1", {1, 2, 6, 5}, {3, 2, 3, 3}, conv_params({2, 2}, {1, 1}, {1, 1}, 1)},
      {"asymmetric stride/padding",
       {1, 2, 7, 6},
       {2, 2, 3, 2},
       conv_params({2, 1}, {0, 1}, {1, 1}, 1)},
      {"dilation 2", {1, 2, 7, 7}, {2, 2, 3, 3}, conv_params({1, 1}, {1, 1}, {2, 2}, 1)},
      {"groups 2", {2, 4, 5, 4}, {6, 2, 3, 3}, conv_params({1, 1}, {1, 1}, {1, 1}, 2)},
      {"depthwise, stride, dilation",
       {1, 3, 7, 7},
       {3, 1, 3, 3},
       conv_params({2, 2}, {2, 1}, {2, 1}, 3)},
      {"1x1", {2, 3, 3, 3}, {2, 3, 1, 1}, {}},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const Conv2dParams p = c.p;
    SCOPED_TRACE(std::string("conv2d ") + c.name);
    expect_gradcheck([p](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], p); },
                     {leaf(c.x, seed), leaf(c.w, seed + 1), leaf({c.w[0]}, seed + 2)});
    expect_gradcheck([p](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], {}, p); },
                     {noncontig_leaf(c.x, seed + 3), leaf(c.w, seed + 4)});
    seed += 5;
  }
  // Only some inputs require grad.
  const Conv2dParams p = conv_params({1, 2}, {1, 0}, {1, 1}, 1);
  Fn f = [p](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], p); };
  expect_gradcheck(
      f, {leaf({1, 2, 4, 5}, 50), rand_t({2, 2, 3, 3}, kFloat64, 51), rand_t({2}, kFloat64, 52)});
  expect_gradcheck(f, {rand_t({1, 2, 4, 5}, kFloat64, 53), leaf({2, 2, 3, 3}, 54), leaf({2}, 55)});
}

TEST(Conv2dGrad, RecordsOneNodeAndEmptyInputs) {
  Tensor x = noncontig_leaf({1, 2, 4, 4}, 1), w = leaf({3, 2, 3, 3}, 2), b = leaf({3}, 3);
  Tensor y = conv2d(x, w, b);
  EXPECT_EQ(name_of(y), "ConvolutionBackward");
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(edge_is_leaf(y, i)) << "conv2d input " << i;
  EXPECT_FALSE(conv2d(x, w).grad_fn()->next_edge(2).valid()) << "no bias: no edge";

  // An empty batch: zero gradients for weight and bias, an empty one for the input.
  Tensor xe = leaf({0, 2, 4, 4}, 4);
  conv2d(xe, w, b).sum().backward();
  EXPECT_EQ(xe.grad().shape(), Shape({0, 2, 4, 4}));
  expect_close(b.grad(), {0, 0, 0}, 0, "conv2d empty batch bias grad");
  expect_close(w.grad(), std::vector<double>(w.numel(), 0.0), 0, "conv2d empty batch w grad");
}

TEST(Conv2dGrad, DoubleBackwardIsRefused) {
  Tensor x = leaf({1, 2, 4, 4}, 1), w = leaf({3, 2, 3, 3}, 2), b = leaf({3}, 3);
  Tensor loss = (conv2d(x, w, b) * conv2d(x, w, b)).sum();
  expect_error<NotImplementedError>(
      [&] { autograd::grad({loss}, {x}, {}, true, /*create_graph=*/true); },
      {"double backward", "ConvolutionBackward", "not supported"});
  // Without create_graph the same graph works.
  auto g = autograd::grad({loss}, {x, w, b});
  EXPECT_FALSE(g[0].requires_grad());
  // The bias gradient alone is a differentiable sum: allowed under create_graph.
  Tensor xd = rand_t({1, 2, 4, 4}, kFloat64, 4), wd = rand_t({3, 2, 3, 3}, kFloat64, 5);
  Tensor y = conv2d(xd, wd, b);
  Tensor gb = autograd::grad({(y * y).sum()}, {b}, {}, std::nullopt, true)[0];
  EXPECT_TRUE(gb.requires_grad());
}

TEST(Conv2dGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): x = lcg [1, 2, 4, 4] seed 1, w = lcg [2, 1, 3, 3] seed 2,
  // b = lcg [2] seed 3 (float32 leaves); y = F.conv2d(x, w, b, stride=2, padding=1, groups=2);
  // y.backward(lcg [1, 2, 2, 2] seed 4).
  Tensor x = leaf({1, 2, 4, 4}, 1, kFloat32), w = leaf({2, 1, 3, 3}, 2, kFloat32),
         b = leaf({2}, 3, kFloat32);
  const Conv2dParams p = conv_params({2, 2}, {1, 1}, {1, 1}, 2);
  Tensor y = conv2d(x, w, b, p);
  y.backward(rand_t({1, 2, 2, 2}, kFloat32, 4));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  EXPECT_EQ(w.grad().dtype(), kFloat32);
  expect_close(y,
               {-1.96985722, -0.811834574, -1.45409298, -1.58889604, 0.140410364, -0.213932887,
                -0.751477242, 0.105921894},
               1e-5, "conv2d forward");
  expect_close(x.grad(), {-0.667523861,  -0.0337305292, 0.692713022,   -0.650062621,  0.18962267,
                          0.385660231,   -0.250127405,  -0.634588182,  0.112290718,   -0.0522439294,
                          -0.0557535104, 0.0523207635,  -0.0484799482, -0.0872652233, 0.0240707975,
                          0.0535100214,  0.0854803324,  -0.442365408,  -0.0318749547, 0.196140602,
                          -0.0459436886, 1.19388545,    -0.104680769,  -0.783985615,  0.0706438273,
                          -0.199406579,  -0.0896785036, 0.551831186,   -0.150255218,  0.0843229145,
                          0.190740839,   -0.495743692},
               1e-5, "conv2d input grad");
  expect_close(w.grad(),
               {-0.0515186414, 0.0173862595, 0.163515285, -0.440491408, 0.192857847, 0.394459516,
                0.600877345, 0.237727791, -1.33448303, -0.333234966, 0.211784318, -0.222579002,
                -0.314476848, -0.683376491, -0.329532653, -0.646834552, 0.715555608, 0.121059984},
               1e-5, "conv2d weight grad");
  expect_close(b.grad(), {0.10144043, -0.263460159}, 1e-5, "conv2d bias grad");
}

TEST(Conv2dGrad, Float32GradientsMatchFloat64) {
  const Conv2dParams p = conv_params({2, 1}, {1, 1}, {1, 2}, 2);
  Tensor x64 = leaf({2, 4, 6, 7}, 1), w64 = leaf({4, 2, 3, 2}, 2), b64 = leaf({4}, 3);
  Tensor x32 = leaf({2, 4, 6, 7}, 1, kFloat32), w32 = leaf({4, 2, 3, 2}, 2, kFloat32),
         b32 = leaf({4}, 3, kFloat32);
  (conv2d(x64, w64, b64, p).tanh()).sum().backward();
  (conv2d(x32, w32, b32, p).tanh()).sum().backward();
  for (auto [g32, g64, what] :
       {std::tuple{x32.grad(), x64.grad(), "input"}, std::tuple{w32.grad(), w64.grad(), "weight"},
        std::tuple{b32.grad(), b64.grad(), "bias"}}) {
    EXPECT_EQ(g32.dtype(), kFloat32) << "conv2d " << what;
    expect_close(g32, g64.to_vector<double>(), 1e-4, std::string("conv2d f32 ") + what);
  }
}

// ---- pooling ----------------------------------------------------------------------------------

Pool2dParams pool(Pair kernel, std::optional<Pair> stride = std::nullopt, Pair padding = {0, 0},
                  Pair dilation = {1, 1}, bool ceil_mode = false, bool count_include_pad = true) {
  Pool2dParams p;
  p.kernel = kernel;
  p.stride = stride;
  p.padding = padding;
  p.dilation = dilation;
  p.ceil_mode = ceil_mode;
  p.count_include_pad = count_include_pad;
  return p;
}

struct PoolCase {
  const char* name;
  Pool2dParams p;
};

std::vector<PoolCase> pool_cases() {
  return {
      {"2x2", pool({2, 2})},
      {"3x3 stride 2 padding 1", pool({3, 3}, Pair{2, 2}, {1, 1})},
      {"3x3 stride 2 padding 1 ceil", pool({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true)},
      {"3x2 stride (1, 2) padding (1, 0) ceil", pool({3, 2}, Pair{1, 2}, {1, 0}, {1, 1}, true)},
      {"2x2 stride 1", pool({2, 2}, Pair{1, 1})},
      {"3x3 stride 2 padding 1 ceil, no pad count",
       pool({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, false)},
  };
}

TEST(MaxPool2dGrad, Gradcheck) {
  auto cases = pool_cases();
  cases.push_back({"dilation 2", pool({2, 3}, Pair{1, 2}, {1, 1}, {2, 2})});
  cases.push_back({"dilation 2 ceil", pool({3, 2}, Pair{2, 2}, {1, 0}, {2, 1}, true)});
  uint64_t seed = 1;
  for (const PoolCase& c : cases) {
    const Pool2dParams p = c.p;
    SCOPED_TRACE(std::string("max_pool2d ") + c.name);
    // lcg values are distinct multiples of 2^-19 > 2 eps: no ties under the perturbation.
    expect_gradcheck([p](const std::vector<Tensor>& in) { return max_pool2d(in[0], p); },
                     {leaf({2, 2, 7, 6}, seed)});
    expect_gradcheck(
        [p](const std::vector<Tensor>& in) { return max_pool2d_with_indices(in[0], p).first; },
        {noncontig_leaf({1, 3, 5, 8}, seed + 1)});
    seed += 2;
  }
}

TEST(MaxPool2dGrad, RecordsOnceAndIndicesHaveNoHistory) {
  Tensor x = noncontig_leaf({1, 2, 4, 4}, 1);
  Tensor y = max_pool2d(x, pool({2, 2}));
  EXPECT_EQ(name_of(y), "MaxPool2DWithIndicesBackward");
  EXPECT_TRUE(edge_is_leaf(y, 0)) << "max_pool2d recorded more than one node";
  auto [y2, idx] = max_pool2d_with_indices(x, pool({2, 2}));
  EXPECT_EQ(name_of(y2), "MaxPool2DWithIndicesBackward");
  EXPECT_FALSE(idx.requires_grad());
  EXPECT_EQ(idx.dtype(), kInt64);
}

TEST(MaxPool2dGrad, TiesGoToTheFirstMaximumAsInPyTorch) {
  // torch 1.13: F.max_pool2d(torch.ones(1, 1, 2, 2), 2).backward() -> x.grad = [1, 0, 0, 0].
  Tensor x = ones({1, 1, 2, 2}, kFloat64).requires_grad_();
  max_pool2d(x, pool({2, 2})).sum().backward();
  expect_close(x.grad(), {1, 0, 0, 0}, 0, "max_pool2d ties");
}

TEST(MaxPool2dGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): x = lcg [1, 1, 5, 5] seed 8 (float32 leaf);
  // y, idx = F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True);
  // y.backward(lcg [1, 1, 3, 3] seed 9).
  Tensor x = leaf({1, 1, 5, 5}, 8, kFloat32);
  auto [y, idx] = max_pool2d_with_indices(x, pool({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true));
  ASSERT_EQ(y.shape(), Shape({1, 1, 3, 3}));
  EXPECT_EQ(idx.to_vector<int64_t>(), (std::vector<int64_t>{6, 6, 8, 6, 6, 8, 20, 22, 19}));
  y.backward(rand_t({1, 1, 3, 3}, kFloat32, 9));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  expect_close(x.grad(), {0, 0, 0, 0, 0, 0,          0.453926086,  0, 0.320983887,  0, 0, 0, 0, 0,
                          0, 0, 0, 0, 0, 0.98997879, -0.143461227, 0, -0.738407135, 0, 0},
               1e-6, "max_pool2d grad");
}

TEST(AvgPool2dGrad, Gradcheck) {
  uint64_t seed = 1;
  for (const PoolCase& c : pool_cases()) {
    const Pool2dParams p = c.p;
    SCOPED_TRACE(std::string("avg_pool2d ") + c.name);
    Fn f = [p](const std::vector<Tensor>& in) { return avg_pool2d(in[0], p); };
    expect_gradcheck(f, {leaf({2, 2, 7, 6}, seed)});
    expect_gradcheck(f, {noncontig_leaf({1, 3, 5, 8}, seed + 1)});
    seed += 2;
  }
  Tensor y = avg_pool2d(noncontig_leaf({1, 1, 4, 4}, 30), pool({2, 2}));
  EXPECT_EQ(name_of(y), "AvgPool2DBackward");
  EXPECT_TRUE(edge_is_leaf(y, 0));
}

TEST(AvgPool2dGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): x = lcg [1, 1, 5, 5] seed 10 (float32 leaf);
  // y = F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False);
  // y.backward(lcg [1, 1, 3, 3] seed 11).
  Tensor x = leaf({1, 1, 5, 5}, 10, kFloat32);
  Tensor y = avg_pool2d(x, pool({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, false));
  ASSERT_EQ(y.shape(), Shape({1, 1, 3, 3}));
  y.backward(rand_t({1, 1, 3, 3}, kFloat32, 11));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  expect_close(x.grad(),
               {-0.164445877,  -0.273706436,  -0.109260559,  -0.0699729919, 0.0392875671,
                -0.268469185,  -0.461203992,  -0.192734823,  -0.196896017,  -0.00416119769,
                -0.1040233,    -0.187497556,  -0.0834742635, -0.126923025,  -0.0434487648,
                -0.200397819,  -0.235062703,  -0.0346648954, -0.204674825,  -0.170009926,
                -0.0963745117, -0.0475651436, 0.0488093682,  -0.0777518004, -0.126561165},
               1e-5, "avg_pool2d grad");
}

TEST(AdaptiveAvgPool2dGrad, Gradcheck) {
  const std::pair<Shape, Pair> cases[] = {
      {{2, 3, 6, 6}, {3, 3}},  // divisible
      {{1, 2, 5, 7}, {3, 4}},  // overlapping windows
      {{1, 2, 3, 3}, {5, 4}},  // output larger than input
      {{2, 2, 4, 5}, {1, 1}},  // global
  };
  uint64_t seed = 1;
  for (const auto& [shape, out] : cases) {
    const Pair o = out;
    SCOPED_TRACE("adaptive_avg_pool2d " + detail::str_cat(shape) + " -> " + std::to_string(o[0]) +
                 "x" + std::to_string(o[1]));
    Fn f = [o](const std::vector<Tensor>& in) { return adaptive_avg_pool2d(in[0], o); };
    expect_gradcheck(f, {leaf(shape, seed)});
    expect_gradcheck(f, {noncontig_leaf(shape, seed + 1)});
    seed += 2;
  }
  EXPECT_EQ(name_of(adaptive_avg_pool2d(leaf({1, 1, 4, 4}, 9), {2, 2})),
            "AdaptiveAvgPool2DBackward");
}

TEST(AdaptiveAvgPool2dGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): x = lcg [1, 1, 5, 7] seed 12 (float32 leaf);
  // y = F.adaptive_avg_pool2d(x, (3, 4)); y.backward(lcg [1, 1, 3, 4] seed 13).
  Tensor x = leaf({1, 1, 5, 7}, 12, kFloat32);
  Tensor y = adaptive_avg_pool2d(x, {3, 4});
  y.backward(rand_t({1, 1, 3, 4}, kFloat32, 13));
  EXPECT_EQ(x.grad().dtype(), kFloat32);
  expect_close(
      x.grad(),
      {-0.152248383,  -0.000336334109, 0.151912048,   0.27418834,    0.122276306,     0.140888691,
       0.0186123848,  -0.186975792,    0.046967078,   0.233942866,   0.286493301,     0.0525504202,
       -0.0414836183, -0.0940340385,   -0.0347274132, 0.0473034121,  0.0820308253,    0.0123049393,
       -0.069725886,  -0.182372302,    -0.112646423,  -0.0353444405, -0.0829265416,   -0.0475820974,
       -0.0490477905, -0.00146569312,  -0.248313159,  -0.246847481,  -0.000617027283, -0.13022995,
       -0.129612923,  -0.0613527298,   0.0682601929,  -0.0659408569, -0.13420105},
      1e-5, "adaptive_avg_pool2d grad");
}

TEST(PoolGrad, DoubleBackward) {
  Tensor x = leaf({1, 2, 5, 5}, 1);
  const Pool2dParams p = pool({3, 3}, Pair{2, 2}, {1, 1});
  const std::pair<const char*, Fn> ops[] = {
      {"MaxPool2DWithIndicesBackward",
       [p](const std::vector<Tensor>& in) { return max_pool2d(in[0], p); }},
      {"AvgPool2DBackward", [p](const std::vector<Tensor>& in) { return avg_pool2d(in[0], p); }},
      {"AdaptiveAvgPool2DBackward",
       [](const std::vector<Tensor>& in) {
         return adaptive_avg_pool2d(in[0], {2, 3});
       }},
  };
  for (const auto& [node, f] : ops) {
    SCOPED_TRACE(node);
    // The gradient depends on x only through the incoming gradient: when that has no history,
    // create_graph works (the result is constant in x).
    auto g = autograd::grad({f({x}).sum()}, {x}, {}, std::nullopt, /*create_graph=*/true);
    EXPECT_FALSE(g[0].requires_grad());
    // An incoming gradient with history would need the backward kernel differentiated.
    Tensor y = f({x});
    expect_error<NotImplementedError>(
        [&] { autograd::grad({(y * y).sum()}, {x}, {}, true, /*create_graph=*/true); },
        {"double backward", node, "not supported"});
    auto g1 = autograd::grad({(y * y).sum()}, {x});  // fine without create_graph
    EXPECT_EQ(g1[0].shape(), x.shape());
  }
}

// ---- a small network --------------------------------------------------------------------------

TEST(LinalgGrad, ConvPoolLinearChainGradcheck) {
  const Conv2dParams cp = conv_params({1, 1}, {1, 1}, {1, 1}, 1);
  Fn net = [cp](const std::vector<Tensor>& in) {
    Tensor h = conv2d(in[0], in[1], in[2], cp).tanh();
    h = max_pool2d(h, pool({2, 2}));
    h = adaptive_avg_pool2d(h, {1, 2}).reshape({2, -1});
    return addmm(in[4], h, in[3]);
  };
  expect_gradcheck(net, {leaf({2, 2, 4, 4}, 1), leaf({3, 2, 3, 3}, 2), leaf({3}, 3),
                         leaf({6, 2}, 4), leaf({2}, 5)});
}

// ---- CUDA -------------------------------------------------------------------------------------

TEST(ConvGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  if (!ember::cuda::cudnn_is_available()) GTEST_SKIP() << "this build has no cuDNN";
  // float64, so cuDNN gradients compare tightly with the CPU ones (no TF32).
  const Conv2dParams cp = conv_params({2, 1}, {1, 1}, {1, 2}, 2);
  const Pool2dParams pp = pool({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, false);
  const GradCase cases[] = {
      {"conv2d",
       {{2, 4, 6, 7}, {4, 2, 3, 2}, {4}},
       [cp](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], cp); }},
      {"conv2d without bias",
       {{2, 4, 6, 7}, {4, 2, 3, 2}},
       [cp](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], {}, cp); }},
      {"max_pool2d",
       {{2, 2, 7, 6}},
       [pp](const std::vector<Tensor>& in) { return max_pool2d(in[0], pp); }},
      {"avg_pool2d",
       {{2, 2, 7, 6}},
       [pp](const std::vector<Tensor>& in) { return avg_pool2d(in[0], pp); }},
      {"adaptive_avg_pool2d",
       {{1, 2, 5, 7}},
       [](const std::vector<Tensor>& in) {
         return adaptive_avg_pool2d(in[0], {3, 4});
       }},
  };
  expect_cuda_grads_match_cpu(cases);
}

}  // namespace
}  // namespace ember
