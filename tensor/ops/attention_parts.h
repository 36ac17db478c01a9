// The fused attention's forward and backward as two plain ops (PyTorch's
// _scaled_dot_product_flash_attention and its backward), for attention computed over blocks of
// keys and combined: context parallelism (dist::context_parallel_attention), ring attention.
// scaled_dot_product_attention (tensor/ops/attention.h) is the differentiable op; these record
// nothing.
#pragma once

#include <optional>

#include <ember/tensor/tensor.h>

namespace ember {

/// The output and the logsumexp of one fused attention call.
struct AttentionForward {
  Tensor out;  ///< [..., L, Ev]
  /// [..., L]: per query row, log(sum_j exp(scale * q . k_j)) over the keys it sees (natural
  /// log), float32 (float64 for float64 operands on the CPU).
  Tensor lse;
};

/// softmax(q @ k^T * scale) @ v through the fused kernels (Note [Fused attention]; cuDNN's flash
/// attention on CUDA where it applies), without mask or dropout, and the rows' logsumexp. Two
/// calls over disjoint key blocks combine exactly: lse = logaddexp(lse1, lse2), out =
/// out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse). q [..., L, E], k [..., S, E], v [..., S,
/// Ev] as for scaled_dot_product_attention; is_causal: query i sees keys j <= i. out is in the
/// dtype the kernel computes in: float32 for float16/bfloat16 on the CPU, the operands' on CUDA.
/// Throws as scaled_dot_product_attention does for bad operands, and NotImplementedError for
/// empty ones or what no fused kernel takes (float64 or head dims past 128 on CUDA).
AttentionForward scaled_dot_product_attention_forward(const Tensor& q, const Tensor& k,
                                                      const Tensor& v, bool is_causal = false,
                                                      std::optional<double> scale = std::nullopt);

/// The gradients of the attention of q over k, v.
struct AttentionGrads {
  Tensor dq, dk, dv;  ///< q's, k's and v's shapes and dtypes
};

/// The backward of one block (FlashAttention-2's): the gradients of q, k and v of that call
/// given dout and the forward's out and lse. Passing a combined out and lse (every block's)
/// gives this block's exact share of dq and its keys' dk and dv, so blocks' backward calls sum
/// to the whole attention's. Same operands and conditions as the forward; out and lse of q's
/// leading shape (any floating dtype, converted as the kernel needs).
AttentionGrads scaled_dot_product_attention_backward(const Tensor& dout, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& out, const Tensor& lse,
                                                     bool is_causal = false,
                                                     std::optional<double> scale = std::nullopt);

}  // namespace ember
