#include "nn/multihead_attention.h"

#include <cmath>

#include "nn/attention.h"
#include "nn/functional.h"
#include "nn/init.h"
#include "nn/layer_utils.h"

namespace ember::nn {

namespace {

constexpr const char* kOp = "MultiheadAttention";

/// A mask in MultiheadAttention's convention (bool: true = masked out) as an additive mask of
/// `dtype`: 0 where attending is allowed, -inf where it is not.
Tensor additive_mask(const Tensor& m, Dtype dtype) {
  if (m.dtype() != kBool) return m.to(dtype);
  return masked_fill(zeros(m.shape(), TensorOptions(dtype).device(m.device())), m, -INFINITY);
}

void check_mask_dtype(const Tensor& m, const char* what) {
  EMBER_CHECK_TYPE(TypeError, m.dtype() == kBool || m.is_floating_point(), "[", kOp,
                   "] expected a bool or floating ", what, ", got ", m.dtype());
}

/// [T, N, E] -> [N, H, T, E / H]
Tensor split_heads(const Tensor& x, int64_t heads) {
  return x.reshape({x.size(0), x.size(1), heads, x.size(2) / heads}).permute({1, 2, 0, 3});
}

}  // namespace

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads,
                                       const MultiheadAttentionOptions& options)
    : embed_dim(embed_dim),
      num_heads(num_heads),
      head_dim(num_heads > 0 ? embed_dim / num_heads : 0),
      kdim(options.kdim.value_or(embed_dim)),
      vdim(options.vdim.value_or(embed_dim)),
      options(options) {
  EMBER_CHECK(embed_dim > 0 && num_heads > 0 && embed_dim % num_heads == 0, "[", kOp,
              "] expected positive embed_dim divisible by num_heads, got embed_dim=", embed_dim,
              ", num_heads=", num_heads);
  EMBER_CHECK(kdim > 0 && vdim > 0, "[", kOp, "] expected positive kdim and vdim, got ", kdim,
              " and ", vdim);
  EMBER_CHECK(options.dropout >= 0.0 && options.dropout < 1.0, "[", kOp,
              "] expected dropout in [0, 1), got ", options.dropout);
  if (options.add_bias_kv || options.add_zero_attn) {
    throw NotImplementedError(detail::str_cat(
        "[", kOp, "] add_bias_kv and add_zero_attn are not supported (got add_bias_kv=",
        detail::repr_bool(options.add_bias_kv),
        ", add_zero_attn=", detail::repr_bool(options.add_zero_attn), ")"));
  }
  // torch registers the packed or the separate weights first, then in_proj_bias, then
  // out_proj: the same order gives the same state_dict.
  if (same_embed_dim()) {
    in_proj_weight = register_parameter("in_proj_weight", empty({3 * embed_dim, embed_dim}));
  } else {
    q_proj_weight = register_parameter("q_proj_weight", empty({embed_dim, embed_dim}));
    k_proj_weight = register_parameter("k_proj_weight", empty({embed_dim, kdim}));
    v_proj_weight = register_parameter("v_proj_weight", empty({embed_dim, vdim}));
  }
  if (options.bias) in_proj_bias = register_parameter("in_proj_bias", empty({3 * embed_dim}));
  out_proj = register_module("out_proj", std::make_shared<Linear>(embed_dim, embed_dim,
                                                                  options.bias));
  reset_parameters();
}

void MultiheadAttention::reset_parameters() {
  if (same_embed_dim()) {
    init::xavier_uniform_(in_proj_weight);
  } else {
    init::xavier_uniform_(q_proj_weight);
    init::xavier_uniform_(k_proj_weight);
    init::xavier_uniform_(v_proj_weight);
  }
  if (in_proj_bias.defined()) {
    init::zeros_(in_proj_bias);
    init::zeros_(out_proj->bias);
  }
}

void MultiheadAttention::on_parameter_set(const std::string& name, const Tensor& t) {
  if (name == "in_proj_weight") in_proj_weight = t;
  if (name == "q_proj_weight") q_proj_weight = t;
  if (name == "k_proj_weight") k_proj_weight = t;
  if (name == "v_proj_weight") v_proj_weight = t;
  if (name == "in_proj_bias") in_proj_bias = t;
}

std::string MultiheadAttention::extra_repr() const {
  std::string s = detail::str_cat("embed_dim=", embed_dim, ", num_heads=", num_heads);
  if (options.dropout > 0) s += detail::str_cat(", dropout=", options.dropout);
  if (!same_embed_dim()) s += detail::str_cat(", kdim=", kdim, ", vdim=", vdim);
  if (options.batch_first) s += ", batch_first=true";
  return s;
}

Tensor MultiheadAttention::forward(const Tensor& x) { return forward(x, x, x, {}, false).output; }

AttentionOutput MultiheadAttention::forward(const Tensor& query_in, const Tensor& key_in,
                                            const Tensor& value_in, const Tensor& key_padding_mask,
                                            bool need_weights, const Tensor& attn_mask,
                                            bool average_attn_weights, bool is_causal) {
  detail::check_defined(kOp, query_in, "query");
  detail::check_defined(kOp, key_in, "key");
  detail::check_defined(kOp, value_in, "value");
  const bool batched = query_in.dim() == 3;
  EMBER_CHECK((batched || query_in.dim() == 2) && key_in.dim() == query_in.dim() &&
                  value_in.dim() == query_in.dim(),
              "[", kOp, "] expected query, key and value all 3-D (batched) or all 2-D, got shapes ",
              query_in.shape(), ", ", key_in.shape(), " and ", value_in.shape());
  // Work in [T, N, E]: torch's layout without batch_first.
  auto layout = [&](const Tensor& t) {
    if (!batched) return t.unsqueeze(1);
    return options.batch_first ? t.transpose(0, 1) : t;
  };
  const Tensor query = layout(query_in), key = layout(key_in), value = layout(value_in);
  const int64_t L = query.size(0), N = query.size(1), S = key.size(0), E = embed_dim;
  EMBER_CHECK(query.size(2) == E && key.size(2) == kdim && value.size(2) == vdim, "[", kOp,
              "] expected query, key and value with ", E, ", ", kdim, " and ", vdim,
              " features, got shapes ", query_in.shape(), ", ", key_in.shape(), " and ",
              value_in.shape());
  EMBER_CHECK(key.size(1) == N && value.size(1) == N && value.size(0) == S, "[", kOp,
              "] expected key and value with query's batch size ", N,
              " and as many values as keys, got shapes ", key_in.shape(), " and ",
              value_in.shape());

  // ---- projections: q [L, N, E], k [S, N, E], v [S, N, E] ----
  Tensor q, k, v;
  auto bias = [&](int64_t i) {
    return in_proj_bias.defined() ? in_proj_bias.narrow(0, i * E, E) : Tensor();
  };
  if (same_embed_dim() && query_in.is_same(key_in) && key_in.is_same(value_in)) {
    // Self-attention: one matmul for all three projections.
    const Tensor qkv = functional::linear(query, in_proj_weight, in_proj_bias);
    q = qkv.narrow(2, 0, E);
    k = qkv.narrow(2, E, E);
    v = qkv.narrow(2, 2 * E, E);
  } else {
    auto w = [&](int64_t i, const Tensor& separate) {
      return same_embed_dim() ? in_proj_weight.narrow(0, i * E, E) : separate;
    };
    q = functional::linear(query, w(0, q_proj_weight), bias(0));
    k = functional::linear(key, w(1, k_proj_weight), bias(1));
    v = functional::linear(value, w(2, v_proj_weight), bias(2));
  }

  // ---- masks, as one additive mask broadcasting to [N, H, L, S] ----
  Tensor mask;
  if (attn_mask.defined()) {
    check_mask_dtype(attn_mask, "attn_mask");
    if (attn_mask.dim() == 2) {
      EMBER_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S, "[", kOp,
                  "] the 2-D attn_mask must be [L, S] = [", L, ", ", S, "], got ",
                  attn_mask.shape());
      mask = attn_mask.view({1, 1, L, S});
    } else {
      EMBER_CHECK(attn_mask.dim() == 3 && attn_mask.size(0) == N * num_heads &&
                      attn_mask.size(1) == L && attn_mask.size(2) == S,
                  "[", kOp, "] attn_mask must be [L, S] = [", L, ", ", S,
                  "] or [N * num_heads, L, S] = [", N * num_heads, ", ", L, ", ", S, "], got ",
                  attn_mask.shape());
      mask = attn_mask.reshape({N, num_heads, L, S});
    }
  }
  const bool sdpa_causal = is_causal && !key_padding_mask.defined() && !need_weights;
  if (sdpa_causal) {
    mask = Tensor();  // attn_mask is the causal mask (the hint): the flag says it cheaper
  } else if (is_causal && !mask.defined()) {
    TensorOptions idx = TensorOptions(kInt64).device(query.device());
    mask = gt(arange(0, S, 1, idx).unsqueeze(0), arange(0, L, 1, idx).unsqueeze(1))
               .view({1, 1, L, S});
  }
  if (mask.defined()) mask = additive_mask(mask, q.dtype());
  if (key_padding_mask.defined()) {
    check_mask_dtype(key_padding_mask, "key_padding_mask");
    const Tensor kpm = batched ? key_padding_mask : key_padding_mask.unsqueeze(0);
    EMBER_CHECK(kpm.dim() == 2 && kpm.size(0) == N && kpm.size(1) == S, "[", kOp,
                "] expected key_padding_mask [N, S] = [", N, ", ", S, "]",
                batched ? "" : " (or [S] for unbatched input)", ", got ",
                key_padding_mask.shape());
    const Tensor add = additive_mask(kpm, q.dtype()).view({N, 1, 1, S});
    mask = mask.defined() ? mask + add : add;
  }

  // ---- attention per head: [N, H, L, head_dim] ----
  const Tensor qh = split_heads(q, num_heads), kh = split_heads(k, num_heads),
               vh = split_heads(v, num_heads);
  const double p = is_training() ? options.dropout : 0.0;
  Tensor heads, weights;
  if (need_weights) {
    Tensor scores = matmul(qh * (1.0 / std::sqrt(static_cast<double>(head_dim))),
                           kh.transpose(-2, -1));  // [N, H, L, S]
    if (mask.defined()) scores = scores + mask;
    // torch returns the weights after dropout, the ones that multiplied the values.
    weights = softmax(scores, -1);
    if (p > 0) weights = functional::dropout(weights, p, true);
    heads = matmul(weights, vh);
    if (average_attn_weights) weights = weights.mean({1});
    if (!batched) weights = weights.squeeze(0);
  } else {
    heads = functional::scaled_dot_product_attention(qh, kh, vh, mask, p, sdpa_causal);
  }
  // [N, H, L, hd] -> [L, N, E]
  Tensor out = out_proj->forward(heads.permute({2, 0, 1, 3}).reshape({L, N, E}));
  if (!batched) {
    out = out.squeeze(1);
  } else if (options.batch_first) {
    out = out.transpose(0, 1);
  }
  return {out, weights};
}

}  // namespace ember::nn
