// Tensor parallelism for examples/gpt's model (gpt_model.h): the plan that lays a GPT out over
// a 1-D tensor-parallel mesh, Megatron's layout:
//   - wte vocabulary parallel (RowwiseParallel on the Embedding), the tied head column parallel
//     over the same rows, so the logits come out sharded on the vocabulary (loss_parallel);
//   - each block's attention: qkv column parallel by heads (output_chunks = 3, each rank its
//     heads of q, k and v), proj row parallel; its MLP: fc column, fc_proj row parallel;
//   - with sequence parallelism the LayerNorms and dropouts work on the rank's part of the
//     sequence, and the all-reduces become all-gathers before the column-parallel layers and
//     reduce-scatters after the row-parallel ones (the same bytes); the position embedding's
//     output is cut to the rank's part of the sequence.
// Header-only beside gpt_model.h; needs ember_distributed.
#pragma once

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/tensor_parallel/parallelize.h>

namespace ember::examples {

/// The plan of a GPT over a tensor-parallel mesh: `sequence_parallel` shards the LayerNorms'
/// and dropouts' activations on the sequence; `loss_parallel` leaves the logits sharded on the
/// vocabulary (a DTensor output: dist::as_dtensor(logits) -> dist::loss_parallel::cross_entropy)
/// instead of all-gathering them. `overlap_chunks`: the sequence-parallel collectives fused with
/// their matmuls in this many pieces (ColwiseParallelOptions::overlap_chunks; 0 unfused).
inline dist::ParallelizePlan gpt_tensor_parallel_plan(bool sequence_parallel, bool loss_parallel,
                                                      int64_t overlap_chunks = 1) {
  using namespace dist;
  const Placement act = sequence_parallel ? Placement(Shard(1)) : Placement(Replicate());
  ParallelizePlan plan = {
      {"wte", RowwiseParallel({.input_layouts = Replicate(), .output_layouts = act})},
      {"blocks.*.qkv", ColwiseParallel({.input_layouts = act,
                                        .output_chunks = 3,
                                        .overlap_chunks = overlap_chunks})},
      {"blocks.*.proj", RowwiseParallel({.output_layouts = act, .overlap_chunks = overlap_chunks})},
      {"blocks.*.fc", ColwiseParallel({.input_layouts = act, .overlap_chunks = overlap_chunks})},
      {"blocks.*.fc_proj",
       RowwiseParallel({.output_layouts = act, .overlap_chunks = overlap_chunks})},
      {"lm_head", ColwiseParallel({.input_layouts = act,
                                   .output_layouts = loss_parallel ? Placement(Shard(-1))
                                                                   : Placement(Replicate()),
                                   .use_local_output = !loss_parallel})},
  };
  if (sequence_parallel) {
    // The position embedding [T, C] meets the token embedding's part of the sequence.
    plan.push_back({"wpe", PrepareModuleOutput({.output_layouts = {Replicate()},
                                                .desired_output_layouts = {Shard(0)}})});
    for (const char* m : {"drop", "blocks.*.ln1", "blocks.*.ln2", "blocks.*.drop", "ln_f"}) {
      plan.push_back({m, SequenceParallel()});
    }
  }
  return plan;
}

}  // namespace ember::examples
