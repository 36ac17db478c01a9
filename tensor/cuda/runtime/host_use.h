// The pinned host allocator's record of asynchronous copies (tensor/cuda/runtime/allocator.cpp);
// internal to tensor/cuda/.
#pragma once

#include <cstdint>

#include <ember/tensor/gpu/cuda.h>

namespace ember::detail {
/// Tells the pinned allocator that an asynchronous copy on s reads or writes host_ptr, so the
/// block is not reused before the copy has finished.
void record_host_use(void* host_ptr, const cuda::Stream& s);
/// For tests: the CUDA events the pinned allocator holds for its blocks' uses.
int64_t pinned_events_held();
}  // namespace ember::detail
