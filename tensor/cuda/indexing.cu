// CUDA kernels for gather-like and scatter-like index loops (see tensor/detail/indexing_kernels.h).
//
// Note [CUDA index checks]: bounds are checked on the device without the host waiting for them
// (gather and scatter_add run in every cross_entropy, forward and backward: a read-back per call
// would stall the CPU on the whole queued stream, several times per training step). A kernel
// skips a bad index (so no memory outside the tensors is touched; the op's result is then
// unspecified) and records the first one in a two-word slot {flag, value}, which is copied into
// pinned host memory on the same stream. The flag is read once that copy has completed: at the
// start of every later gather/scatter call on CUDA (polling, never waiting), which then raises
// the same IndexError as the CPU, naming the op that had the bad index (the fused cross_entropy's
// row kernels check their targets the same way: tensor/cuda/index_check.cuh). So an error surfaces
// at the next index op after the device has got there (e.g. after cuda::synchronize()), not at the
// call itself. PyTorch instead makes a bad index a device-side assert, which leaves the CUDA
// context unusable; here the context stays usable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/device_pool.h>
#include <ember/tensor/cuda/index_check.cuh>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/indexing_kernels.h>

// scatter_add's CUDA dtypes: those with a hardware atomicAdd.
#define EMBER_CUDA_SCATTER_CASES_(F) \
  EMBER_CASES_FLOAT_(F)              \
  EMBER_DTYPE_CASE_(Int32, int32_t, F) EMBER_DTYPE_CASE_(Int64, int64_t, F)

namespace ember::detail {

namespace cuda_index {

namespace {

// A slot's copy on the host, read once `copied` has passed (Note [CUDA index checks]).
struct PendingCheck {
  std::string op;
  int64_t dim;
  int64_t size;
  Tensor host;  // pinned int64 {flag, value}
  std::shared_ptr<cuda::Event> copied;
};

// Never destroyed: at exit, checks still queued would free pinned memory and events after the
// allocator and the CUDA runtime are gone.
std::mutex& pending_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::deque<PendingCheck>& pending_checks() {
  static auto* checks = new std::deque<PendingCheck>;
  return *checks;
}

}  // namespace

// The first bad index found is thrown; the other completed slots are dropped (the first error
// is the one to fix).
void report_bad_indices() {
  // Nothing a capture records has run yet, and it may query no events: checks queued before it
  // are reported at the first index op after it.
  if (cuda::detail::capturing()) return;
  std::optional<PendingCheck> bad;
  {
    std::lock_guard<std::mutex> lock(pending_mutex());
    auto& checks = pending_checks();
    for (auto it = checks.begin(); it != checks.end();) {
      if (!it->copied->query()) {
        ++it;
        continue;
      }
      if (!bad && it->host.data<int64_t>()[0] != 0) bad = std::move(*it);
      it = checks.erase(it);
    }
  }
  if (!bad) return;
  try {
    throw_index_out_of_bounds(IndexBound{bad->op.c_str(), bad->dim, bad->size},
                              bad->host.data<int64_t>()[1]);
  } catch (const IndexError& e) {
    throw IndexError(str_cat(e.what(),
                             " (checked on the device; reported at the next index op "
                             "on CUDA, see Note [CUDA index checks])"));
  }
}

BadIndexSlot::BadIndexSlot(Device d, cudaStream_t s) : stream_(s) {
  buf_ = make_empty({2}, kInt64, d);
  EMBER_CUDA_CHECK(cudaMemsetAsync(buf_.data_ptr(), 0, 2 * sizeof(int64_t), s));
}

void BadIndexSlot::queue_check(const IndexBound& b) const {
  // In a capture the slot is zeroed and written by each replay, and the copy to the host (which
  // a capture cannot hold: its pinned buffer and event are host state) follows each launch, so
  // a bad index in a replay is reported at the next index op after it, as eagerly.
  const int device = buf_.device().index;
  if (cuda::detail::capturing(device)) {
    cuda::detail::after_each_replay(
        device, [slot = *this, op = std::string(b.op), dim = b.dim, size = b.size](cudaStream_t s) {
          BadIndexSlot now = slot;
          now.stream_ = s;
          now.queue_check(IndexBound{op.c_str(), dim, size});
        });
    return;
  }
  PendingCheck check{b.op, b.dim, b.size, empty({2}, TensorOptions(kInt64).pinned_memory()),
                     std::make_shared<cuda::Event>()};
  EMBER_CUDA_CHECK(cudaMemcpyAsync(check.host.data_ptr(), buf_.data_ptr(), 2 * sizeof(int64_t),
                                   cudaMemcpyDeviceToHost, stream_));
  check.copied->record(cuda::current_stream(buf_.device().index));
  std::lock_guard<std::mutex> lock(pending_mutex());
  pending_checks().push_back(std::move(check));
}

}  // namespace cuda_index

namespace {

using cuda::detail::DeviceGuard;
using cuda_index::BadIndexSlot;
using cuda_index::report_bad_index;
using cuda_index::report_bad_indices;
using cuda_loops::blocks_for;
using cuda_loops::kThreads;
using cuda_loops::stream_of;

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

template <typename Fn>
void dispatch_index(Dtype t, const char* op, Fn&& fn) {
  if (t == kInt64) return fn.template operator()<int64_t>();
  if (t == kInt32) return fn.template operator()<int32_t>();
  throw TypeError(str_cat("[", op, "] expected an int64 or int32 index, got ", t));
}

}  // namespace

void gather_cuda(const GatherArgs& a) {
  report_bad_indices();
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
  slot.queue_check(a.bound);
}

void scatter_add_cuda(const ScatterArgs& a) {
  report_bad_indices();
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
  slot.queue_check(a.bound);
}

}  // namespace ember::detail
