// Pipeline stages (torch.distributed.pipelining's PipelineStage) and splitting a sequential
// model into them.
//
//   auto parts = pipelining::split_sequential(*model, {4});       // layers [0, 4) and [4, 8)
//   auto stage = std::make_shared<pipelining::PipelineStage>(parts[rank], rank, 2, kCPU, pg);
//   pipelining::PipelineSchedule schedule({stage}, 8, pipelining::ScheduleKind::OneFOneB,
//                                         {.loss_fn = cross_entropy_loss});
//   schedule.step(rank == 0 ? x : Tensor(), rank == 1 ? y : Tensor(), &losses);
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/nn/layers/container.h>

namespace ember::dist::pipelining {

/// A run of a Sequential's modules, model[begin, end), under their names in the whole model:
/// the part's parameters read "4.weight" as in the unsplit model, so a checkpoint of the
/// stages is one of the model.
class SequentialPart : public nn::Module {
 public:
  SequentialPart(const nn::Sequential& model, int64_t begin, int64_t end);
  std::string name() const override { return "SequentialPart"; }
  Tensor forward(const Tensor& input) override;
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }

 private:
  int64_t begin_, end_;
  std::vector<std::shared_ptr<nn::Module>> modules_;
};

/// `model` cut before each of `boundaries` (strictly increasing, inside (0, size)): parts
/// [0, b0), [b0, b1), ..., [bk, size). The parts share the model's modules. Throws ValueError
/// naming the boundaries.
std::vector<std::shared_ptr<SequentialPart>> split_sequential(const nn::Sequential& model,
                                                              const std::vector<int64_t>& boundaries);
/// `num_stages` parts of equal length; throws ValueError naming both numbers when the modules
/// do not divide evenly.
std::vector<std::shared_ptr<SequentialPart>> split_sequential_evenly(const nn::Sequential& model,
                                                                     int num_stages);

struct PipelineStageOptions {
  /// The shape of the micro-batch this stage takes (torch's input_args), checked against what
  /// arrives; without it the first micro-batch's shape is learned from the sender.
  std::optional<Shape> input_shape;
  /// Every activation carries its shape (send_with_shape), for stages whose output shapes vary
  /// between steps; otherwise shapes after the first step must match the first step's. Set on
  /// either side of a boundary (the stage whose output varies, or the one that takes it), it
  /// holds for both: the schedule's ranks agree on it when it is made.
  bool dynamic_shapes = false;
};

/// One stage of a pipeline: `submodule` runs stage `stage_index` of `num_stages` on `device`;
/// stages talk over `group` (null: the default group), whose rank r runs the stages the
/// schedule places there.
class PipelineStage {
 public:
  PipelineStage(std::shared_ptr<nn::Module> submodule, int stage_index, int num_stages,
                Device device = kCPU, std::shared_ptr<ProcessGroup> group = {},
                PipelineStageOptions options = {});

  nn::Module& submodule() const { return *submodule_; }
  const std::shared_ptr<nn::Module>& submodule_ptr() const { return submodule_; }
  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  const Device& device() const { return device_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  const PipelineStageOptions& options() const { return options_; }

 private:
  std::shared_ptr<nn::Module> submodule_;
  int stage_index_;
  int num_stages_;
  Device device_;
  std::shared_ptr<ProcessGroup> group_;
  PipelineStageOptions options_;
};

}  // namespace ember::dist::pipelining
