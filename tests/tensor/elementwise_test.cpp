// Element-wise ops: values per dtype against naive loops and closed forms, broadcasting, 0-sized
// and strided inputs, PyTorch's type promotion (including its 0-dim rule), in-place and _out
// semantics and errors, activation values against PyTorch, and CUDA-vs-CPU agreement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ember/tensor/cuda/fast_div.h>
#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_error;

using namespace ember;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

bool same_value(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

/// Checks every element of t (as double) against want; prints the index and both values.
void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 0) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size())) << "shape " << t.shape();
  const std::vector<double> got = t.to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(same_value(got[i], want[i], tol))
        << "index " << i << ": got " << got[i] << ", want " << want[i] << " (dtype " << t.dtype()
        << ")";
  }
}

/// A float64 tensor of shape with values f(i) at row-major index i.
Tensor make(IntList shape, const std::function<double(int64_t)>& f, Dtype dt = kFloat64) {
  std::vector<double> v(Shape(shape).numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = f(static_cast<int64_t>(i));
  return from_vector(v, shape).to(dt);
}

/// Asserts that fn throws E whose message contains every piece.
const Dtype kAllDtypes[] = {kBool,    kUInt8,     kInt32,   kInt64,
                            kFloat16, kBFloat16, kFloat32, kFloat64};

double tol_for(Dtype dt) {
  switch (dt) {
    case kFloat16: return 1e-3;
    case kBFloat16: return 8e-3;
    case kFloat32: return 1e-6;
    case kFloat64: return 1e-14;
    default: return 0;
  }
}

/// Reference value of an integer/float result after a cast to dt (wraps for uint8).
double cast_to(double v, Dtype dt) {
  switch (dt) {
    case kBool: return v != 0;
    case kUInt8: return static_cast<double>(static_cast<uint8_t>(static_cast<int64_t>(v)));
    case kInt32: return static_cast<double>(static_cast<int32_t>(v));
    case kInt64: return static_cast<double>(static_cast<int64_t>(v));
    case kFloat16: return static_cast<float>(Half(static_cast<float>(v)));
    case kBFloat16: return static_cast<float>(BFloat16(static_cast<float>(v)));
    case kFloat32: return static_cast<float>(v);
    default: return v;
  }
}

}  // namespace

// ---- type promotion ---------------------------------------------------------------------------

TEST(Promotion, TensorTensorFollowsPromoteTypes) {
  Tensor i32 = ones({2}, kInt32), f64 = ones({2}, kFloat64), f16 = ones({2}, kFloat16);
  Tensor bf16 = ones({2}, kBFloat16), u8 = ones({2}, kUInt8), b = ones({2}, kBool);
  EXPECT_EQ((i32 + f64).dtype(), kFloat64);
  EXPECT_EQ((f16 + bf16).dtype(), kFloat32);
  EXPECT_EQ((u8 + i32).dtype(), kInt32);
  EXPECT_EQ((b + b).dtype(), kBool);
  EXPECT_EQ((b + u8).dtype(), kUInt8);
  EXPECT_EQ((ones({2}, kInt64) * f16).dtype(), kFloat16);
}

TEST(Promotion, ZeroDimTensorsOnlyRaiseTheCategory) {
  // torch.result_type: a 0-dim tensor acts like a scalar of its category.
  Tensor f16 = ones({2}, kFloat16);
  EXPECT_EQ((f16 + scalar_tensor(1.0, kFloat32)).dtype(), kFloat16);
  EXPECT_EQ((scalar_tensor(1.0, kFloat64) * f16).dtype(), kFloat16);
  EXPECT_EQ((ones({2}, kInt32) + scalar_tensor(1.0, kFloat64)).dtype(), kFloat64);
  EXPECT_EQ((ones({2}, kInt32) + scalar_tensor(1, kInt64)).dtype(), kInt32);
  EXPECT_EQ((ones({2}, kBool) + scalar_tensor(1, kUInt8)).dtype(), kUInt8);
  EXPECT_EQ((ones({2}, kUInt8) + scalar_tensor(true, kBool)).dtype(), kUInt8);
  // Two 0-dim tensors promote normally.
  EXPECT_EQ((scalar_tensor(1.0, kFloat16) + scalar_tensor(1.0, kFloat32)).dtype(), kFloat32);
  // Values are right too: [1, 2] (f16) + 0.5 (f32, 0-dim) = [1.5, 2.5] in f16.
  expect_values(tensor({1.f, 2.f}).to(kFloat16) + scalar_tensor(0.5, kFloat32), {1.5, 2.5});
}

TEST(Promotion, TensorScalar) {
  EXPECT_EQ((ones({2}, kInt64) + 2.5).dtype(), kFloat32);
  expect_values(tensor({1, 2}) + 2.5, {3.5, 4.5});
  EXPECT_EQ((ones({2}, kInt32) + 2).dtype(), kInt32);
  EXPECT_EQ((ones({2}, kBool) + 2).dtype(), kInt64);
  EXPECT_EQ((ones({2}, kBool) + true).dtype(), kBool);
  EXPECT_EQ((ones({2}, kFloat16) * 2.5).dtype(), kFloat16);
  EXPECT_EQ((ones({2}, kBFloat16) * 3).dtype(), kBFloat16);
  // uint8 arithmetic wraps like PyTorch: 1 - 5 = 252, 1 + 300 = 45.
  expect_values(tensor({1}).to(kUInt8) - 5, {252});
  expect_values(tensor({1}).to(kUInt8) + 300, {45});
}

TEST(Promotion, RealOnlyOpsPromoteIntegersToFloat32) {
  Tensor i = tensor({1, 4}), b = tensor({true, false});
  for (const Tensor& r : {exp(i), log(i), log1p(i), sqrt(i), rsqrt(i), reciprocal(i), sin(i),
                          cos(i), tanh(i), sigmoid(i), gelu(i), silu(i), erf(i), exp(b), i / i,
                          div(i, 2), rdiv(i, 2)}) {
    EXPECT_EQ(r.dtype(), kFloat32);
  }
  expect_values(tensor({1, 3}) / tensor({2, 4}), {0.5, 0.75});
  expect_values(sqrt(i), {1, 2});
  expect_values(exp(b), {std::exp(1.0), 1}, 1e-6);
  expect_values(div(tensor({1}), tensor({0})), {kInf});
  EXPECT_EQ((tensor({1}).to(kInt32) / scalar_tensor(2.0, kFloat64)).dtype(), kFloat64);
}

TEST(Promotion, ComparisonsAndLogicReturnBool) {
  Tensor i = tensor({1, 2, 3}).to(kInt32);
  Tensor f = tensor({1.5f, 2.f, 2.5f});
  for (const Tensor& r : {eq(i, f), ne(i, f), lt(i, f), le(i, f), gt(i, f), ge(i, f),
                          eq(i, 2), lt(i, 2.5), logical_and(i, f), logical_or(i, f),
                          logical_xor(i, f), logical_not(f)}) {
    EXPECT_EQ(r.dtype(), kBool);
  }
  // int tensor vs float scalar compares in float32: 2 < 2.5.
  expect_values(lt(i, 2.5), {1, 1, 0});
  expect_values(eq(i, f), {0, 1, 0});
}

// ---- binary arithmetic values per dtype --------------------------------------------------------

TEST(Binary, AddSubMulDivEveryDtypeMatchNaiveLoops) {
  const int64_t n = 37;  // not a multiple of any vector width
  for (Dtype dt : kAllDtypes) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    auto fa = [&](int64_t i) { return dt == kBool ? double(i % 2) : double(i % 11 + 1); };
    auto fb = [&](int64_t i) { return dt == kBool ? double(i % 3 == 0) : double(i % 7 + 1); };
    Tensor a = make({n}, fa, dt), b = make({n}, fb, dt);
    std::vector<double> add_w(n), mul_w(n), sub_w(n), div_w(n), max_w(n), min_w(n);
    for (int64_t i = 0; i < n; ++i) {
      const double x = cast_to(fa(i), dt), y = cast_to(fb(i), dt);
      add_w[i] = cast_to(x + y, dt);
      mul_w[i] = cast_to(x * y, dt);
      sub_w[i] = cast_to(x - y, dt);
      max_w[i] = std::max(x, y);
      min_w[i] = std::min(x, y);
      const Dtype ddt = is_floating(dt) ? dt : kFloat32;
      div_w[i] = cast_to(x / y, ddt);
    }
    const double tol = tol_for(dt);
    expect_values(a + b, add_w, tol);
    expect_values(add(a, b), add_w, tol);
    expect_values(a * b, mul_w, tol);
    expect_values(maximum(a, b), max_w);
    expect_values(minimum(a, b), min_w);
    if (dt != kBool) {
      expect_values(a - b, sub_w, tol);
      expect_values(a / b, div_w, tol_for(is_floating(dt) ? dt : kFloat32));
    }
  }
}

TEST(Binary, AlphaScalesTheSecondOperand) {
  Tensor a = tensor({1.f, 2.f}), b = tensor({10.f, 20.f});
  expect_values(add(a, b, 2), {21, 42});
  expect_values(sub(a, b, 0.5), {-4, -8});
  expect_values(a.add(b, -1), {-9, -18});
  expect_values(add(tensor({3}).to(kInt32), tensor({5}).to(kInt32), 3), {18});
  expect_values(sub(tensor({3}).to(kInt32), tensor({5}).to(kInt32), 3), {-12});
  expect_values(sub(tensor({3}).to(kUInt8), tensor({5}).to(kUInt8)), {254});
  expect_values(add(tensor({1000.f}).to(kFloat16), tensor({1.f}).to(kFloat16), 0.5), {1000.5});
  expect_error<TypeError>([&] { add(tensor({1}), tensor({2}), 2.5); },
                          {"[add]", "alpha", "2.5", "int64"});
  expect_error<TypeError>([&] { add(tensor({1}), tensor({2}), true); }, {"[add]", "alpha"});
}

TEST(Binary, BoolArithmeticIsLogicalOrRejected) {
  Tensor t = tensor({true, true, false, false}), u = tensor({true, false, true, false});
  expect_values(t + u, {1, 1, 1, 0});
  expect_values(t * u, {1, 0, 0, 0});
  expect_error<TypeError>([&] { t - u; }, {"[sub]", "bool", "logical_xor"});
  expect_error<TypeError>([&] { -t; }, {"[neg]", "bool"});
  expect_error<TypeError>([&] { abs(t); }, {"[abs]", "bool"});
  expect_error<TypeError>([&] { relu(t); }, {"[relu]", "bool"});
  expect_error<TypeError>([&] { pow(t, u); }, {"[pow]", "bool"});
}

TEST(Binary, PowFloatIntAndScalarForms) {
  expect_values(pow(tensor({2.f, -2.f, 0.5f}), tensor({3.f, 0.5f, -1.f})), {8, kNaN, 2});
  // Integer powers by squaring; negative exponents as PyTorch: 1, +-1, else 0.
  expect_values(pow(tensor({5, -3, 7}).to(kInt32), 3), {125, -27, 343});
  expect_values(pow(tensor({-1, 1, 2, 0, -1}), tensor({-1, -2, -1, -1, -2})), {-1, 1, 0, 0, 1});
  EXPECT_EQ(pow(tensor({2}).to(kInt32), 3).dtype(), kInt32);
  expect_error<ValueError>([&] { pow(tensor({2}), -1); }, {"[pow]", "negative", "-1"});
  // Scalar exponents: 2 (square), 0.5 (sqrt), -1 (reciprocal) and general.
  Tensor x = tensor({1.f, 4.f, 9.f});
  expect_values(pow(x, 2), {1, 16, 81});
  expect_values(pow(x, 0.5), {1, 2, 3});
  expect_values(pow(x, -1.0), {1, 0.25, 1.0 / 9}, 1e-7);
  expect_values(pow(x, 1.5), {1, 8, 27}, 1e-6);
  expect_values(x.pow(3), {1, 64, 729});
  EXPECT_EQ(pow(tensor({true, false}), 2).dtype(), kInt64);
  EXPECT_EQ(pow(tensor({2, 3}), 0.5).dtype(), kFloat32);
  // Scalar base.
  expect_values(pow(2, tensor({0, 1, 3}).to(kInt32)), {1, 2, 8});
  EXPECT_EQ(pow(2, tensor({1}).to(kInt32)).dtype(), kInt32);
  expect_values(pow(2.5, tensor({1, 2}).to(kInt32)), {2.5, 6.25});
  Tensor y = tensor({2.f, 3.f});
  pow_(y, 2);
  expect_values(y, {4, 9});
}

TEST(Binary, MaximumMinimumPropagateNaN) {
  Tensor a = tensor({1.0, kNaN, 3.0, -0.5}), b = tensor({kNaN, 2.0, 1.0, -1.0});
  expect_values(maximum(a, b), {kNaN, kNaN, 3, -0.5});
  expect_values(minimum(a, b), {kNaN, kNaN, 1, -1});
  expect_values(maximum(tensor({3, -7}), tensor({-2, 5})), {3, 5});
}

TEST(Binary, ReluBackwardPassesGradientWhereOutputIsPositive) {
  Tensor g = tensor({1.5, -2.0, 3.0, 4.0, 5.0}), y = tensor({0.5, 2.0, 0.0, -0.0, kNaN});
  expect_values(relu_backward(g, y), {1.5, -2.0, 0, 0, 0});  // relu'(0) = 0, as torch
  Tensor gf = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}).view({2, 3}).t();  // non-contiguous
  Tensor yf = tensor({1.f, -1.f, 2.f});                                  // broadcast over rows
  expect_values(relu_backward(gf.contiguous(), yf.view({3, 1})), {1, 4, 0, 0, 3, 6});
  expect_values(relu_backward(gf, yf.view({3, 1})), {1, 4, 0, 0, 3, 6});
  expect_error([] { relu_backward(tensor({1, 2}), tensor({1, 2})); }, {"relu_backward", "int64"});
}

TEST(Binary, ScalarOperandsOnEitherSide) {
  Tensor a = tensor({1.f, 2.f, 4.f});
  expect_values(a + 1, {2, 3, 5});
  expect_values(1 + a, {2, 3, 5});
  expect_values(a - 1, {0, 1, 3});
  expect_values(1 - a, {0, -1, -3});
  expect_values(rsub(a, 10), {9, 8, 6});
  expect_values(a * 0.5, {0.5, 1, 2});
  expect_values(0.5 * a, {0.5, 1, 2});
  expect_values(a / 2, {0.5, 1, 2});
  expect_values(2 / a, {2, 1, 0.5});
  expect_values(rdiv(a, 8), {8, 4, 2});
  expect_values(-a, {-1, -2, -4});
  // A 0-dim or one-element tensor operand on either side takes the hoisted-scalar loop.
  Tensor s0 = scalar_tensor(3.0, kFloat32), s1 = tensor({3.f});
  expect_values(a - s0, {-2, -1, 1});
  expect_values(s0 - a, {2, 1, -1});
  expect_values(a / s1, {1.0 / 3, 2.0 / 3, 4.0 / 3}, 1e-7);
  expect_values(s1 / a, {3, 1.5, 0.75});
  expect_values(lt(s1, a), {0, 0, 1});
}

TEST(Binary, HalfScalarStaysInFloat) {
  // The scalar is kept in float (the compute type), not rounded to half first: 1000 * 1.0004 =
  // 1000.4 rounds to 1000.5 in half, while rounding 1.0004 to half (1.0) first would give 1000.
  // This is PyTorch's CUDA (opmath) behaviour; the CPU and CUDA kernels here agree on it.
  expect_values(tensor({1000.f}).to(kFloat16) * 1.0004, {1000.5});
  // 2048 + 1 = 2049 is not a half: ties to even gives 2048.
  expect_values(tensor({2048.f}).to(kFloat16) + 1, {2048});
  expect_values(tensor({2048.f}).to(kFloat16) + tensor({1.f}).to(kFloat16), {2048});
  expect_values(tensor({1.f, 2.f}).to(kBFloat16) * 3 + 1, {4, 7});
}

// ---- broadcasting, 0-sized and strided inputs --------------------------------------------------

TEST(Broadcast, ThreeOneFiveWithFourOne) {
  Tensor a = make({3, 1, 5}, [](int64_t i) { return double(i); });
  Tensor b = make({4, 1}, [](int64_t i) { return 100.0 * i; });
  for (Dtype dt : {kFloat32, kFloat64, kInt32, kInt64, kFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor c = a.to(dt) + b.to(dt);
    ASSERT_EQ(c.shape(), Shape({3, 4, 5}));
    std::vector<double> want;
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t k = 0; k < 5; ++k) want.push_back(cast_to(i * 5 + k + 100.0 * j, dt));
    expect_values(c, want, tol_for(dt));
    // And the other way round, through a comparison (bool output, strided broadcast loop).
    Tensor g = gt(b.to(dt), a.to(dt));
    ASSERT_EQ(g.shape(), Shape({3, 4, 5}));
    std::vector<double> gw;
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t k = 0; k < 5; ++k) gw.push_back(100.0 * j > i * 5 + k);
    expect_values(g, gw);
  }
}

TEST(Broadcast, RowAndColumnVectorsAndMismatchError) {
  Tensor m = make({2, 3}, [](int64_t i) { return double(i); }, kFloat32);
  expect_values(m * tensor({1.f, 10.f, 100.f}), {0, 10, 200, 3, 40, 500});
  expect_values(m + make({2, 1}, [](int64_t i) { return 10.0 * i; }, kFloat32),
                {0, 1, 2, 13, 14, 15});
  expect_values(m + scalar_tensor(1.f, kFloat32), {1, 2, 3, 4, 5, 6});
  expect_error<ValueError>([&] { m + ones({4}); }, {"[add]", "[2, 3]", "[4]"});
  expect_error<ValueError>([&] { eq(m, ones({2, 2})); }, {"[eq]"});
}

TEST(Broadcast, ZeroSizedTensors) {
  Tensor e = empty({0, 3});
  EXPECT_EQ((e + ones({3})).shape(), Shape({0, 3}));
  EXPECT_EQ((e * 2).shape(), Shape({0, 3}));
  EXPECT_EQ(exp(e).shape(), Shape({0, 3}));
  EXPECT_EQ(where(empty({0, 1}, kBool), e, 1.0).shape(), Shape({0, 3}));
  EXPECT_EQ(clamp(e, 0, 1).shape(), Shape({0, 3}));
  EXPECT_EQ(lt(e, ones({1, 3})).dtype(), kBool);
  Tensor f = empty({0});
  f.add_(1);
  f += empty({0});
  EXPECT_TRUE(equal(e, empty({0, 3})));
  EXPECT_TRUE(allclose(e, empty({0, 3})));
}

TEST(Strided, TransposedSlicedAndExpandedInputs) {
  Tensor m = make({4, 6}, [](int64_t i) { return double(i); }, kFloat32);
  Tensor t = m.t();                   // [6, 4], non-contiguous
  Tensor s = m.slice(1, 0, 6, 2);     // [4, 3], step 2
  Tensor ex = tensor({1.f, 2.f, 3.f, 4.f}).unsqueeze(0).expand({6, 4});  // stride 0 rows
  Tensor r = t + ex;
  std::vector<double> want;
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 4; ++j) want.push_back((j * 6 + i) + (j + 1));
  expect_values(r, want);
  expect_values(exp(s) * 0 + s, {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22});
  expect_values(neg(s.t()), {0, -6, -12, -18, -2, -8, -14, -20, -4, -10, -16, -22});
  // Mixed: transposed out of place, strided scalar op, strided compare.
  expect_values(t.slice(0, 0, 1) * 2, {0, 12, 24, 36});
  expect_values(ge(s, 10.0), {0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1});
  // In place on a transposed view writes through to the base.
  Tensor base = zeros({2, 3});
  Tensor bt = base.t();
  bt.add_(make({3, 2}, [](int64_t i) { return double(i); }, kFloat32));
  expect_values(base, {0, 2, 4, 1, 3, 5});
}

// ---- in place and out= ------------------------------------------------------------------------

TEST(InPlace, WritesSelfBumpsVersionAndBroadcastsOther) {
  Tensor a = tensor({1.f, 2.f, 3.f});
  Tensor alias = a;  // same tensor: sees the change
  const uint32_t v0 = a.version();
  a.add_(tensor({1.f, 1.f, 1.f}));
  EXPECT_GT(a.version(), v0);
  expect_values(alias, {2, 3, 4});
  a += 1;
  a -= tensor({1.f});
  a *= 2;
  a /= scalar_tensor(4.f, kFloat32);
  expect_values(a, {1, 1.5, 2});
  a.mul_(tensor({2.f, 2.f, 2.f})).div_(2);
  a.sub_(tensor({0.5f, 0.5f, 0.5f}), 2);
  expect_values(a, {0, 0.5, 1});
  mul_(a, 2);
  div_(a, tensor({1.f, 2.f, 3.f}));
  sub_(a, 1);
  add_(a, tensor({1.f, 1.f, 1.f}), 10);
  expect_values(a, {9, 9.5, 29.0 / 3}, 1e-7);
  Tensor m = zeros({2, 3});
  m += tensor({1.f, 2.f, 3.f});
  expect_values(m, {1, 2, 3, 1, 2, 3});
  const uint32_t v1 = m.version();
  exp_(m);
  log_(m);
  EXPECT_GE(m.version(), v1 + 2);
  expect_values(m, {1, 2, 3, 1, 2, 3}, 1e-6);
  Tensor u = tensor({-4.f, 4.f});
  neg_(u);
  abs_(u);
  sqrt_(u);
  rsqrt_(u);
  expect_values(u, {std::sqrt(0.5), std::sqrt(0.5)}, 1e-6);
  Tensor w = tensor({-1.f, 0.f, 1.f});
  relu_(w);
  expect_values(w, {0, 0, 1});
  tanh_(w);
  sigmoid_(w);
  expect_values(w, {0.5, 0.5, 1 / (1 + std::exp(-std::tanh(1.0)))}, 1e-6);
}

TEST(InPlace, MixedDtypesCastIntoSelf) {
  Tensor h = tensor({1.f, 2.f}).to(kFloat16);
  h += tensor({0.5, 0.25});  // float64 result cast into float16: allowed
  EXPECT_EQ(h.dtype(), kFloat16);
  expect_values(h, {1.5, 2.25});
  Tensor i = tensor({1, 2}).to(kInt32);
  i += tensor({10, 20});  // int64 into int32
  EXPECT_EQ(i.dtype(), kInt32);
  expect_values(i, {11, 22});
  Tensor f = tensor({1.f});
  f *= tensor({3}).to(kInt32);
  expect_values(f, {3});
}

TEST(InPlace, ErrorsForUncastableResultsAndGrowingSelf) {
  Tensor i = zeros({2}, kInt64);
  expect_error<TypeError>([&] { i += tensor({1.5f, 2.f}); },
                          {"[add_]", "result type float32", "can't be cast", "int64"});
  expect_error<TypeError>([&] { i += 2.5; }, {"[add_]", "float32", "int64"});
  expect_error<TypeError>([&] { i.div_(tensor({2, 2})); }, {"[div_]", "float32", "int64"});
  expect_error<TypeError>([&] { exp_(i); }, {"[exp_]", "float32", "int64"});
  Tensor b = tensor({true, false});
  expect_error<TypeError>([&] { b += tensor({1, 2}); }, {"[add_]", "int64", "bool"});
  Tensor f = zeros({2});
  expect_error<ValueError>([&] { f += zeros({3, 2}); },
                           {"[add_]", "output with shape [2]", "broadcast shape [3, 2]"});
  Tensor ex = zeros({1}).expand({3});
  expect_error<ValueError>([&] { ex.add_(ones({3})); }, {"[add_]", "share one memory location"});
  Tensor c = zeros({2}, kInt32);
  expect_error<TypeError>([&] { clamp_(c, 0.5, std::nullopt); }, {"[clamp_]", "float32", "int32"});
  // Nothing was written by the failed calls.
  expect_values(i, {0, 0});
}

TEST(Out, WritesIntoExistingTensorAndResizesEmpty) {
  Tensor a = tensor({1.f, 2.f}), b = tensor({3.f, 4.f});
  Tensor out = empty({2});
  void* p = out.data_ptr();
  const uint32_t v0 = out.version();
  add_out(out, a, b);
  EXPECT_EQ(out.data_ptr(), p);
  EXPECT_GT(out.version(), v0);
  expect_values(out, {4, 6});
  sub_out(out, a, b, 2);
  expect_values(out, {-5, -6});
  mul_out(out, a, b);
  expect_values(out, {3, 8});
  div_out(out, a, b);
  expect_values(out, {1.0 / 3, 0.5}, 1e-7);
  // Broadcast result into a matching out; a strided out.
  Tensor o2 = zeros({3, 2}).t();  // [2, 3] non-contiguous
  add_out(o2, make({2, 1}, [](int64_t i) { return double(i); }, kFloat32), tensor({1.f, 2.f, 3.f}));
  expect_values(o2, {1, 2, 3, 2, 3, 4});
  // Empty out is resized in place (every handle sees it); undefined out is allocated.
  Tensor e = empty({0});
  Tensor e_alias = e;
  add_out(e, make({2, 2}, [](int64_t i) { return double(i); }, kFloat32), ones({2}));
  EXPECT_EQ(e_alias.shape(), Shape({2, 2}));
  expect_values(e_alias, {1, 2, 3, 4});
  Tensor u;
  mul_out(u, a, b);
  expect_values(u, {3, 8});
  // A wider out dtype takes the cast result.
  Tensor d = empty({2}, kFloat64);
  add_out(d, a, b);
  expect_values(d, {4, 6});
  expect_error<ValueError>([&] { Tensor w = empty({3}); add_out(w, a, b); },
                           {"[add_out]", "[3]", "[2]"});
  expect_error<TypeError>([&] { Tensor w = empty({2}, kInt32); add_out(w, a, b); },
                          {"[add_out]", "float32", "int32"});
}

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
  }
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

// ---- CUDA ------------------------------------------------------------------------------------

namespace {
void expect_cuda_matches_cpu(const std::function<Tensor(const Tensor&, const Tensor&)>& op,
                             const Tensor& a, const Tensor& b, double tol) {
  Tensor want = op(a, b);
  Tensor got = op(a.cuda(), b.cuda());
  ASSERT_TRUE(got.is_cuda());
  ASSERT_EQ(got.dtype(), want.dtype());
  ASSERT_EQ(got.shape(), want.shape());
  expect_values(got.cpu(), want.to_vector<double>(), tol);
}
}  // namespace

TEST(Cuda, BinaryOpsMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  Tensor a = make({3, 1, 5}, [](int64_t i) { return 0.25 * i - 1; });
  Tensor b = make({4, 1}, [](int64_t i) { return 0.5 * i + 0.75; });
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = a.to(dt), y = b.to(dt);
    const double tol = tol_for(dt);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p + q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return sub(p, q, 2); }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p * q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p / q; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return pow(abs(p), q); }, x, y, 4 * tol);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return maximum(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return minimum(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return lt(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return logical_xor(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto&) { return p * 1.0004 - 2; }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto&) { return 2 / (abs(p) + 1); }, x, y, tol);
    expect_cuda_matches_cpu([](auto& p, auto&) { return ge(p, 0.5); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return where(gt(p, 0), p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return relu_backward(q, p); }, x, y, 0);
  }
  for (Dtype dt : {kInt32, kInt64, kUInt8, kBool}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = make({2, 5}, [](int64_t i) { return double(i % 3); }, dt);
    Tensor y = make({5}, [](int64_t i) { return double(i % 2); }, dt);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p + q; }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return p * q; }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return eq(p, q); }, x, y, 0);
    expect_cuda_matches_cpu([](auto& p, auto& q) { return maximum(p, q); }, x, y, 0);
    if (dt != kBool) {
      expect_cuda_matches_cpu([](auto& p, auto& q) { return add(p, q, 3); }, x, y, 0);
      expect_cuda_matches_cpu([](auto& p, auto& q) { return pow(p, q); }, x, y, 0);
      expect_cuda_matches_cpu([](auto& p, auto& q) { return p / q; }, x, y, 0);
    }
  }
}

// The strided CUDA loop (Note [CUDA element-wise loops]) splits linear indices with FastDiv;
// its host form is the same arithmetic as the device's multiply-high.
TEST(FastDiv, MatchesIntegerDivision) {
  std::vector<uint32_t> divisors = {1, 2, 3, 5, 7, 31, 33, 256, 384, 1000, 1536, 65535, 65536,
                                    65537, 1000003, (1u << 30) - 1, 1u << 30, (1u << 30) + 1,
                                    (1u << 31) - 1};
  uint64_t s = 12345;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(s >> 33);  // [0, 2^31)
  };
  for (int i = 0; i < 200; ++i) divisors.push_back(std::max<uint32_t>(1, next() >> (i % 31)));
  for (uint32_t d : divisors) {
    const ember::detail::FastDiv f = ember::detail::FastDiv::make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, (1u << 31) - 1,
                                (1u << 31) - 2, (1u << 31) - d, ((1u << 31) - 1) / d * d,
                                ((1u << 31) - 1) / d * d - 1};
    for (int i = 0; i < 2000; ++i) ns.push_back(next() >> (i % 31));
    for (uint32_t n : ns) {
      if (n > (1u << 31) - 1) continue;
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
    }
  }
}

// Broadcast, transposed and in-place operands take the strided kernel: the GPT's shapes (bias
// add over rows, a per-row scalar, a mask broadcast over heads), sizes that are no multiple of
// a block's elements, 4-d broadcasts, four operands (where), and an in-place op on a view.
TEST(Cuda, StridedLoopsMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  using Op = std::function<Tensor(const Tensor&, const Tensor&)>;
  struct Case {
    std::vector<int64_t> a, b;
    Op op;
  };
  const Op plus = [](const Tensor& p, const Tensor& q) { return p + q; };
  const std::vector<Case> cases = {
      {{1000, 1536}, {1536}, plus},
      {{3, 1027}, {1027}, plus},
      {{777, 33}, {777, 1}, [](const Tensor& p, const Tensor& q) { return p - q; }},
      {{6, 64, 64}, {64, 64}, plus},
      {{5, 1, 7, 3}, {1, 6, 1, 3}, [](const Tensor& p, const Tensor& q) { return p * q; }},
      {{50, 37}, {50}, [](const Tensor& p, const Tensor& q) { return p.t() + q; }},
      {{40, 30}, {30, 40}, [](const Tensor& p, const Tensor& q) { return p.t() * q; }},
      {{4, 33, 33}, {33, 33},
       [](const Tensor& p, const Tensor& q) { return masked_fill(p, gt(q, 0), -1e4); }},
      {{4, 33, 33}, {33, 1},
       [](const Tensor& p, const Tensor& q) { return where(gt(q, 0), p, q); }},
      {{64, 48}, {32},
       [](const Tensor& p, const Tensor& q) {
         Tensor r = p.clone();
         r.narrow(1, 8, 32).add_(q);  // in place on a strided view
         return r;
       }},
  };
  for (Dtype dt : {kFloat32, kBFloat16, kFloat64}) {
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dt << " case " << i);
      const Case& c = cases[i];
      const Tensor a = make(c.a, [](int64_t k) { return 0.37 * (k % 101) - 7; }, dt);
      const Tensor b = make(c.b, [](int64_t k) { return 0.5 * (k % 13) - 3; }, dt);
      expect_cuda_matches_cpu(c.op, a, b, tol_for(dt));
    }
  }
}

TEST(Cuda, UnaryClampAndInPlaceMatchCpu) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  Tensor base = make({4, 6}, [](int64_t i) { return 0.37 * i - 4; });
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << dt);
    Tensor x = base.to(dt).t();  // strided
    const double tol = 2 * tol_for(dt);
    for (auto op : {+[](const Tensor& t) { return exp(t); }, +[](const Tensor& t) { return log(abs(t)); },
                    +[](const Tensor& t) { return log1p(abs(t)); }, +[](const Tensor& t) { return sqrt(abs(t)); },
                    +[](const Tensor& t) { return rsqrt(abs(t)); }, +[](const Tensor& t) { return reciprocal(t); },
                    +[](const Tensor& t) { return square(t); }, +[](const Tensor& t) { return sin(t); },
                    +[](const Tensor& t) { return cos(t); }, +[](const Tensor& t) { return tanh(t); },
                    +[](const Tensor& t) { return sigmoid(t); }, +[](const Tensor& t) { return relu(t); },
                    +[](const Tensor& t) { return gelu(t); }, +[](const Tensor& t) { return gelu(t, "tanh"); },
                    +[](const Tensor& t) { return silu(t); }, +[](const Tensor& t) { return erf(t); },
                    +[](const Tensor& t) { return neg(t); },
                    +[](const Tensor& t) { return sign(t); }, +[](const Tensor& t) { return logical_not(t); },
                    +[](const Tensor& t) { return clamp(t, -1, 2); },
                    +[](const Tensor& t) { return masked_fill(t, gt(t, 0), 9); }}) {
      expect_cuda_matches_cpu([op](auto& p, auto&) { return op(p); }, x, x, tol);
    }
  }
  Tensor c = base.cuda();
  c += 1;
  c.mul_(base.cuda());
  clamp_(c, -3, 3);
  Tensor h = base.clone();
  h += 1;
  h.mul_(base);
  clamp_(h, -3, 3);
  expect_values(c.cpu(), h.to_vector<double>(), 1e-12);
  // A 0-dim CPU tensor may join a CUDA op; other device mixes are errors naming both.
  expect_values((c + scalar_tensor(1.0, kFloat64)).cpu(), (h + 1).to_vector<double>(), 1e-12);
  expect_error<ValueError>([&] { c + base; }, {"[add]", "cuda:0", "cpu"});
}
