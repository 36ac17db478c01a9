// Multi-tensor CUDA kernels of tensor/ops/foreach.h.
//
// Note [Multi-tensor launches]
// A launch's arguments carry a Batch: up to kMaxTensors tensors (data pointer, element count)
// and up to kMaxBlocks blocks, each naming its tensor and its chunk of kChunk elements of it (a
// table of about 2.6 KB, inside the 4 KB that kernel arguments always allow). The host walks the
// list once, filling batches and launching each when either table is full; a tensor whose
// chunks straddle two batches appears in both. Arguments travel with the launch, so no table is
// copied to the device and nothing is synchronised. total_norm's blocks each write one partial
// value, in list order across batches, and one more launch combines them in that fixed order:
// the result does not depend on scheduling (no atomics).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/cuda/reduce_block.cuh>
#include <ember/tensor/detail/reduce_kernels.h>

namespace ember::detail {

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;

constexpr int kMaxTensors = 64;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 32768;
constexpr int kThreads = 256;

struct Batch {
  void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t chunk[kMaxBlocks];
  uint8_t tensor[kMaxBlocks];
};
static_assert(sizeof(Batch) < 3000, "a Batch must fit the 4 KB of kernel arguments");
static_assert(kMaxTensors <= 256, "Batch::tensor holds tensor slots in a byte");

int64_t chunks_of(const Tensor& t) { return (t.numel() + kChunk - 1) / kChunk; }

// Calls launch(batch, blocks) for consecutive batches covering every chunk of every non-empty
// tensor, in list order.
template <typename Launch>
void for_each_batch(const std::vector<Tensor>& tensors, Launch launch) {
  Batch b{};
  int nt = 0, nb = 0;
  auto flush = [&] {
    if (nb > 0) launch(b, nb);
    nt = nb = 0;
  };
  for (const Tensor& t : tensors) {
    const int64_t chunks = chunks_of(t);
    bool slotted = false;
    for (int64_t c = 0; c < chunks; ++c) {
      if (!slotted) {
        if (nt == kMaxTensors) flush();
        b.data[nt] = t.data_ptr();
        b.numel[nt] = t.numel();
        ++nt;
        slotted = true;
      }
      b.tensor[nb] = static_cast<uint8_t>(nt - 1);
      b.chunk[nb] = static_cast<int32_t>(c);
      if (++nb == kMaxBlocks) {
        flush();
        slotted = false;
      }
    }
  }
  flush();
}

// The elements [begin, end) of this block's chunk.
struct Span {
  void* data;
  int64_t begin, end;
};
__device__ Span span_of(const Batch& b) {
  const int t = b.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(b.chunk[blockIdx.x]) * kChunk;
  return {b.data[t], begin, min(b.numel[t], begin + kChunk)};
}

template <typename T, typename Red>
__global__ void norm_chunks_kernel(Batch b, Red r, typename Red::acc* partial) {
  using A = typename Red::acc;
  __shared__ A smem[32];
  const Span s = span_of(b);
  A v = cuda_reduce::fold(static_cast<const T*>(s.data), s.begin + threadIdx.x, s.end,
                          blockDim.x, r, A{});
  v = cuda_reduce::block_reduce(v, r, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = v;
}

template <typename T>
__global__ void mul_chunks_kernel(Batch b, const acc_t<T>* scale) {
  using A = acc_t<T>;
  const A k = *scale;
  const Span s = span_of(b);
  T* x = static_cast<T*>(s.data);
  for (int64_t i = s.begin + threadIdx.x; i < s.end; i += blockDim.x) {
    x[i] = convert<T>(convert<A>(x[i]) * k);
  }
}

template <typename T, typename Red>
Tensor total_with(const std::vector<Tensor>& tensors, const Red& r) {
  using A = typename Red::acc;
  const Device dev = tensors.front().device();
  cudaStream_t stream = stream_of(dev);
  int64_t blocks = 0;
  for (const Tensor& t : tensors) blocks += chunks_of(t);
  Tensor partial = make_empty({std::max<int64_t>(1, blocks)}, dtype_of<A>, dev);
  A* pp = partial.data<A>();
  int64_t base = 0;
  for_each_batch(tensors, [&](const Batch& b, int nb) {
    norm_chunks_kernel<T><<<nb, kThreads, 0, stream>>>(b, r, pp + base);
    EMBER_CUDA_CHECK(cudaGetLastError());
    base += nb;
  });
  Tensor out = make_empty({}, tensors.front().dtype(), dev);
  cuda_reduce::reduce_partials_kernel<<<1, kThreads, 0, stream>>>(1, pp, out.data<T>(), r,
                                                                  static_cast<const A*>(nullptr),
                                                                  blocks);
  EMBER_CUDA_CHECK(cudaGetLastError());
  return out;
}

}  // namespace

Tensor total_norm_cuda(const std::vector<Tensor>& tensors, double p) {
  DeviceGuard guard(tensors.front().device().index);
  Tensor out;
  EMBER_DISPATCH_FLOATING(tensors.front().dtype(), "total_norm", [&]<typename T>() {
    with_norm_op<T>(p, [&](const auto& r) { out = total_with<T>(tensors, r); });
  });
  return out;
}

void foreach_mul_cuda(const std::vector<Tensor>& tensors, const Tensor& scale) {
  const Device dev = tensors.front().device();
  DeviceGuard guard(dev.index);
  cudaStream_t stream = stream_of(dev);
  EMBER_DISPATCH_FLOATING(tensors.front().dtype(), "foreach_mul_", [&]<typename T>() {
    using A = acc_t<T>;
    // The scale in the accumulation type, on the device: a copy kernel at most, no host wait.
    const Tensor k = scale.reshape({}).to(dtype_of<A>);
    for_each_batch(tensors, [&](const Batch& b, int nb) {
      mul_chunks_kernel<T><<<nb, kThreads, 0, stream>>>(b, k.data<A>());
      EMBER_CUDA_CHECK(cudaGetLastError());
    });
  });
}

}  // namespace ember::detail
