#include <ember/nn/layers/multihead_attention.h>

#include <cmath>

#include <ember/nn/attention.h>
#include <ember/nn/functional.h>
#include <ember/nn/init.h>
#include <ember/nn/layers/layer_utils.h>

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
  // torch registers the packed or the separate weights, in_proj_bias, bias_k and bias_v, and
  // then out_proj: the same order gives the same state_dict.
  if (same_embed_dim()) {
    in_proj_weight = register_parameter("in_proj_weight", empty({3 * embed_dim, embed_dim}));
  } else {
    q_proj_weight = register_parameter("q_proj_weight", empty({embed_dim, embed_dim}));
    k_proj_weight = register_parameter("k_proj_weight", empty({embed_dim, kdim}));
    v_proj_weight = register_parameter("v_proj_weight", empty({embed_dim, vdim}));
  }
  if (options.bias) in_proj_bias = register_parameter("in_proj_bias", empty({3 * embed_dim}));
  if (options.add_bias_kv) {
    bias_k = register_parameter("bias_k", empty({1, 1, embed_dim}));
    bias_v = register_parameter("bias_v", empty({1, 1, embed_dim}));
  }
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
  if (bias_k.defined()) {
    init::xavier_normal_(bias_k);
    init::xavier_normal_(bias_v);
  }
}

void MultiheadAttention::on_parameter_set(const std::string& name, const Tensor& t) {
  if (name == "in_proj_weight") in_proj_weight = t;
  if (name == "q_proj_weight") q_proj_weight = t;
  if (name == "k_proj_weight") k_proj_weight = t;
  if (name == "v_proj_weight") v_proj_weight = t;
  if (name == "in_proj_bias") in_proj_bias = t;
  if (name == "bias_k") bias_k = t;
  if (name == "bias_v") bias_v = t;
}

std::string MultiheadAttention::extra_repr() const {
  std::string s = detail::str_cat("embed_dim=", embed_dim, ", num_heads=", num_heads);
  if (options.dropout > 0) s += detail::str_cat(", dropout=", options.dropout);
  if (!same_embed_dim()) s += detail::str_cat(", kdim=", kdim, ", vdim=", vdim);
  if (options.add_bias_kv) s += ", add_bias_kv=true";
  if (options.add_zero_attn) s += ", add_zero_attn=true";
  if (options.batch_first) s += ", batch_first=true";
  return s;
}

Tensor MultiheadAttention::forward(const Tensor& x) { return forward(x, x, x, {}, false).output; }

namespace {

/// The masks as given, checked, in the [T, N, E] layout: attn [L, S] or [N * H, L, S] as
/// [1, 1, L, S] or [N, H, L, S]; key padding [N, S].
struct Masks {
  Tensor attn, key_padding;
};

Masks check_masks(const Tensor& attn_mask, const Tensor& key_padding_mask, bool batched,
                  int64_t N, int64_t H, int64_t L, int64_t S) {
  Masks m;
  if (attn_mask.defined()) {
    check_mask_dtype(attn_mask, "attn_mask");
    if (attn_mask.dim() == 2) {
      EMBER_CHECK(attn_mask.size(0) == L && attn_mask.size(1) == S, "[", kOp,
                  "] the 2-D attn_mask must be [L, S] = [", L, ", ", S, "], got ",
                  attn_mask.shape());
      m.attn = attn_mask.view({1, 1, L, S});
    } else {
      EMBER_CHECK(attn_mask.dim() == 3 && attn_mask.size(0) == N * H && attn_mask.size(1) == L &&
                      attn_mask.size(2) == S,
                  "[", kOp, "] attn_mask must be [L, S] = [", L, ", ", S,
                  "] or [N * num_heads, L, S] = [", N * H, ", ", L, ", ", S, "], got ",
                  attn_mask.shape());
      m.attn = attn_mask.reshape({N, H, L, S});
    }
  }
  if (key_padding_mask.defined()) {
    check_mask_dtype(key_padding_mask, "key_padding_mask");
    m.key_padding = batched ? key_padding_mask : key_padding_mask.unsqueeze(0);
    EMBER_CHECK(m.key_padding.dim() == 2 && m.key_padding.size(0) == N &&
                    m.key_padding.size(1) == S,
                "[", kOp, "] expected key_padding_mask [N, S] = [", N, ", ", S, "]",
                batched ? "" : " (or [S] for unbatched input)", ", got ",
                key_padding_mask.shape());
  }
  return m;
}

/// One more key that every query may attend to (add_bias_kv, add_zero_attn): a false / zero
/// column at the end of each mask.
void pad_masks(Masks& m) {
  auto pad = [](const Tensor& t) {
    Shape s = t.shape();
    s[s.size() - 1] = 1;
    return cat({t, zeros(s, TensorOptions(t.dtype()).device(t.device()))}, -1);
  };
  if (m.attn.defined()) m.attn = pad(m.attn);
  if (m.key_padding.defined()) m.key_padding = pad(m.key_padding);
}

/// [T, N, E] -> [N, H, T, E / H]
Tensor split_heads(const Tensor& x, int64_t heads) {
  return x.reshape({x.size(0), x.size(1), heads, x.size(2) / heads}).permute({1, 2, 0, 3});
}

/// The keys and values with one zero row appended per head: [N, H, S + 1, hd].
Tensor append_zero(const Tensor& x) {
  return cat({x, zeros({x.size(0), x.size(1), 1, x.size(3)},
                       TensorOptions(x.dtype()).device(x.device()))},
             2);
}

}  // namespace

MultiheadAttention::Projected MultiheadAttention::project(const Tensor& query, const Tensor& key,
                                                          const Tensor& value,
                                                          bool self_attention) const {
  const int64_t E = embed_dim;
  if (self_attention && same_embed_dim()) {
    // One matmul for all three projections.
    const Tensor qkv = functional::linear(query, in_proj_weight, in_proj_bias);
    return {qkv.narrow(2, 0, E), qkv.narrow(2, E, E), qkv.narrow(2, 2 * E, E)};
  }
  auto w = [&](int64_t i, const Tensor& separate) {
    return same_embed_dim() ? in_proj_weight.narrow(0, i * E, E) : separate;
  };
  auto b = [&](int64_t i) {
    return in_proj_bias.defined() ? in_proj_bias.narrow(0, i * E, E) : Tensor();
  };
  return {functional::linear(query, w(0, q_proj_weight), b(0)),
          functional::linear(key, w(1, k_proj_weight), b(1)),
          functional::linear(value, w(2, v_proj_weight), b(2))};
}

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
  Masks masks = check_masks(attn_mask, key_padding_mask, batched, N, num_heads, L, S);
  const bool extra_keys = options.add_bias_kv || options.add_zero_attn;
  // With no padding mask and no weights wanted, is_causal goes to scaled_dot_product_attention
  // as a flag (attn_mask, if any, is taken to be the causal mask: torch's hint); otherwise the
  // causal mask is built here when none was given.
  const bool sdpa_causal = is_causal && !masks.key_padding.defined() && !need_weights &&
                           !extra_keys;
  if (sdpa_causal) {
    masks.attn = Tensor();
  } else if (is_causal && !masks.attn.defined()) {
    TensorOptions idx = TensorOptions(kInt64).device(query.device());
    masks.attn = gt(arange(0, S, 1, idx).unsqueeze(0), arange(0, L, 1, idx).unsqueeze(1))
                     .view({1, 1, L, S});
  }

  // Projections, then [N, H, T, head_dim] per head.
  Projected p = project(query, key, value, query_in.is_same(key_in) && key_in.is_same(value_in));
  if (options.add_bias_kv) {
    p.k = cat({p.k, bias_k.expand({1, N, E})}, 0);
    p.v = cat({p.v, bias_v.expand({1, N, E})}, 0);
    pad_masks(masks);
  }
  const Tensor qh = split_heads(p.q, num_heads);
  Tensor kh = split_heads(p.k, num_heads), vh = split_heads(p.v, num_heads);
  if (options.add_zero_attn) {
    kh = append_zero(kh);
    vh = append_zero(vh);
    pad_masks(masks);
  }
  const int64_t S_all = kh.size(2);
  // One additive mask broadcasting to [N, H, L, S_all].
  Tensor mask;
  if (masks.attn.defined()) mask = additive_mask(masks.attn, p.q.dtype());
  if (masks.key_padding.defined()) {
    const Tensor add = additive_mask(masks.key_padding, p.q.dtype()).view({N, 1, 1, S_all});
    mask = mask.defined() ? mask + add : add;
  }

  const double dropout_p = is_training() ? options.dropout : 0.0;
  Tensor heads, weights;
  if (need_weights) {
    Tensor scores = matmul(qh * (1.0 / std::sqrt(static_cast<double>(head_dim))),
                           kh.transpose(-2, -1));  // [N, H, L, S_all]
    if (mask.defined()) scores = scores + mask;
    // torch returns the weights after dropout, the ones that multiplied the values.
    weights = softmax(scores, -1);
    if (dropout_p > 0) weights = functional::dropout(weights, dropout_p, true);
    heads = matmul(weights, vh);
    if (average_attn_weights) weights = weights.mean({1});
    if (!batched) weights = weights.squeeze(0);
  } else {
    heads = functional::scaled_dot_product_attention(qh, kh, vh, mask, dropout_p, sdpa_causal);
  }
  // [N, H, L, hd] -> [L, N, E]
  Tensor out = out_proj->forward(heads.permute({2, 0, 1, 3}).reshape({L, N, E}));
  if (!batched) return {out.squeeze(1), weights};
  return {options.batch_first ? out.transpose(0, 1) : out, weights};
}

}  // namespace ember::nn
