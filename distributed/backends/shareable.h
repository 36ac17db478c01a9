// Tensors in memory that the other ranks of a gloo group on this machine can map (torch's
// symmetric memory, for CPU tensors over gloo).
//
// The shared-memory collectives (docs/distributed_pg.md) copy a buffer into the group's segment
// and out again, or, for large blocks of the collectives that only move data, read it straight
// from the peer with cross-memory attach. A reduction cannot read a peer's value without a copy
// unless the peer's memory is mapped here: allreduce, reduce and reduce_scatter over tensors
// from empty_shareable() (on every rank) read the peers' values where they lie and write the
// results straight into every rank's buffer, one pass over the data instead of three (Note
// [mapped reductions] in shm_mapped.cpp). Any other tensor takes the staged path as before, and
// so does a collective where some rank's tensor is not shareable: the results are the same.
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::dist {

/// A zero-filled, contiguous CPU tensor whose memory (a memfd) the group's peers on this
/// machine map when a reduction uses it. Like a tensor moved to shared memory with torch's
/// share_memory_(), it stays shared with a child forked after it was made. The memory goes back
/// to the system when the last tensor using it dies and every peer that mapped it has unmapped
/// it (at the group's end, or when the peer keeps too many mappings). Throws ValueError for a
/// device other than the CPU, and DistError naming the size if the memory cannot be had.
Tensor empty_shareable(IntList shape, TensorOptions opts = {});

/// True if `t`'s elements lie in memory from empty_shareable() (views of one included).
bool is_shareable(const Tensor& t);

}  // namespace ember::dist
