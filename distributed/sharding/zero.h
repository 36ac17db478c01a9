// ZeroRedundancyOptimizer: optimizer state sharded across the ranks of a group
// (torch.distributed.optim.ZeroRedundancyOptimizer; ZeRO stage 1).
//
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model);
//   dist::ZeroRedundancyOptimizer opt(ddp->parameters(), [](std::vector<nn::optim::ParamGroup> g) {
//     return std::make_unique<nn::optim::Adam>(std::move(g), nn::optim::AdamOptions{.lr = 3e-4});
//   });
//   loss.backward();  // DDP averages the gradients on every rank
//   opt.step();       // each rank updates its partition, then every rank gets every update
//
// The parameters are partitioned across the ranks by size (Note [ZeRO partition]); each rank
// builds the wrapped optimizer over its own partition only, so Adam's two moments exist once in
// the job instead of once per rank. step() runs the local optimizer, then one all-gather per
// dtype and device (every rank's updated parameters packed into a flat buffer) gives every rank
// the full updated model. Every rank must call step() (it is a collective) with the same
// parameters; LR schedulers drive optimizer() (every rank schedules the same way).
//
// Checkpoints: consolidate_state_dict(to) gathers the full state on rank `to`, whose
// state_dict() then returns it in the wrapped optimizer's own layout (as if one optimizer had
// held every parameter: load it into a plain optimizer, or into a ZeroRedundancyOptimizer of
// any world size with load_state_dict, which keeps each rank's part).
//
// Overlap with DDP (torch's overlap_with_ddp): built with ZeroOptions{.overlap_with_ddp = true}
// and driven by DDP's communication hook hook_with_zero_step (distributed/sharding/zero_hook.h), each
// bucket's update is stepped and sent while the later buckets are still being all-reduced; the
// parameters are updated when backward returns, and step() only checks that this happened.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/nn/optim/optimizer.h>

namespace ember::dist::detail {
class ZeroOverlap;
}  // namespace ember::dist::detail

namespace ember::dist {

/// Options of ZeroRedundancyOptimizer (torch's constructor arguments of the same names).
struct ZeroOptions {
  /// Update the parameters from DDP's communication hook instead of in step(): register
  /// hook_with_zero_step (distributed/sharding/zero_hook.h) on the DDP that trains these parameters.
  /// step() then updates nothing and throws ValueError if no synchronised backward pass updated
  /// the parameters since the last step() (no hook registered, or a backward under no_sync()).
  bool overlap_with_ddp = false;
};

class ZeroRedundancyOptimizer {
 public:
  /// Builds the wrapped optimizer over the groups it is given (this rank's partition of each
  /// group, in the same order, with the group's options).
  using OptimizerFactory = std::function<std::unique_ptr<nn::optim::Optimizer>(
      std::vector<nn::optim::ParamGroup>)>;

  /// Collective only in that every rank must construct it with the same parameters (shapes,
  /// dtypes, order) and group; nothing is communicated. `group` null: the default group. Throws
  /// ValueError for no parameters, a parameter that does not require grad or is repeated, a
  /// null factory or optimizer, or a partition that leaves some rank without parameters.
  ZeroRedundancyOptimizer(std::vector<nn::optim::ParamGroup> groups, OptimizerFactory factory,
                          std::shared_ptr<ProcessGroup> group = nullptr, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<Tensor> params, OptimizerFactory factory,
                          std::shared_ptr<ProcessGroup> group = nullptr, ZeroOptions options = {})
      : ZeroRedundancyOptimizer(std::vector<nn::optim::ParamGroup>{{std::move(params)}},
                                std::move(factory), std::move(group), options) {}
  ~ZeroRedundancyOptimizer();

  /// Collective: the local optimizer's step over this rank's partition, then the all-gather of
  /// the updated parameters. Throws the group's errors (naming the collective and rank).
  /// With overlap_with_ddp: not collective, updates nothing (the hook did); throws ValueError
  /// if no synchronised backward pass ran the hook since the last step().
  void step();
  /// Adds a group (layers unfrozen during training, as torch's add_param_group): its parameters
  /// are partitioned over the ranks after those already held, so no earlier parameter moves and
  /// no state is communicated; the wrapped optimizer gets this rank's part as a new group (empty
  /// on a rank given none of it). Every rank must call it with the same group (shapes, order),
  /// between steps. Throws ValueError for a parameter that does not require grad or is already
  /// held, an empty group, or with overlap_with_ddp (the hook's buckets are fixed).
  void add_param_group(nn::optim::ParamGroup group);
  /// Clears (set_to_none) or zeroes the gradients of every parameter, not only this rank's.
  void zero_grad(bool set_to_none = true);

  /// The wrapped optimizer over this rank's partition (for LR schedulers and inspection).
  nn::optim::Optimizer& optimizer() { return *local_opt_; }
  const nn::optim::Optimizer& optimizer() const { return *local_opt_; }
  /// step()'s all-gather moves each rank's updated parameters in windows of at most this many
  /// bytes per rank (default 8 MiB), so its buffers are world x bytes, not a copy of the model.
  void set_gather_chunk_bytes(int64_t bytes);

  /// Which rank holds parameter i (counted across groups, in order) and its state.
  int rank_of(size_t i) const { return owner_[i]; }
  /// Indices (across groups) of the parameters this rank updates.
  const std::vector<size_t>& local_indices() const { return local_; }
  const ZeroOptions& options() const { return options_; }

  /// Collective: gathers every rank's optimizer state on rank `to` (the others keep nothing).
  /// Throws ValueError for `to` outside the group, and the group's errors.
  void consolidate_state_dict(int to = 0);
  /// On the rank consolidate_state_dict gathered to, the full state (in the wrapped optimizer's
  /// layout, parameters indexed across all groups). Throws ValueError on any other rank, or
  /// before a consolidation, or if a step() ran since (the state would be stale).
  nn::optim::OptimizerState state_dict() const;
  /// Not collective: takes this rank's part of a full state (from state_dict() or a plain
  /// optimizer over the same parameters) into the local optimizer. Throws ValueError (from the
  /// wrapped optimizer's load_state_dict, or here) for a state of another type or shape.
  void load_state_dict(const nn::optim::OptimizerState& full);

 private:
  struct Flat;  // one dtype and device's parameters, packed per rank for the all-gather
  // Checks and appends a group's parameters (params_, group_of_); returns their indices.
  std::vector<size_t> take_params(const nn::optim::ParamGroup& group, size_t g);
  // flats_ from params_ and owner_, with gather windows of gather_chunk_bytes_.
  void build_flats();
  friend class detail::ZeroOverlap;  // detail/zero_overlap.h: steps and sends bucket by bucket

  std::shared_ptr<ProcessGroup> group_;
  ZeroOptions options_;
  std::vector<Tensor> params_;      // every parameter, across groups in order
  std::vector<int> owner_;          // rank holding each parameter
  std::vector<size_t> local_;       // this rank's parameter indices, ascending
  std::vector<size_t> group_of_;    // the group of each parameter
  std::unique_ptr<nn::optim::Optimizer> local_opt_;
  std::vector<Flat> flats_;
  std::vector<int64_t> load_;  // bytes each rank holds, where the next group's partition starts
  int64_t gather_chunk_bytes_;
  std::optional<nn::optim::OptimizerState> consolidated_;
  int64_t steps_ = 0;
  int64_t consolidated_at_ = -1;  // steps_ when consolidated
  // With overlap_with_ddp; shared with the hook, which outlives nothing it needs from here.
  std::shared_ptr<detail::ZeroOverlap> overlap_;
};

}  // namespace ember::dist
