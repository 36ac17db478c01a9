#include "nn/attention.h"

#include <cmath>

#include "nn/functional.h"

namespace ember::nn::functional {

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                  double dropout_p, bool is_causal) {
  detail::check_defined(kOp, q, "query");
  detail::check_defined(kOp, k, "key");
  detail::check_defined(kOp, v, "value");
  EMBER_CHECK_TYPE(TypeError, q.is_floating_point(), "[", kOp,
                   "] expected a floating-point query, got ", q.dtype());
  EMBER_CHECK_TYPE(TypeError, k.dtype() == q.dtype() && v.dtype() == q.dtype(), "[", kOp,
                   "] expected query, key and value of one dtype, got ", q.dtype(), ", ",
                   k.dtype(), " and ", v.dtype());
  EMBER_CHECK(k.device() == q.device() && v.device() == q.device(), "[", kOp,
              "] expected query, key and value on one device, got ", q.device(), ", ",
              k.device(), " and ", v.device());
  EMBER_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), "[", kOp,
              "] expected query, key and value of one rank >= 2, got shapes ", q.shape(), ", ",
              k.shape(), " and ", v.shape());
  const int64_t n = q.dim();
  for (int64_t d = 0; d < n - 2; ++d) {
    EMBER_CHECK(q.size(d) == k.size(d) && q.size(d) == v.size(d), "[", kOp,
                "] expected equal leading dims, got query ", q.shape(), ", key ", k.shape(),
                ", value ", v.shape());
  }
  EMBER_CHECK(k.size(n - 1) == q.size(n - 1), "[", kOp,
              "] last dim of key must equal last dim of query, got query ", q.shape(), ", key ",
              k.shape());
  EMBER_CHECK(v.size(n - 2) == k.size(n - 2), "[", kOp,
              "] value must have as many rows as key, got key ", k.shape(), ", value ",
              v.shape());
  EMBER_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "[", kOp,
              "] expected dropout_p in [0, 1), got ", dropout_p);
  if (attn_mask.defined()) {
    EMBER_CHECK(!is_causal, "[", kOp, "] attn_mask and is_causal may not both be given");
    EMBER_CHECK_TYPE(TypeError, attn_mask.dtype() == kBool || attn_mask.dtype() == q.dtype(),
                     "[", kOp, "] expected a bool attn_mask or one of the query's dtype ",
                     q.dtype(), ", got ", attn_mask.dtype());
    EMBER_CHECK(attn_mask.device() == q.device(), "[", kOp, "] expected attn_mask on ",
                q.device(), ", got ", attn_mask.device());
  }
}

}  // namespace

Tensor scaled_dot_product_attention_math(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& attn_mask, double dropout_p,
                                         bool is_causal, std::optional<double> scale,
                                         Generator* gen) {
  check_inputs(q, k, v, attn_mask, dropout_p, is_causal);
  const int64_t n = q.dim();
  const int64_t L = q.size(n - 2), S = k.size(n - 2);
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(n - 1)));
  // scores: [..., L, S]
  Tensor scores = matmul(q, k.transpose(-2, -1)) * s;
  Tensor mask = attn_mask;
  if (is_causal) {
    TensorOptions idx = TensorOptions(kInt64).device(q.device());
    mask = ge(arange(0, L, 1, idx).unsqueeze(1), arange(0, S, 1, idx).unsqueeze(0));
  }
  if (mask.defined()) {
    scores = mask.dtype() == kBool ? masked_fill(scores, logical_not(mask), -INFINITY)
                                   : scores + mask;
  }
  Tensor weights = softmax(scores, -1);
  if (dropout_p > 0.0) weights = dropout(weights, dropout_p, /*training=*/true, false, gen);
  return matmul(weights, v);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale, Generator* gen) {
  return scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale, gen);
}

}  // namespace ember::nn::functional
