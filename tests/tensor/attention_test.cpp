// scaled_dot_product_attention's front end (tensor/ops/attention.h): the fused kernel and the math
// path against the closed form, the backend choice, and the errors. The gradients, masks,
// dropout and PyTorch's values are tested where nn tests its attention
// (tests/nn/attention_test.cpp), which is this op.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <ember/tensor/ops.h>
#include "test_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;

// softmax(q k^T * scale (+ causal mask)) v for q [L, E], k [S, E], v [S, Ev], row by row.
std::vector<double> closed_form(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const int64_t L = q.size(0), S = k.size(0), E = q.size(1), Ev = v.size(1);
  const auto qv = q.to_vector<double>(), kv = k.to_vector<double>(), vv = v.to_vector<double>();
  std::vector<double> y(L * Ev, 0.0);
  for (int64_t i = 0; i < L; ++i) {
    std::vector<double> p(S);
    double sum = 0;
    for (int64_t j = 0; j < S; ++j) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += qv[i * E + e] * kv[j * E + e];
      p[j] = causal && j > i ? 0.0 : std::exp(s / std::sqrt(static_cast<double>(E)));
      sum += p[j];
    }
    for (int64_t j = 0; j < S; ++j) {
      for (int64_t e = 0; e < Ev; ++e) y[i * Ev + e] += p[j] / sum * vv[j * Ev + e];
    }
  }
  return y;
}

TEST(Attention, FusedAndMathMatchTheClosedForm) {
  const Tensor q = rand_t({4, 3}, kFloat64, 1), k = rand_t({6, 3}, kFloat64, 2);
  const Tensor v = rand_t({6, 5}, kFloat64, 3);
  for (bool causal : {false, true}) {
    const auto want = closed_form(q, k, v, causal);
    for (SdpBackend b : {SdpBackend::kFused, SdpBackend::kMath}) {
      SdpBackendGuard guard(b);
      expect_close(scaled_dot_product_attention(q, k, v, {}, 0.0, causal), want, 1e-14,
                   b == SdpBackend::kFused ? "fused" : "math");
    }
    expect_close(scaled_dot_product_attention_math(q, k, v, {}, 0.0, causal), want, 1e-14,
                 "math");
  }
  EXPECT_EQ(sdp_backend(), SdpBackend::kAuto);
  // Leading dims [2, 1] and a bool mask that lets every query see the first four keys only.
  const Tensor mask = lt(arange(0, 6), 4).reshape({1, 6});
  const Tensor y = scaled_dot_product_attention(q.expand({2, 1, 4, 3}), k.expand({2, 1, 6, 3}),
                                                v.expand({2, 1, 6, 5}), mask);
  ASSERT_EQ(y.shape(), Shape({2, 1, 4, 5}));
  const auto want = closed_form(q, k.slice(0, 0, 4), v.slice(0, 0, 4), false);
  expect_close(y[1][0], want, 1e-14, "leading dims and a bool mask");
}

TEST(Attention, ErrorsNameTheOpWhatWasExpectedAndWhatWasGot) {
  const Tensor q = rand_t({2, 3, 4}, kFloat32, 1);
  expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, ones({2, 3, 5}, kBool)); },
                           {"[scaled_dot_product_attention]", "attn_mask of shape [2, 3, 5]",
                            "[2, 3, 3]"});
  expect_error<ValueError>(
      [&] { scaled_dot_product_attention(q, rand_t({2, 3, 5}, kFloat32, 2), q); },
      {"[scaled_dot_product_attention]", "last dim of key", "[2, 3, 4]", "[2, 3, 5]"});
  expect_error<ValueError>([&] { scaled_dot_product_attention(q, q, q, {}, 1.0); },
                           {"[scaled_dot_product_attention]", "dropout_p in [0, 1)", "1"});
  expect_error<TypeError>([&] { scaled_dot_product_attention(q, q, q, ones({3, 3}, kFloat64)); },
                          {"[scaled_dot_product_attention]", "attn_mask", "float32", "float64"});
  expect_error<TypeError>([&] { scaled_dot_product_attention(q, q.to(kFloat64), q); },
                          {"[scaled_dot_product_attention]", "one dtype", "float64"});
  expect_error<TypeError>([] { scaled_dot_product_attention(ones({2, 2}, kInt64), ones({2, 2}),
                                                            ones({2, 2})); },
                          {"[scaled_dot_product_attention]", "floating-point query", "int64"});
  expect_error<ValueError>([&] { scaled_dot_product_attention(q, rand_t({3, 4}, kFloat32, 3), q); },
                           {"[scaled_dot_product_attention]", "rank >= 2", "[3, 4]"});
  expect_error<ValueError>(
      [&] { scaled_dot_product_attention(q, q, q, ones({3, 3}, kBool), 0.0, true); },
      {"[scaled_dot_product_attention]", "attn_mask and is_causal"});
  expect_error<ValueError>(
      [&] { scaled_dot_product_attention_math(q, q, rand_t({2, 2, 4}, kFloat32, 4)); },
      {"[scaled_dot_product_attention]", "value must have as many rows as key"});
}

}  // namespace
}  // namespace ember
