// Post-local SGD and model averaging (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
// ICLR 2020): torch.distributed.new_subgroups, torch.distributed.algorithms.model_averaging
// (averagers, hierarchical_model_averager, utils), ddp_comm_hooks.post_localSGD_hook and
// torch.distributed.optim.PostLocalSGDOptimizer.
//
//   auto state = std::make_shared<dist::PostLocalSGDState>(
//       nullptr, nullptr, /*start_localSGD_iter=*/100);  // subgroups of LOCAL_WORLD_SIZE ranks
//   ddp.register_comm_hook(state, dist::post_localSGD_hook, "post_localSGD");
//   dist::PostLocalSGDOptimizer opt(
//       std::make_shared<nn::optim::SGD>(ddp.parameters(), nn::optim::SGDOptions{.lr = 0.01}),
//       std::make_shared<dist::PeriodicModelAverager>(/*period=*/4, /*warmup_steps=*/100));
//   for (...) { opt.zero_grad(); loss(ddp.forward(x), y).backward(); opt.step(); }
//
// For the first start_localSGD_iter iterations DDP averages gradients over the whole group, as
// without a hook. Afterwards each subgroup (usually a node) averages its gradients alone (or no
// rank communicates, post_local_gradient_allreduce = false), so replicas drift apart between
// nodes, and the optimizer averages the parameters themselves over the whole group every
// `period` steps. warmup_steps of the averager should equal start_localSGD_iter.
//
// Resuming: save PostLocalSGDState::state_dict() and PostLocalSGDOptimizer::state_dict() (it
// carries the averager's step) with the model; between two averagings the ranks' parameters
// differ, so each rank saves and reloads its own.
//
// Groups: new_subgroups (and so the default subgroup of PostLocalSGDState and the subgroups of
// HierarchicalModelAverager) are made with new_group, which every rank of the world calls in the
// same order; construct these objects on every rank, in the same order. Threads: like the
// optimizer they wrap, one thread at a time; the hook runs on DDP's backward thread.
#pragma once

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/process_group.h>
#include <ember/nn/module.h>
#include <ember/nn/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace ember::dist {

/// What new_subgroups made.
struct Subgroups {
  /// This rank's subgroup.
  std::shared_ptr<ProcessGroup> group;
  /// Every subgroup's members as world ranks, in creation order (this rank's is among them).
  std::vector<std::vector<int>> ranks;
};

/// Splits `group` (null: the default group) into consecutive subgroups of `group_size` ranks:
/// group ranks [0, group_size), [group_size, 2 group_size), ... (torch.distributed.new_subgroups
/// with a given size). Collective over the world: every rank calls it with the same arguments.
/// `group` must span the whole world (new_group is collective over the world, so a subgroup of a
/// smaller group cannot be made on the ranks outside it); torch 1.13 also splits the world
/// whatever group it is given. Throws ValueError if group_size < 1, exceeds the group's size or
/// does not divide it, if `group` is not the whole world, or if no default group exists.
Subgroups new_subgroups(int group_size, std::shared_ptr<ProcessGroup> group = nullptr);

/// Averages `params` over `group` in place: packs them into one flat buffer per dtype and device
/// (one all-reduce, ReduceOp::Avg, per kind; usually one in all) and copies the averages back,
/// so every parameter keeps its storage (optimizers hold the tensors). Parameters without a
/// gradient are skipped, as torch's get_params_to_average does (a frozen or unused parameter
/// is not trained, so it is not averaged either). Blocks until the all-reduce completes, bounded
/// by the group's timeout. Every rank of `group` must pass the same parameters (shapes, dtypes,
/// order, and which have gradients). Throws ValueError for an undefined parameter.
void average_parameters(const std::vector<Tensor>& params, ProcessGroup& group);
/// The parameters of every group, in order (torch's average_parameters_or_parameter_groups).
void average_parameters(const std::vector<nn::optim::ParamGroup>& groups, ProcessGroup& group);

/// Averages parameters on some steps of a training loop (torch's ModelAverager). Call
/// average_parameters once per iteration, after the optimizer's step; it advances step().
class ModelAverager {
 public:
  virtual ~ModelAverager() = default;
  ModelAverager(const ModelAverager&) = delete;
  ModelAverager& operator=(const ModelAverager&) = delete;

  /// Averages `params` if this step calls for it (see the subclasses), then advances step().
  /// Collective over the averaging group on the steps that average.
  virtual void average_parameters(const std::vector<Tensor>& params) = 0;
  /// The same over an optimizer's parameter groups.
  void average_parameters(const std::vector<nn::optim::ParamGroup>& groups);

  /// Calls of average_parameters so far (torch's `step` attribute).
  int64_t step() const { return step_; }
  /// Restores the count (a resumed run). Throws ValueError if `step` < 0.
  void set_step(int64_t step);
  /// The group parameters are averaged over at the top of the hierarchy.
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }

 protected:
  /// `group` null: the default group (ValueError if none).
  explicit ModelAverager(std::shared_ptr<ProcessGroup> group);
  /// Advances step() (called at the end of average_parameters).
  void advance() { ++step_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  int64_t step_ = 0;
};

/// Averages over process_group() at every step s with s >= warmup_steps and
/// (s - warmup_steps) % period == 0 (torch's PeriodicModelAverager).
class PeriodicModelAverager : public ModelAverager {
 public:
  /// Throws ValueError for period < 1 or warmup_steps < 0; warns (logger) for period 1, where
  /// averaging gradients with plain DDP costs no more.
  explicit PeriodicModelAverager(int64_t period, int64_t warmup_steps = 0,
                                 std::shared_ptr<ProcessGroup> group = nullptr);
  using ModelAverager::average_parameters;
  void average_parameters(const std::vector<Tensor>& params) override;

  int64_t period() const { return period_; }
  int64_t warmup_steps() const { return warmup_steps_; }

 private:
  int64_t period_;
  int64_t warmup_steps_;
};

/// Averages at several levels (hierarchical SGD, arXiv:2010.12998; torch's
/// HierarchicalModelAverager): `period_group_sizes` pairs a period with a group size, e.g.
/// {{4, 8}, {16, 16}}: groups of 8 consecutive ranks average every 4 steps, the whole group
/// every 16. At a step s >= warmup_steps, the group of the largest period dividing s (s itself,
/// not s - warmup_steps, as torch) averages; none if no period divides s.
class HierarchicalModelAverager : public ModelAverager {
 public:
  /// Makes the subgroups with new_subgroups (collective over the world) for every size below
  /// the group's. Throws ValueError for an empty list, a period < 1, periods not strictly
  /// increasing, a last group size other than the group's size, warmup_steps < 0, and
  /// new_subgroups' errors; warns (logger) when the largest period is 1.
  explicit HierarchicalModelAverager(std::vector<std::pair<int64_t, int>> period_group_sizes,
                                     int64_t warmup_steps = 0,
                                     std::shared_ptr<ProcessGroup> group = nullptr);
  using ModelAverager::average_parameters;
  void average_parameters(const std::vector<Tensor>& params) override;

  int64_t warmup_steps() const { return warmup_steps_; }
  /// The group that averages at step `step` (ignoring the warm-up), or null if none does.
  std::shared_ptr<ProcessGroup> group_at(int64_t step) const;

 private:
  // (period, this rank's group for it), periods increasing.
  std::vector<std::pair<int64_t, std::shared_ptr<ProcessGroup>>> levels_;
  int64_t warmup_steps_;
};

/// The state of post_localSGD_hook (torch's PostLocalSGDState). Its iteration count is what a
/// resumed run needs (state_dict()); the groups are made again by the new run.
class PostLocalSGDState {
 public:
  /// `process_group` null: the default group (used before start_localSGD_iter).
  /// `subgroup` null and post_local_gradient_allreduce: new_subgroups(ranks on this node),
  /// made here (collective over the world) rather than in the first local iteration as torch
  /// does, so no group is created from inside backward. The ranks on a node are
  /// local_world_size() (LOCAL_WORLD_SIZE, which emberrun and torchrun set). Throws ValueError
  /// if start_localSGD_iter < 0, or if a subgroup is needed, none is given and the environment
  /// does not say how many ranks a node has (pass one made with new_subgroups).
  PostLocalSGDState(std::shared_ptr<ProcessGroup> process_group,
                    std::shared_ptr<ProcessGroup> subgroup, int64_t start_localSGD_iter,
                    bool post_local_gradient_allreduce = true);

  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  /// Null when post_local_gradient_allreduce is false and none was given.
  const std::shared_ptr<ProcessGroup>& subgroup() const { return subgroup_; }
  int64_t start_localSGD_iter() const { return start_; }
  bool post_local_gradient_allreduce() const { return post_local_allreduce_; }
  /// Iterations run with the global all-reduce so far: counted on each iteration's last
  /// bucket, and, as torch's, no longer once it reaches start_localSGD_iter.
  int64_t iteration() const { return iter_; }

  /// {"iteration", "start_localSGD_iter", "post_local_gradient_allreduce"}: int64 tensors of one
  /// element, safe to save with nn::save_safetensors.
  nn::NamedTensors state_dict() const;
  /// Restores the iteration. Throws ValueError, changing nothing, if "iteration" is missing or
  /// not in [0, start_localSGD_iter], if the saved start_localSGD_iter or
  /// post_local_gradient_allreduce differ from this state's (a resumed run would follow another
  /// schedule), or for an entry it does not know.
  void load_state_dict(const nn::NamedTensors& state);

 private:
  friend std::shared_ptr<Future> post_localSGD_hook(PostLocalSGDState&, GradBucket&);
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<ProcessGroup> subgroup_;
  int64_t start_;
  bool post_local_allreduce_;
  int64_t iter_ = 0;
};

/// Post-local SGD as a DDP communication hook: ddp.register_comm_hook(state,
/// post_localSGD_hook, "post_localSGD"). Before state.start_localSGD_iter() iterations it
/// averages the bucket over state.process_group() (allreduce_hook); afterwards over
/// state.subgroup(), or not at all (each rank keeps its local gradient) when
/// post_local_gradient_allreduce is false. Pair it with a ModelAverager (PostLocalSGDOptimizer).
std::shared_ptr<Future> post_localSGD_hook(PostLocalSGDState& state, GradBucket& bucket);

/// Runs an optimizer and then a model averager over its parameters at every step (torch's
/// PostLocalSGDOptimizer). Not an nn::optim::Optimizer itself: it forwards to the one it wraps.
class PostLocalSGDOptimizer {
 public:
  /// Throws ValueError if either is null.
  PostLocalSGDOptimizer(std::shared_ptr<nn::optim::Optimizer> optimizer,
                        std::shared_ptr<ModelAverager> averager);

  /// optimizer().step(), then averager().average_parameters(param_groups()) (collective on the
  /// steps that average).
  void step();
  /// optimizer().zero_grad(set_to_none).
  void zero_grad(bool set_to_none = true);

  /// The wrapped optimizer's state plus an int64 entry "step" in `state`: the averager's step,
  /// as torch adds 'step' to the dict.
  nn::optim::OptimizerState state_dict() const;
  /// Loads the wrapped optimizer's state (without "step") and sets the averager's step to the
  /// saved one; without a "step" entry it warns (logger) and resets the step to 0, as torch.
  /// Throws the optimizer's ValueErrors, and ValueError for a "step" that is not one
  /// non-negative integer.
  void load_state_dict(const nn::optim::OptimizerState& state);

  std::vector<nn::optim::ParamGroup>& param_groups() { return optimizer_->param_groups(); }
  const std::vector<nn::optim::ParamGroup>& param_groups() const {
    return optimizer_->param_groups();
  }
  nn::optim::Optimizer& optimizer() const { return *optimizer_; }
  ModelAverager& averager() const { return *averager_; }

 private:
  std::shared_ptr<nn::optim::Optimizer> optimizer_;
  std::shared_ptr<ModelAverager> averager_;
};

}  // namespace ember::dist
