// Element-wise ops beyond binary arithmetic: unary ops against libm and activation values
// against PyTorch, comparisons and logic, where, clamp, masked_fill, equal and allclose, errors
// for undefined tensors, and operators against the free functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <string>
#include <vector>

#include <ember/tensor/ops.h>
#include "elementwise_test_util.h"
#include "test_util.h"

using namespace ember;
using namespace ember::test;

// ---- unary ------------------------------------------------------------------------------------

TEST(Unary, FloatOpsMatchLibmInFloat32AndFloat64) {
  const std::vector<double> xs = {0.1, 0.5, 1.0, 2.0, 3.5, 10.0};
  struct Case {
    const char* name;
    Tensor (*op)(const Tensor&);
    double (*ref)(double);
  };
  const Case cases[] = {
      {"exp", ember::exp, [](double x) { return std::exp(x); }},
      {"log", ember::log, [](double x) { return std::log(x); }},
      {"log1p", ember::log1p, [](double x) { return std::log1p(x); }},
      {"sqrt", ember::sqrt, [](double x) { return std::sqrt(x); }},
      {"rsqrt", ember::rsqrt, [](double x) { return 1 / std::sqrt(x); }},
      {"reciprocal", ember::reciprocal, [](double x) { return 1 / x; }},
      {"square", ember::square, [](double x) { return x * x; }},
      {"sin", ember::sin, [](double x) { return std::sin(x); }},
      {"cos", ember::cos, [](double x) { return std::cos(x); }},
      {"tanh", ember::tanh, [](double x) { return std::tanh(x); }},
      {"neg", ember::neg, [](double x) { return -x; }},
      {"abs", ember::abs, [](double x) { return x; }},
  };
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    Tensor x = from_vector(xs).to(dt);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << c.name << " " << dt);
      Tensor r = c.op(x);
      EXPECT_EQ(r.dtype(), dt);
      std::vector<double> want;
      for (double v : xs) want.push_back(cast_to(c.ref(cast_to(v, dt)), dt));
      expect_values(r, want, 2 * tol_for(dt));
    }
  }
  expect_values(log(tensor({0.f, -1.f})), {-kInf, kNaN});
  expect_values(sqrt(tensor({-1.0})), {kNaN});
  expect_values(reciprocal(tensor({0.f})), {kInf});
}

// float32 exp is Ember's own branch-free exp (vectorised, AVX-512/AVX2 picked at load time):
// within 2 ulp of the true value over the whole range, overflow to inf, subnormals, 0 below, the
// special values as libm; and the same bits whatever the layout (dense loops and strided ones).
TEST(Unary, Float32ExpIsWithinTwoUlpEverywhereAndTheSameInEveryLayout) {
  std::vector<float> xs;
  for (double v = -110; v <= 95; v += 0.0137) xs.push_back(static_cast<float>(v));
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 88.72f, 88.7229f, -87.3f, -103.9f, -104.0f}) {
    xs.push_back(v);
  }
  const std::vector<float> got = exp(from_vector(xs)).to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double want = std::exp(static_cast<double>(xs[i]));
    SCOPED_TRACE(::testing::Message() << "exp(" << xs[i] << ") = " << got[i] << ", want " << want);
    if (want > std::numeric_limits<float>::max()) {
      EXPECT_TRUE(std::isinf(got[i]));
    } else if (want >= std::numeric_limits<float>::min()) {
      EXPECT_LE(std::abs(got[i] - want), 2.5 * std::ldexp(1.0, std::ilogb(want) - 23));
    } else {  // subnormal or below: within 2 units of the smallest subnormal
      EXPECT_LE(std::abs(got[i] - want), 2 * std::numeric_limits<float>::denorm_min());
    }
  }
  const std::vector<float> special =
      exp(tensor({-kInf, kInf, kNaN, 1.0f})).to_vector<float>();
  EXPECT_EQ(special[0], 0.0f);
  EXPECT_TRUE(std::isinf(special[1]) && special[1] > 0);
  EXPECT_TRUE(std::isnan(special[2]));
  // Strided (a transposed view) and bfloat16 go through other loops: the same arithmetic.
  Tensor m = from_vector(std::vector<float>(xs.begin(), xs.begin() + 1000)).reshape({40, 25});
  EXPECT_EQ(exp(m.t()).contiguous().to_vector<float>(), exp(m).t().contiguous().to_vector<float>());
}

TEST(Unary, IntegerAndSignOps) {
  Tensor i = tensor({-3, 0, 4}).to(kInt32);
  expect_values(neg(i), {3, 0, -4});
  expect_values(abs(i), {3, 0, 4});
  expect_values(sign(i), {-1, 0, 1});
  expect_values(relu(i), {0, 0, 4});
  expect_values(square(i), {9, 0, 16});
  EXPECT_EQ(neg(i).dtype(), kInt32);
  Tensor u = tensor({253, 0, 4}).to(kUInt8);
  expect_values(neg(u), {3, 0, 252});
  expect_values(abs(u), {253, 0, 4});
  expect_values(sign(u), {1, 0, 1});
  expect_values(sign(tensor({kNaN, -0.0, 2.0, -kInf})), {0, 0, 1, -1});  // PyTorch 1.13: sign(nan)=0
  EXPECT_EQ(sign(tensor({true, false})).dtype(), kBool);
  EXPECT_EQ(square(tensor({true, false})).dtype(), kInt64);
  expect_values(square(tensor({true, false})), {1, 0});
  expect_values(relu(tensor({-1.0, kNaN, 2.0})), {0, kNaN, 2});
  expect_values(abs(tensor({-0.0, -kInf})), {0, kInf});
  expect_values(logical_not(tensor({0.f, 2.f, -0.f})), {1, 0, 1});
  expect_values(logical_not(tensor({0, 3})), {1, 0});
  expect_values(logical_not(tensor({true, false})), {0, 1});
}

TEST(Unary, ActivationsMatchPyTorch) {
  // Produced with torch 1.13 (float64 and float32):
  //   x = torch.tensor([-20., -3., -1., -0.5, 0., 0.5, 1., 3., 20.], dtype=torch.float64)
  //   F.gelu(x), F.gelu(x, approximate='tanh'), F.silu(x), torch.sigmoid(x)
  const std::vector<double> xs = {-20, -3, -1, -0.5, 0, 0.5, 1, 3, 20};
  const std::vector<double> gelu_w = {-0.0, -0.0040496940948903104, -0.15865525393145702,
                                      -0.15426876936299344, 0, 0.34573123063700656,
                                      0.84134474606854304, 2.9959503059051098, 20};
  const std::vector<double> gelu_tanh_w = {-0.0, -0.0036373920817729943, -0.15880800939172329,
                                           -0.15428599017485606, 0, 0.34571400982514394,
                                           0.84119199060827676, 2.9963626079182268, 20};
  const std::vector<double> silu_w = {-4.1223072363804073e-08, -0.14227761953270035,
                                      -0.2689414213699951, -0.1887703343990727, 0,
                                      0.3112296656009273, 0.7310585786300049,
                                      2.8577223804672998, 19.999999958776925};
  const std::vector<double> sigmoid_w = {2.0611536181902037e-09, 0.047425873177566781,
                                         0.2689414213699951, 0.37754066879814541, 0.5,
                                         0.62245933120185459, 0.7310585786300049,
                                         0.95257412682243336, 0.99999999793884631};
  Tensor x64 = from_vector(xs);
  expect_values(gelu(x64), gelu_w, 1e-15);
  expect_values(gelu(x64, "tanh"), gelu_tanh_w, 1e-15);
  expect_values(silu(x64), silu_w, 1e-15);
  expect_values(sigmoid(x64), sigmoid_w, 1e-15);
  Tensor x32 = x64.to(kFloat32);
  // float32 values differ from the float64 ones by rounding only.
  expect_values(gelu(x32), gelu_w, 2e-7);
  expect_values(gelu(x32, "tanh"), gelu_tanh_w, 2e-7);
  expect_values(silu(x32), silu_w, 2e-7);
  expect_values(sigmoid(x32), sigmoid_w, 2e-7);
  // float16: torch.nn.functional.gelu(h.float()).half() for h = [-3, -1, 0.5, 1, 3]
  expect_values(gelu(tensor({-3.f, -1.f, 0.5f, 1.f, 3.f}).to(kFloat16)),
                {-0.0040512085, -0.158691406, 0.345703125, 0.841308594, 2.99609375}, 1e-8);
  // bfloat16: computed in float and rounded once (one bf16 ulp of PyTorch's CPU values).
  expect_values(silu(tensor({-3.f, -1.f, 0.5f, 1.f, 3.f}).to(kBFloat16)),
                {-0.142578125, -0.26953125, 0.310546875, 0.73046875, 2.859375});
  // Stable at the extremes: no NaN, exact limits.
  expect_values(sigmoid(tensor({-1000.f, 1000.f})), {0, 1});
  expect_values(silu(tensor({-1000.f, 1000.f})), {-0.0, 1000});
  expect_values(sigmoid(tensor({kNaN})), {kNaN});
  expect_error<ValueError>([&] { gelu(x32, "fast"); }, {"[gelu]", "fast"});
}

// Bitwise equality, NaN equal to NaN.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::vector<float>& xs,
                      const char* what) {
  const std::vector<float> g = got.to(kFloat32).to_vector<float>();
  const std::vector<float> w = want.to(kFloat32).to_vector<float>();
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    const bool same = std::isnan(w[i]) ? std::isnan(g[i])
                                       : g[i] == w[i] && std::signbit(g[i]) == std::signbit(w[i]);
    EXPECT_TRUE(same) << what << " (" << got.dtype() << ") at " << xs[i] << ": " << g[i]
                      << " vs " << w[i];
  }
}

TEST(Unary, GeluTanhWideLoopMatchesGenericLoop) {
  // Dense float32 and bfloat16 GELU (tanh form) and its gradient run on loops compiled for the
  // CPU's widest vectors (tensor/cpu/wide_loops.cpp); strided operands take the generic loop.
  // Both must give the same bits, across tanh's two branches (|x| = 0.625), its saturation,
  // zeros and NaN.
  const int64_t n = 4099;  // not a multiple of any vector width
  std::vector<float> xs = linspace(-12.0, 12.0, n, {kFloat32}).to_vector<float>();
  xs[0] = std::numeric_limits<float>::quiet_NaN();
  xs[1] = -0.f;
  xs[2] = std::numeric_limits<float>::infinity();
  xs[3] = 0.625f;
  for (Dtype dt : {kFloat32, kBFloat16}) {
    const Tensor x = from_vector(xs).to(dt);
    const Tensor g = linspace(-2.0, 3.0, n, {kFloat32}).to(dt);
    // Every other element of a twice-as-long buffer: the same values, not dense.
    auto strided = [&](const Tensor& t) {
      Tensor buf = zeros({n, 2}, {dt});
      buf.select(1, 0).copy_(t);
      return buf.select(1, 0);
    };
    ASSERT_FALSE(strided(x).is_contiguous());
    expect_same_bits(gelu(x, "tanh"), gelu(strided(x), "tanh"), xs, "gelu");
    expect_same_bits(gelu_tanh_backward(g, x), gelu_tanh_backward(strided(g), strided(x)), xs,
                     "gelu_tanh_backward");
    // The gradient of a sum or a mean: one value expanded to x's shape (its own wide loop).
    const Tensor g1 = tensor({-0.75f}).to(dt).expand({n});
    ASSERT_EQ(g1.stride(0), 0);
    expect_same_bits(gelu_tanh_backward(g1, x), gelu_tanh_backward(g1, strided(x)), xs,
                     "gelu_tanh_backward, expanded gradient");
    expect_same_bits(gelu_tanh_backward(g1, x), gelu_tanh_backward(g1.contiguous(), x), xs,
                     "gelu_tanh_backward, expanded gradient against dense");
  }
}

TEST(Unary, GeluTanhFloatKeepsItsDigitsWhereTheTanhFormCancels) {
  // float32 GELU (tanh form) and its gradient against float64 over [-12, 12], within 1e-6 of the
  // value or of a floor (0.01; the gradient's 0.05, as its two terms cancel near its root at
  // x = -0.75 in any form). The tanh form in float, 0.5 x (1 + tanh(inner)) and 1 - tanh^2,
  // cancels for x below about -5 and misses this by up to 15x (forward) and 23x (gradient) even
  // with a correctly rounded tanh; the sigmoid form the CPU uses does not cancel there. (float64's
  // own tanh form is exact to 1e-15 here, far inside the bound.)
  const int64_t n = 4801;
  const Tensor x64 = linspace(-12.0, 12.0, n, {kFloat64});
  const Tensor g64 = linspace(-2.0, 3.0, n, {kFloat64});
  const Tensor x32 = x64.to(kFloat32), g32 = g64.to(kFloat32);
  // The reference at the float32 inputs, so that only the computation differs.
  const Tensor xr = x32.to(kFloat64), gr = g32.to(kFloat64);
  const std::vector<float> xs = x32.to_vector<float>();
  auto check = [&](const Tensor& got, const Tensor& want, double floor, const char* what) {
    const std::vector<double> g = got.to(kFloat64).to_vector<double>();
    const std::vector<double> w = want.to_vector<double>();
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_LE(std::abs(g[i] - w[i]), 1e-6 * std::max(std::abs(w[i]), floor))
          << what << " at x = " << xs[i] << ": " << g[i] << " vs " << w[i];
    }
  };
  check(gelu(x32, "tanh"), gelu(xr, "tanh"), 0.01, "gelu");
  check(gelu_tanh_backward(g32, x32), gelu_tanh_backward(gr, xr), 0.05, "gelu_tanh_backward");
  // The limits: -0 far left, x far right, NaN kept.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_values(gelu(tensor({-1e4f, 1e4f, nan}), "tanh"), {-0.0, 1e4, kNaN});
  expect_values(gelu_tanh_backward(tensor({1.f, 1.f, 1.f}), tensor({-1e4f, 1e4f, nan})),
                {0, 1, kNaN});
}

// ---- comparisons and logic --------------------------------------------------------------------

TEST(Compare, AllOpsTensorAndScalarEveryDtype) {
  for (Dtype dt : kAllDtypes) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor a = (dt == kBool ? tensor({0, 1, 1}) : tensor({1, 2, 3})).to(dt);
    Tensor b = (dt == kBool ? tensor({1, 1, 0}) : tensor({2, 2, 2})).to(dt);
    if (dt == kBool) {
      expect_values(eq(a, b), {0, 1, 0});
      expect_values(lt(a, b), {1, 0, 0});
      expect_values(ge(a, b), {0, 1, 1});
      expect_values(logical_xor(a, b), {1, 0, 1});
      continue;
    }
    expect_values(eq(a, b), {0, 1, 0});
    expect_values(ne(a, b), {1, 0, 1});
    expect_values(lt(a, b), {1, 0, 0});
    expect_values(le(a, b), {1, 1, 0});
    expect_values(gt(a, b), {0, 0, 1});
    expect_values(ge(a, b), {0, 1, 1});
    expect_values(eq(a, 2), {0, 1, 0});
    expect_values(ne(a, 2), {1, 0, 1});
    expect_values(lt(a, 2), {1, 0, 0});
    expect_values(le(a, 2), {1, 1, 0});
    expect_values(gt(a, 2), {0, 0, 1});
    expect_values(ge(a, 2), {0, 1, 1});
    Tensor z = (tensor({0, 1, 0})).to(dt);
    expect_values(logical_and(a, z), {0, 1, 0});
    expect_values(logical_or(z, z), {0, 1, 0});
    expect_values(logical_xor(a, z), {1, 0, 1});
  }
  expect_values(eq(tensor({kNaN}), tensor({kNaN})), {0});
  expect_values(ne(tensor({kNaN}), kNaN), {1});
  expect_values(logical_and(tensor({kNaN, 0.0}), tensor({true, true})), {1, 0});
}

// A scalar is compared at the tensor's dtype, as PyTorch does (torch 1.13 on the CPU:
// torch.full((1,), 0.1, dtype=torch.bfloat16) == 0.1 is True): bfloat16's 0.1 is 0.10009765625,
// which the unrounded float32 0.1 is not.
TEST(Compare, AScalarIsRoundedToTheTensorsDtype) {
  for (Dtype dt : {kBFloat16, kFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    const Tensor x = full({1}, 0.1, dt);
    expect_values(eq(x, 0.1), {1});
    expect_values(ne(x, 0.1), {0});
    expect_values(lt(x, 0.1), {0});
    expect_values(gt(x, 0.1), {0});
  }
  expect_values(eq(full({1}, 0.1, kFloat32), 0.1), {1});   // float32's 0.1 as well
  expect_values(eq(full({1}, 0.1, kFloat64), 0.1f), {0});  // the float 0.1f is not double's 0.1
}

// ---- where, clamp, masked_fill ----------------------------------------------------------------

TEST(Where, BroadcastsAllThreeAndPromotes) {
  Tensor c = tensor({true, false, true}).view({3, 1});
  Tensor a = tensor({1.f, 2.f});                     // [2]
  Tensor b = make({2, 3, 1}, [](int64_t i) { return -1.0 - i; }, kFloat32);
  Tensor r = where(c, a, b);
  ASSERT_EQ(r.shape(), Shape({2, 3, 2}));
  expect_values(r, {1, 2, -2, -2, 1, 2, 1, 2, -5, -5, 1, 2});
  // Promotion as torch.where: int32 with float16 gives float16; scalars by category.
  Tensor m = tensor({true, false});
  EXPECT_EQ(where(m, tensor({1, 2}).to(kInt32), tensor({1.f, 2.f}).to(kFloat16)).dtype(),
            kFloat16);
  Tensor ws = where(m, tensor({1, 2}).to(kInt32), 2.5);
  EXPECT_EQ(ws.dtype(), kFloat32);
  expect_values(ws, {1, 2.5});
  EXPECT_EQ(where(m, tensor({1.f, 2.f}).to(kFloat16), 2.5).dtype(), kFloat16);
  for (Dtype dt : kAllDtypes) {
    expect_values(where(m, ones({2}, dt), zeros({2}, dt)), {1, 0});
  }
  expect_error<TypeError>([&] { where(tensor({1, 0}), a, a); }, {"[where]", "bool", "int64"});
  expect_error<ValueError>([&] { where(m, ones({3}), ones({3})); }, {"[where]"});
}

TEST(Clamp, BoundsNaNAndPromotion) {
  Tensor x = tensor({-2.0, 0.5, 3.0, kNaN});
  expect_values(clamp(x, -1, 1), {-1, 0.5, 1, kNaN});
  expect_values(clamp(x, std::nullopt, 1), {-2, 0.5, 1, kNaN});
  expect_values(clamp_min(x, 0), {0, 0.5, 3, kNaN});
  expect_values(clamp_max(x, 0), {-2, 0, 0, kNaN});
  expect_values(clamp(x, 2, 1), {1, 1, 1, kNaN});  // min > max gives max
  Tensor i = tensor({-2, 0, 5});
  expect_values(clamp(i, -1, 2), {-1, 0, 2});
  EXPECT_EQ(clamp(i, -1, 2).dtype(), kInt64);
  Tensor f = clamp(i, -1.5, 2.5);
  EXPECT_EQ(f.dtype(), kFloat32);
  expect_values(f, {-1.5, 0, 2.5});
  EXPECT_EQ(clamp(tensor({true, false}), 0, std::nullopt).dtype(), kInt64);
  expect_values(clamp(tensor({-2.f, 5.f}).to(kFloat16), -1, 1), {-1, 1});
  expect_values(clamp(tensor({10, 250}).to(kUInt8), 20, 200), {20, 200});
  Tensor y = tensor({-5.f, 5.f});
  const uint32_t v = y.version();
  clamp_(y, -1, 1);
  EXPECT_GT(y.version(), v);
  expect_values(y, {-1, 1});
  expect_error<ValueError>([&] { clamp(x, std::nullopt, std::nullopt); },
                           {"[clamp]", "min", "max"});
}

TEST(MaskedFill, BroadcastMaskAndErrors) {
  Tensor t = make({2, 3}, [](int64_t i) { return double(i); }, kFloat32);
  Tensor m = tensor({true, false, true});
  expect_values(masked_fill(t, m, -1), {-1, 1, -1, -1, 4, -1});
  expect_values(masked_fill(tensor({0, 0}), tensor({true, false}), 2.7), {2, 0});
  EXPECT_EQ(masked_fill(tensor({0, 0}), tensor({true, false}), 2.7).dtype(), kInt64);
  expect_values(masked_fill(t, scalar_tensor(true), 7), {7, 7, 7, 7, 7, 7});
  expect_error<TypeError>([&] { masked_fill(t, tensor({1, 0, 1}), 0); },
                          {"[masked_fill]", "bool", "int64"});
  expect_error<ValueError>([&] { masked_fill(t, ones({4, 2, 3}, kBool), 0); },
                           {"[masked_fill]", "[2, 3]", "[4, 2, 3]"});
}

// ---- equal, allclose --------------------------------------------------------------------------

TEST(Equal, ShapesValuesAndDtypes) {
  EXPECT_TRUE(equal(tensor({1.f, 2.f}), tensor({1.f, 2.f})));
  EXPECT_FALSE(equal(tensor({1.f, 2.f}), tensor({1.f, 3.f})));
  EXPECT_FALSE(equal(tensor({1.f, 2.f}), tensor({1.f, 2.f}).view({1, 2})));
  EXPECT_TRUE(equal(tensor({1.f, 2.f}), tensor({1, 2})));  // as torch.equal: by value
  EXPECT_FALSE(equal(tensor({kNaN}), tensor({kNaN})));
  Tensor m = make({3, 2}, [](int64_t i) { return double(i); });
  EXPECT_TRUE(equal(m.t(), m.t().contiguous()));
}

TEST(AllClose, TolerancesNaNInfAndBroadcast) {
  EXPECT_TRUE(allclose(tensor({1.f, 2.f, 3.f}), tensor({1.f, 2.f, 3.00001f})));
  EXPECT_FALSE(allclose(tensor({1.0}), tensor({1.001})));
  EXPECT_TRUE(allclose(tensor({1.0}), tensor({1.001}), 1e-2));
  EXPECT_TRUE(allclose(tensor({0.0}), tensor({1e-9})));
  EXPECT_FALSE(allclose(tensor({1.0, 2.0}), tensor({1.0, kNaN})));
  EXPECT_TRUE(allclose(tensor({kInf}), tensor({kInf})));
  EXPECT_FALSE(allclose(tensor({kInf}), tensor({-kInf})));
  EXPECT_TRUE(allclose(ones({2, 3}), tensor({1.f, 1.f, 1.f})));
  expect_error<ValueError>([&] { allclose(ones({2}), ones({2}), -1.0); }, {"[allclose]", "-1"});
}

// ---- errors and operators ---------------------------------------------------------------------

TEST(Errors, UndefinedTensorsAreNamed) {
  Tensor u;
  expect_error<ValueError>([&] { add(u, ones({1})); }, {"[add]", "self"});
  expect_error<ValueError>([&] { mul(ones({1}), u); }, {"[mul]", "other"});
  expect_error<ValueError>([&] { exp(u); }, {"[exp]", "self"});
  expect_error<ValueError>([&] { where(u, ones({1}), ones({1})); }, {"[where]", "condition"});
}

TEST(Operators, MethodsMatchFreeFunctions) {
  Tensor a = tensor({1.f, 4.f}), b = tensor({2.f, 2.f});
  expect_values(a.add(b), {3, 6});
  expect_values(a.sub(b, 2), {-3, 0});
  expect_values(a.mul(b), {2, 8});
  expect_values(a.div(b), {0.5, 2});
  expect_values(a.neg(), {-1, -4});
  expect_values(a.neg().abs(), {1, 4});
  expect_values(a.sqrt(), {1, 2});
  expect_values(a.log().exp(), {1, 4}, 1e-6);
  expect_values(a.pow(2), {1, 16});
  expect_values((-a).relu(), {0, 0});
  expect_values(a.sigmoid(), {1 / (1 + std::exp(-1.0)), 1 / (1 + std::exp(-4.0))}, 1e-7);
  expect_values(a.tanh(), {std::tanh(1.0), std::tanh(4.0)}, 1e-7);
  expect_values(a * b - a / b + 1, {2.5, 7});
  expect_values(3 - a * 2, {1, -5});
  Tensor c = a.clone();
  c.add_(1).mul_(2).div_(b).sub_(b, 0.5);
  expect_values(c, {1, 4});
  c.add_(b).mul_(b).div_(2);
  expect_values(c, {3, 6});
}
