// Attention (torch.nn.functional.scaled_dot_product_attention, PyTorch 2 semantics).
#pragma once

#include <optional>

#include "tensor/ops.h"

namespace ember::nn::functional {

/// softmax(q @ k^T * scale + mask) @ v, with dropout on the attention weights.
///   q [..., L, E], k [..., S, E], v [..., S, Ev] -> [..., L, Ev]; the leading dims of q, k
///   and v must be equal (e.g. [B, H]).
///   attn_mask (optional) broadcasts to [..., L, S]: a bool mask where true means "may attend",
///   or a floating mask (of q's dtype) added to the scores.
///   dropout_p in [0, 1): the attention weights are dropped with this probability (drawn from
///   `gen`, default the global generator) whenever dropout_p > 0, as in PyTorch (pass 0 in eval).
///   is_causal: query i attends to keys j <= i (the top-left aligned lower triangle); may not
///   be combined with attn_mask.
///   scale (optional) defaults to 1 / sqrt(E).
/// A row whose keys are all masked out yields NaN, as in PyTorch (with a bool mask its query
/// gradient is 0 and the key gradient stays finite, as through masked_fill; the value gradient
/// is NaN). Throws ValueError/TypeError naming the op for mismatched shapes, dtypes or devices.
///
/// Runs as one fused op (tensor/detail/attention_kernels.h, Note [Fused attention]): the
/// [..., L, S] scores are never stored; forward keeps the output and one logsumexp per query
/// row, backward recomputes the scores tile by tile, and dropout masks are regenerated from one
/// seed and offset drawn from `gen` per call (so they differ from the math path's draws). On the
/// CPU float32 and float64 run natively and float16/bfloat16 compute in float32; on CUDA
/// float16, bfloat16 and float32 with float32 accumulation and head dims up to 128. The math
/// path runs instead for float64 on CUDA, larger CUDA head dims, empty operands and a floating
/// attn_mask that requires grad. The fused op has no double backward: a backward with
/// create_graph=true through it throws NotImplementedError (use the math path for that).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask = {}, double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    Generator* gen = nullptr);

/// The same attention written out with differentiable tensor ops (matmul, softmax, dropout):
/// it materialises the [..., L, S] scores. It is the reference the fused kernels are tested
/// against, and the path taken where no fused kernel applies.
Tensor scaled_dot_product_attention_math(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& attn_mask = {}, double dropout_p = 0.0,
                                         bool is_causal = false,
                                         std::optional<double> scale = std::nullopt,
                                         Generator* gen = nullptr);

}  // namespace ember::nn::functional
