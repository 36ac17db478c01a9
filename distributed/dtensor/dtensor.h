// DTensor: a tensor distributed over a DeviceMesh (torch.distributed.tensor.DTensor): this
// rank's local tensor, the mesh, one Placement per mesh dimension and the global shape.
//
//   auto mesh = dist::init_device_mesh("cpu", {4}, {"tp"});
//   dist::DTensor w = dist::distribute_tensor(full_weight, mesh, {dist::Shard(0)});
//   dist::DTensor r = w.redistribute({dist::Replicate()});   // all-gather
//   Tensor whole = w.full_tensor();                           // the same, as a plain Tensor
//
// A DTensor is a value (cheap to copy) that is not a Tensor: tensor ops take its local tensor
// (to_local()) or go through the DTensor ops of dtensor/ops.h, which know the placements; an op
// without a rule for the placements it is given throws naming the op and the placements, and
// nothing is ever gathered silently. Autograd runs on the local tensors: redistribute, the
// DTensor ops, from_local and to_local are differentiable, and the local tensors' gradients have
// the DTensor's placements (a Shard's gradient is its shard's, a Replicate's the whole one).
//
// Shards are torch.chunk's: pieces of ceil(size / n), the last ones shorter or empty (uneven
// shards are padded for the collectives and unpadded after, as PyTorch does). A tensor dimension
// may be sharded by one mesh dimension at most. Collectives follow the mesh groups' rules: every
// rank of the mesh makes the same calls in the same order.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/dtensor/placement.h>
#include <ember/distributed/mesh/device_mesh.h>

namespace ember::dist {

class DTensor {
 public:
  /// An undefined DTensor.
  DTensor() = default;

  /// This rank's `local` as its part of a DTensor (PyTorch's DTensor.from_local): no data moves.
  /// `shape`: the global shape; default: local's with each sharded dimension times its mesh
  /// dimension's size (even shards). `run_check`: check across the mesh that every rank's local
  /// shape is its shard of `shape` (a collective per mesh dimension), and broadcast Replicate
  /// data from each mesh dimension's first rank. Differentiable. Throws ValueError when the
  /// placements are not one per mesh dimension, a Shard dimension is out of range or sharded
  /// twice, or local's shape is not this rank's shard of `shape`.
  static DTensor from_local(Tensor local, std::shared_ptr<DeviceMesh> mesh, Placements placements,
                            std::optional<Shape> shape = {}, bool run_check = false);

  /// This rank's local tensor (differentiable; a Replicate's gradient is then the whole one).
  Tensor to_local() const;
  /// The whole tensor on every rank: redistribute to Replicate everywhere, then to_local().
  Tensor full_tensor() const;
  /// The same tensor with other placements (PyTorch's redistribute), per mesh dimension:
  /// Shard -> Replicate all-gathers, Replicate -> Shard takes this rank's chunk, Partial ->
  /// Replicate all-reduces, Partial -> Shard reduce-scatters, Shard(a) -> Shard(b) all-to-alls,
  /// Replicate -> Partial(sum) keeps the value on the first rank (zeros elsewhere), Replicate ->
  /// Partial(avg, max or min) on every rank. Differentiable. Throws ValueError for a placement
  /// count that is not the mesh's, Partial -> Partial of another reduction, or Replicate ->
  /// Partial(product).
  DTensor redistribute(const Placements& to) const;

  bool defined() const { return local_.defined(); }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return shape_.size(); }
  int64_t size(int64_t d) const;
  Dtype dtype() const { return local_.dtype(); }
  Device device() const { return local_.device(); }
  const std::shared_ptr<DeviceMesh>& device_mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  bool requires_grad() const { return local_.requires_grad(); }
  /// Makes the local tensor a leaf that requires grad (or not).
  DTensor& requires_grad_(bool on = true);
  /// The local gradient as a DTensor of this one's placements (undefined when there is none).
  DTensor grad() const;
  /// "DTensor(float32 [8, 16], (Shard(0),) on DeviceMesh(cpu, (tp=4,), ...), local [2, 16])".
  std::string str() const;

  // ---- for the DTensor ops (dtensor/ops.cpp) and redistribute ----
  /// The local tensor exactly as held (to_local() may wrap it for autograd; see Note [gradient
  /// conventions] in dtensor.cpp).
  const Tensor& local() const { return local_; }
  /// Whether mesh dimension i is Replicate with a local gradient that is this rank's part of the
  /// whole (the ranks' parts sum to it), as after an all-gather whose backward reduce-scatters.
  bool partial_grad(int i) const { return partial_grad_[i]; }
  /// A DTensor made by an op: no checks beyond the shapes'. `partial_grad` per mesh dimension
  /// (empty: none).
  static DTensor make(Tensor local, std::shared_ptr<DeviceMesh> mesh, Placements placements,
                      Shape shape, std::vector<bool> partial_grad = {});

 private:
  Tensor local_;
  std::shared_ptr<DeviceMesh> mesh_;
  Placements placements_;
  Shape shape_;
  std::vector<bool> partial_grad_;
};

/// Splits `full` (the same on every rank of the mesh, or taken from `src_data_rank`'s) into this
/// rank's part as `placements` say (PyTorch's distribute_tensor). With src_data_rank >= 0 each
/// mesh dimension's first rank broadcasts its data first, so the result is the source's; -1 uses
/// each rank's own `full`. A Partial is split as redistribute splits a Replicate (product is
/// refused). The local tensor is a new leaf that requires grad as `full` does.
DTensor distribute_tensor(const Tensor& full, std::shared_ptr<DeviceMesh> mesh,
                          const Placements& placements, int src_data_rank = 0);

/// This rank's local shape of a tensor of `shape` placed as `placements` on `mesh`.
Shape local_shape(const Shape& shape, const DeviceMesh& mesh, const Placements& placements);

/// Records that `local` (this exact tensor handle's impl) is this rank's part of `d` (or, with
/// another shape of as many elements, a view of it: a fused projection's blocks), so that
/// as_dtensor finds the placements again: parallelize_module records the parameters it shards
/// and the outputs it leaves distributed (use_local_output = false); clip_grad_norm and
/// checkpoints read them. The record lasts as long as the tensor.
void register_dtensor(const Tensor& local, const DTensor& d);
/// The DTensor `t` was recorded as the local part of, if any.
std::optional<DTensor> as_dtensor(const Tensor& t);

}  // namespace ember::dist
