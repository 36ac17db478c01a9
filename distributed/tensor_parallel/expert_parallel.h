// Expert parallelism (torchtitan's ExpertParallel, DeepSeek's and GShard's EP): a mixture of
// experts' experts split over the ranks of a group, each rank holding experts / size of them.
// Every rank routes its own tokens; all_to_all_single sends each token's row to the rank holding
// the expert it chose, that rank runs its experts over the rows it received from every rank, and
// a second all_to_all_single brings the outputs back, where they are weighted and summed as in
// one process. Backward runs the two exchanges reversed.
//
//   // every rank builds the same model (same seed; here examples/gpt's with experts), then:
//   for (auto& block : model->blocks) dist::parallelize_experts(block->moe(), group);
//   // data parallel over the rest, on the same ranks: DDP leaves the experts to their ranks
//   dist::DistributedDataParallel ddp(model, group, {.ignored_parameters =
//                                                        dist::expert_parameter_names(*model)});
//
// A step is then the step of one process over every rank's batch with the losses averaged: the
// experts' gradients arrive summed over the group's tokens and are divided by
// gradient_divide_factor (default: the group's size), as DDP averages the others. Each rank's
// expert weights are recorded as their Shard(0) of the whole (as_dtensor), so
// save_model_checkpoint writes them as parts of the whole experts, load_model_checkpoint reads
// them into any other layout (another group size, one process), and dist::clip_grad_norm_ over
// a mesh of the group counts each expert once.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/nn/layers/moe.h>

namespace ember::dist {

struct ExpertParallelOptions {
  /// What the experts' gradients are divided by once backward has summed them over every
  /// rank's tokens; default the group's size (each rank's loss an average over its batch, the
  /// data-parallel convention). 1 keeps the sums.
  std::optional<double> gradient_divide_factor;
};

/// Shards `moe`'s experts over `group`: rank r keeps experts [r E / n, (r + 1) E / n) of the
/// E the layer holds (MoE::keep_experts) and its forward dispatches rows to the ranks holding
/// their experts. Every rank must call it with the same weights (build the model from the same
/// seed, or broadcast it first) and then call the layer's forward the same number of times,
/// since each forward and backward is collective over `group`. The router and everything
/// outside the experts stay replicated. The kept weights are registered as DTensors sharded
/// along dim 0 over a 1-D mesh of `group` (register_dtensor). They are new tensors: build the
/// optimizer afterwards (Module::to() keeps them). Not with DDP's join() (a joined rank runs no
/// forward, so the others wait in the experts' exchange until the timeout) nor with a
/// ZeroRedundancyOptimizer over the experts (it would broadcast one rank's experts to all). Throws
/// ValueError when the group's size does not divide the experts, or the layer is already sharded.
void parallelize_experts(const std::shared_ptr<nn::MoE>& moe, std::shared_ptr<ProcessGroup> group,
                         const ExpertParallelOptions& options = {});

/// The names (as root.named_parameters() gives them) of the expert weights of every MoE layer
/// under `root` that parallelize_experts sharded: what data parallelism over the same ranks must
/// leave alone (DDPOptions::ignored_parameters).
std::vector<std::string> expert_parameter_names(nn::Module& root);

}  // namespace ember::dist
