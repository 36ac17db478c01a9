// Multi-head attention (torch.nn.MultiheadAttention).
#pragma once

#include <optional>
#include <string>

#include <ember/nn/layers/linear.h>
#include <ember/nn/module.h>

namespace ember::nn {

/// Constructor options of MultiheadAttention (torch's keyword arguments of the same names).
struct MultiheadAttentionOptions {
  double dropout = 0.0;  ///< dropout on the attention weights, in training mode
  bool bias = true;      ///< in_proj_bias and out_proj.bias
  /// Learned rows bias_k, bias_v [1, 1, E] appended to the projected keys and values (one
  /// more key every query may attend to).
  bool add_bias_kv = false;
  /// A zero row appended to each head's keys and values (after bias_k/bias_v).
  bool add_zero_attn = false;
  std::optional<int64_t> kdim;  ///< features of key (default embed_dim)
  std::optional<int64_t> vdim;  ///< features of value (default embed_dim)
  /// Inputs and output are [batch, seq, feature] instead of [seq, batch, feature].
  bool batch_first = false;
};

/// What MultiheadAttention::forward returns: the attention output and, when need_weights was
/// true, the attention weights (undefined otherwise).
struct AttentionOutput {
  Tensor output;   ///< [L, N, E] ([N, L, E] with batch_first; [L, E] for unbatched input)
  Tensor weights;  ///< [N, L, S] averaged over heads, or [N, H, L, S]; no N when unbatched
};

/// Multi-head attention with PyTorch's parameters, initialisation and semantics:
///   out = out_proj(concat_h softmax(Q_h K_h^T / sqrt(head_dim) + mask) V_h)
/// with Q, K, V the input projections of query, key and value.
///
/// Parameters (state_dict names as in torch): `in_proj_weight` [3E, E] when kdim == vdim ==
/// embed_dim, else `q_proj_weight` [E, E], `k_proj_weight` [E, kdim], `v_proj_weight`
/// [E, vdim]; `in_proj_bias` [3E], with add_bias_kv `bias_k` and `bias_v` [1, 1, E], and the
/// submodule `out_proj` (Linear(E, E)). The projection weights start xavier_uniform, bias_k and
/// bias_v xavier_normal, in_proj_bias and out_proj.bias at zero, out_proj.weight as Linear's
/// (all from the global generator).
class MultiheadAttention : public Module {
 public:
  /// Throws ValueError unless embed_dim is divisible by num_heads (both positive) and dropout is
  /// in [0, 1).
  MultiheadAttention(int64_t embed_dim, int64_t num_heads,
                     const MultiheadAttentionOptions& options = {});
  std::string name() const override { return "MultiheadAttention"; }
  std::string extra_repr() const override;

  /// Attention of query [L, N, E] over key [S, N, kdim] and value [S, N, vdim] (batch first:
  /// [N, L, E], ...; unbatched: [L, E], [S, kdim], [S, vdim]).
  ///   key_padding_mask [N, S] ([S] unbatched): bool, true = this key is padding and is ignored;
  ///     or floating, added to the scores.
  ///   need_weights: also return the attention weights (computed explicitly: softmax, dropout,
  ///     matmul). When false the attention runs as
  ///     nn::functional::scaled_dot_product_attention (the fused kernels where they apply).
  ///   attn_mask [L, S] or [N * num_heads, L, S]: bool, true = NOT allowed to attend (PyTorch
  ///     MultiheadAttention's meaning, the opposite of scaled_dot_product_attention's bool
  ///     mask); or floating, added to the scores.
  ///   average_attn_weights: weights averaged over heads [N, L, S], else [N, H, L, S].
  ///   is_causal: query i attends to keys j <= i. Without attn_mask the causal mask is built
  ///     here; with one, attn_mask is taken to be that causal mask (PyTorch's hint) and may be
  ///     replaced by the is_causal flag of scaled_dot_product_attention.
  /// A query whose keys are all masked gets NaN, as in PyTorch. Throws ValueError/TypeError
  /// naming what is wrong for mismatched shapes, dims or dtypes.
  AttentionOutput forward(const Tensor& query, const Tensor& key, const Tensor& value,
                          const Tensor& key_padding_mask = {}, bool need_weights = true,
                          const Tensor& attn_mask = {}, bool average_attn_weights = true,
                          bool is_causal = false);
  /// Self-attention without masks or weights: forward(x, x, x, {}, false).output.
  Tensor forward(const Tensor& x) override;

  const int64_t embed_dim, num_heads, head_dim, kdim, vdim;
  const MultiheadAttentionOptions options;
  /// [3E, E], undefined when kdim or vdim differ from embed_dim (then the three below).
  Tensor in_proj_weight;
  Tensor q_proj_weight, k_proj_weight, v_proj_weight;
  Tensor in_proj_bias;  ///< [3E], undefined without bias
  Tensor bias_k, bias_v;  ///< [1, 1, E], undefined without add_bias_kv
  std::shared_ptr<Linear> out_proj;

 protected:
  void on_parameter_set(const std::string& name, const Tensor& t) override;

 private:
  struct Projected {
    Tensor q, k, v;  ///< [L, N, E], [S, N, E], [S, N, E]
  };
  /// The input projections of query, key and value ([T, N, features] each).
  Projected project(const Tensor& query, const Tensor& key, const Tensor& value,
                    bool self_attention) const;
  void reset_parameters();
  bool same_embed_dim() const { return kdim == embed_dim && vdim == embed_dim; }
};

}  // namespace ember::nn
