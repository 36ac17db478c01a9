// Running a pipeline schedule (torch.distributed.pipelining's PipelineScheduleSingle/Multi):
// one executor for every schedule, since a schedule is its list of actions (schedule.h).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <ember/distributed/errors.h>
#include <ember/distributed/pipelining/schedule.h>
#include <ember/distributed/pipelining/stage.h>

namespace ember::dist::pipelining {

/// A stage's output disagrees with the shape or dtype its receiver takes (torch's
/// PipeliningShapeError).
class PipeliningShapeError : public ValueError {
 public:
  using ValueError::ValueError;
};

/// loss_fn(output, target) of one micro-batch: a one-element tensor.
using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

struct ScheduleOptions {
  /// Required: the last stage's loss per micro-batch.
  LossFn loss_fn;
  /// Gradients as of the mean of the micro-batches' losses (each loss divided by their number
  /// before its backward), for a loss_fn that averages; false: of their sum.
  bool scale_grads = true;
  /// The dimension the batch (input and target) is split along into micro-batches.
  int64_t split_dim = 0;
};

/// Time of the last step on this rank.
struct StepStats {
  double wall_s = 0;     ///< the step, from its start to its last send's completion
  double compute_s = 0;  ///< forwards and backwards (what is not waiting)
  double busy_fraction() const { return wall_s > 0 ? compute_s / wall_s : 0; }
};

/// Runs a schedule's actions for this rank's `stages` (those the schedule places on this rank
/// of their group). Every rank of the group makes one with the same schedule and micro-batches.
class PipelineSchedule {
 public:
  /// Collective over the stages' group: every rank constructs its schedule, and a rank with
  /// other micro-batches, stages or actions is named (ValueError on every rank).
  ///
  /// One of the named schedules. `stages`: this rank's, all with one group and num_stages;
  /// the schedule decides which rank runs which stage (stage_rank). Throws ValueError naming
  /// what does not fit: stages on the wrong rank, a stage count the ranks do not divide.
  PipelineSchedule(std::vector<std::shared_ptr<PipelineStage>> stages, int n_microbatches,
                   ScheduleKind kind, ScheduleOptions options);
  /// A schedule of one's own (from_csv): one list per rank, computation only or with the
  /// transfers; each stage's rank is where its actions are. Validated at construction.
  PipelineSchedule(std::vector<std::shared_ptr<PipelineStage>> stages, int n_microbatches,
                   RankActions actions, ScheduleOptions options);
  ~PipelineSchedule();
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  /// One training step over the whole batch: `input` on the rank with stage 0 and `target` on
  /// the rank with the last stage (undefined elsewhere), split into the micro-batches; runs
  /// this rank's actions; the stages' gradients accumulate into their parameters' grad().
  /// Returns the outputs merged along split_dim on the last stage's rank (undefined
  /// elsewhere) and appends each micro-batch's loss to `losses` there. Throws ValueError for a
  /// batch the micro-batches do not divide; a failed transfer throws the backend's error,
  /// naming stage, micro-batch and peer. A step that throws on one rank (its stage's forward,
  /// its loss, a bad batch) aborts the group (ProcessGroup::abort), so that the other ranks,
  /// waiting on it, fail within moments naming this rank and its error instead of at their
  /// timeout; the group cannot be used again.
  Tensor step(const Tensor& input = {}, const Tensor& target = {},
              std::vector<Tensor>* losses = nullptr);

  /// Forward only (torch's schedule.eval()): the batch split into the micro-batches and run
  /// through the stages under no_grad, in the schedule's order of forwards and their
  /// transfers, with the modules as they are (call eval() on them first for evaluation mode).
  /// Returns and appends what step() does; `target` may be undefined (no losses then). No
  /// gradient is touched, so it may run between steps.
  Tensor eval(const Tensor& input = {}, const Tensor& target = {},
              std::vector<Tensor>* losses = nullptr);

  /// Every rank's actions, with the transfers.
  const RankActions& actions() const { return actions_; }
  const std::vector<int>& rank_of_stage() const { return rank_of_stage_; }
  int n_microbatches() const { return m_; }
  /// format_table() of this schedule.
  std::string table() const;
  const StepStats& last_step() const { return stats_; }

 private:
  struct Impl;
  void init(std::vector<std::shared_ptr<PipelineStage>> stages, RankActions actions,
            std::vector<int> rank_of_stage);
  void agree();
  // run_actions(), aborting the group if it throws (Note [a failed step aborts the group]).
  Tensor run(const std::vector<Action>& mine, const Tensor& input, const Tensor& target,
             std::vector<Tensor>* losses, bool training);
  Tensor run_actions(const std::vector<Action>& mine, const Tensor& input, const Tensor& target,
                     std::vector<Tensor>* losses, bool training);
  int m_;
  ScheduleOptions options_;
  RankActions actions_;
  std::vector<int> rank_of_stage_;
  StepStats stats_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ember::dist::pipelining
