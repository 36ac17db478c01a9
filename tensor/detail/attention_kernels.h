// Fused scaled-dot-product attention kernels (flash-attention style), one per backend:
// tensor/cpu/attention.cpp and tensor/cuda/attention.cu. The front end (tensor/ops/attention.cpp)
// validates, lays the operands out for the kernel (below), turns a bool mask into an additive one
// and draws the dropout seed, so kernels only assert; the autograd node is in
// autograd/functions_nn.cpp.
//
// Note [Attention operand layouts]
// The CUDA kernel takes q, k, v, out and dout contiguous. The CPU kernel takes them strided: any
// strides over the leading dims and between rows, elements of a row adjacent (AttentionRows), so
// the heads a transformer splits off a fused qkv projection ([B, T, 3, H, D] viewed as
// [B, H, T, D]) reach it without a copy. The CPU output and the gradients are allocated densely
// in their input's dim order (attention_empty_like): from such heads, out is [B, T, H, D] in
// memory, so out.transpose(1, 2).reshape({B, T, C}) and the gradients' way back through the same
// views copy nothing (PyTorch's CPU flash attention allocates its output the same way).
//
// Note [Fused attention]
// Forward walks key tiles with an online softmax (running max m and sum l per query row), so
// the [batch, L, S] scores never exist in memory; it saves the output O and the per-row
// logsumexp lse = m + log(l). Backward (FlashAttention-2) recomputes each score tile as
// P = exp(scale * Q K^T + mask - lse), then dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with
// D = rowsum(dO * O), dQ += scale * dS K, dK += scale * dS^T Q. Causal attention is top-left
// aligned (query i sees keys j <= i) and tiles above the diagonal are skipped. A row whose keys
// are all masked has l = 0 and lse = -inf: its output is 0/0 = NaN and its recomputed P is NaN,
// which is what the written-out softmax gives (and PyTorch).
// Dropout multiplies P (after l is summed) by keep / (1 - p); element (b, i, j) keeps when the
// Philox word number (b * L + i) * S + j of the stream (seed, offset) is >= p as a uniform, so
// backward (and the CUDA kernel) regenerate the same mask without storing it.
#pragma once

#include <cstdint>

#include <ember/tensor/half.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

/// Leading dims an additive mask is broadcast over, at most; the front end makes a mask
/// contiguous when its broadcast needs more.
inline constexpr int kAttentionMaxLead = 6;

/// Where element (b, i, j) of the broadcast mask lives: the flat batch index b is split over
/// the leading dims (sizes, strides; stride 0 where the mask broadcasts).
struct AttentionMaskLayout {
  int nlead = 0;
  int64_t size[kAttentionMaxLead] = {};
  int64_t stride[kAttentionMaxLead] = {};
  int64_t row_stride = 0, col_stride = 0;

  EMBER_HD int64_t batch_offset(int64_t b) const {
    int64_t off = 0;
    for (int d = nlead - 1; d >= 0; --d) {
      off += (b % size[d]) * stride[d];
      b /= size[d];
    }
    return off;
  }
};

/// Where row i of batch entry b of an operand [..., rows, cols] lives: the flat batch index is
/// split over the leading dims; the row's elements are adjacent (the front end copies operands
/// whose last dim is strided). row_stride >= cols, so a row block is a BLAS matrix with that
/// leading dim.
struct AttentionRows {
  AttentionMaskLayout lead;  ///< nlead, sizes and strides of the leading dims
  int64_t row_stride = 0;
  template <typename T>
  T* row(T* base, int64_t b, int64_t i) const {
    return base + lead.batch_offset(b) + i * row_stride;
  }
};

/// The CPU kernel's view of t ([..., rows, cols] with at most kAttentionMaxLead leading dims,
/// last stride 1, row stride >= cols).
AttentionRows attention_rows(const Tensor& t);

/// Whether t has a layout attention_rows accepts.
bool attention_rows_ok(const Tensor& t);

/// Whether a kernel reads t as it is: on the CPU with a row layout. Others (CUDA, or no row
/// layout) get a contiguous copy from the front end and the autograd node.
bool attention_reads_as_is(const Tensor& t);

/// An uninitialised tensor of like's shape, its last dim `last` wide, dense in like's dim order
/// (dims by decreasing stride; Note [Attention operand layouts]). Contiguous when like is.
Tensor attention_empty_like(const Tensor& like, int64_t last, Dtype dtype);

/// Shapes and attributes of one fused attention call. q [..., L, E], k [..., S, E],
/// v [..., S, Ev], out [..., L, Ev] with `batch` entries over the leading dims (contiguous on
/// CUDA, AttentionRows on the CPU), lse [batch, L] contiguous (float32 on CUDA, else q's dtype).
struct AttentionParams {
  int64_t batch = 0, L = 0, S = 0, E = 0, Ev = 0;
  double scale = 1.0;
  bool causal = false;
  AttentionMaskLayout mask;  ///< used when the mask tensor passed is defined
  /// The mask came from a bool mask: a fully masked row then gets a zero dq and contributes
  /// zero to dk (masked_fill's gradient), where an additive -inf mask passes NaN on.
  bool bool_mask = false;
  double dropout_p = 0.0;
  uint64_t seed = 0, offset = 0;  ///< Philox stream of the dropout mask
  /// In a CUDA graph: the graph's {seed, first counter} words, `offset` relative to them
  /// (detail::PhiloxArgs).
  const uint64_t* philox_replay = nullptr;
};

/// Counter values of the dropout stream a call reserves (one per four elements).
inline uint64_t attention_dropout_counters(const AttentionParams& p) {
  return (static_cast<uint64_t>(p.batch * p.L * p.S) + 3) / 4;
}

/// Forward: writes out and lse. mask: additive, q's dtype, or undefined.
void attention_forward_cpu(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& mask, const AttentionParams& p);
void attention_forward_cuda(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& mask, const AttentionParams& p);

/// cuDNN's fused attention on tensor cores (Note [Attention through cuDNN],
/// tensor/cuda/attention_cudnn.cpp), which the CUDA forward and backward try first. Whether it
/// takes a call of this dtype on this device: float16 or bfloat16, no mask, no dropout, equal
/// head dims that are a multiple of 8 up to 128, a GPU of compute capability 8.0 or later, and a
/// graph cuDNN builds for these shapes (built once per shape and thread, then cached). False in
/// a build without cuDNN's frontend and on the CPU.
bool attention_cudnn_supported(Dtype dtype, Device device, const AttentionParams& p, bool has_mask);
/// Whether cuDNN's backward takes the call (attention_cudnn_backward runs it rather than
/// returning false): the same conditions, and a backward graph cuDNN builds for these shapes.
bool attention_cudnn_backward_supported(Dtype dtype, Device device, const AttentionParams& p);
/// Run it; false (nothing written) where attention_cudnn_supported is false. Operands as for
/// attention_forward_cuda; lse is cuDNN's Stats (the logsumexp of the scaled scores, natural
/// log), so either kernel's backward reads the other's forward.
bool attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, const AttentionParams& p);
bool attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const AttentionParams& p);

/// Ember's float32 attention on tensor cores (Note [TF32 attention], tensor/cuda/
/// attention_tf32.cu), which the CUDA forward and backward take after cuDNN's. Whether it takes
/// a call: float32 on a CUDA device of compute capability 8.0 or later while TF32 matmuls are
/// allowed (cuda::set_matmul_allow_tf32), no mask, no dropout, equal head dims of 32 or 64, and
/// the shared memory its kernels need. False in a build without CUDA and on the CPU.
bool attention_tf32_supported(Dtype dtype, Device device, const AttentionParams& p, bool has_mask);

/// Backward: writes dq, dk, dv (same shapes as q, k, v) from dout and the forward's out, lse.
void attention_backward_cpu(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor& mask,
                            const AttentionParams& p);
void attention_backward_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const Tensor& mask,
                             const AttentionParams& p);

}  // namespace ember::detail
