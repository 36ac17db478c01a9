// Element-wise ops, binary arithmetic: values per dtype against naive loops and closed forms,
// PyTorch's type promotion (including its 0-dim rule), broadcasting, 0-sized and strided inputs,
// and in-place and _out semantics and errors. Unary ops, comparisons and selection are in
// elementwise_unary_test.cpp, CUDA-vs-CPU agreement in elementwise_cuda_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <ember/tensor/ops.h>
#include "elementwise_test_util.h"
#include "test_util.h"

using namespace ember;
using namespace ember::test;

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
