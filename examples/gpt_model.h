// The GPT-2-style byte-level language model of examples/gpt, built from a GPTConfig, so that
// every program that trains or measures it (examples/gpt.cpp, benchmarks/bench_cuda.cpp's gpt_*
// cases, a sharded-training test or benchmark) runs the same modules under the same state-dict
// names: wte, wpe, blocks.<i>.{ln1,qkv,proj,ln2,fc,fc_proj}, ln_f (with experts, blocks.<i>.moe.
// {router,w1,w3,w2} instead of fc and fc_proj). Header-only: it needs ember_nn alone, and
// examples/ and benchmarks/ both include from the source root.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/activation_checkpoint.h>
#include <ember/nn/attention.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>

namespace ember::examples {

/// Byte-level tokens: the vocabulary is every byte value.
inline constexpr int64_t kByteVocab = 256;

/// The model's shape. dim must be a multiple of heads; context is the longest sequence forward()
/// takes (the size of the position embedding).
struct GPTConfig {
  int64_t vocab = kByteVocab;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t dim = 128;
  int64_t context = 128;
  double dropout = 0;
  /// In training, keep only each block's input and recompute the rest in backward.
  bool checkpoint_activations = false;
  /// > 0: each block's MLP is a mixture of this many SwiGLU experts of hidden width 4 dim
  /// (nn::MoE), each token routed to top_k of them.
  int64_t experts = 0;
  int64_t top_k = 2;
};

/// An expert's hidden width: the dense MLP's.
inline int64_t expert_hidden(const GPTConfig& c) { return 4 * c.dim; }

/// The parameters of GPT(c), each counted once (the LM head is the token embedding's weight),
/// as a closed form of the shape: it holds for a model laid out on many ranks (tensor-parallel,
/// sharded or pipelined), whose own parameters are only its parts. A block has 12 d^2 + 13 d:
/// qkv 3d^2 + 3d, proj d^2 + d, fc 4d^2 + 4d, fc_proj 4d^2 + d and two LayerNorms of 2d. With
/// experts, fc and fc_proj give way to a router (d E) and E experts of 3 d h (h = 4d); `active`
/// counts the top_k experts a token runs (what its FLOPs are of) instead of all E.
inline int64_t parameter_count(const GPTConfig& c, bool active = false) {
  const int64_t d = c.dim;
  const int64_t dense_mlp = 8 * d * d + 5 * d;
  const int64_t used = active ? c.top_k : c.experts;
  const int64_t mlp = c.experts > 0 ? d * c.experts + used * 3 * d * expert_hidden(c) : dense_mlp;
  return c.vocab * d + c.context * d + c.layers * (4 * d * d + 8 * d + mlp) + 2 * d;
}

/// Training FLOPs per token of a sequence of `sequence` tokens, as PaLM (appendix B) and nanoGPT
/// (6N + 12 L H Q T, H Q = d) count them: 6N for the forward and backward matmuls of N
/// parameters, plus 12 L d T for the attention scores and their weighted sum (L layers, width d,
/// sequence T), the causal mask's skipped half not subtracted. llm.c's gpt2_estimate_mfu counts
/// 6N + 6 L d T, so its MFU for the same speed is lower (docs/quickstart.md converts).
/// Recomputation (activation checkpointing) is not counted: MFU measures the model's FLOPs, not the
/// hardware's.
inline int64_t flops_per_token(const GPTConfig& c, int64_t sequence) {
  return 6 * parameter_count(c, /*active=*/true) + 12 * c.layers * c.dim * sequence;
}

/// A pre-LayerNorm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x)). The query, key and
/// value projections are one Linear (fused qkv), as in GPT-2; attention is causal, through
/// scaled_dot_product_attention; the MLP is 4x wide with tanh-GELU. Default (PyTorch) init: the
/// GPT scales its own.
class Block : public nn::Module {
 public:
  /// experts > 0: the MLP is an nn::MoE of that many experts (hidden 4 dim), top_k per token.
  Block(int64_t dim, int64_t heads, double dropout, int64_t experts = 0, int64_t top_k = 2)
      : heads_(heads),
        dropout_p_(dropout),
        ln1_(register_module("ln1", std::make_shared<nn::LayerNorm>(dim))),
        qkv_(register_module("qkv", std::make_shared<nn::Linear>(dim, 3 * dim))),
        proj_(register_module("proj", std::make_shared<nn::Linear>(dim, dim))),
        ln2_(register_module("ln2", std::make_shared<nn::LayerNorm>(dim))),
        fc_(experts > 0 ? nullptr
                        : register_module("fc", std::make_shared<nn::Linear>(dim, 4 * dim))),
        gelu_(register_module("gelu", std::make_shared<nn::GELU>("tanh"))),
        fc_proj_(experts > 0
                     ? nullptr
                     : register_module("fc_proj", std::make_shared<nn::Linear>(4 * dim, dim))),
        moe_(experts > 0
                 ? register_module(
                       "moe",
                       std::make_shared<nn::MoE>(nn::MoEOptions{
                           .dim = dim, .hidden = 4 * dim, .experts = experts, .top_k = top_k}))
                 : nullptr),
        drop_(register_module("drop", std::make_shared<nn::Dropout>(dropout))) {
    EMBER_CHECK(heads > 0 && dim % heads == 0, "[gpt Block] dim (", dim,
                ") must be a multiple of heads (", heads, ")");
  }
  std::string name() const override { return "Block"; }

  /// Causal attention of q, k, v [B, heads, T, D]; unset: scaled_dot_product_attention. Context
  /// parallelism sets its own (dist::context_parallel_attention over the ranks' parts).
  using Attention = std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>;
  void set_attention(Attention attention) { attention_ = std::move(attention); }

  /// x [B, T, C] -> [B, T, C]. Children are called through operator(), so that their hooks and
  /// the layouts of tensor parallelism (dist::parallelize_module) run: under tensor parallelism
  /// qkv holds this rank's heads (its width is 3 x heads / tp x head dim, the width the split
  /// and the attention use) and, with sequence parallelism, x is this rank's part of the
  /// sequence while qkv's output covers the whole sequence.
  Tensor forward(const Tensor& x) override {
    const int64_t C = x.size(2), D = C / heads_;
    const Tensor qkv_out = (*qkv_)((*ln1_)(x));
    const int64_t B = qkv_out.size(0), T = qkv_out.size(1), width = qkv_out.size(2) / 3;
    const std::vector<Tensor> qkv = ember::split(qkv_out, width, 2);
    // [B, T, width] -> [B, heads here, T, D]
    auto heads = [&](const Tensor& t) { return t.reshape({B, T, width / D, D}).transpose(1, 2); };
    const Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    Tensor y = attention_ ? attention_(q, k, v)
                          : nn::functional::scaled_dot_product_attention(
                                q, k, v, {}, is_training() ? dropout_p_ : 0.0, /*is_causal=*/true);
    y = y.transpose(1, 2).reshape({B, T, width});
    Tensor h = x + (*drop_)((*proj_)(y));
    if (moe_) return h + (*drop_)((*moe_)((*ln2_)(h)));
    return h + (*drop_)((*fc_proj_)((*gelu_)((*fc_)((*ln2_)(h)))));
  }

  /// The projections that write into the residual stream (GPT-2 scales their init).
  std::vector<Tensor> residual_projections() const {
    return {proj_->weight, moe_ ? moe_->w2 : fc_proj_->weight};
  }
  /// The mixture of experts in place of the MLP, or null.
  const std::shared_ptr<nn::MoE>& moe() const { return moe_; }

 private:
  int64_t heads_;
  double dropout_p_;
  std::shared_ptr<nn::LayerNorm> ln1_;
  std::shared_ptr<nn::Linear> qkv_, proj_;
  std::shared_ptr<nn::LayerNorm> ln2_;
  std::shared_ptr<nn::Linear> fc_;
  std::shared_ptr<nn::GELU> gelu_;
  std::shared_ptr<nn::Linear> fc_proj_;
  std::shared_ptr<nn::MoE> moe_;
  std::shared_ptr<nn::Dropout> drop_;
  Attention attention_;
};

/// The LM head tied to the token embedding: logits = x wte.weight^T with wte's own weight, so the
/// optimizer, DDP and the state dict see one parameter. A module of its own (without parameters)
/// so that tensor parallelism can lay it out (a column-parallel head over a vocabulary-parallel
/// embedding's rows).
class TiedHead : public nn::Module {
 public:
  explicit TiedHead(std::shared_ptr<nn::Embedding> embedding) : embedding_(std::move(embedding)) {}
  std::string name() const override { return "TiedHead"; }
  /// x [..., C] -> [..., vocab]
  Tensor forward(const Tensor& x) override {
    return nn::functional::linear(x, embedding_->weight);
  }

 private:
  std::shared_ptr<nn::Embedding> embedding_;
};

/// Token + learned position embeddings, the blocks, a final LayerNorm and the LM head, tied to
/// the token embedding (TiedHead). Weights are GPT-2's init, drawn from the
/// global generator (seed it first for the same weights on every rank).
class GPT : public nn::Module {
 public:
  explicit GPT(const GPTConfig& c)
      : config(c),
        wte_(register_module("wte", std::make_shared<nn::Embedding>(c.vocab, c.dim))),
        wpe_(register_module("wpe", std::make_shared<nn::Embedding>(c.context, c.dim))),
        drop_(register_module("drop", std::make_shared<nn::Dropout>(c.dropout))),
        sequence_(register_module("blocks", std::make_shared<nn::Sequential>())),
        ln_f_(register_module("ln_f", std::make_shared<nn::LayerNorm>(c.dim))),
        lm_head_(register_module("lm_head", std::make_shared<TiedHead>(wte_))),
        blocks(make_blocks(c, *sequence_)) {
    init_weights();
  }
  std::string name() const override { return "GPT"; }

  /// tokens [B, T] (int64, T <= context) -> logits [B, T, vocab]
  Tensor forward(const Tensor& tokens) override {
    Tensor x = embed(tokens);
    for (const auto& block : blocks) x = run_block(block, x, is_training());
    return head(x);
  }
  // The three pieces of forward, for a pipeline stage that runs some of them
  // (gpt_pipeline.h's GPTPart). Modules are called as (*m)(x), so that their hooks
  // (fully_shard's) and layouts (tensor parallelism's) run.
  /// tokens [B, T] -> the first block's input [B, T, C]
  Tensor embed(const Tensor& tokens) {
    if (!local_positions_.defined()) {
      return (*drop_)((*wte_)(tokens) + (*wpe_)(positions(tokens.size(1), tokens.device())));
    }
    EMBER_CHECK(local_positions_.size(0) == tokens.size(1), "[GPT] ", tokens.size(1),
                " tokens, but this rank's part of the sequence holds ", local_positions_.size(0));
    return (*drop_)((*wte_)(tokens) + (*wpe_)(local_positions_));
  }
  /// Context parallelism: the tokens are this rank's part of each sequence, at `positions` (its
  /// chunks of 0..context-1), and every block attends through `attention`.
  void set_context_parallel(const Block::Attention& attention, Tensor positions) {
    for (const auto& block : blocks) block->set_attention(attention);
    local_positions_ = std::move(positions);
  }
  /// One block, checkpointed when the config says so and `training`.
  Tensor run_block(const std::shared_ptr<Block>& block, const Tensor& x, bool training) const {
    return config.checkpoint_activations && training ? nn::checkpoint(block, x) : (*block)(x);
  }
  /// The last block's output -> logits [B, T, vocab]
  Tensor head(const Tensor& x) { return (*lm_head_)((*ln_f_)(x)); }
  /// With experts: the mean over blocks of their balance losses in the last forward (each 1
  /// when the loads are even); undefined without.
  Tensor aux_loss() const {
    Tensor sum;
    for (const auto& block : blocks) {
      if (!block->moe()) return {};
      sum = sum.defined() ? sum + block->moe()->aux_loss() : block->moe()->aux_loss();
    }
    return sum.defined() ? sum / static_cast<double>(blocks.size()) : sum;
  }
  int64_t context() const { return config.context; }

  const GPTConfig config;

 private:
  // The blocks, in order, each also registered in `sequence` (named blocks.<i>).
  static std::vector<std::shared_ptr<Block>> make_blocks(const GPTConfig& c,
                                                         nn::Sequential& sequence) {
    std::vector<std::shared_ptr<Block>> made;
    for (int64_t i = 0; i < c.layers; ++i) {
      made.push_back(std::make_shared<Block>(c.dim, c.heads, c.dropout, c.experts, c.top_k));
      sequence.push_back(made.back());
    }
    return made;
  }

  // GPT-2's: every Linear weight and embedding N(0, 0.02), biases zero (LayerNorm keeps its ones
  // and zeros), and the residual projections N(0, 0.02 / sqrt(2 * layers)).
  void init_weights() {
    for (auto& [name, p] : named_parameters()) {
      const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
      if (name.find("ln") != std::string::npos) continue;
      if (bias) {
        nn::init::zeros_(p);
      } else {
        nn::init::normal_(p, 0.0, 0.02);
      }
    }
    for (const auto& block : blocks) {
      for (Tensor w : block->residual_projections()) {
        nn::init::normal_(w, 0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(config.layers)));
      }
    }
  }

  // 0..T-1 on `device`: a prefix of 0..context-1, made once per device. A copy from the host in
  // every step would cost an upload, and a CUDA graph could not capture it; one tensor for every
  // length keeps the memory a captured step reads alive when a later forward (sampling) uses
  // another length.
  Tensor positions(int64_t T, Device device) {
    if (!positions_.defined() || positions_.device() != device) {
      positions_ = ember::arange(0, config.context, 1, {ember::kInt64}).to(device);
    }
    EMBER_CHECK(T <= config.context, "[GPT] a sequence of ", T, " tokens is longer than the ",
                "model's context of ", config.context);
    return positions_.narrow(0, 0, T);
  }

  std::shared_ptr<nn::Embedding> wte_, wpe_;
  std::shared_ptr<nn::Dropout> drop_;
  std::shared_ptr<nn::Sequential> sequence_;
  std::shared_ptr<nn::LayerNorm> ln_f_;
  std::shared_ptr<TiedHead> lm_head_;
  Tensor positions_;
  Tensor local_positions_;  // set_context_parallel's

 public:
  /// The decoder blocks in order: the modules of the state dict's blocks.<i>, for a caller that
  /// wraps, shards or measures them one by one. Declared last because the blocks are built
  /// after ln_f: the construction order fixes the random draws, so a seed gives the weights it
  /// always gave.
  const std::vector<std::shared_ptr<Block>> blocks;
};

}  // namespace ember::examples
