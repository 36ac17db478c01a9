// Transformer layers (torch.nn.TransformerEncoderLayer).
#pragma once

#include <memory>
#include <string>

#include <ember/nn/layers/dropout.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/multihead_attention.h>
#include <ember/nn/layers/norm.h>

namespace ember::nn {

/// Constructor options of TransformerEncoderLayer (torch's keyword arguments).
struct TransformerEncoderLayerOptions {
  int64_t dim_feedforward = 2048;
  double dropout = 0.1;
  std::string activation = "relu";  ///< "relu" or "gelu" (the exact, erf form)
  double layer_norm_eps = 1e-5;
  bool batch_first = false;
  /// Pre-LayerNorm: x + sa(norm1(x)), then x + ff(norm2(x)); else post-LayerNorm:
  /// norm1(x + sa(x)), then norm2(x + ff(x)).
  bool norm_first = false;
  bool bias = true;  ///< biases of the attention, the linears and the LayerNorms
};

/// One encoder block of self-attention and a feed-forward network, each with dropout, a
/// residual connection and LayerNorm (torch.nn.TransformerEncoderLayer). Submodules, and so
/// state_dict names, are torch's: self_attn (MultiheadAttention), linear1 (d_model ->
/// dim_feedforward), dropout, linear2, norm1, norm2, dropout1, dropout2.
class TransformerEncoderLayer : public Module {
 public:
  /// Throws ValueError for an unknown activation, and MultiheadAttention's errors.
  TransformerEncoderLayer(int64_t d_model, int64_t nhead,
                          const TransformerEncoderLayerOptions& options = {});
  std::string name() const override { return "TransformerEncoderLayer"; }

  /// src [S, N, d_model] ([N, S, d_model] with batch_first; [S, d_model] unbatched) -> same
  /// shape. src_mask and src_key_padding_mask as MultiheadAttention's attn_mask and
  /// key_padding_mask (bool: true = masked out); is_causal as MultiheadAttention's.
  Tensor forward(const Tensor& src, const Tensor& src_mask,
                 const Tensor& src_key_padding_mask = {}, bool is_causal = false);
  /// forward(src, {}, {}).
  Tensor forward(const Tensor& src) override;

  const TransformerEncoderLayerOptions options;
  std::shared_ptr<MultiheadAttention> self_attn;
  std::shared_ptr<Linear> linear1, linear2;
  std::shared_ptr<Dropout> dropout, dropout1, dropout2;
  std::shared_ptr<LayerNorm> norm1, norm2;

 private:
  Tensor sa_block(const Tensor& x, const Tensor& mask, const Tensor& kpm, bool is_causal);
  Tensor ff_block(const Tensor& x);
};

}  // namespace ember::nn
