// The options of fully_shard (fsdp.h), apart so that FSDP's unit state (detail/fsdp_unit.h) can
// use them without including the API it implements.
#pragma once

#include <memory>
#include <optional>

#include <ember/distributed/process_group.h>

namespace ember::dist {

class DeviceMesh;

/// PyTorch's MixedPrecisionPolicy: the dtype modules compute in, and the dtype gradients are
/// reduced in, while the shards (and the optimizer) stay in the parameters' own dtype.
struct MixedPrecisionPolicy {
  /// Gathered parameters (and so forward and backward) in this dtype; none: their own dtype.
  std::optional<Dtype> param_dtype;
  /// Gradients reduce-scattered in this dtype; none: param_dtype, else their own dtype.
  std::optional<Dtype> reduce_dtype;
  /// Cast the module's floating-point inputs to param_dtype before its forward.
  bool cast_forward_inputs = true;
};

struct FullyShardOptions {
  /// The ranks to shard across; null: the default group (or `mesh`'s).
  std::shared_ptr<ProcessGroup> group;
  /// Hybrid sharding (HSDP): the ranks that hold the same shards as this one, one per copy of
  /// `group` (the ranks of the other nodes with this rank's place in their node, typically).
  /// Each gradient is reduce-scattered over `group`, then its shard all-reduced (averaged) over
  /// this group; parameters are gathered over `group` only. Null: no replication (plain FSDP).
  std::shared_ptr<ProcessGroup> replicate_group;
  /// PyTorch's `mesh`, instead of the groups: a 1-D mesh shards over its ranks; a 2-D mesh is
  /// HSDP, replicating over its dimension 0 and sharding over its dimension 1 (PyTorch's order:
  /// `init_device_mesh("cpu", {nodes, ranks_per_node}, {"replicate", "shard"})`).
  std::shared_ptr<DeviceMesh> mesh;
  /// Release the gathered parameters after the forward and gather them again for the backward
  /// (less memory, one more all-gather per step); false keeps them from forward to backward.
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
  /// Issue the next module's all-gather before this module computes.
  bool prefetch = true;
};

}  // namespace ember::dist
