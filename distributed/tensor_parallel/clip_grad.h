// Gradient clipping for a tensor-parallel model (PyTorch's clip_grad_norm_ over DTensor
// parameters): the norm of the whole model's gradient, though each rank holds shards.
#pragma once

#include <vector>

#include <ember/distributed/mesh/device_mesh.h>
#include <ember/nn/module.h>

namespace ember::dist {

/// Scales the gradients of `params` (a model laid out by parallelize_module over the 1-D
/// `mesh`, replicated or DDP-synchronised across any other ranks) so that the norm of the whole
/// model's gradient is at most max_norm: each sharded parameter's shards are counted once over
/// the mesh, each replicated parameter (a Replicate placement, or none) once; every gradient is
/// multiplied by min(1, max_norm / (total + 1e-6)), as nn::clip_grad_norm_ does. Collective
/// over the mesh (one all-reduce of one value). Returns the total norm before clipping, a
/// float32 0-dim tensor equal on every rank. Throws ValueError for a negative max_norm, a
/// norm_type <= 0, or a mesh that is not 1-D.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, const DeviceMesh& mesh,
                       double norm_type = 2.0);

/// The same for a model sharded by fully_shard over the data-parallel ranks on top of tensor
/// parallelism (2-D): `mesh` is (dp, tp), fully_shard's group mesh dimension 0 and
/// parallelize_module's mesh dimension 1. The norm sums the shards over both dimensions and
/// counts a parameter replicated over either once. Collective over the mesh (an all-reduce over
/// each dimension).
Tensor clip_grad_norm_(const nn::Module& root, double max_norm, const DeviceMesh& mesh,
                       double norm_type = 2.0);

}  // namespace ember::dist
