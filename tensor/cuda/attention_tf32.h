// Ember's float32 attention on tensor cores (Note [TF32 attention], attention_tf32.cu): internal
// to tensor/cuda/. attention.cu's entry points hand it the calls attention_tf32_supported()
// takes (tensor/detail/attention_kernels.h).
#pragma once

#include <cuda_runtime_api.h>

#include <ember/tensor/detail/attention_kernels.h>

namespace ember::detail {

/// out [batch, L, E] and lse [batch, L] from q [batch, L, E], k, v [batch, S, E], all float32
/// and contiguous, for a call attention_tf32_supported() takes.
void attention_tf32_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                            const AttentionParams& p, cudaStream_t s);

/// dk, dv (written) and dq32 (added to: zeroed by the caller, float32) from the forward's lse
/// and dvec[row] = sum_c dout[row, c] out[row, c].
void attention_tf32_backward(const float* q, const float* k, const float* v, const float* dout,
                             const float* lse, const float* dvec, float* dq32, float* dk, float* dv,
                             const AttentionParams& p, cudaStream_t s);

}  // namespace ember::detail
