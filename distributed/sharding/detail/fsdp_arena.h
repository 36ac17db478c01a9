// The memory a sharded module's gathered parameters live in (Note [FSDP arenas] in
// distributed/sharding/fsdp.cpp): a fixed address range whose memory is taken on gather and given back on
// reshard, so the parameters' views keep their data pointers. On the CPU a HostArena
// (host_arena.h); on a CUDA device a CudaArena (fsdp_cuda_arena.cpp, CUDA's virtual memory
// management).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <ember/tensor/device.h>

namespace ember::dist::detail {

class FsdpArena {
 public:
  virtual ~FsdpArena() = default;
  /// The start of the range: the same for the arena's whole life.
  virtual void* data() const = 0;
  /// The bytes the parameters use (the memory held may be rounded up: held_bytes()).
  virtual size_t nbytes() const = 0;
  /// The memory held while committed (CUDA: nbytes rounded up to the allocation granularity).
  virtual size_t held_bytes() const = 0;
  virtual Device device() const = 0;
  virtual bool committed() const = 0;
  /// Backs the range with memory (its contents are undefined). No-op when committed.
  virtual void commit() = 0;
  /// Gives the memory back; the range stays reserved. No-op when not committed. On CUDA the
  /// memory goes back once the work queued so far on the calling thread's current stream of the
  /// device is done (where the parameters were read and the gathers were waited for): without a
  /// host wait, at a later commit or flush (Note [CUDA arenas]).
  virtual void release() = 0;
};

/// An arena of `nbytes` on `device` (the CPU or a CUDA device); `label` names the owner in
/// errors, e.g. "fully_shard(Block)". Throws NotImplementedError for other devices, for CUDA in
/// a build without it, or a device without virtual memory management.
std::shared_ptr<FsdpArena> make_fsdp_arena(const Device& device, size_t nbytes,
                                           const std::string& label);

/// CUDA arenas (fsdp_cuda_arena.cpp); in a build without CUDA both throw NotImplementedError.
std::shared_ptr<FsdpArena> make_cuda_arena(int device, size_t nbytes, const std::string& label);

/// The physical memory all CUDA arenas of this process hold now on `device` (0 without CUDA):
/// released arenas count until their memory has gone back.
int64_t cuda_arena_held_bytes(int device);
/// Waits for the GPU work of every released arena on `device` and gives their memory back
/// (no-op without CUDA).
void flush_released_cuda_arenas(int device);
/// The device's free memory as the driver reports it (cudaMemGetInfo), for tests that check
/// that a release really gives memory back. Throws NotImplementedError without CUDA.
int64_t cuda_free_bytes(int device);

}  // namespace ember::dist::detail
