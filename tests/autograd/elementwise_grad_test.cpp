// Backward rules of the element-wise ops (autograd/functions_elementwise.cpp) and the recording
// front ends in tensor/ops/elementwise.cpp: gradcheck over plain, broadcast and non-contiguous
// inputs, second derivatives, PyTorch's values and subgradients, in-place ops, CUDA vs CPU.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::expect_gradcheck;

using UnaryFn = std::function<Tensor(const Tensor&)>;
using BinaryFn = std::function<Tensor(const Tensor&, const Tensor&)>;

/// A float64 leaf of `shape` with lcg values mapped onto [lo, hi); values within 0.05 of a
/// point in `kinks` are moved 0.05 away from it, so finite differences never straddle a kink.
/// noncontig: the leaf is the transpose of a contiguous tensor (last two dims swapped).
Tensor leaf_in(IntList shape, uint64_t seed, double lo, double hi, bool noncontig = false,
               const std::vector<double>& kinks = {}) {
  Shape s(shape);
  const int64_t n = s.size();
  if (noncontig) std::swap(s[n - 1], s[n - 2]);
  std::vector<double> v = test::lcg_values(s.numel(), seed);
  for (double& x : v) {
    x = lo + (x + 1) / 2 * (hi - lo);
    for (double k : kinks) {
      if (std::fabs(x - k) < 0.05) x = x < k ? k - 0.05 : k + 0.05;
    }
  }
  Tensor t = from_vector(v).to(kFloat64).reshape(s);
  if (noncontig) t = t.transpose(n - 1, n - 2);
  t.requires_grad_();
  return t;
}

/// The first derivative of sum(fn(v) * w) with respect to v[which], for fixed weights w, as a
/// function of v: gradcheck of this checks the second derivatives (the backward rules run under
/// create_graph). One derivative per function: gradcheck perturbs its inputs in place between
/// outputs, which would invalidate the tensors that a multi-output graph saved.
autograd::GradcheckFn first_derivative(std::function<Tensor(const std::vector<Tensor>&)> fn,
                                       size_t which = 0) {
  return [fn, which](const std::vector<Tensor>& v) {
    const bool create_graph = GradMode::is_enabled();  // off while gradcheck only evaluates
    EnableGradGuard enable;
    const Tensor y = fn(v);
    const Tensor w = test::rand_t(y.shape(), kFloat64, 77);
    return autograd::grad({(y * w).sum()}, {v[which]}, {}, std::nullopt, create_graph,
                          /*allow_unused=*/true);
  };
}

/// expect_close that also accepts equal infinities.
void expect_close_inf(const Tensor& got, const std::vector<double>& want, double tol,
                      const std::string& what) {
  const std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isinf(want[i])) {
      EXPECT_EQ(g[i], want[i]) << what << ": index " << i;
    } else {
      EXPECT_NEAR(g[i], want[i], tol * (1 + std::fabs(want[i]))) << what << ": index " << i;
    }
  }
}

// ---- unary ops --------------------------------------------------------------------------------

struct UnaryCase {
  std::string name;
  UnaryFn fn;
  double lo = -1, hi = 1;
  std::vector<double> kinks = {};
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }},
      {"operator-", [](const Tensor& x) { return -x; }},
      {"abs", [](const Tensor& x) { return abs(x); }, -1, 1, {0}},
      {"sign", [](const Tensor& x) { return sign(x); }, -1, 1, {0}},
      {"exp", [](const Tensor& x) { return exp(x); }, -2, 2},
      {"log", [](const Tensor& x) { return log(x); }, 0.2, 3},
      {"log1p", [](const Tensor& x) { return log1p(x); }, -0.7, 2},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.2, 3},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, 0.2, 3},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }, -2, 2, {0}},
      {"square", [](const Tensor& x) { return square(x); }, -2, 2},
      {"sin", [](const Tensor& x) { return sin(x); }, -3, 3},
      {"cos", [](const Tensor& x) { return cos(x); }, -3, 3},
      {"tanh", [](const Tensor& x) { return tanh(x); }, -3, 3},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -4, 4},
      {"relu", [](const Tensor& x) { return relu(x); }, -1, 1, {0}},
      {"silu", [](const Tensor& x) { return silu(x); }, -5, 5},
      {"erf", [](const Tensor& x) { return erf(x); }, -2, 2},
      {"gelu", [](const Tensor& x) { return gelu(x); }, -5, 5},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, "tanh"); }, -5, 5},
      {"pow_3", [](const Tensor& x) { return pow(x, 3); }, -2, 2},
      {"pow_2.5", [](const Tensor& x) { return pow(x, 2.5); }, 0.2, 2},
      {"pow_-1.5", [](const Tensor& x) { return pow(x, -1.5); }, 0.2, 2},
      {"pow_2_square", [](const Tensor& x) { return pow(x, 2); }, -2, 2},
      {"pow_0.5_sqrt", [](const Tensor& x) { return pow(x, 0.5); }, 0.2, 2},
      {"pow_-1_reciprocal", [](const Tensor& x) { return pow(x, -1.0); }, 0.2, 2},
      {"pow_0", [](const Tensor& x) { return pow(x, 0); }, -2, 2},
      {"pow_1", [](const Tensor& x) { return pow(x, 1); }, -2, 2},
      {"Tensor::pow", [](const Tensor& x) { return x.pow(1.7); }, 0.2, 2},
      {"rpow_2", [](const Tensor& x) { return pow(2.0, x); }, -2, 2},
      {"rpow_0.3", [](const Tensor& x) { return pow(0.3, x); }, -2, 2},
      {"clamp", [](const Tensor& x) { return clamp(x, -0.5, 0.5); }, -1, 1, {-0.5, 0.5}},
      {"clamp_min", [](const Tensor& x) { return clamp_min(x, 0.25); }, -1, 1, {0.25}},
      {"clamp_max", [](const Tensor& x) { return clamp_max(x, -0.25); }, -1, 1, {-0.25}},
      {"clamp_int_bounds", [](const Tensor& x) { return clamp(x, -1, 1); }, -2, 2, {-1, 1}},
      {"clamp_lo_above_hi", [](const Tensor& x) { return clamp(x, 0.5, -0.5); }, -1, 1,
       {-0.5, 0.5}},
      {"add_scalar", [](const Tensor& x) { return x + 2.5; }},
      {"sub_scalar", [](const Tensor& x) { return x - 2; }},
      {"rsub_scalar", [](const Tensor& x) { return 2.5 - x; }},
      {"mul_scalar", [](const Tensor& x) { return x * -3.0; }},
      {"div_scalar", [](const Tensor& x) { return x / 4; }},
      {"rdiv_scalar", [](const Tensor& x) { return 3.0 / x; }, -2, 2, {0}},
      {"masked_fill",
       [](const Tensor& x) {
         return masked_fill(x, gt(test::rand_t(x.shape(), kFloat64, 5), 0), 7.0);
       }},
  };
}

TEST(ElementwiseGrad, UnaryGradcheck) {
  uint64_t seed = 100;
  for (const UnaryCase& c : unary_cases()) {
    for (bool noncontig : {false, true}) {
      SCOPED_TRACE(c.name + (noncontig ? " non-contiguous" : " contiguous"));
      Tensor x = leaf_in({3, 4}, ++seed, c.lo, c.hi, noncontig, c.kinks);
      expect_gradcheck([&](const std::vector<Tensor>& v) { return c.fn(v[0]); }, {x});
    }
    SCOPED_TRACE(c.name + " 0-dim");
    expect_gradcheck([&](const std::vector<Tensor>& v) { return c.fn(v[0]); },
                     {leaf_in({}, ++seed, c.lo, c.hi, false, c.kinks)});
  }
}

TEST(ElementwiseGrad, UnaryEmptyTensors) {
  for (const UnaryCase& c : unary_cases()) {
    Tensor x = zeros({0, 3}, kFloat64).requires_grad_();
    Tensor y = c.fn(x);
    ASSERT_TRUE(y.requires_grad()) << c.name;
    y.sum().backward();
    EXPECT_EQ(x.grad().shape(), Shape({0, 3})) << c.name;
  }
}

TEST(ElementwiseGrad, UnarySecondDerivatives) {
  uint64_t seed = 300;
  for (const UnaryCase& c : unary_cases()) {
    SCOPED_TRACE(c.name);
    Tensor x = leaf_in({2, 3}, ++seed, c.lo, c.hi, false, c.kinks);
    expect_gradcheck(first_derivative([&](const std::vector<Tensor>& v) { return c.fn(v[0]); }),
                     {x});
  }
}

// ---- binary ops -------------------------------------------------------------------------------

struct BinaryCase {
  std::string name;
  BinaryFn fn;
  double a_lo = -1, a_hi = 1, b_lo = -1, b_hi = 1;
  std::vector<double> b_kinks = {};
};

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"add_alpha", [](const Tensor& a, const Tensor& b) { return add(a, b, 2.5); }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }},
      {"sub_alpha", [](const Tensor& a, const Tensor& b) { return sub(a, b, -3); }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, -1, 1, -2, 2, {0}},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, 0.2, 2, -2, 2},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
      // Away from the cut along b < 0: the right half-plane, then the upper one.
      {"atan2", [](const Tensor& a, const Tensor& b) { return atan2(a, b); }, -1, 1, 0.2, 2},
      {"atan2_upper", [](const Tensor& a, const Tensor& b) { return atan2(a, b); }, 0.2, 2, -2, 2},
      {"where",
       [](const Tensor& a, const Tensor& b) {
         const Shape s = broadcast_shapes("test", a.shape(), b.shape());
         return where(gt(test::rand_t(s, kFloat64, 9), 0).to(a.device()), a, b);
       }},
      {"where_cond_broadcast",
       [](const Tensor& a, const Tensor& b) {
         const Tensor cond = tensor({true, false}).reshape({2, 1, 1});
         return where(cond.to(a.device()), a, b);
       }},
  };
}

struct ShapePair {
  Shape a, b;
  bool noncontig = false;
};

TEST(ElementwiseGrad, BinaryGradcheck) {
  const std::vector<ShapePair> shapes = {
      {{3, 4}, {3, 4}},    {{3, 1}, {4}}, {{2, 3, 1}, {1, 3}}, {{}, {3, 3}},
      {{3, 3}, {}},        {{3, 3}, {3, 3}, true},
  };
  uint64_t seed = 500;
  for (const BinaryCase& c : binary_cases()) {
    for (const ShapePair& s : shapes) {
      SCOPED_TRACE(c.name + " a " + detail::str_cat(s.a) + " b " + detail::str_cat(s.b) +
                   (s.noncontig ? " non-contiguous" : ""));
      auto make = [&](const Shape& shape, double lo, double hi, const std::vector<double>& k) {
        return leaf_in(shape, ++seed, lo, hi, s.noncontig && shape.size() >= 2, k);
      };
      Tensor a = make(s.a, c.a_lo, c.a_hi, {});
      Tensor b = make(s.b, c.b_lo, c.b_hi, c.b_kinks);
      auto f = [&](const std::vector<Tensor>& v) { return c.fn(v[0], v[1]); };
      expect_gradcheck(f, {a, b});
      // Only one side requiring grad takes the other branches of the rules.
      expect_gradcheck(f, {a, b.detach()});
      expect_gradcheck(f, {a.detach(), b});
    }
  }
}

TEST(ElementwiseGrad, BinarySecondDerivatives) {
  uint64_t seed = 700;
  for (const BinaryCase& c : binary_cases()) {
    SCOPED_TRACE(c.name);
    Tensor a = leaf_in({2, 3}, ++seed, c.a_lo, c.a_hi);
    Tensor b = leaf_in({3}, ++seed, c.b_lo, c.b_hi, false, c.b_kinks);
    auto f = [&](const std::vector<Tensor>& v) { return c.fn(v[0], v[1]); };
    for (size_t which : {0, 1}) {
      SCOPED_TRACE(which == 0 ? "d/da" : "d/db");
      expect_gradcheck(first_derivative(f, which), {a, b});
    }
  }
}

TEST(ElementwiseGrad, WhereWithScalarRecordsOnce) {
  Tensor cond = tensor({true, false, true});
  Tensor a = leaf_in({3}, 1, -1, 1);
  expect_gradcheck([&](const std::vector<Tensor>& v) { return where(cond, v[0], 0.5); }, {a});
  Tensor y = where(cond, a, 2.0);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_STREQ(y.grad_fn()->name(), "WhereBackward");
  ASSERT_EQ(y.grad_fn()->num_outputs(), 3u);
  EXPECT_EQ(y.grad_fn()->next_edge(1).fn, autograd::gradient_edge(a).fn)
      << "where(cond, a, scalar) should record one node whose input is a itself";
  EXPECT_FALSE(y.grad_fn()->next_edge(0).valid()) << "cond gets no gradient";
  y.sum().backward();
  expect_close(a.grad(), {1, 0, 1}, 0, "where(cond, a, 2) d/da");
}

TEST(ElementwiseGrad, MaskedFillGivesNoGradientToTheMask) {
  Tensor x = leaf_in({2, 3}, 2, -1, 1);
  Tensor mask = tensor({false, true, false}).reshape({1, 3});
  Tensor y = masked_fill(x, mask, -1.5);
  EXPECT_STREQ(y.grad_fn()->name(), "MaskedFillBackward");
  EXPECT_FALSE(y.grad_fn()->next_edge(1).valid());
  y.sum().backward();
  expect_close(x.grad(), {1, 0, 1, 1, 0, 1}, 0, "masked_fill d/dx");
}

// ---- values and subgradients against PyTorch --------------------------------------------------

/// d sum(fn(x...)) / d x for float64 tensors made from `values`.
std::vector<Tensor> grads_of(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                             const std::vector<std::vector<double>>& values) {
  std::vector<Tensor> xs;
  for (const auto& v : values) xs.push_back(from_vector(v).to(kFloat64).requires_grad_());
  fn(xs).sum().backward();
  std::vector<Tensor> g;
  for (const Tensor& x : xs) g.push_back(x.grad());
  return g;
}

// The expected numbers below are x.grad after f(x).sum().backward() in PyTorch 1.13 (float64),
// e.g. `x = torch.tensor([...], dtype=torch.float64, requires_grad=True);
// torch.nn.functional.gelu(x).sum().backward(); x.grad.tolist()`.

TEST(ElementwiseGrad, GeluMatchesPyTorch) {
  auto g = grads_of([](const auto& v) { return gelu(v[0]); },
                    {{-3, -1, -1e-7, 0, 1e-7, 0.5, 2, 6}});
  expect_close(g[0],
               {-0.01194564720418392, -0.08331547058768635, 0.49999992021154394, 0.5,
                0.5000000797884561, 0.8674951246561629, 1.085231801078197, 1.0000000354687093},
               1e-14, "gelu'(x)");
  g = grads_of([](const auto& v) { return gelu(v[0], "tanh"); }, {{-3, -1, 0, 0.5, 2}});
  expect_close(g[0],
               {-0.011584166630969648, -0.08296408384578252, 0.5, 0.8673699035346424,
                1.0860992566236183},
               1e-14, "gelu(tanh)'(x)");
  // Near and at zero (subnormal x included) the rule stays finite and smooth.
  g = grads_of([](const auto& v) { return gelu(v[0]); }, {{-1.0001e-6, -0.9999e-6, 0.9999e-6,
                                                           1.0001e-6, 1e-300, -1e-310}});
  const double k = 2 * 0.3989422804014327;  // gelu'(x) = 1/2 + 2 phi(0) x + O(x^3)
  expect_close(g[0], {0.5 - k * 1.0001e-6, 0.5 - k * 0.9999e-6, 0.5 + k * 0.9999e-6,
                      0.5 + k * 1.0001e-6, 0.5, 0.5},
               1e-15, "gelu'(x) near 0");
}

// Values from the closed forms: erf(x) and erf'(x) = 2/sqrt(pi) e^(-x^2) (math.erf, math.exp).
TEST(ElementwiseGrad, ErfMatchesClosedForm) {
  const std::vector<double> xs = {-2, -0.5, 0, 1, 3};
  Tensor x = from_vector(xs).to(kFloat64).requires_grad_();
  Tensor y = erf(x);
  expect_close(y, {-0.9953222650189527, -0.5204998778130465, 0, 0.8427007929497149,
                   0.9999779095030014},
               1e-15, "erf(x)");
  EXPECT_STREQ(y.grad_fn()->name(), "ErfBackward");
  y.sum().backward();
  expect_close(x.grad(), {0.020666985354092053, 0.8787825789354448, 1.1283791670955126,
                          0.4151074974205947, 0.00013925305194674786},
               1e-15, "erf'(x)");
  // Integer inputs compute in float32, as torch.erf.
  Tensor yi = erf(from_vector(std::vector<int64_t>{0, 1}));
  EXPECT_EQ(yi.dtype(), kFloat32);
  expect_close(yi, {0, 0.8427007929497149}, 1e-7, "erf of int64");
}

// Values from the closed forms: std::atan2, and d/da = b / (a^2 + b^2), d/db = -a / (a^2 + b^2)
// (PyTorch's atan2_backward), in every quadrant and on the axes.
TEST(ElementwiseGrad, Atan2MatchesClosedForm) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> as = {1, 1, -1, -1, 0, 0, -0.0, 3, 2, inf, 1};
  const std::vector<double> bs = {1, -1, 1, -1, 1, -1, -1, 0, -0.5, 2, -inf};
  Tensor a = from_vector(as).to(kFloat64).requires_grad_();
  Tensor b = from_vector(bs).to(kFloat64).requires_grad_();
  Tensor y = atan2(a, b);
  std::vector<double> want, da, db;
  for (size_t i = 0; i < as.size(); ++i) {
    want.push_back(std::atan2(as[i], bs[i]));
    const double r = as[i] * as[i] + bs[i] * bs[i];
    da.push_back(bs[i] / r);
    db.push_back(-as[i] / r);
  }
  expect_close(y, want, 0, "atan2(a, b)");
  // Signed zeros pick the half-plane: atan2(+-0, -1) = +-pi.
  EXPECT_EQ(y.to_vector<double>()[5], M_PI);
  EXPECT_EQ(y.to_vector<double>()[6], -M_PI);
  EXPECT_STREQ(y.grad_fn()->name(), "Atan2Backward");
  y.sum().backward();
  // The same formula as PyTorch's: with an infinite operand inf / inf gives NaN.
  const std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
  auto check = [](double got, double want, const char* what, size_t i) {
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "atan2 " << what << " at " << i << ": got " << got;
    } else {
      EXPECT_NEAR(got, want, 1e-15 * (1 + std::fabs(want))) << "atan2 " << what << " at " << i;
    }
  };
  for (size_t i = 0; i < as.size(); ++i) {
    check(ga[i], da[i], "d/da", i);
    check(gb[i], db[i], "d/db", i);
  }
  // At the origin the gradient is NaN, as PyTorch's (0 * inf).
  auto g = grads_of([](const auto& v) { return atan2(v[0], v[1]); }, {{0}, {0}});
  EXPECT_TRUE(std::isnan(g[0].item<double>()) && std::isnan(g[1].item<double>()));
}

TEST(ElementwiseGrad, Atan2DtypesAndBroadcasting) {
  // Integer and bool operands compute in float32, as torch.atan2.
  Tensor yi = atan2(tensor({1, -2, 0}), tensor({2, 0, -3}));
  EXPECT_EQ(yi.dtype(), kFloat32);
  expect_close(yi, {std::atan2(1.0, 2.0), std::atan2(-2.0, 0.0), std::atan2(0.0, -3.0)}, 1e-7,
               "atan2 of int64");
  EXPECT_EQ(atan2(tensor({true}), tensor({false})).dtype(), kFloat32);
  // float16 computes in float32 and rounds once.
  Tensor h = atan2(tensor({0.5f, -3.0f}).to(kFloat16), tensor({-1.5f, 2.0f}).to(kFloat16));
  EXPECT_EQ(h.dtype(), kFloat16);
  expect_close(h, {std::atan2(0.5, -1.5), std::atan2(-3.0, 2.0)}, 1e-3, "atan2 of float16");
  // [3, 1] with [4] broadcasts to [3, 4]; each gradient is summed back to its input's shape.
  Tensor a = leaf_in({3, 1}, 31, -2, 2), b = leaf_in({4}, 32, 0.5, 2);
  Tensor y = atan2(a, b);
  ASSERT_EQ(y.shape(), Shape({3, 4}));
  const std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> want, da(3, 0.0), db(4, 0.0);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) {
      want.push_back(std::atan2(av[i], bv[j]));
      const double r = av[i] * av[i] + bv[j] * bv[j];
      da[i] += bv[j] / r;
      db[j] -= av[i] / r;
    }
  }
  expect_close(y, want, 1e-15, "atan2 broadcast");
  y.sum().backward();
  expect_close(a.grad(), da, 1e-14, "atan2 broadcast d/da");
  expect_close(b.grad(), db, 1e-14, "atan2 broadcast d/db");
  expect_error([] { atan2(ones({2}), ones({3})); }, {"[atan2]", "[2]", "[3]"});
}

TEST(ElementwiseGrad, GeluSecondDerivativeAtAndNearZero) {
  // PyTorch: g, = autograd.grad(gelu(x).sum(), x, create_graph=True); autograd.grad(g.sum(), x)
  const std::vector<double> xs = {-2, -0.5, 0, 1e-7, 0.3};
  const std::pair<const char*, std::vector<double>> cases[] = {
      {"none",
       {-0.10798193302637613, 0.6161143218375241, 0.7978845608028654, 0.7978845608028574,
        0.728450727529601}},
      {"tanh",
       {-0.10787507995107845, 0.615506895115985, 0.7978845608028654, 0.7978845608028575,
        0.7281484484339118}},
  };
  for (const auto& [mode, want] : cases) {
    Tensor x = from_vector(xs).to(kFloat64).requires_grad_();
    auto g = autograd::grad({gelu(x, mode).sum()}, {x}, {}, std::nullopt, true);
    auto gg = autograd::grad({g[0].sum()}, {x});
    expect_close(gg[0], want, 1e-12, std::string("gelu''(x), approximate=") + mode);
    // Double backward through the rule (erf, exp) agrees with finite differences.
    expect_gradcheck(first_derivative([m = mode](const auto& v) { return gelu(v[0], m); }),
                     {x});
  }
}

TEST(ElementwiseGrad, SubgradientsMatchPyTorch) {
  expect_close(grads_of([](const auto& v) { return abs(v[0]); }, {{0, -2, 3}})[0], {0, -1, 1}, 0,
               "abs'(0) = 0");
  expect_close(grads_of([](const auto& v) { return sign(v[0]); }, {{0, -2}})[0], {0, 0}, 0,
               "sign' = 0");
  expect_close(grads_of([](const auto& v) { return relu(v[0]); }, {{0, -1, 2}})[0], {0, 0, 1}, 0,
               "relu'(0) = 0");
  expect_close(grads_of([](const auto& v) { return clamp(v[0], 0, 1); }, {{-1, 0, 0.5, 1, 2}})[0],
               {0, 1, 1, 1, 0}, 0, "clamp passes the gradient at the bounds");
  auto g = grads_of([](const auto& v) { return maximum(v[0], v[1]); }, {{1, 2, 3}, {1, 1, 4}});
  expect_close(g[0], {0.5, 1, 0}, 0, "maximum ties d/da");
  expect_close(g[1], {0.5, 0, 1}, 0, "maximum ties d/db");
  g = grads_of([](const auto& v) { return minimum(v[0], v[1]); }, {{1, 2, 3}, {1, 1, 4}});
  expect_close(g[0], {0.5, 0, 1}, 0, "minimum ties d/da");
  expect_close(g[1], {0.5, 1, 0}, 0, "minimum ties d/db");
  // maximum(x, x): both halves arrive at x.
  Tensor x = leaf_in({3}, 3, -1, 1);
  maximum(x, x).sum().backward();
  expect_close(x.grad(), {1, 1, 1}, 0, "maximum(x, x)");
}

TEST(ElementwiseGrad, PowEdgeCasesMatchPyTorch) {
  const double inf = std::numeric_limits<double>::infinity();
  auto g = grads_of([](const auto& v) { return pow(v[0], v[1]); }, {{0, 0, 0, 2}, {2, 0, -1, 3}});
  expect_close_inf(g[0], {0, 0, -inf, 12}, 1e-15, "pow d/da with a = 0");
  expect_close_inf(g[1], {0, 0, -inf, 5.545177444479562}, 1e-15, "pow d/db with a = 0");
  expect_close_inf(grads_of([](const auto& v) { return pow(0.0, v[0]); }, {{1, 0, -1}})[0],
               {0, 0, -inf}, 0, "0 ** x");
  expect_close(grads_of([](const auto& v) { return pow(2.0, v[0]); }, {{0.5, -1}})[0],
               {0.9802581434685472, 0.34657359027997264}, 1e-15, "2 ** x");
  expect_close(grads_of([](const auto& v) { return pow(v[0], 0); }, {{0, 2}})[0], {0, 0}, 0,
               "x ** 0");
  expect_close(grads_of([](const auto& v) { return pow(v[0], 1.5); }, {{0.25, 4}})[0], {0.75, 3},
               1e-15, "x ** 1.5");
}

TEST(ElementwiseGrad, OtherValuesMatchPyTorch) {
  expect_close(grads_of([](const auto& v) { return silu(v[0]); }, {{-2, 0.5, 3}})[0],
               {-0.09078424878489547, 0.7399611873026519, 1.0881041060151693}, 1e-15, "silu'");
  auto g = grads_of([](const auto& v) { return v[0] / v[1]; }, {{1, 2}, {4, -0.5}});
  expect_close(g[0], {0.25, -2}, 0, "div d/da");
  expect_close(g[1], {-0.0625, -8}, 0, "div d/db");
  expect_close(grads_of([](const auto& v) { return sigmoid(v[0]); }, {{0.3}})[0],
               {0.24445831169074586}, 1e-15, "sigmoid'");
  expect_close(grads_of([](const auto& v) { return log1p(v[0]); }, {{0.5}})[0],
               {0.6666666666666666}, 1e-15, "log1p'");
  expect_close(grads_of([](const auto& v) { return rsqrt(v[0]); }, {{4}})[0], {-0.0625}, 0,
               "rsqrt'");
  expect_close(grads_of([](const auto& v) { return reciprocal(v[0]); }, {{-2}})[0], {-0.25}, 0,
               "reciprocal'");
}

// ---- recording --------------------------------------------------------------------------------

TEST(ElementwiseGrad, PowShortcutsRecordOneNode) {
  Tensor x = leaf_in({3}, 4, 0.2, 2);
  const struct {
    Scalar e;
    const char* node;
  } cases[] = {{2, "SquareBackward"},     {2.0, "SquareBackward"}, {0.5, "SqrtBackward"},
               {-1.0, "ReciprocalBackward"}, {3, "PowBackward"},  {-1, "ReciprocalBackward"},
               {0, "PowBackward"}, {-2.5, "PowBackward"}};
  for (const auto& c : cases) {
    Tensor y = pow(x, c.e);
    ASSERT_NE(y.grad_fn(), nullptr) << "pow(x, " << c.e << ")";
    EXPECT_STREQ(y.grad_fn()->name(), c.node) << "pow(x, " << c.e << ")";
    EXPECT_EQ(y.grad_fn()->next_edge(0).fn, autograd::gradient_edge(x).fn)
        << "pow(x, " << c.e << ") should record one node on x";
  }
  Tensor y = clamp_min(x, 0.5);
  EXPECT_STREQ(y.grad_fn()->name(), "ClampBackward");
  EXPECT_EQ(y.grad_fn()->next_edge(0).fn, autograd::gradient_edge(x).fn);
}

TEST(ElementwiseGrad, NodeNames) {
  Tensor x = leaf_in({2}, 5, 0.5, 1);
  Tensor w = leaf_in({2}, 6, 0.5, 1);
  const std::pair<Tensor, const char*> cases[] = {
      {exp(x), "ExpBackward"},          {gelu(x), "GeluBackward"},
      {x / w, "DivBackward"},           {x / 2.0, "DivBackward"},
      {2.0 / x, "RdivBackward"},        {pow(x, w), "PowBackward"},
      {pow(2.0, x), "PowBackward"},     {maximum(x, w), "MaximumBackward"},
      {minimum(x, w), "MinimumBackward"}, {clamp(x, 0, 1), "ClampBackward"},
      {x - 1.0, "AddBackward"},         {1.0 - x, "RsubBackward"},
  };
  for (const auto& [y, name] : cases) {
    ASSERT_NE(y.grad_fn(), nullptr) << name;
    EXPECT_STREQ(y.grad_fn()->name(), name);
  }
}

TEST(ElementwiseGrad, NoGradRecordsNothing) {
  Tensor x = leaf_in({2}, 7, 0.5, 1);
  NoGradGuard no_grad;
  for (const UnaryCase& c : unary_cases()) {
    EXPECT_FALSE(c.fn(x).requires_grad()) << c.name;
  }
  EXPECT_FALSE(where(tensor({true, false}), x, x).requires_grad());
}

TEST(ElementwiseGrad, OutVariantsRefuseInputsThatRequireGrad) {
  Tensor x = leaf_in({2}, 8, -1, 1);
  Tensor out;
  expect_error([&] { add_out(out, x, ones({2}, kFloat64)); }, {"[add_out]", "out="});
  expect_error([&] { mul_out(out, ones({2}, kFloat64), x); }, {"[mul_out]", "out="});
  NoGradGuard no_grad;
  add_out(out, x, x);  // fine without recording
  expect_close(out, (x * 2.0).to_vector<double>(), 0, "add_out under NoGradGuard");
}

// ---- in-place ops -----------------------------------------------------------------------------

TEST(ElementwiseGrad, InPlaceOpsGradcheck) {
  struct Case {
    std::string name;
    std::function<void(Tensor&, const Tensor&)> op;  // op(self, other)
    double lo, hi;
  };
  const std::vector<Case> cases = {
      {"neg_", [](Tensor& s, const Tensor&) { neg_(s); }, -1, 1},
      {"abs_", [](Tensor& s, const Tensor&) { abs_(s); }, 0.2, 1},
      {"exp_", [](Tensor& s, const Tensor&) { exp_(s); }, -1, 1},
      {"log_", [](Tensor& s, const Tensor&) { log_(s); }, 0.2, 2},
      {"sqrt_", [](Tensor& s, const Tensor&) { sqrt_(s); }, 0.2, 2},
      {"rsqrt_", [](Tensor& s, const Tensor&) { rsqrt_(s); }, 0.2, 2},
      {"tanh_", [](Tensor& s, const Tensor&) { tanh_(s); }, -1, 1},
      {"sigmoid_", [](Tensor& s, const Tensor&) { sigmoid_(s); }, -1, 1},
      {"relu_", [](Tensor& s, const Tensor&) { relu_(s); }, 0.1, 1},
      {"clamp_", [](Tensor& s, const Tensor&) { clamp_(s, -0.3, 0.4); }, -0.2, 0.3},
      {"clamp_ (cut)", [](Tensor& s, const Tensor&) { clamp_(s, 0.6, std::nullopt); }, -1, 0.5},
      {"pow_", [](Tensor& s, const Tensor&) { pow_(s, 3); }, -1, 1},
      {"add_", [](Tensor& s, const Tensor& o) { s.add_(o, 2); }, -1, 1},
      {"sub_ scalar", [](Tensor& s, const Tensor&) { sub_(s, 0.5); }, -1, 1},
      {"mul_", [](Tensor& s, const Tensor& o) { s *= o; }, -1, 1},
      {"mul_ scalar", [](Tensor& s, const Tensor&) { s *= 3.0; }, -1, 1},
      {"div_", [](Tensor& s, const Tensor& o) { s /= o; }, 0.5, 1},
      {"div_ scalar", [](Tensor& s, const Tensor&) { div_(s, 4.0); }, -1, 1},
  };
  uint64_t seed = 900;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Tensor x = leaf_in({2, 3}, ++seed, c.lo, c.hi);
    Tensor o = leaf_in({3}, ++seed, c.lo, c.hi);
    expect_gradcheck(
        [&](const std::vector<Tensor>& v) {
          Tensor y = v[0] * 1.0;
          c.op(y, v[1]);
          return y;
        },
        {x, o});
    // A leaf that requires grad may not be changed in place.
    Tensor l = leaf_in({2, 3}, ++seed, c.lo, c.hi);
    expect_error<autograd::AutogradError>([&] { c.op(l, o); }, {"leaf"});
  }
}

TEST(ElementwiseGrad, ClampInPlaceMatchesOutOfPlace) {
  Tensor x = tensor({-1.0, 0.0, 0.5, 1.0, 2.0}).requires_grad_();
  Tensor y = x * 1.0;
  clamp_(y, 0, 1);
  EXPECT_STREQ(y.grad_fn()->name(), "CloneBackward");
  expect_close(y, {0, 0, 0.5, 1, 1}, 0, "clamp_ value");
  y.sum().backward();
  expect_close(x.grad(), {0, 1, 1, 1, 0}, 0, "clamp_ gradient");
  expect_error<autograd::AutogradError>([&] { clamp_(x, 0, 1); }, {"[clamp_]", "leaf"});
}

TEST(ElementwiseGrad, ModifyingASavedInputIsReported) {
  Tensor x = leaf_in({3}, 9, 0.5, 1);
  Tensor y = x * 1.0;
  Tensor z = log(y);  // saves y
  y.add_(1.0);
  expect_error<autograd::AutogradError>([&] { z.sum().backward(); }, {"modified", "LogBackward"});
}

// ---- dtypes -----------------------------------------------------------------------------------

// The binary nodes save what their row says, only for the gradients wanted (PyTorch's choices
// in derivatives.yaml): changing in place a tensor that was not saved leaves backward working,
// changing a saved one is reported.
TEST(ElementwiseGrad, BinaryNodesSaveWhatTheirRowSays) {
  struct Case {
    const char* name;
    BinaryFn fn;
    bool a_needs_grad, b_needs_grad;
    bool a_saved, b_saved;
  };
  const BinaryFn add_fn = [](const Tensor& a, const Tensor& b) { return a + b; };
  const BinaryFn mul_fn = [](const Tensor& a, const Tensor& b) { return a * b; };
  const BinaryFn div_fn = [](const Tensor& a, const Tensor& b) { return a / b; };
  const BinaryFn pow_fn = [](const Tensor& a, const Tensor& b) { return pow(a, b); };
  const std::vector<Case> cases = {
      {"add", add_fn, true, true, false, false},
      {"mul d/da", mul_fn, true, false, false, true},
      {"mul d/db", mul_fn, false, true, true, false},
      {"div d/da", div_fn, true, false, false, true},
      {"div d/db", div_fn, false, true, true, true},
      {"pow d/da", pow_fn, true, false, true, true},
  };
  for (const Case& c : cases) {
    for (int changed : {0, 1}) {
      SCOPED_TRACE(std::string(c.name) + (changed == 0 ? ", a changed" : ", b changed"));
      Tensor a = leaf_in({3}, 40, 0.5, 1), b = leaf_in({3}, 41, 0.5, 1);
      a = c.a_needs_grad ? a * 1.0 : a.detach();
      b = c.b_needs_grad ? b * 1.0 : b.detach();
      const Tensor y = c.fn(a, b);
      (changed == 0 ? a : b).add_(1.0);
      if (changed == 0 ? c.a_saved : c.b_saved) {
        expect_error<autograd::AutogradError>([&] { y.sum().backward(); }, {"modified"});
      } else {
        EXPECT_NO_THROW(y.sum().backward());
      }
    }
  }
}

TEST(ElementwiseGrad, Float32GradientsAreFloat32AndCloseToFloat64) {
  const std::vector<BinaryFn> fns = {
      [](const Tensor& a, const Tensor& b) { return gelu(a) * sigmoid(b); },
      [](const Tensor& a, const Tensor& b) { return pow(a.abs() + 0.5, b) / (b * b + 1.0); },
      [](const Tensor& a, const Tensor& b) { return maximum(a, b) + clamp(a, -0.3, 0.3); },
      [](const Tensor& a, const Tensor& b) { return where(gt(a, b), exp(a), silu(b)); },
      [](const Tensor& a, const Tensor& b) { return gelu(a, "tanh") - rsqrt(b * b + 1.0); },
  };
  for (size_t i = 0; i < fns.size(); ++i) {
    Tensor a64 = leaf_in({4, 5}, 20 + i, -2, 2), b64 = leaf_in({5}, 40 + i, -2, 2);
    Tensor a32 = a64.detach().to(kFloat32).requires_grad_();
    Tensor b32 = b64.detach().to(kFloat32).requires_grad_();
    fns[i](a64, b64).sum().backward();
    fns[i](a32, b32).sum().backward();
    EXPECT_EQ(a32.grad().dtype(), kFloat32) << "fn " << i;
    EXPECT_EQ(b32.grad().dtype(), kFloat32) << "fn " << i;
    expect_close(a32.grad(), a64.grad().to_vector<double>(), 1e-5, "float32 d/da, fn " +
                                                                      std::to_string(i));
    expect_close(b32.grad(), b64.grad().to_vector<double>(), 1e-5, "float32 d/db, fn " +
                                                                      std::to_string(i));
  }
}

TEST(ElementwiseGrad, MixedDtypesGetTheirOwnDtypeBack) {
  Tensor a = leaf_in({3}, 10, 0.5, 1).detach().to(kFloat32).requires_grad_();
  Tensor b = leaf_in({3}, 11, 0.5, 1);
  Tensor y = a / b;
  EXPECT_EQ(y.dtype(), kFloat64);
  y.sum().backward();
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  EXPECT_EQ(b.grad().dtype(), kFloat64);
  expect_close(a.grad(), reciprocal(b).to_vector<double>(), 1e-6, "d(a/b)/da as float32");
}

// ---- CUDA -------------------------------------------------------------------------------------

TEST(ElementwiseGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  }
  const Device cuda_dev("cuda");
  uint64_t seed = 1000;
  for (const UnaryCase& c : unary_cases()) {
    if (c.name == "masked_fill") continue;  // its mask is made on the CPU
    Tensor x = leaf_in({5, 7}, ++seed, c.lo, c.hi, false, c.kinks);
    Tensor xc = x.detach().to(cuda_dev).requires_grad_();
    Tensor w = test::rand_t({5, 7}, kFloat64, seed);
    (c.fn(x) * w).sum().backward();
    (c.fn(xc) * w.to(cuda_dev)).sum().backward();
    ASSERT_TRUE(xc.grad().is_cuda()) << c.name;
    expect_close(xc.grad().cpu(), x.grad().to_vector<double>(), 1e-12, "cuda " + c.name);
  }
  for (const BinaryCase& c : binary_cases()) {
    Tensor a = leaf_in({2, 3, 4}, ++seed, c.a_lo, c.a_hi);
    Tensor b = leaf_in({3, 1}, ++seed, c.b_lo, c.b_hi, false, c.b_kinks);
    Tensor ac = a.detach().to(cuda_dev).requires_grad_();
    Tensor bc = b.detach().to(cuda_dev).requires_grad_();
    Tensor y = c.fn(a, b), yc = c.fn(ac, bc);
    Tensor w = test::rand_t(y.shape(), kFloat64, seed);
    (y * w).sum().backward();
    (yc * w.to(cuda_dev)).sum().backward();
    expect_close(ac.grad().cpu(), a.grad().to_vector<double>(), 1e-12, "cuda d/da " + c.name);
    expect_close(bc.grad().cpu(), b.grad().to_vector<double>(), 1e-12, "cuda d/db " + c.name);
  }
  // float32 on the GPU against float32 on the CPU.
  Tensor x = leaf_in({64}, 7, -3, 3).detach().to(kFloat32).requires_grad_();
  Tensor xc = x.detach().to(cuda_dev).requires_grad_();
  auto f = [](const Tensor& t) { return gelu(t) + gelu(t, "tanh") * silu(t) + clamp(t, -1, 1); };
  f(x).sum().backward();
  f(xc).sum().backward();
  EXPECT_EQ(xc.grad().dtype(), kFloat32);
  expect_close(xc.grad().cpu(), x.grad().to_vector<double>(), 1e-5, "cuda float32");
}

}  // namespace
}  // namespace ember
