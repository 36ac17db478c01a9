// CUDA random fills: one thread per Philox block, running the same functors as the CPU loop
// (Note [Random streams]), so a seed gives the same tensor on either device.
#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/random_kernels.h>

namespace ember::detail {

namespace {

template <typename T, typename Op>
__global__ void random_kernel(T* out, int64_t numel, int64_t blocks, PhiloxArgs args, Op op) {
  const uint64_t seed = args.key(), base = args.first();
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < blocks;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Philox4 w = philox_block(seed, base + j);
    const int64_t first = j * Op::kPerBlock;
    const int64_t left = numel - first;
    op(w, out + first, left < Op::kPerBlock ? static_cast<int>(left) : Op::kPerBlock);
  }
}

template <typename T>
void fill_typed(const Tensor& t, const RandomSpec& spec, const PhiloxArgs& args) {
  T* out = static_cast<T*>(t.data_ptr());
  const int64_t numel = t.numel();
  cudaStream_t s = cuda_loops::stream_of(t.device());
  with_random_op<T>(spec, [&](const auto& op) {
    using Op = std::remove_cvref_t<decltype(op)>;
    const int64_t blocks = (numel + Op::kPerBlock - 1) / Op::kPerBlock;
    random_kernel<T, Op><<<cuda_loops::blocks_for(blocks), cuda_loops::kThreads, 0, s>>>(
        out, numel, blocks, args, op);
  });
  EMBER_CUDA_CHECK(cudaGetLastError());
}

__global__ void write_philox_kernel(uint64_t* replay, uint64_t seed, uint64_t first) {
  replay[0] = seed;
  replay[1] = first;
}

}  // namespace

void random_fill_cuda(const Tensor& out, const RandomSpec& spec, const PhiloxArgs& args) {
  if (out.numel() == 0) return;
  EMBER_INTERNAL_ASSERT(out.is_contiguous());
  cuda::detail::DeviceGuard guard(out.device().index);
  dispatch_random(out, spec, [&]<typename T>() { fill_typed<T>(out, spec, args); });
}

void write_philox_replay(uint64_t* replay, uint64_t seed, uint64_t first, void* stream) {
  write_philox_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(replay, seed, first);
  EMBER_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ember::detail
