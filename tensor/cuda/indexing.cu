// CUDA kernels for gather-like and scatter-like index loops (see tensor/detail/indexing_kernels.h).
// Bounds are checked on the device: the first bad index is recorded in a two-word slot
// {flag, value} that the host reads back after the kernel, raising the same IndexError as the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tensor/cuda/loops.cuh"
#include "tensor/detail/indexing_kernels.h"

// scatter_add's CUDA dtypes: those with a hardware atomicAdd.
#define EMBER_CUDA_SCATTER_CASES_(F) \
  EMBER_CASES_FLOAT_(F)              \
  EMBER_DTYPE_CASE_(Int32, int32_t, F) EMBER_DTYPE_CASE_(Int64, int64_t, F)

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::blocks_for;
using cuda_loops::kThreads;
using cuda_loops::stream_of;

__device__ inline void report_bad_index(unsigned long long* slot, int64_t ix) {
  if (atomicCAS(slot, 0ull, 1ull) == 0ull) slot[1] = static_cast<unsigned long long>(ix);
}

// Byte offsets of the three operands of linear element i.
__device__ inline void offsets3(const Geometry& g, int64_t i, int64_t off[3]) {
  off[0] = off[1] = off[2] = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const int64_t idx = i % g.sizes[d];
    i /= g.sizes[d];
    off[0] += idx * g.strides[0][d];
    off[1] += idx * g.strides[1][d];
    off[2] += idx * g.strides[2][d];
  }
}

template <typename T, typename I>
__global__ void gather_kernel(Geometry g, int64_t src_dim_stride, int64_t bound,
                              unsigned long long* err) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[3];
    offsets3(g, i, off);
    const int64_t ix = *reinterpret_cast<const I*>(g.data[2] + off[2]);
    if (static_cast<uint64_t>(ix) >= static_cast<uint64_t>(bound)) {
      report_bad_index(err, ix);
      continue;
    }
    *reinterpret_cast<T*>(g.data[0] + off[0]) =
        *reinterpret_cast<const T*>(g.data[1] + off[1] + ix * src_dim_stride);
  }
}

__device__ inline void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ inline void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ inline void atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
__device__ inline void atomic_add(int64_t* p, int64_t v) {
  // Two's complement: adding the unsigned bit pattern is signed addition.
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
// Ember's Half/BFloat16 have the bit layout of __half/__nv_bfloat16; sm_70+/sm_80+ add them
// atomically in hardware.
__device__ inline void atomic_add(Half* p, Half v) {
  atomicAdd(reinterpret_cast<__half*>(p), __ushort_as_half(v.x));
}
__device__ inline void atomic_add(BFloat16* p, BFloat16 v) {
  atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __ushort_as_bfloat16(v.x));
}

template <typename T, typename I>
__global__ void scatter_add_kernel(Geometry g, int64_t self_dim_stride, int64_t bound,
                                   acc_t<T> alpha, unsigned long long* err) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < g.numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[3];
    offsets3(g, i, off);
    const int64_t ix = *reinterpret_cast<const I*>(g.data[2] + off[2]);
    if (static_cast<uint64_t>(ix) >= static_cast<uint64_t>(bound)) {
      report_bad_index(err, ix);
      continue;
    }
    const acc_t<T> v = alpha * static_cast<acc_t<T>>(*reinterpret_cast<const T*>(g.data[1] + off[1]));
    atomic_add(reinterpret_cast<T*>(g.data[0] + off[0] + ix * self_dim_stride), convert<T>(v));
  }
}

// The {flag, value} slot for one op; check() synchronises the stream and throws if set.
class BadIndexSlot {
 public:
  BadIndexSlot(Device d, cudaStream_t s) : stream_(s) {
    buf_ = make_empty({2}, kInt64, d);
    EMBER_CUDA_CHECK(cudaMemsetAsync(buf_.data_ptr(), 0, 2 * sizeof(int64_t), s));
  }
  unsigned long long* ptr() const { return static_cast<unsigned long long*>(buf_.data_ptr()); }
  void check(const IndexBound& b) const {
    int64_t h[2] = {0, 0};
    EMBER_CUDA_CHECK(cudaMemcpyAsync(h, buf_.data_ptr(), sizeof(h), cudaMemcpyDeviceToHost, stream_));
    EMBER_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (h[0] != 0) throw_index_out_of_bounds(b, h[1]);
  }

 private:
  Tensor buf_;
  cudaStream_t stream_;
};

template <typename Fn>
void dispatch_index(Dtype t, const char* op, Fn&& fn) {
  if (t == kInt64) return fn.template operator()<int64_t>();
  if (t == kInt32) return fn.template operator()<int32_t>();
  throw TypeError(str_cat("[", op, "] expected an int64 or int32 index, got ", t));
}

}  // namespace

void gather_cuda(const GatherArgs& a) {
  if (a.out.numel() == 0) return;
  DeviceGuard guard(a.out.device().index);
  cudaStream_t s = stream_of(a.out.device());
  Geometry g = make_geometry(a.out.shape(), {&a.out, &a.src_r, &a.index});
  BadIndexSlot slot(a.out.device(), s);
  const int64_t es = a.out.element_size();
  auto launch = [&]<typename T>() {
    dispatch_index(a.index.dtype(), a.bound.op, [&]<typename I>() {
      gather_kernel<T, I><<<blocks_for(g.numel), kThreads, 0, s>>>(g, a.src_dim_stride * es,
                                                                  a.bound.size, slot.ptr());
    });
  };
  // A gather only moves bytes: dispatch on the element size.
  switch (es) {
    case 1: launch.template operator()<uint8_t>(); break;
    case 2: launch.template operator()<uint16_t>(); break;
    case 4: launch.template operator()<uint32_t>(); break;
    default: launch.template operator()<uint64_t>(); break;
  }
  EMBER_CUDA_CHECK(cudaGetLastError());
  slot.check(a.bound);
}

void scatter_add_cuda(const ScatterArgs& a) {
  if (a.index.numel() == 0) return;
  DeviceGuard guard(a.self_r.device().index);
  cudaStream_t s = stream_of(a.self_r.device());
  Geometry g = make_geometry(a.index.shape(), {&a.self_r, &a.src, &a.index});
  const Dtype dt = a.self_r.dtype();
  EMBER_CHECK_TYPE(TypeError, dt != kUInt8 && dt != kBool, "[", a.bound.op,
                   "] on CUDA supports float64, float32, float16, bfloat16, int64 and int32 "
                   "(atomicAdd), got ", dt);
  BadIndexSlot slot(a.self_r.device(), s);
  EMBER_DISPATCH_(dt, a.bound.op, "float, int32 and int64 dtypes", EMBER_CUDA_SCATTER_CASES_,
                  [&]<typename T>() {
    dispatch_index(a.index.dtype(), a.bound.op, [&]<typename I>() {
      scatter_add_kernel<T, I><<<blocks_for(g.numel), kThreads, 0, s>>>(
          g, a.self_dim_stride * a.self_r.element_size(), a.bound.size, a.alpha.to<acc_t<T>>(),
          slot.ptr());
    });
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
  slot.check(a.bound);
}

}  // namespace ember::detail
