// Host memory that a component maps itself, outside cpu_allocator(), but that belongs in the
// process's tensor memory statistics.
#pragma once

#include <cstdint>

namespace ember {

/// Adds `delta` bytes to cpu_allocator_stats().allocated (raising its peak as an allocation
/// would). For host memory a component maps and unmaps itself, such as FSDP's fixed-address
/// parameter arenas (distributed/sharding/fsdp.h), so that peak_allocated stays the peak of everything
/// tensors use.
void cpu_allocator_account(int64_t delta);

}  // namespace ember
