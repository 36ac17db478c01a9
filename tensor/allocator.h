// Memory for tensor storage.
//
// Note [Caching allocators]
// Fresh large allocations are slow on both devices: on the host every new page faults on first
// touch (so a large fresh `a + b` is much slower than adding into an existing tensor), and
// cudaMalloc synchronizes the device. Both allocators therefore keep freed blocks and hand them
// out again. The CPU allocator caches blocks of 128 KiB and more (smaller requests go to malloc,
// which is fast there); the CUDA allocator splits and merges blocks per stream (Note [CUDA caching
// pool]): a block freed on stream S is reused at once on S (stream order makes that safe), and is
// only reused elsewhere after the events recorded by record_stream() have completed.
#pragma once

#include <cstddef>
#include <cstdint>

#include <ember/tensor/device.h>

namespace ember {

/// Allocates and frees raw device memory. Implementations are thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// Returns memory for nbytes (on the host 64-byte aligned from 1 KiB up, 16-byte below;
  /// nullptr for 0 bytes). Throws
  /// OutOfMemoryError naming the size when the device has none left.
  virtual void* allocate(size_t nbytes) = 0;
  /// Returns memory got from allocate(); ptr may be nullptr.
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual Device device() const = 0;
  /// True for page-locked host memory.
  virtual bool is_pinned() const { return false; }
};

/// Statistics of a caching allocator, in bytes.
struct AllocatorStats {
  int64_t allocated = 0;       ///< handed out and not yet freed
  int64_t cached = 0;          ///< freed and kept for reuse
  int64_t peak_allocated = 0;  ///< highest `allocated` so far
  int64_t num_fresh = 0;       ///< allocations that went to the system (cache misses)
  int64_t num_reused = 0;      ///< allocations served from the cache
};

/// The host caching allocator used for every CPU tensor.
Allocator* cpu_allocator();
/// Page-locked host memory (cudaHostAlloc), for fast asynchronous copies to and from CUDA.
/// Throws NotImplementedError in a build without CUDA or on a machine without a CUDA device.
Allocator* pinned_allocator();
/// The caching allocator of CUDA device `index`; blocks belong to the current stream.
Allocator* cuda_allocator(int index);
/// The allocator for a device (CPU tensors use cpu_allocator()).
Allocator* allocator_for(Device d);

AllocatorStats cpu_allocator_stats();
/// Adds `delta` bytes to cpu_allocator_stats().allocated (raising its peak as an allocation
/// would), for host memory a component maps and unmaps itself outside cpu_allocator(), such as
/// FSDP's fixed-address parameter arenas (distributed/sharding/fsdp.h): so that peak_allocated
/// stays the peak of everything tensors use.
void cpu_allocator_account(int64_t delta);
/// Returns every cached host block to the system.
void cpu_empty_cache();
/// Sets cpu_allocator_stats().peak_allocated to what is allocated now, so that a later read is
/// the peak of what ran in between (cuda::reset_peak_memory_stats for the host).
void cpu_reset_peak_stats();

}  // namespace ember
