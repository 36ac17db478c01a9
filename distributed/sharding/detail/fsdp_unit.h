// FSDP's internal state (distributed/sharding/fsdp.cpp drives a step; fsdp_state.cpp reads and writes
// the shards for parameters, clipping and state dicts).
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/sharding/detail/fsdp_arena.h>
#include <ember/distributed/sharding/fsdp_options.h>
#include <ember/nn/module.h>

namespace ember::dist::detail {

struct FsdpContext;

/// One sharded module's parameters of one dtype and requires_grad, flattened.
struct FlatGroup {
  std::vector<Tensor> params;       // the module's own handles, now views of the arena
  std::vector<std::string> names;   // relative to the sharded module
  std::vector<int64_t> offsets;     // of each parameter in the flat buffer
  int64_t total = 0;                // elements of all parameters
  int64_t shard_size = 0;           // S: elements per rank (total padded to N * S)
  Dtype dtype = kFloat32;           // the parameters' own (and the shard's) dtype
  Dtype compute_dtype = kFloat32;   // of the gathered parameters
  Dtype reduce_dtype = kFloat32;    // of the reduce-scatter
  bool requires_grad = true;
  Device device = kCPU;             // of the parameters, the shard, the arena and the gradients
  Tensor shard;                     // [S]: this rank's elements [rank * S, (rank + 1) * S)
  /// Per parameter, this rank's elements of it: a 1-D view of `shard` (undefined when this
  /// rank holds none), a leaf that requires grad as the parameter does. The optimizer steps
  /// these, so it sees one tensor per parameter and can group them as it groups parameters.
  std::vector<Tensor> pieces;
  std::vector<int64_t> piece_begin;  // where each piece starts in its parameter (flattened)
  std::vector<int64_t> piece_at;     // and in the shard
  std::shared_ptr<FsdpArena> arena;  // N * S elements of compute_dtype on `device`
  Tensor full;                      // the arena as a tensor for collectives (its own storage)
  bool gathered = false;            // the arena holds the parameters (or a gather is pending)
  Tensor grad_flat;                 // [N * S] compute_dtype: the parameters' gradients' storage
  /// Per parameter: a gradient arrived since the last reduce-scatter (grad_flat holds zeros for
  /// the others, which stay without a gradient, as PyTorch's FSDP2 leaves them).
  std::vector<char> used;
};

struct FsdpUnit : std::enable_shared_from_this<FsdpUnit> {
  std::weak_ptr<nn::Module> module;
  std::string label;  // "fully_shard(Block)" for messages
  FullyShardOptions options;
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<FsdpContext> ctx;
  std::vector<FlatGroup> groups;
  int trainable = 0;  // parameters that require grad (post-accumulate hooks expected)

  std::vector<std::pair<WorkPtr, Tensor>> pending;  // all-gathers not yet waited for, inputs
  bool outermost = false;    // this forward ran with no other sharded module around it
  bool in_backward = false;  // its pre-backward hook ran in the current backward
  bool reduced = false;      // its gradients went to the reduce-scatter in this backward
  int ready = 0;             // gradients accumulated in this backward

  ~FsdpUnit();
  /// All-gathers every released group (wait: block until done; else a prefetch).
  void unshard(bool wait);
  void wait_unshard();
  /// Releases the gathered groups (only those that require grad when trainable_only).
  void reshard(bool trainable_only);
  void pre_forward(std::vector<Tensor>& inputs);
  void post_forward(std::vector<Tensor>& outputs);
  void pre_backward();
  /// Parameter `i` of groups[group] got its gradient.
  void on_grad_ready(size_t group, size_t i);
  /// Hands the parameters' gradients to reduce-scatters (or keeps them, without sync).
  void reduce_grads();
  void prepare_grads();
};

/// A reduce-scatter in flight (or, under HSDP, the all-reduce of its result across the
/// replicas): `out` is added to the gradients of `group`'s pieces.
struct PendingReduce {
  WorkPtr work;
  Tensor input, out;
  FlatGroup* group = nullptr;  // stays valid: units outlive their backward
  std::vector<char> used;      // the group's `used` when it was sent: which pieces get the result
};

/// The sharded modules of one process group on this rank: forward order (for prefetching and
/// for finishing a backward), reduce-scatters in flight, replicated parameters.
struct FsdpContext {
  std::shared_ptr<ProcessGroup> group;
  /// HSDP's group of the ranks holding the same shards (null: plain FSDP); every unit of the
  /// context has the same one.
  std::shared_ptr<ProcessGroup> replicate;
  bool configured = false;                          // the first unit has set `replicate`
  std::vector<std::weak_ptr<FsdpUnit>> order;       // forward order of the current step
  std::vector<std::weak_ptr<FsdpUnit>> last_order;  // and of the previous one (prefetching)
  std::vector<std::weak_ptr<FsdpUnit>> units;       // every unit of the group, for finish_backward
  int depth = 0;                      // sharded forwards running (nesting)
  bool callback_queued = false;
  bool sync = true;
  std::deque<PendingReduce> reduces;
  std::deque<PendingReduce> replica_reduces;  // HSDP: shards' all-reduces in flight
  std::vector<Tensor> replicated;     // parameters outside every unit (averaged gradients)
  /// Host time blocked in waits on the context's collectives (fsdp_comm_stats), in ns; read by
  /// the training thread while backward's hooks may add to it.
  std::atomic<int64_t> wait_ns{0};
};

/// Waits for `work`, adding the time the host was blocked to ctx.wait_ns.
void timed_wait(FsdpContext& ctx, const WorkPtr& work);

/// The unit of a module, or null.
std::shared_ptr<FsdpUnit> unit_of(const nn::Module& module);
/// The units of `root` and its submodules, in modules() order.
std::vector<std::shared_ptr<FsdpUnit>> units_under(const nn::Module& root);
/// The unit that holds parameter `t` (by tensor identity), or null.
std::shared_ptr<FsdpUnit> unit_holding(const Tensor& t);

}  // namespace ember::dist::detail
