// Device-side index checks that the host reads later without waiting (Note [CUDA index checks],
// tensor/cuda/indexing.cu): internal to tensor/cuda/. Used by the gather and scatter kernels and
// by the fused cross_entropy's row kernels (softmax.cu), which read each row's target class.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include <ember/tensor/detail/indexing_kernels.h>
#include <ember/tensor/tensor.h>

namespace ember::detail::cuda_index {

/// Records the first bad index of an op in its {flag, value} slot.
__device__ inline void report_bad_index(unsigned long long* slot, int64_t ix) {
  if (atomicCAS(slot, 0ull, 1ull) == 0ull) slot[1] = static_cast<unsigned long long>(ix);
}

/// Reads every slot whose copy to the host has completed, without waiting for the others, and
/// throws the IndexError of the first bad index found. Every op that checks indices on the
/// device calls it first.
void report_bad_indices();

/// The {flag, value} slot for one op (zeroed on `s` when made); queue_check() copies it to the
/// host on the same stream, for a later report_bad_indices().
class BadIndexSlot {
 public:
  BadIndexSlot(Device d, cudaStream_t s);
  unsigned long long* ptr() const { return static_cast<unsigned long long*>(buf_.data_ptr()); }
  void queue_check(const IndexBound& b) const;

 private:
  Tensor buf_;
  cudaStream_t stream_;
};

}  // namespace ember::detail::cuda_index
