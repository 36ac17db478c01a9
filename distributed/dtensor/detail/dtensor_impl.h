// DTensor's internals: placement checks and the autograd pieces its redistribute and ops are
// made of (Note [gradient conventions] in dtensor.cpp). Internal.
#pragma once

#include <ember/distributed/dtensor/dtensor.h>

namespace ember::dist::detail {

/// `p` with negative Shard dims wrapped, checked against `mesh` (one per dimension) and a tensor
/// of `ndim` dims (in range, no tensor dimension sharded twice); errors name `op`.
Placements normalized(const char* op, Placements p, const DeviceMesh& mesh, int64_t ndim);

/// Identity forward; backward passes the gradient on at the first rank of mesh dimension `dim`
/// and zeros elsewhere: a partial_grad Replicate used by a replicated computation.
Tensor keep_first_grad(const Tensor& t, const DeviceMesh& mesh, int dim);

/// `a`'s local tensor, ready for an op whose output has placements `out`: a whole-gradient
/// Replicate entering a non-Replicate output is wrapped in Megatron's f (copy_to_mesh_dim); a
/// partial_grad Replicate entering a Replicate output passes its gradient on from the first rank
/// only (keep_first_grad).
Tensor local_for(const DTensor& a, const Placements& out);

/// Megatron's f over mesh dimension `dim`: identity forward, all-reduce backward. For a
/// Replicate (not partial_grad) entering a sharded computation.
Tensor copy_to_mesh_dim(const Tensor& t, const DeviceMesh& mesh, int dim);

/// Throws ValueError naming `op` for a Replicate -> Partial(`reduce`) that has no split of a
/// replicated value (product, as in PyTorch).
void check_partition(const char* op, ReduceOp reduce, int mesh_dim);

/// from_local's run_check: every rank's dims, local shape and global shape exchanged along each
/// mesh dimension and checked alike on every rank (ValueError naming the rank and both shapes,
/// thrown on all of them), and Replicate data broadcast from each mesh dimension's first rank
/// (returned; the identity to autograd, so a Replicate's gradient stays whole on every rank).
Tensor check_and_sync(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const Shape& global);

}  // namespace ember::dist::detail
