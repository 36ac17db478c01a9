// scaled_dot_product_attention: the fused kernels (CPU here, CUDA when a device is present)
// against PyTorch 1.13's written-out attention (tests/nn/attention_reference.h, made by
// tests/nn/make_attention_reference.py) and against the math path over many shapes, masks and
// flags, in float32 and float64; gradcheck (masks and dropout included); NaN rows; errors.
#include <ember/nn/attention.h>

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/detail/attention_kernels.h>
#include "tests/autograd/grad_util.h"
#include "tests/nn/attention_reference.h"

namespace ember::nn {
namespace {

namespace F = functional;
namespace R = test::attn_ref;
using test::expect_close;
using test::expect_error;
using test::rand_t;

struct Grads {
  Tensor y, dq, dk, dv;
};

using Attn = std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>;

// y = attn(q, k, v) and the gradients of sum(y * w) for lcg-filled q, k, v, w.
Grads run(const Attn& attn, IntList qs, IntList ks, IntList vs, uint64_t seed, Dtype dt,
          Device dev = Device("cpu")) {
  Tensor q = rand_t(qs, dt, seed).to(dev).requires_grad_();
  Tensor k = rand_t(ks, dt, seed + 1).to(dev).requires_grad_();
  Tensor v = rand_t(vs, dt, seed + 2).to(dev).requires_grad_();
  Tensor y = attn(q, k, v);
  y.backward(rand_t(y.shape(), dt, seed + 3).to(dev));
  return {y, q.grad(), k.grad(), v.grad()};
}

void expect_tensors_close(const Tensor& got, const Tensor& want, double tol,
                          const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  expect_close(got.to(Device("cpu")), want.to(Device("cpu")).to_vector<double>(), tol, what);
}

void expect_grads_close(const Grads& got, const Grads& want, double tol, const std::string& what) {
  expect_tensors_close(got.y, want.y, tol, what + " output");
  expect_tensors_close(got.dq, want.dq, tol, what + " dq");
  expect_tensors_close(got.dk, want.dk, tol, what + " dk");
  expect_tensors_close(got.dv, want.dv, tol, what + " dv");
}

class AttentionRef : public ::testing::TestWithParam<Dtype> {
 protected:
  Dtype dt() const { return GetParam(); }
  double tol() const { return dt() == kFloat64 ? 1e-10 : 2e-5; }
  void check(const Attn& attn, IntList qs, IntList ks, IntList vs, uint64_t seed,
             const std::vector<double>& y, const std::vector<double>& dq,
             const std::vector<double>& dk, const std::vector<double>& dv, const char* what) {
    const Grads g = run(attn, qs, ks, vs, seed, dt());
    EXPECT_EQ(g.y.dtype(), dt());
    expect_close(g.y, y, tol(), std::string(what) + " output");
    expect_close(g.dq, dq, tol(), std::string(what) + " dq");
    expect_close(g.dk, dk, tol(), std::string(what) + " dk");
    expect_close(g.dv, dv, tol(), std::string(what) + " dv");
  }
};

TEST_P(AttentionRef, MatchesTorchWrittenOut) {
  auto fused = [](const Tensor& mask, bool causal, std::optional<double> scale) -> Attn {
    return [=](const Tensor& q, const Tensor& k, const Tensor& v) {
      return F::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale);
    };
  };
  check(fused({}, false, {}), {2, 3, 5, 4}, {2, 3, 7, 4}, {2, 3, 7, 6}, 100, R::kPlainY,
        R::kPlainDq, R::kPlainDk, R::kPlainDv, "plain");
  const Tensor bmask = ne(from_vector(R::kBoolMask).reshape({5, 7}), 0.0);
  check(fused(bmask, false, {}), {2, 3, 5, 4}, {2, 3, 7, 4}, {2, 3, 7, 6}, 110, R::kBoolY,
        R::kBoolDq, R::kBoolDk, R::kBoolDv, "bool mask");
  const Tensor fmask = from_vector(R::kFloatMask).reshape({2, 1, 1, 7}).to(dt());
  check(fused(fmask, false, {}), {2, 3, 5, 4}, {2, 3, 7, 4}, {2, 3, 7, 6}, 120, R::kFloatY,
        R::kFloatDq, R::kFloatDk, R::kFloatDv, "float mask");
  check(fused({}, true, 0.3), {3, 6, 8}, {3, 9, 8}, {3, 9, 5}, 130, R::kCausalY, R::kCausalDq,
        R::kCausalDk, R::kCausalDv, "causal");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionRef, ::testing::Values(kFloat32, kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- fused kernel vs math path ------------------------------------------------------------------

struct Case {
  const char* name;
  Shape q, k, v;
  Shape mask;  // empty: none
  bool bool_mask = false;
  bool causal = false;
  std::optional<double> scale = std::nullopt;
};

// Sizes straddle the CPU tiles (64 query rows by 64 keys; on CUDA 16 rows, 32 keys) and include L
// != S, E != Ev, 1 and several heads, and masks broadcast over every leading pattern.
std::vector<Case> cases() {
  return {
      {"tiny", {1, 1, 1, 3}, {1, 1, 1, 3}, {1, 1, 1, 2}, {}},
      {"tiles", {2, 2, 130, 16}, {2, 2, 200, 16}, {2, 2, 200, 24}, {}},
      {"heads8", {1, 8, 65, 8}, {1, 8, 129, 8}, {1, 8, 129, 8}, {}},
      {"3d", {3, 70, 5}, {3, 40, 5}, {3, 40, 9}, {}},
      {"5d", {2, 2, 2, 9, 4}, {2, 2, 2, 11, 4}, {2, 2, 2, 11, 3}, {2, 1, 2, 9, 1}},
      {"bool_ls", {2, 3, 67, 8}, {2, 3, 131, 8}, {2, 3, 131, 8}, {67, 131}, true},
      {"bool_b11s", {2, 3, 67, 8}, {2, 3, 131, 8}, {2, 3, 131, 8}, {2, 1, 1, 131}, true},
      {"float_full", {2, 3, 20, 8}, {2, 3, 30, 8}, {2, 3, 30, 4}, {2, 3, 20, 30}},
      {"float_h1s", {2, 3, 20, 8}, {2, 3, 30, 8}, {2, 3, 30, 4}, {3, 1, 30}},
      {"causal", {2, 2, 150, 16}, {2, 2, 150, 16}, {2, 2, 150, 16}, {}, false, true},
      {"causal_LltS", {2, 2, 70, 8}, {2, 2, 300, 8}, {2, 2, 300, 8}, {}, false, true},
      {"causal_LgtS", {2, 2, 140, 8}, {2, 2, 50, 8}, {2, 2, 50, 8}, {}, false, true},
      {"scale", {2, 2, 33, 8}, {2, 2, 33, 8}, {2, 2, 33, 8}, {}, false, true, 0.9},
  };
}

Tensor make_mask(const Case& c, Dtype dt) {
  if (c.mask.size() == 0) return {};
  Tensor m = rand_t(c.mask, kFloat64, 77);
  if (!c.bool_mask) return (m * 4).to(dt);
  // Keep key 0 so that no row is fully masked (those rows are NaN, tested separately).
  Tensor keep = gt(m, -0.4);
  return logical_or(keep, eq(arange(0, c.mask[c.mask.size() - 1], 1, kInt64), 0));
}

Attn with(const Case& c, Dtype dt, bool fused) {
  const Tensor mask = make_mask(c, dt);
  return [=](const Tensor& q, const Tensor& k, const Tensor& v) {
    return fused ? F::scaled_dot_product_attention(q, k, v, mask, 0.0, c.causal, c.scale)
                 : F::scaled_dot_product_attention_math(q, k, v, mask, 0.0, c.causal, c.scale);
  };
}

class AttentionFused : public ::testing::TestWithParam<Dtype> {};

TEST_P(AttentionFused, MatchesMathPath) {
  const Dtype dt = GetParam();
  const double tol = dt == kFloat64 ? 1e-11 : 5e-5;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Grads want = run(with(c, dt, false), c.q, c.k, c.v, 5, dt);
    const Grads got = run(with(c, dt, true), c.q, c.k, c.v, 5, dt);
    expect_grads_close(got, want, tol, c.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionFused, ::testing::Values(kFloat32, kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The heads a transformer splits off a fused qkv projection reach the CPU kernel as strided
// views (Note [Attention operand layouts]): output and gradients equal the math path's and the
// contiguous inputs', the output comes back [B, T, H, D] in memory (so the transpose and reshape
// after attention copy nothing), and so does the gradient of each head's view. A key broadcast
// over heads (stride 0) and a value whose rows overlap (row stride < head dim, copied) are read
// too, as are 3-d operands with a strided batch dim.
TEST(Attention, StridedHeadsFromFusedQkvMatchContiguous) {
  const int64_t B = 2, T = 70, H = 3, D = 8, C = H * D;
  for (const bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto fused = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      return F::scaled_dot_product_attention(q, k, v, {}, 0.0, causal);
    };
    Tensor qkv = rand_t({B, T, 3 * C}, kFloat32, 31).requires_grad_();
    const std::vector<Tensor> parts = split(qkv, C, 2);
    auto heads = [&](const Tensor& t) { return t.reshape({B, T, H, D}).transpose(1, 2); };
    Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    ASSERT_FALSE(q.is_contiguous());
    Tensor y = fused(q, k, v);
    EXPECT_EQ(y.shape(), Shape({B, H, T, D}));
    EXPECT_TRUE(y.transpose(1, 2).is_contiguous()) << "the output is [B, T, H, D] in memory";
    const Tensor w = rand_t({B, H, T, D}, kFloat32, 32);
    (y * w).sum().backward();
    const Tensor dqkv = qkv.grad();

    Tensor qkv2 = qkv.detach().clone().requires_grad_();
    const std::vector<Tensor> parts2 = split(qkv2, C, 2);
    Tensor y2 = F::scaled_dot_product_attention_math(heads(parts2[0]).contiguous(),
                                                      heads(parts2[1]).contiguous(),
                                                      heads(parts2[2]).contiguous(), {}, 0.0,
                                                      causal);
    (y2 * w).sum().backward();
    expect_tensors_close(y, y2, 5e-5, "output");
    expect_tensors_close(dqkv, qkv2.grad(), 5e-5, "qkv grad");
  }
  // A key shared by every head (expanded: stride 0 over heads), a value view with overlapping
  // rows (row stride 1 < 4: copied for the kernel), and 3-d operands sliced along the batch.
  Tensor q = rand_t({2, 3, 9, 4}, kFloat64, 41).requires_grad_();
  Tensor k1 = rand_t({2, 1, 11, 4}, kFloat64, 42).requires_grad_();
  Tensor vbase = rand_t({2, 3, 14}, kFloat64, 43).requires_grad_();
  Tensor k = k1.expand({2, 3, 11, 4});
  Tensor v = vbase.as_strided({2, 3, 11, 4}, {42, 14, 1, 1});
  Tensor y = F::scaled_dot_product_attention(q, k, v);
  const Tensor w = rand_t({2, 3, 9, 4}, kFloat64, 44);
  (y * w).sum().backward();
  Tensor qm = q.detach().clone().requires_grad_(), km = k1.detach().clone().requires_grad_();
  Tensor vm = vbase.detach().clone().requires_grad_();
  Tensor ym = F::scaled_dot_product_attention_math(
      qm, km.expand({2, 3, 11, 4}), vm.as_strided({2, 3, 11, 4}, {42, 14, 1, 1}));
  (ym * w).sum().backward();
  expect_tensors_close(y, ym, 1e-11, "broadcast key, overlapping value: output");
  expect_tensors_close(q.grad(), qm.grad(), 1e-11, "dq");
  expect_tensors_close(k1.grad(), km.grad(), 1e-11, "dk over the broadcast");
  expect_tensors_close(vbase.grad(), vm.grad(), 1e-11, "dv through the overlapping view");
  Tensor big = rand_t({4, 9, 4}, kFloat64, 45);
  Tensor q3 = big.slice(0, 0, 4, 2);  // batch stride 72
  expect_tensors_close(F::scaled_dot_product_attention(q3, q3, q3),
                       F::scaled_dot_product_attention_math(q3, q3, q3), 1e-11, "3-d, strided batch");
}

// Row 1 of the mask keeps no key: its output is NaN (softmax of all -inf, as in PyTorch), and
// the NaN reaches the gradients exactly as through the written-out softmax: a bool mask's
// masked_fill gives that row a zero dq and keeps dk finite, an additive -inf mask does not.
void expect_nan_like_math_path(const Tensor& mask) {
  Attn fused = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
    return F::scaled_dot_product_attention(q, k, v, mask);
  };
  Attn math = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
    return F::scaled_dot_product_attention_math(q, k, v, mask);
  };
  const Grads got = run(fused, {2, 4, 3}, {2, 6, 3}, {2, 6, 5}, 9, kFloat64);
  const Grads want = run(math, {2, 4, 3}, {2, 6, 3}, {2, 6, 5}, 9, kFloat64);
  for (auto [g, w, what] : {std::tuple{got.y, want.y, "output"},
                            {got.dq, want.dq, "dq"},
                            {got.dk, want.dk, "dk"},
                            {got.dv, want.dv, "dv"}}) {
    const std::vector<double> gv = g.to_vector<double>(), wv = w.to_vector<double>();
    ASSERT_EQ(gv.size(), wv.size());
    for (size_t i = 0; i < gv.size(); ++i) {
      ASSERT_EQ(std::isnan(gv[i]), std::isnan(wv[i])) << what << " index " << i;
      if (!std::isnan(wv[i])) {
        ASSERT_NEAR(gv[i], wv[i], 1e-12) << what << " index " << i;
      }
    }
  }
  EXPECT_TRUE(std::isnan(got.y.select(1, 1).sum().item<double>()));
  EXPECT_FALSE(std::isnan(got.y.select(1, 0).sum().item<double>()));
}

TEST(Attention, FullyMaskedRowIsNanLikeMathPath) {
  Tensor mask = ones({4, 6}, kBool);
  mask.select(0, 1).fill_(false);
  {
    SCOPED_TRACE("bool mask");
    expect_nan_like_math_path(mask);
  }
  SCOPED_TRACE("additive mask");
  expect_nan_like_math_path(where(mask, zeros({}, kFloat64), -INFINITY));
}

TEST(Attention, LowPrecisionComputesInFloat32) {
  for (Dtype dt : {kBFloat16, kFloat16}) {
    Attn fused = [](const Tensor& q, const Tensor& k, const Tensor& v) {
      return F::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    };
    const Grads got = run(fused, {2, 2, 40, 8}, {2, 2, 40, 8}, {2, 2, 40, 8}, 3, dt);
    const Grads want = run(fused, {2, 2, 40, 8}, {2, 2, 40, 8}, {2, 2, 40, 8}, 3, kFloat32);
    EXPECT_EQ(got.y.dtype(), dt);
    EXPECT_EQ(got.dq.dtype(), dt);
    expect_grads_close(got, want, 0.1, std::string(dtype_name(dt)));
  }
}

// The high-water mark of CPU memory while `attn` runs forward and backward, above what was
// allocated before.
int64_t peak_growth(const Attn& attn, IntList shape) {
  Tensor q = rand_t(shape, kFloat32, 1).requires_grad_();
  Tensor k = rand_t(shape, kFloat32, 2).requires_grad_();
  Tensor v = rand_t(shape, kFloat32, 3).requires_grad_();
  const AllocatorStats before = cpu_allocator_stats();
  attn(q, k, v).sum().backward();
  const AllocatorStats after = cpu_allocator_stats();
  EXPECT_LE(before.peak_allocated, before.allocated + (1 << 20))
      << "an earlier test left a high-water mark this test cannot see under";
  return after.peak_allocated - before.allocated;
}

TEST(Attention, NeverStoresTheScores) {
  // [2, 1024, 1024] float32 scores are 8 MiB; q, k, v and their gradients 128 KiB each.
  const int64_t scores = 2 * 1024 * 1024 * 4;
  const int64_t fused = peak_growth(
      [](const Tensor& q, const Tensor& k, const Tensor& v) {
        return F::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
      },
      {2, 1024, 16});
  EXPECT_LT(fused, scores / 4);
  // The measurement can see the scores: the math path stores them (and more).
  const int64_t math = peak_growth(
      [](const Tensor& q, const Tensor& k, const Tensor& v) {
        return F::scaled_dot_product_attention_math(q, k, v, {}, 0.0, true);
      },
      {2, 1024, 16});
  EXPECT_GT(math, scores);
}

// ---- gradcheck ----------------------------------------------------------------------------------

void gradcheck_sdpa(const Tensor& mask, double p, bool causal, std::optional<double> scale,
                    IntList qs, IntList ks, IntList vs) {
  Tensor q = test::leaf(qs, 1), k = test::leaf(ks, 2), v = test::leaf(vs, 3);
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& x) {
        Generator gen(1234);  // the same dropout mask on every evaluation
        return F::scaled_dot_product_attention(x[0], x[1], x[2], mask, p, causal, scale, &gen);
      },
      {q, k, v});
}

TEST(Attention, Gradcheck) {
  gradcheck_sdpa({}, 0.0, false, {}, {2, 3, 4}, {2, 5, 4}, {2, 5, 3});
  gradcheck_sdpa({}, 0.0, true, 0.7, {1, 2, 5, 3}, {1, 2, 4, 3}, {1, 2, 4, 2});
  Tensor bmask = gt(rand_t({3, 5}, kFloat64, 8), -0.3);
  bmask.select(1, 0).fill_(true);
  gradcheck_sdpa(bmask, 0.0, false, {}, {2, 3, 4}, {2, 5, 4}, {2, 5, 3});
  gradcheck_sdpa(rand_t({2, 1, 5}, kFloat64, 9), 0.0, false, {}, {2, 3, 4}, {2, 5, 4}, {2, 5, 3});
}

TEST(Attention, GradcheckDropout) {
  gradcheck_sdpa({}, 0.3, false, {}, {2, 6, 4}, {2, 7, 4}, {2, 7, 3});
  gradcheck_sdpa({}, 0.5, true, {}, {1, 2, 6, 3}, {1, 2, 6, 3}, {1, 2, 6, 3});
}

TEST(Attention, DropoutIsSeededAndScaled) {
  Tensor q = rand_t({4, 64, 8}, kFloat32, 1), k = rand_t({4, 64, 8}, kFloat32, 2);
  Tensor v = ones({4, 64, 8}, kFloat32);
  Generator g1(7), g2(7), g3(8);
  Tensor a = F::scaled_dot_product_attention(q, k, v, {}, 0.25, false, {}, &g1);
  Tensor b = F::scaled_dot_product_attention(q, k, v, {}, 0.25, false, {}, &g2);
  Tensor c = F::scaled_dot_product_attention(q, k, v, {}, 0.25, false, {}, &g3);
  EXPECT_TRUE(equal(a, b));
  EXPECT_FALSE(equal(a, c));
  // With v = 1 each output is sum_j P_ij keep_ij / 0.75: 1 on average.
  EXPECT_NEAR(a.mean().item<double>(), 1.0, 0.05);
  EXPECT_GT(g1.offset(), 0u);  // the draw advanced the generator
}

TEST(Attention, FloatMaskThatNeedsGradTakesMathPath) {
  // The fused kernels give no mask gradient, so such a call runs the written-out attention.
  Tensor q = test::leaf({2, 3, 4}, 1), k = test::leaf({2, 5, 4}, 2), v = test::leaf({2, 5, 3}, 3);
  Tensor mask = test::leaf({3, 5}, 4);
  F::scaled_dot_product_attention(q, k, v, mask).sum().backward();
  ASSERT_TRUE(mask.grad().defined());
  Tensor m2 = mask.detach().requires_grad_();
  F::scaled_dot_product_attention_math(q, k, v, m2).sum().backward();
  expect_tensors_close(mask.grad(), m2.grad(), 1e-12, "mask grad");
}

TEST(Attention, DoubleBackwardIsRefused) {
  Tensor q = test::leaf({2, 3, 4}, 1), k = test::leaf({2, 3, 4}, 2), v = test::leaf({2, 3, 4}, 3);
  Tensor y = F::scaled_dot_product_attention(q, k, v).sum();
  expect_error<NotImplementedError>(
      [&] { autograd::grad({y}, {q}, {}, {}, /*create_graph=*/true); },
      {"scaled_dot_product_attention", "double backward", "scaled_dot_product_attention_math"});
}

TEST(Attention, MathBackendRunsTheWrittenOutPathAndTheGuardRestores) {
  // Under kMath the call is the math path (so double backward works); the guard restores kAuto.
  Tensor q = test::leaf({2, 3, 4}, 1), k = test::leaf({2, 3, 4}, 2), v = test::leaf({2, 3, 4}, 3);
  {
    F::SdpBackendGuard math(F::SdpBackend::kMath);
    EXPECT_EQ(F::sdp_backend(), F::SdpBackend::kMath);
    const Tensor y = F::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    EXPECT_TRUE(equal(y, F::scaled_dot_product_attention_math(q, k, v, {}, 0.0, true)));
    const auto g = autograd::grad({y.sum()}, {q}, {}, {}, /*create_graph=*/true);
    EXPECT_TRUE(g[0].requires_grad());
  }
  EXPECT_EQ(F::sdp_backend(), F::SdpBackend::kAuto);
}

TEST(Attention, Errors) {
  Tensor q = rand_t({2, 3, 4}, kFloat32, 1);
  expect_error<ValueError>(
      [&] {
        F::scaled_dot_product_attention(q, q, q, ones({2, 3, 5}, kBool));
      },
      {"scaled_dot_product_attention", "attn_mask of shape [2, 3, 5]", "[2, 3, 3]"});
  expect_error<ValueError>(
      [&] {
        F::scaled_dot_product_attention(q, rand_t({2, 3, 5}, kFloat32, 2), q);
      },
      {"scaled_dot_product_attention", "last dim of key"});
  expect_error<ValueError>([&] { F::scaled_dot_product_attention(q, q, q, {}, 1.0); },
                           {"scaled_dot_product_attention", "dropout_p"});
  expect_error<TypeError>(
      [&] {
        F::scaled_dot_product_attention(q, q, q, ones({3, 3}, kFloat64));
      },
      {"scaled_dot_product_attention", "attn_mask"});
}

// ---- CUDA ---------------------------------------------------------------------------------------

TEST(AttentionCuda, MatchesCpu) {
  // Both sides see the same (rounded) inputs; the CPU computes float16/bfloat16 in float32 as
  // the CUDA kernel does, so they differ by accumulation order and output rounding only.
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Device gpu("cuda");
  // kAuto takes the math path at these sizes on CUDA; kFused is the CUDA kernel itself.
  for (F::SdpBackend backend : {F::SdpBackend::kFused, F::SdpBackend::kAuto})
  for (Dtype dt : {kFloat32, kBFloat16, kFloat16}) {
    const double tol = dt == kFloat32 ? 1e-4 : 2e-2;
    for (const Case& c : cases()) {
      SCOPED_TRACE(std::string(c.name) + " " + std::string(dtype_name(dt)) +
                   (backend == F::SdpBackend::kFused ? " fused" : " auto"));
      const Tensor mask = make_mask(c, dt);
      Attn attn = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        const Tensor m = mask.defined() ? mask.to(q.device()) : mask;
        return F::scaled_dot_product_attention(q, k, v, m, 0.0, c.causal, c.scale);
      };
      const Grads want = run(attn, c.q, c.k, c.v, 5, dt);
      Grads got;
      {
        F::SdpBackendGuard on_gpu(backend);
        got = run(attn, c.q, c.k, c.v, 5, dt, gpu);
      }
      EXPECT_EQ(got.y.dtype(), dt);
      expect_grads_close(got, want, tol, c.name);
    }
  }
}

TEST(AttentionCuda, DropoutMatchesCpu) {
  // Both backends draw the dropout mask from the same Philox words (Note [Fused attention]).
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  Attn attn = [](const Tensor& q, const Tensor& k, const Tensor& v) {
    Generator gen(99);
    return F::scaled_dot_product_attention(q, k, v, {}, 0.2, true, {}, &gen);
  };
  const Grads want = run(attn, {2, 2, 70, 16}, {2, 2, 70, 16}, {2, 2, 70, 16}, 4, kFloat32);
  F::SdpBackendGuard fused(F::SdpBackend::kFused);
  const Grads got =
      run(attn, {2, 2, 70, 16}, {2, 2, 70, 16}, {2, 2, 70, 16}, 4, kFloat32, Device("cuda"));
  expect_grads_close(got, want, 1e-4, "dropout");
}

// cuDNN's flash attention (Note [Attention through cuDNN]) against the CPU's float32 computation
// of the same rounded inputs, at a transformer's head shapes (including a length that is no
// multiple of a tile and L != S), and each direction against Ember's own CUDA kernel in the
// other: cuDNN's Stats are the logsumexp Ember's backward reads.
TEST(AttentionCuda, CudnnFlashAttentionMatchesCpuAndInteroperatesWithEmbersKernel) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Device gpu("cuda");
  struct Shape4 {
    std::vector<int64_t> q, kv;
    bool causal;
  };
  const std::vector<Shape4> shapes = {{{2, 3, 128, 64}, {2, 3, 128, 64}, true},
                                      {{2, 3, 128, 64}, {2, 3, 128, 64}, false},
                                      {{1, 2, 200, 128}, {1, 2, 200, 128}, true},
                                      {{2, 2, 64, 32}, {2, 2, 96, 32}, false}};
  for (Dtype dt : {kBFloat16, kFloat16}) {
    for (const Shape4& c : shapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " L " + std::to_string(c.q[2]) + " S " +
                   std::to_string(c.kv[2]) + " E " + std::to_string(c.q[3]) +
                   (c.causal ? " causal" : ""));
      detail::AttentionParams p;
      p.batch = c.q[0] * c.q[1], p.L = c.q[2], p.S = c.kv[2], p.E = p.Ev = c.q[3];
      p.scale = 1.0 / std::sqrt(static_cast<double>(p.E));
      p.causal = c.causal;
      if (!detail::attention_cudnn_supported(dt, gpu, p, /*has_mask=*/false)) {
        GTEST_SKIP() << "cuDNN's flash attention does not take this call here (a build without "
                        "cuDNN's frontend, or a GPU before compute capability 8.0)";
      }
      // Else the backward legs below could pass on Ember's kernel alone.
      ASSERT_TRUE(detail::attention_cudnn_backward_supported(dt, gpu, p))
          << "cuDNN built the forward graph but not the backward one";
      Attn attn = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        return F::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal);
      };
      const Grads want = run(attn, c.q, c.kv, c.kv, 11, dt);
      const Grads got = run(attn, c.q, c.kv, c.kv, 11, dt, gpu);  // kAuto: cuDNN both ways
      EXPECT_EQ(got.y.dtype(), dt);
      expect_grads_close(got, want, 2e-2, "cudnn");
      // cuDNN's forward, Ember's backward; then Ember's forward, cuDNN's backward.
      for (bool cudnn_forward : {true, false}) {
        F::SdpBackendGuard fused(F::SdpBackend::kFused);
        struct CudnnBackOn {  // even when an assertion below ends the test early
          ~CudnnBackOn() { F::enable_cudnn_sdp(true); }
        } back_on;
        Attn switching = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
          F::enable_cudnn_sdp(cudnn_forward);
          Tensor y = F::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal);
          F::enable_cudnn_sdp(!cudnn_forward);
          return y;
        };
        const Grads mixed = run(switching, c.q, c.kv, c.kv, 11, dt, gpu);
        F::enable_cudnn_sdp(true);
        expect_grads_close(
            mixed, want, 2e-2,
            cudnn_forward ? "cudnn forward, ember backward" : "ember forward, cudnn backward");
      }
    }
  }
  EXPECT_TRUE(F::cudnn_sdp_enabled());
}

// Ember's TF32 tensor-core kernel (Note [TF32 attention]) takes float32 calls while TF32 matmuls
// are allowed: against the CPU's float32 computation at TF32's precision, at a transformer's
// head widths (32 and 64), lengths that are no multiple of its 64-row tiles, L != S either way,
// causal or not; and, with TF32 off again, the same calls match the exact kernels to 1e-4.
TEST(AttentionCuda, Tf32KernelMatchesCpuWhileTf32IsAllowed) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  const Device gpu("cuda");
  struct Shape4 {
    std::vector<int64_t> q, kv;
    bool causal;
  };
  const std::vector<Shape4> shapes = {
      {{2, 3, 128, 64}, {2, 3, 128, 64}, true}, {{2, 3, 128, 64}, {2, 3, 128, 64}, false},
      {{1, 2, 200, 64}, {1, 2, 200, 64}, true}, {{2, 2, 70, 32}, {2, 2, 130, 32}, false},
      {{2, 2, 130, 32}, {2, 2, 70, 32}, true},  {{1, 1, 1, 64}, {1, 1, 1, 64}, true}};
  struct AllowTf32 {
    bool before = cuda::matmul_allow_tf32();
    AllowTf32() { cuda::set_matmul_allow_tf32(true); }
    ~AllowTf32() { cuda::set_matmul_allow_tf32(before); }
  };
  for (const Shape4& c : shapes) {
    SCOPED_TRACE("L " + std::to_string(c.q[2]) + " S " + std::to_string(c.kv[2]) + " E " +
                 std::to_string(c.q[3]) + (c.causal ? " causal" : ""));
    Attn attn = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      return F::scaled_dot_product_attention(q, k, v, {}, 0.0, c.causal);
    };
    const Grads want = run(attn, c.q, c.kv, c.kv, 13, kFloat32);
    {
      AllowTf32 tf32;
      detail::AttentionParams p;
      p.batch = c.q[0] * c.q[1], p.L = c.q[2], p.S = c.kv[2], p.E = p.Ev = c.q[3];
      p.causal = c.causal;
      if (!detail::attention_tf32_supported(kFloat32, gpu, p, /*has_mask=*/false)) {
        GTEST_SKIP() << "the TF32 kernel does not take this call here (a GPU before compute "
                        "capability 8.0, or without the shared memory it needs)";
      }
      const Grads got = run(attn, c.q, c.kv, c.kv, 13, kFloat32, gpu);  // kAuto: the TF32 kernel
      EXPECT_EQ(got.y.dtype(), kFloat32);
      expect_grads_close(got, want, 1e-2, "tf32");
    }
    F::SdpBackendGuard fused(F::SdpBackend::kFused);
    expect_grads_close(run(attn, c.q, c.kv, c.kv, 13, kFloat32, gpu), want, 1e-4, "tf32 off");
  }
}

}  // namespace
}  // namespace ember::nn
