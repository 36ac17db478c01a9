// Note [TF32 attention]
// float32 attention on tensor cores where TF32 matmuls are allowed (cuda::set_matmul_allow_tf32,
// PyTorch's torch.backends.cuda.matmul.allow_tf32): cuDNN's flash attention takes only float16
// and bfloat16, Ember's SIMT kernel (attention.cu) runs at CUDA-core speed, and the written-out
// path stores the [L, S] scores of every head. The four products of a step (q k^T and P v
// forward; k q^T, v dO^T, P^T dO, dS^T q and dS k backward) are WMMA m16n16k8 TF32 products
// accumulating in float32, with operands rounded to TF32 once as they are staged in shared
// memory; the softmax, its online rescaling and lse stay in float32. As with any matmul under
// allow_tf32 the results carry TF32's 10-bit mantissa in the products. Calls it takes: float32,
// no mask, no dropout, equal head dims of 32 or 64 (GPT-2's; at 128 the backward's fragments
// no longer fit in registers: those calls keep the other paths), compute capability 8.0 or
// later, and the shared memory its backward needs (110 KiB at 64).
//
// Forward: a block of kWarps warps owns kRows = 64 query rows (16 per warp) and walks steps of
// kTile = 64 keys staged in shared memory. Each warp's 16 x 64 scores go to shared memory, where
// its lanes run the online softmax row by row (lane c: keys c and c + 32) and rescale the warp's
// output rows, which live in shared memory too (an accumulator fragment's element layout is
// unspecified, so its rows cannot be scaled in registers), before P v is added to them.
// Backward: a block owns 64 keys (16 per warp) and walks the steps of 64 query rows that see
// them. Per step, each warp computes S^T and dP^T for its keys (k q^T, v dO^T), then P^T =
// exp(scale S^T - lse) and dS^T = P^T (dP^T - D) elementwise; dV += P^T dO and dK += dS^T q
// accumulate in fragments over the steps. dQ's rows of the step (warp w: rows 16 w.., dS k over
// the block's 64 keys) are added to a float32 buffer with atomics, as the SIMT kernel does.
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/attention_tf32.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/warp_rows.cuh>

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define EMBER_TF32_MMA 1
#else
#define EMBER_TF32_MMA 0
#endif

namespace ember::detail {

namespace {

constexpr int kRows = 64;        // query rows (forward) or keys (backward) a block owns
constexpr int kTile = 64;        // keys (forward) or query rows (backward) per step
constexpr int kWarps = 4;        // 16 of the block's rows each
constexpr int kLdS = kTile + 4;  // row stride of the scores, in floats
constexpr int kLdQ = 16 + 4;     // row stride of a warp's 16 x 16 piece of dQ

// Row strides are kD + 4 floats: a multiple of 4 (WMMA's rule for 32-bit operands) whose 16- and
// 8-row offsets stay 32-byte aligned, and not a multiple of 32, so rows start in other banks.
template <int kD>
constexpr int ld_of = kD + 4;

template <int kD>
constexpr size_t forward_smem_bytes = sizeof(float) * (3 * kRows * ld_of<kD> + kRows * kLdS);
template <int kD>
constexpr size_t backward_smem_bytes = sizeof(float) *
                                       (4 * kRows * ld_of<kD> + 2 * kWarps * 16 * kLdS +
                                        kWarps * 16 * kLdQ + 2 * kTile);

__device__ inline float warp_max(float v) {
  return warp_rows::all_reduce(v, [](float a, float b) { return fmaxf(a, b); });
}

__device__ inline bool visible(const AttentionParams& p, int64_t i, int64_t j) {
  return j < p.S && (!p.causal || j <= i);
}

#if EMBER_TF32_MMA
namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using FragAcol = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using FragBcol = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

__device__ inline float tf32(float x) { return wmma::__float_to_tf32(x); }

// Rows [r0, r0 + 64) of a [rows, kD] float32 matrix into shared memory (row stride ld_of<kD>),
// rounded to TF32; rows past `rows` are zero.
template <int kD>
__device__ void stage_rows(float* dst, const float* src, int64_t r0, int64_t rows) {
  for (int idx = threadIdx.x; idx < kRows * kD; idx += blockDim.x) {
    const int r = idx / kD, c = idx % kD;
    dst[r * ld_of<kD> + c] = r0 + r < rows ? tf32(src[(r0 + r) * kD + c]) : 0.f;
  }
}
#endif

template <int kD>
__global__ void __launch_bounds__(kWarps * 32)
    attention_tf32_fwd_kernel(const float* __restrict__ q, const float* __restrict__ k,
                              const float* __restrict__ v, float* __restrict__ out,
                              float* __restrict__ lse, AttentionParams p, int64_t tiles) {
#if EMBER_TF32_MMA
  constexpr int ld = ld_of<kD>;
  extern __shared__ __align__(128) float smem[];
  float* ks = smem;             // [kTile][ld] the step's keys
  float* vs = ks + kTile * ld;  // [kTile][ld] and values
  float* os = vs + kTile * ld;  // [kRows][ld] the block's q rows, then its output rows
  float* ss = os + kRows * ld;  // [kRows][kLdS] scores, then probabilities
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / tiles, row0 = (blockIdx.x % tiles) * kRows;
  const int64_t L = p.L, S = p.S;
  const float scale = static_cast<float>(p.scale);

  stage_rows<kD>(os, q + b * L * kD, row0, L);
  __syncthreads();
  FragA qf[kD / 8];
#pragma unroll
  for (int kk = 0; kk < kD / 8; ++kk) {
    wmma::load_matrix_sync(qf[kk], os + warp * 16 * ld + kk * 8, ld);
  }
  __syncthreads();  // every warp holds its q: os becomes the output rows
  for (int idx = threadIdx.x; idx < kRows * ld; idx += blockDim.x) os[idx] = 0.f;

  float m[16], l[16];  // each of the warp's rows' running max and sum (alike in every lane)
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  float* sw = ss + warp * 16 * kLdS;
  float* ow = os + warp * 16 * ld;
  const int64_t wrow0 = row0 + warp * 16;
  const int64_t key_end = p.causal ? min(S, row0 + kRows) : S;
  for (int64_t j0 = 0; j0 < key_end; j0 += kTile) {
    __syncthreads();  // the previous step's keys and values are consumed (first: os zeroed)
    stage_rows<kD>(ks, k + b * S * kD, j0, S);
    stage_rows<kD>(vs, v + b * S * kD, j0, S);
    __syncthreads();
    // The warp's scores, q_w k^T: [16, 64]. (Outer loops here stay rolled: unrolled, the
    // compiler keeps every fragment of every iteration live.)
#pragma unroll 1
    for (int nt = 0; nt < kTile / 16; ++nt) {
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kD / 8; ++kk) {
        FragBcol kb;  // k^T: element (c, j) is ks[j * ld + c]
        wmma::load_matrix_sync(kb, ks + nt * 16 * ld + kk * 8, ld);
        wmma::mma_sync(acc, qf[kk], kb, acc);
      }
      wmma::store_matrix_sync(sw + nt * 16, acc, kLdS, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int64_t i = wrow0 + r;
      float s0 = sw[r * kLdS + lane] * scale, s1 = sw[r * kLdS + lane + 32] * scale;
      if (!(i < L && visible(p, i, j0 + lane))) s0 = -INFINITY;
      if (!(i < L && visible(p, i, j0 + lane + 32))) s1 = -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(fmaxf(s0, s1)));
      const bool none = m_new == -INFINITY;  // every key so far masked (a padding row)
      const float p0 = none ? 0.f : __expf(s0 - m_new), p1 = none ? 0.f : __expf(s1 - m_new);
      const float alpha = none ? 1.f : __expf(m[r] - m_new);
      l[r] = l[r] * alpha + warp_rows::sum(p0 + p1);
      m[r] = m_new;
      sw[r * kLdS + lane] = tf32(p0);
      sw[r * kLdS + lane + 32] = tf32(p1);
      for (int c = lane; c < kD; c += 32) ow[r * ld + c] *= alpha;
    }
    __syncwarp();
    // o_w += P_w v.
#pragma unroll 1
    for (int nt = 0; nt < kD / 16; ++nt) {
      FragC acc;
      wmma::load_matrix_sync(acc, ow + nt * 16, ld, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTile / 8; ++kk) {
        FragA pa;
        FragB vb;
        wmma::load_matrix_sync(pa, sw + kk * 8, kLdS);
        wmma::load_matrix_sync(vb, vs + kk * 8 * ld + nt * 16, ld);
        wmma::mma_sync(acc, pa, vb, acc);
      }
      wmma::store_matrix_sync(ow + nt * 16, acc, ld, wmma::mem_row_major);
    }
    __syncwarp();
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int64_t i = wrow0 + r;
    if (i >= L) continue;
    const float inv = 1.f / l[r];
    for (int c = lane; c < kD; c += 32) out[(b * L + i) * kD + c] = ow[r * ld + c] * inv;
    if (lane == 0) lse[b * L + i] = m[r] + logf(l[r]);
  }
#endif
}

template <int kD>
__global__ void __launch_bounds__(kWarps * 32)
    attention_tf32_bwd_kernel(const float* __restrict__ q, const float* __restrict__ k,
                              const float* __restrict__ v, const float* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ dvec,
                              float* __restrict__ dq, float* __restrict__ dk,
                              float* __restrict__ dv, AttentionParams p, int64_t tiles) {
#if EMBER_TF32_MMA
  constexpr int ld = ld_of<kD>;
  extern __shared__ __align__(128) float smem[];
  float* ks = smem;                         // [kRows][ld] the block's keys
  float* vs = ks + kRows * ld;              // [kRows][ld] and values
  float* qs = vs + kRows * ld;              // [kTile][ld] the step's q rows
  float* dos = qs + kTile * ld;             // [kTile][ld] and output gradients
  float* st = dos + kTile * ld;             // [kRows][kLdS] S^T, then P^T (warp w: rows 16 w..)
  float* dpt = st + kRows * kLdS;           // [kRows][kLdS] dP^T, then dS^T
  float* dqw = dpt + kRows * kLdS;          // [kWarps][16][kLdQ] a warp's piece of dQ
  float* lse_s = dqw + kWarps * 16 * kLdQ;  // [kTile]
  float* d_s = lse_s + kTile;               // [kTile]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / tiles, j0 = (blockIdx.x % tiles) * kRows;
  const int64_t L = p.L, S = p.S;
  const float scale = static_cast<float>(p.scale);

  stage_rows<kD>(ks, k + b * S * kD, j0, S);
  stage_rows<kD>(vs, v + b * S * kD, j0, S);
  FragC dk_acc[kD / 16], dv_acc[kD / 16];
#pragma unroll
  for (int nt = 0; nt < kD / 16; ++nt) {
    wmma::fill_fragment(dk_acc[nt], 0.f);
    wmma::fill_fragment(dv_acc[nt], 0.f);
  }
  const float* kw = ks + warp * 16 * ld;
  const float* vw = vs + warp * 16 * ld;
  float* stw = st + warp * 16 * kLdS;
  float* dptw = dpt + warp * 16 * kLdS;
  float* dqp = dqw + warp * 16 * kLdQ;
  // Causal: query rows before j0 see none of the block's keys (kTile == kRows keeps the steps
  // aligned with the blocks).
  for (int64_t i0 = p.causal ? j0 : 0; i0 < L; i0 += kTile) {
    __syncthreads();  // the previous step is consumed (first: ks and vs staged)
    stage_rows<kD>(qs, q + b * L * kD, i0, L);
    stage_rows<kD>(dos, dout + b * L * kD, i0, L);
    for (int t = threadIdx.x; t < kTile; t += blockDim.x) {
      const int64_t i = i0 + t;
      lse_s[t] = i < L ? lse[b * L + i] : 0.f;
      d_s[t] = i < L ? dvec[b * L + i] : 0.f;
    }
    __syncthreads();
    // The warp's S^T = k_w q^T and dP^T = v_w dO^T: [16 keys, 64 rows].
#pragma unroll 1
    for (int nt = 0; nt < kTile / 16; ++nt) {
      FragC sacc, pacc;
      wmma::fill_fragment(sacc, 0.f);
      wmma::fill_fragment(pacc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kD / 8; ++kk) {
        FragA ka, va;
        FragBcol qb, db;  // q^T and dO^T, as k^T forward
        wmma::load_matrix_sync(ka, kw + kk * 8, ld);
        wmma::load_matrix_sync(va, vw + kk * 8, ld);
        wmma::load_matrix_sync(qb, qs + nt * 16 * ld + kk * 8, ld);
        wmma::load_matrix_sync(db, dos + nt * 16 * ld + kk * 8, ld);
        wmma::mma_sync(sacc, ka, qb, sacc);
        wmma::mma_sync(pacc, va, db, pacc);
      }
      wmma::store_matrix_sync(stw + nt * 16, sacc, kLdS, wmma::mem_row_major);
      wmma::store_matrix_sync(dptw + nt * 16, pacc, kLdS, wmma::mem_row_major);
    }
    __syncwarp();
    for (int idx = lane; idx < 16 * kTile; idx += 32) {
      const int r = idx / kTile, c = idx % kTile;
      const int64_t j = j0 + warp * 16 + r, i = i0 + c;
      float pr = 0.f, ds = 0.f;
      if (i < L && visible(p, i, j)) {
        pr = __expf(stw[r * kLdS + c] * scale - lse_s[c]);
        ds = pr * (dptw[r * kLdS + c] - d_s[c]);
      }
      stw[r * kLdS + c] = tf32(pr);
      dptw[r * kLdS + c] = tf32(ds);
    }
    __syncwarp();
    // dV_w += P^T_w dO and dK_w += dS^T_w q (scaled when written): each 8-row slice of P^T_w
    // and dS^T_w is loaded once for every column tile.
#pragma unroll 1
    for (int kk = 0; kk < kTile / 8; ++kk) {
      FragA pa, sa;
      wmma::load_matrix_sync(pa, stw + kk * 8, kLdS);
      wmma::load_matrix_sync(sa, dptw + kk * 8, kLdS);
#pragma unroll
      for (int nt = 0; nt < kD / 16; ++nt) {
        FragB db, qb;
        wmma::load_matrix_sync(db, dos + kk * 8 * ld + nt * 16, ld);
        wmma::load_matrix_sync(qb, qs + kk * 8 * ld + nt * 16, ld);
        wmma::mma_sync(dv_acc[nt], pa, db, dv_acc[nt]);
        wmma::mma_sync(dk_acc[nt], sa, qb, dk_acc[nt]);
      }
    }
    __syncthreads();  // every warp's dS^T is written
    // dQ's rows 16 w.. of the step += scale dS k over the block's keys; dS = (dS^T)^T is dpt
    // read column-major.
    const int64_t iw = i0 + warp * 16;
#pragma unroll 1
    for (int nt = 0; nt < kD / 16; ++nt) {
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int kk = 0; kk < kRows / 8; ++kk) {
        FragAcol sa;
        FragB kb;
        wmma::load_matrix_sync(sa, dpt + kk * 8 * kLdS + warp * 16, kLdS);
        wmma::load_matrix_sync(kb, ks + kk * 8 * ld + nt * 16, ld);
        wmma::mma_sync(acc, sa, kb, acc);
      }
      wmma::store_matrix_sync(dqp, acc, kLdQ, wmma::mem_row_major);
      __syncwarp();
      for (int idx = lane; idx < 16 * 16; idx += 32) {
        const int r = idx / 16, c = idx % 16;
        if (iw + r < L) {
          atomicAdd(dq + (b * L + iw + r) * kD + nt * 16 + c, scale * dqp[r * kLdQ + c]);
        }
      }
      __syncwarp();
    }
  }
  __syncthreads();  // the last step's tiles are consumed: qs and dos take dK and dV
  float* dks = qs + warp * 16 * ld;
  float* dvs = dos + warp * 16 * ld;
#pragma unroll
  for (int nt = 0; nt < kD / 16; ++nt) {
    wmma::store_matrix_sync(dks + nt * 16, dk_acc[nt], ld, wmma::mem_row_major);
    wmma::store_matrix_sync(dvs + nt * 16, dv_acc[nt], ld, wmma::mem_row_major);
  }
  __syncwarp();
  for (int idx = lane; idx < 16 * kD; idx += 32) {
    const int r = idx / kD, c = idx % kD;
    const int64_t j = j0 + warp * 16 + r;
    if (j < S) {
      dk[(b * S + j) * kD + c] = scale * dks[r * ld + c];
      dv[(b * S + j) * kD + c] = dvs[r * ld + c];
    }
  }
#endif
}

// Runs fn.template operator()<kD>() for the head dims the kernels are built for; false for others.
template <typename Fn>
bool dispatch_dim(int64_t E, Fn&& fn) {
  switch (E) {
    case 32:
      fn.template operator()<32>();
      return true;
    case 64:
      fn.template operator()<64>();
      return true;
    default:
      return false;
  }
}

template <typename K>
void allow_smem(K kernel, size_t bytes) {
  EMBER_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

}  // namespace

bool attention_tf32_supported(Dtype dtype, Device device, const AttentionParams& p, bool has_mask) {
  if (dtype != kFloat32 || !device.is_cuda() || has_mask || p.dropout_p > 0.0 || p.E != p.Ev) {
    return false;
  }
  if (!cuda::matmul_allow_tf32()) return false;
  size_t need = 0;
  if (!dispatch_dim(p.E, [&]<int kD>() {
        need = std::max(forward_smem_bytes<kD>, backward_smem_bytes<kD>);
      })) {
    return false;
  }
  int major = 0, smem = 0;
  EMBER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index));
  EMBER_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index));
  return major >= 8 && need <= static_cast<size_t>(smem);
}

void attention_tf32_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                            const AttentionParams& p, cudaStream_t s) {
  const int64_t tiles = (p.L + kRows - 1) / kRows;
  const bool ok = dispatch_dim(p.E, [&]<int kD>() {
    allow_smem(attention_tf32_fwd_kernel<kD>, forward_smem_bytes<kD>);
    attention_tf32_fwd_kernel<kD>
        <<<static_cast<unsigned>(p.batch * tiles), kWarps * 32, forward_smem_bytes<kD>, s>>>(
            q, k, v, out, lse, p, tiles);
  });
  EMBER_INTERNAL_ASSERT(ok, "attention_tf32_forward: head dim ", p.E, " has no kernel");
  EMBER_CUDA_CHECK(cudaGetLastError());
}

void attention_tf32_backward(const float* q, const float* k, const float* v, const float* dout,
                             const float* lse, const float* dvec, float* dq32, float* dk, float* dv,
                             const AttentionParams& p, cudaStream_t s) {
  const int64_t tiles = (p.S + kRows - 1) / kRows;
  const bool ok = dispatch_dim(p.E, [&]<int kD>() {
    allow_smem(attention_tf32_bwd_kernel<kD>, backward_smem_bytes<kD>);
    attention_tf32_bwd_kernel<kD>
        <<<static_cast<unsigned>(p.batch * tiles), kWarps * 32, backward_smem_bytes<kD>, s>>>(
            q, k, v, dout, lse, dvec, dq32, dk, dv, p, tiles);
  });
  EMBER_INTERNAL_ASSERT(ok, "attention_tf32_backward: head dim ", p.E, " has no kernel");
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember::detail
