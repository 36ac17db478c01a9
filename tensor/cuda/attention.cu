// CUDA fused attention (Note [Fused attention] in tensor/detail/attention_kernels.h) for
// float32, float16 and bfloat16 operands, accumulating in float32. Plain SIMT code (no tensor
// cores), written for clarity and a short compile: one template per dtype, head dims up to
// kMaxHeadDim (the front end sends larger ones to the math path). Where cuDNN's flash attention
// applies (Note [Attention through cuDNN], attention_cudnn.cpp) the entry points hand it the call.
//
// Forward: a block of kFwdWarps warps owns kFwdRows query rows (kRowsPerWarp per warp) and walks
// tiles of 32 keys staged in shared memory as float. Lane j scores key j of the tile for each
// of the warp's rows; the online softmax runs on warp shuffles, and lane c accumulates output
// columns c, c + 32, ... so P V needs no shared scratch.
// Backward: one warp per block owns 32 keys (lane j owns key j, its dK and dV rows live in
// shared memory) and walks every query row that can see them. dQ rows are shared by all key
// blocks, so they are summed with float atomics into a float32 buffer; D = rowsum(dO * O) is a
// separate small kernel run first.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include <ember/tensor/cuda/attention_tf32.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/attention_dropout.h>
#include <ember/tensor/detail/attention_kernels.h>

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;

constexpr int kMaxHeadDim = 128;  // must match kCudaMaxHeadDim in tensor/ops/attention.cpp
constexpr int kChunks = kMaxHeadDim / 32;
constexpr int kKeys = 32;
constexpr int kFwdWarps = 4, kRowsPerWarp = 4, kFwdRows = kFwdWarps * kRowsPerWarp;
constexpr unsigned kFull = 0xffffffffu;

__device__ inline float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

template <typename T>
struct Operands {
  const T* q;
  const T* k;
  const T* v;
  const T* mask;  // additive, or null
  AttentionParams p;

  // scale * q_i . k_j + mask(i, j) for a valid key, from float rows in shared memory.
  __device__ float score(const float* qi, const float* kj, int64_t b, int64_t i, int64_t j) const {
    float s = 0.f;
    for (int c = 0; c < p.E; ++c) s += qi[c] * kj[c];
    s *= static_cast<float>(p.scale);
    if (mask != nullptr) {
      s += static_cast<float>(
          mask[p.mask.batch_offset(b) + i * p.mask.row_stride + j * p.mask.col_stride]);
    }
    return s;
  }
  __device__ bool visible(int64_t i, int64_t j) const { return j < p.S && (!p.causal || j <= i); }
  // keep / (1 - p) for element (b, i, j), or 1 without dropout.
  __device__ float dropout_factor(int64_t b, int64_t i, int64_t j) const {
    if (p.dropout_p <= 0.0) return 1.f;
    const uint64_t e = static_cast<uint64_t>((b * p.L + i) * p.S + j);
    const PhiloxArgs a{p.seed, p.offset, p.philox_replay};
    const uint32_t w = philox_block(a.key(), a.first() + e / 4).v[e % 4];
    return attention_keep(w, static_cast<float>(p.dropout_p))
               ? static_cast<float>(1.0 / (1.0 - p.dropout_p))
               : 0.f;
  }
};

// Copies rows [r0, r0 + n) of a [rows, cols] matrix into shared memory as float with row stride
// ld, zero-filling rows past `rows`.
template <typename T>
__device__ void stage(float* dst, int ld, const T* src, int64_t r0, int n, int64_t rows, int cols) {
  for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
    const int r = idx / cols, c = idx % cols;
    dst[r * ld + c] = r0 + r < rows ? static_cast<float>(src[(r0 + r) * cols + c]) : 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kFwdWarps * 32)
    attention_fwd_kernel(Operands<T> o, T* out, float* lse, int64_t tiles) {
  extern __shared__ float smem[];
  const AttentionParams& p = o.p;
  const int E = static_cast<int>(p.E), Ev = static_cast<int>(p.Ev);
  const int ke = E + 1, kv = Ev + 1;  // odd strides: lanes reading one column each hit 32 banks
  float* ks = smem;
  float* vs = ks + kKeys * ke;
  float* qs = vs + kKeys * kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / tiles, row0 = (blockIdx.x % tiles) * kFwdRows;
  stage(qs, E, o.q + b * p.L * p.E, row0, kFwdRows, p.L, E);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kChunks];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int cc = 0; cc < kChunks; ++cc) acc[r][cc] = 0.f;
  }
  const int64_t key_end = p.causal ? min(p.S, row0 + kFwdRows) : p.S;
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeys) {
    __syncthreads();  // the previous tile (and, first time, qs) is complete / consumed
    stage(ks, ke, o.k + b * p.S * p.E, j0, kKeys, p.S, E);
    stage(vs, kv, o.v + b * p.S * p.Ev, j0, kKeys, p.S, Ev);
    __syncthreads();
    const int64_t j = j0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int lr = warp * kRowsPerWarp + r;
      const int64_t i = row0 + lr;
      const bool ok = i < p.L && o.visible(i, j);
      const float s = ok ? o.score(qs + lr * E, ks + lane * ke, b, i, j) : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(s));
      const bool none = m_new == -INFINITY;  // every key so far masked
      float pr = none ? 0.f : __expf(s - m_new);
      const float alpha = none ? 1.f : __expf(m[r] - m_new);
      l[r] = l[r] * alpha + pr;  // per-lane partial sums, all scaled alike
      m[r] = m_new;
      if (ok) pr *= o.dropout_factor(b, i, j);
#pragma unroll
      for (int cc = 0; cc < kChunks; ++cc) acc[r][cc] *= alpha;
      for (int jj = 0; jj < kKeys; ++jj) {
        const float pj = __shfl_sync(kFull, pr, jj);
#pragma unroll
        for (int cc = 0; cc < kChunks; ++cc) {
          const int c = lane + 32 * cc;
          if (c < Ev) acc[r][cc] += pj * vs[jj * kv + c];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    const float total = warp_sum(l[r]);
    if (i >= p.L) continue;
    const float inv = 1.f / total;  // inf for a fully masked row: 0 * inf = NaN, as on the CPU
#pragma unroll
    for (int cc = 0; cc < kChunks; ++cc) {
      const int c = lane + 32 * cc;
      if (c < Ev) out[(b * p.L + i) * p.Ev + c] = static_cast<T>(acc[r][cc] * inv);
    }
    if (lane == 0) lse[b * p.L + i] = m[r] + logf(total);
  }
}

// d[row] = sum_c dout[row, c] * out[row, c], one warp per row.
template <typename T>
__global__ void attention_rowdot_kernel(const T* dout, const T* out, float* d, int64_t rows,
                                        int64_t cols) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  float s = 0.f;
  for (int64_t c = lane; c < cols; c += 32) {
    s += static_cast<float>(dout[row * cols + c]) * static_cast<float>(out[row * cols + c]);
  }
  s = warp_sum(s);
  if (lane == 0) d[row] = s;
}

template <typename T>
__global__ void __launch_bounds__(32)
    attention_bwd_kernel(Operands<T> o, const T* dout, const float* lse, const float* dvec,
                         float* dq, T* dk, T* dv, int64_t tiles) {
  extern __shared__ float smem[];
  const AttentionParams& p = o.p;
  const int E = static_cast<int>(p.E), Ev = static_cast<int>(p.Ev);
  const int ke = E + 1, kv = Ev + 1;
  float* ks = smem;
  float* vs = ks + kKeys * ke;
  float* dks = vs + kKeys * kv;
  float* dvs = dks + kKeys * ke;
  float* qi = dvs + kKeys * kv;
  float* doi = qi + E;
  const int lane = threadIdx.x;
  const int64_t b = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * kKeys, j = j0 + lane;
  stage(ks, ke, o.k + b * p.S * p.E, j0, kKeys, p.S, E);
  stage(vs, kv, o.v + b * p.S * p.Ev, j0, kKeys, p.S, Ev);
  for (int c = 0; c < E; ++c) dks[lane * ke + c] = 0.f;
  for (int c = 0; c < Ev; ++c) dvs[lane * kv + c] = 0.f;
  const float scale = static_cast<float>(p.scale);
  // Causal: rows before j0 see none of these keys.
  for (int64_t i = p.causal ? j0 : 0; i < p.L; ++i) {
    __syncwarp();  // the previous row's qi / doi are consumed (and the first staging done)
    stage(qi, E, o.q + b * p.L * p.E, i, 1, p.L, E);
    stage(doi, Ev, dout + b * p.L * p.Ev, i, 1, p.L, Ev);
    __syncwarp();
    const float lse_i = lse[b * p.L + i], d_i = dvec[b * p.L + i];
    float ds = 0.f;
    if (o.visible(i, j)) {
      const float pr = __expf(o.score(qi, ks + lane * ke, b, i, j) - lse_i);
      float dp = 0.f;
      for (int c = 0; c < Ev; ++c) dp += doi[c] * vs[lane * kv + c];
      const float z = o.dropout_factor(b, i, j);
      ds = pr * (dp * z - d_i);
      // Note [Fused attention]: a bool mask's fully masked row gets masked_fill's zero.
      if (p.bool_mask && lse_i == -INFINITY) ds = 0.f;
      const float pd = pr * z;
      for (int c = 0; c < Ev; ++c) dvs[lane * kv + c] += pd * doi[c];
      for (int c = 0; c < E; ++c) dks[lane * ke + c] += scale * ds * qi[c];
    }
    float acc[kChunks] = {};
    for (int jj = 0; jj < kKeys; ++jj) {
      const float dsj = __shfl_sync(kFull, ds, jj);
#pragma unroll
      for (int cc = 0; cc < kChunks; ++cc) {
        const int c = lane + 32 * cc;
        if (c < E) acc[cc] += dsj * ks[jj * ke + c];
      }
    }
#pragma unroll
    for (int cc = 0; cc < kChunks; ++cc) {
      const int c = lane + 32 * cc;
      if (c < E) atomicAdd(dq + (b * p.L + i) * p.E + c, scale * acc[cc]);
    }
  }
  if (j < p.S) {
    for (int c = 0; c < E; ++c) dk[(b * p.S + j) * p.E + c] = static_cast<T>(dks[lane * ke + c]);
    for (int c = 0; c < Ev; ++c) dv[(b * p.S + j) * p.Ev + c] = static_cast<T>(dvs[lane * kv + c]);
  }
}

template <typename T>
__global__ void attention_cast_kernel(const float* src, T* dst, int64_t n) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) dst[idx] = static_cast<T>(src[idx]);
}

// Dynamic shared memory above the default 48 KiB must be opted into per kernel.
template <typename K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    EMBER_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
  }
}

template <typename T>
Operands<T> operands(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                     const AttentionParams& p) {
  return {q.data<T>(), k.data<T>(), v.data<T>(), mask.defined() ? mask.data<T>() : nullptr, p};
}

template <typename T>
void forward_typed(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, const Tensor& mask, const AttentionParams& p, cudaStream_t s) {
  const int64_t tiles = (p.L + kFwdRows - 1) / kFwdRows;
  const size_t smem = sizeof(float) * (kKeys * (p.E + 1) + kKeys * (p.Ev + 1) + kFwdRows * p.E);
  allow_smem(attention_fwd_kernel<T>, smem);
  attention_fwd_kernel<T><<<static_cast<unsigned>(p.batch * tiles), kFwdWarps * 32, smem, s>>>(
      operands<T>(q, k, v, mask, p), out.data<T>(), lse.data<float>(), tiles);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void backward_typed(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const Tensor& mask, const AttentionParams& p,
                    cudaStream_t s) {
  const int64_t rows = p.batch * p.L;
  Tensor dvec = make_empty({rows}, kFloat32, q.device());
  attention_rowdot_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, s>>>(
      dout.data<T>(), out.data<T>(), dvec.data<float>(), rows, p.Ev);
  EMBER_CUDA_CHECK(cudaGetLastError());
  // dQ is summed over key blocks with atomics, in float32 whatever T is.
  Tensor dq32 = dq.dtype() == kFloat32 ? dq : make_empty(dq.shape(), kFloat32, q.device());
  EMBER_CUDA_CHECK(cudaMemsetAsync(dq32.data_ptr(), 0, dq32.numel() * sizeof(float), s));
  if constexpr (std::is_same_v<T, float>) {
    if (!mask.defined() && attention_tf32_supported(kFloat32, q.device(), p, false)) {
      attention_tf32_backward(q.data<float>(), k.data<float>(), v.data<float>(), dout.data<float>(),
                              lse.data<float>(), dvec.data<float>(), dq32.data<float>(),
                              dk.data<float>(), dv.data<float>(), p, s);
      return;  // dq32 is dq
    }
  }
  const int64_t tiles = (p.S + kKeys - 1) / kKeys;
  const size_t smem = sizeof(float) * (2 * kKeys * (p.E + 1) + 2 * kKeys * (p.Ev + 1) + p.E + p.Ev);
  allow_smem(attention_bwd_kernel<T>, smem);
  attention_bwd_kernel<T><<<static_cast<unsigned>(p.batch * tiles), 32, smem, s>>>(
      operands<T>(q, k, v, mask, p), dout.data<T>(), lse.data<float>(), dvec.data<float>(),
      dq32.data<float>(), dk.data<T>(), dv.data<T>(), tiles);
  EMBER_CUDA_CHECK(cudaGetLastError());
  if (!dq32.is_same(dq)) {
    const int64_t n = dq.numel();
    attention_cast_kernel<T><<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(
        dq32.data<float>(), dq.data<T>(), n);
    EMBER_CUDA_CHECK(cudaGetLastError());
  }
}

// Runs fn.template operator()<T>() for q's dtype (float32, float16, bfloat16).
template <typename Fn>
void dispatch(Dtype dt, Fn&& fn) {
  if (dt == kFloat32) {
    fn.template operator()<float>();
  } else if (dt == kFloat16) {
    fn.template operator()<Half>();
  } else {
    EMBER_INTERNAL_ASSERT(dt == kBFloat16, "attention CUDA kernel: unexpected dtype ", dt);
    fn.template operator()<BFloat16>();
  }
}

}  // namespace

void attention_forward_cuda(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& mask, const AttentionParams& p) {
  EMBER_INTERNAL_ASSERT(p.E <= kMaxHeadDim && p.Ev <= kMaxHeadDim,
                        "attention CUDA kernel: head dim above ", kMaxHeadDim);
  if (!mask.defined() && attention_cudnn_forward(out, lse, q, k, v, p)) return;
  DeviceGuard guard(q.device().index);
  cudaStream_t s = stream_of(q.device());
  if (attention_tf32_supported(q.dtype(), q.device(), p, mask.defined())) {
    attention_tf32_forward(q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                           lse.data<float>(), p, s);
    EMBER_CUDA_CHECK(cudaGetLastError());
    return;
  }
  dispatch(q.dtype(), [&]<typename T>() { forward_typed<T>(out, lse, q, k, v, mask, p, s); });
}

void attention_backward_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse, const Tensor& mask,
                             const AttentionParams& p) {
  if (!mask.defined() && attention_cudnn_backward(dq, dk, dv, dout, q, k, v, out, lse, p)) return;
  DeviceGuard guard(q.device().index);
  cudaStream_t s = stream_of(q.device());
  dispatch(q.dtype(), [&]<typename T>() {
    backward_typed<T>(dq, dk, dv, dout, q, k, v, out, lse, mask, p, s);
  });
}

}  // namespace ember::detail
