#include <ember/nn/layers/transformer.h>

#include <ember/nn/functional.h>

namespace ember::nn {

namespace {
constexpr const char* kOp = "TransformerEncoderLayer";
}  // namespace

TransformerEncoderLayer::TransformerEncoderLayer(int64_t d_model, int64_t nhead,
                                                 const TransformerEncoderLayerOptions& options)
    : options(options) {
  EMBER_CHECK(options.activation == "relu" || options.activation == "gelu", "[", kOp,
              "] expected activation \"relu\" or \"gelu\", got \"", options.activation, "\"");
  // Ember's LayerNorm always has a bias when it has a weight; torch 2.1's bias=False would
  // drop the LayerNorms' biases too, so a half-honoured flag is refused instead.
  if (!options.bias) {
    throw NotImplementedError(detail::str_cat(
        "[", kOp, "] bias=false is not supported (LayerNorm has no bias-free form in Ember)"));
  }
  // Registration order is torch's, so state_dict lists the same names in the same order.
  MultiheadAttentionOptions attn;
  attn.dropout = options.dropout;
  attn.batch_first = options.batch_first;
  attn.bias = options.bias;
  self_attn = register_module("self_attn", std::make_shared<MultiheadAttention>(d_model, nhead,
                                                                                 attn));
  linear1 = register_module("linear1", std::make_shared<Linear>(d_model, options.dim_feedforward,
                                                                options.bias));
  dropout = register_module("dropout", std::make_shared<Dropout>(options.dropout));
  linear2 = register_module("linear2", std::make_shared<Linear>(options.dim_feedforward, d_model,
                                                                options.bias));
  const LayerNormOptions ln{.eps = options.layer_norm_eps};
  norm1 = register_module("norm1", std::make_shared<LayerNorm>(d_model, ln));
  norm2 = register_module("norm2", std::make_shared<LayerNorm>(d_model, ln));
  dropout1 = register_module("dropout1", std::make_shared<Dropout>(options.dropout));
  dropout2 = register_module("dropout2", std::make_shared<Dropout>(options.dropout));
}

Tensor TransformerEncoderLayer::sa_block(const Tensor& x, const Tensor& mask, const Tensor& kpm,
                                         bool is_causal) {
  return dropout1->forward(
      self_attn->forward(x, x, x, kpm, /*need_weights=*/false, mask, true, is_causal).output);
}

Tensor TransformerEncoderLayer::ff_block(const Tensor& x) {
  const Tensor h = linear1->forward(x);
  const Tensor a = options.activation == "gelu" ? gelu(h) : relu(h);
  return dropout2->forward(linear2->forward(dropout->forward(a)));
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const Tensor& src_mask,
                                        const Tensor& src_key_padding_mask, bool is_causal) {
  Tensor x = src;
  if (options.norm_first) {
    x = x + sa_block(norm1->forward(x), src_mask, src_key_padding_mask, is_causal);
    return x + ff_block(norm2->forward(x));
  }
  x = norm1->forward(x + sa_block(x, src_mask, src_key_padding_mask, is_causal));
  return norm2->forward(x + ff_block(x));
}

Tensor TransformerEncoderLayer::forward(const Tensor& src) { return forward(src, {}, {}); }

}  // namespace ember::nn
