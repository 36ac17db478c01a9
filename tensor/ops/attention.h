// Attention (torch.nn.functional.scaled_dot_product_attention, PyTorch 2 semantics) and the
// choice of its implementation (torch.nn.attention.sdpa_kernel). nn::functional names the same
// functions (nn/attention.h).
#pragma once

#include <cstdint>
#include <optional>

#include <ember/tensor/ops/random.h>
#include <ember/tensor/tensor.h>

namespace ember {

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
/// Under autocast it runs in the low precision, as matmul does.
///
/// The fused op (Note [Fused attention], tensor/detail/attention_kernels.h): the [..., L, S]
/// scores are never stored; forward keeps the output and one logsumexp per query row, backward
/// recomputes the scores tile by tile, and dropout masks are regenerated from one seed and
/// offset drawn from `gen` per call (so they differ from the math path's draws). On the CPU
/// float32 and float64 run natively and float16/bfloat16 compute in float32; on CUDA float16,
/// bfloat16 and float32 with float32 accumulation and head dims up to 128, float16/bfloat16
/// through cuDNN's flash attention where it applies (see SdpBackend). The math path runs
/// instead for float64 on CUDA, larger CUDA head dims, empty operands and a floating attn_mask
/// that requires grad. The fused op has no double backward: a backward with create_graph=true
/// through it throws NotImplementedError (use the math path for that).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask = {}, double dropout_p = 0.0,
                                    bool is_causal = false,
                                    std::optional<double> scale = std::nullopt,
                                    Generator* gen = nullptr);

/// The same attention written out with differentiable tensor ops (matmul, softmax, dropout):
/// it materialises the [..., L, S] scores. It is the reference the fused kernels are tested
/// against, and the path taken where no fused kernel applies. Validates as the fused op.
Tensor scaled_dot_product_attention_math(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& attn_mask = {}, double dropout_p = 0.0,
                                         bool is_causal = false,
                                         std::optional<double> scale = std::nullopt,
                                         Generator* gen = nullptr);

/// Which implementation scaled_dot_product_attention uses (PyTorch's
/// torch.nn.attention.sdpa_kernel). kAuto: on the CPU the fused kernel (faster than the math path
/// at every size measured); on CUDA the fused op whenever cuDNN's flash attention takes the call
/// (float16/bfloat16, no mask, no dropout, head dims a multiple of 8 up to 128, compute
/// capability 8.0 or later: tensor cores; Note [Attention through cuDNN]) or, for float32 while
/// cuda::set_matmul_allow_tf32 is on, Ember's TF32 tensor-core kernel (no mask, no dropout, head
/// dims 32 or 64, compute capability 8.0 or later; Note [TF32 attention]), else the math path
/// (cuBLAS matmuls, several times faster than Ember's SIMT fused kernel) unless its [..., L, S]
/// scores would take more than kAttentionMathBudgetBytes, where the fused kernel's O(L) memory
/// wins.
/// kFused and kMath force one (kFused still falls back to math where no kernel applies, see
/// above). A process-wide setting, as PyTorch's backend flags are.
enum class SdpBackend { kAuto, kFused, kMath };
/// Bytes of scores above which kAuto takes the fused kernel on CUDA.
inline constexpr int64_t kAttentionMathBudgetBytes = int64_t{1} << 30;
/// Sets / reads the process-wide backend (thread-safe).
void set_sdp_backend(SdpBackend b);
SdpBackend sdp_backend();

/// Whether the fused op may hand CUDA calls to cuDNN's flash attention (PyTorch's
/// torch.backends.cuda.enable_cudnn_sdp / cudnn_sdp_enabled). On by default; off, CUDA runs
/// Ember's own fused kernel where kFused or kAuto chooses it. Process-wide and thread-safe.
void enable_cudnn_sdp(bool enabled);
bool cudnn_sdp_enabled();

/// Sets the backend for a scope and restores the previous one (`with sdpa_kernel(...)`).
class SdpBackendGuard {
 public:
  explicit SdpBackendGuard(SdpBackend b) : prev_(sdp_backend()) { set_sdp_backend(b); }
  ~SdpBackendGuard() { set_sdp_backend(prev_); }
  SdpBackendGuard(const SdpBackendGuard&) = delete;
  SdpBackendGuard& operator=(const SdpBackendGuard&) = delete;

 private:
  SdpBackend prev_;
};

}  // namespace ember
