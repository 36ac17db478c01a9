// A fixed-address block of host memory whose pages can be given back to the system and taken
// again: FSDP's unsharded parameters live in one per sharded module (Note [FSDP arenas] in
// distributed/sharding/fsdp.cpp).
#pragma once

#include <cstddef>
#include <string>

namespace ember::dist::detail {

class HostArena {
 public:
  /// Reserves `nbytes` of address space (no memory yet). `label` names the owner in the
  /// message printed when released memory is read (e.g. "fully_shard(Block 'blocks.3')").
  HostArena(size_t nbytes, std::string label);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  bool committed() const { return committed_; }
  /// Makes the block readable and writable (pages are supplied as they are first written) and
  /// counts it in cpu_allocator_stats(). No-op when committed.
  void commit();
  /// Gives the pages back and makes the block inaccessible: a later read faults, and the fault
  /// is reported as a read of released parameters (naming the label) before the process dies.
  /// No-op when not committed.
  void release();

 private:
  void* base_ = nullptr;  // the reservation (data_ is aligned inside it)
  size_t reserved_ = 0;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  bool committed_ = false;
  int slot_ = -1;  // in the fault reporter's table
  std::string label_;
};

}  // namespace ember::dist::detail
