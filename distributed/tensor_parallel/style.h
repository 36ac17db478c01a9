// Parallel styles (torch.distributed.tensor.parallel): how parallelize_module lays one module
// out over a 1-D mesh (the tensor-parallel ranks). A style shards the module's parameters (each
// rank keeps its part, recorded as a DTensor: as_dtensor(param)) and replaces its forward by the
// same computation on the parts, with the collectives the layout needs (DTensor's redistribute
// and ops), or adds hooks that lay its inputs or outputs out.
//
//   ColwiseParallel    Linear: weight Shard(0), bias Shard(0); input Replicate -> output
//                      Shard(-1). Embedding: weight Shard(1). Any other module: run as is on
//                      the replicated input (its parameters already sharded, e.g. a head tied to
//                      a vocabulary-parallel embedding). output_chunks: a fused projection
//                      (GPT-2's q, k, v in one Linear) sharded block by block.
//   RowwiseParallel    Linear: weight Shard(1), bias Replicate (added once); input Shard(-1) ->
//                      output Replicate (all-reduce) or Shard(1) (reduce-scatter). Embedding:
//                      weight Shard(0) (vocabulary parallel); input Replicate.
//   SequenceParallel   LayerNorm, Dropout: parameters Replicate; input and output sharded on
//                      the sequence dim (Megatron's sequence parallelism).
//   PrepareModuleInput / PrepareModuleOutput: lay a module's inputs or outputs out, leaving its
//                      forward alone.
//
// Layouts of inputs: a module's input that a style left distributed (use_local_output = false)
// is found again (as_dtensor) and redistributed from where it is; any other input is taken to
// be laid out as `input_layouts` says, with even shards (as PyTorch assumes). Modules return
// Tensors: use_local_output = false returns the local tensor recorded as a DTensor, for the next
// style to find. Parallelized modules must be called through operator() (`(*m)(x)`), where the
// replaced forward and the hooks run.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/nn/module.h>

namespace ember::dist {

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  /// "ColwiseParallel", for errors.
  virtual std::string name() const = 0;
  /// Lays `module` (at `path` in the model, for errors) out over the 1-D `mesh`; parameters
  /// come from `src_data_rank`'s copy (-1: each rank's own). Throws ValueError for a module the
  /// style does not support, or sizes not divisible by the mesh.
  virtual void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                     const std::string& path, int src_data_rank) const = 0;
};

struct ColwiseParallelOptions {
  /// How the input is laid out (default Replicate; Shard(1) under sequence parallelism).
  std::optional<Placement> input_layouts;
  /// How the output is laid out (default Shard(-1)).
  std::optional<Placement> output_layouts;
  bool use_local_output = true;
  /// The output features are this many equal blocks each sharded on its own (3 for a fused
  /// q, k, v projection), so each rank's output is its part of every block, in order. Needs
  /// the default output layout and use_local_output.
  int64_t output_chunks = 1;
  /// A Linear whose input is sharded on the sequence (input_layouts Shard(1)): its all-gather
  /// fused with the matmul, in this many pieces along the batch, each piece's all-gather
  /// overlapping the previous piece's matmul (Note [fused sequence-parallel linears]); the
  /// gathered input is not kept for backward. 1: fused, no overlap; 0: redistribute, then
  /// linear.
  int64_t overlap_chunks = 1;
};
class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(ColwiseParallelOptions o = {}) : o_(o) {}
  std::string name() const override { return "ColwiseParallel"; }
  void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
             const std::string& path, int src_data_rank) const override;

 private:
  ColwiseParallelOptions o_;
};

struct RowwiseParallelOptions {
  /// Default Shard(-1) (Linear) or Replicate (Embedding).
  std::optional<Placement> input_layouts;
  /// Default Replicate; Shard(1) under sequence parallelism (a reduce-scatter).
  std::optional<Placement> output_layouts;
  bool use_local_output = true;
  /// A Linear whose output is sharded on the sequence: its reduce-scatter fused with the
  /// matmul, in this many pieces, each piece's reduce-scatter overlapping the next piece's
  /// matmul. 1: fused, no overlap; 0: linear, then redistribute.
  int64_t overlap_chunks = 1;
};
class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(RowwiseParallelOptions o = {}) : o_(o) {}
  std::string name() const override { return "RowwiseParallel"; }
  void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
             const std::string& path, int src_data_rank) const override;

 private:
  RowwiseParallelOptions o_;
};

struct SequenceParallelOptions {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};
class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions o = {}) : o_(o) {}
  std::string name() const override { return "SequenceParallel"; }
  void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
             const std::string& path, int src_data_rank) const override;

 private:
  SequenceParallelOptions o_;
};

/// One entry per input (nullopt: leave that input alone).
using Layouts = std::vector<std::optional<Placement>>;

struct PrepareModuleInputOptions {
  Layouts input_layouts;
  Layouts desired_input_layouts;
  bool use_local_output = false;
};
class PrepareModuleInput : public ParallelStyle {
 public:
  explicit PrepareModuleInput(PrepareModuleInputOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "PrepareModuleInput"; }
  void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
             const std::string& path, int src_data_rank) const override;

 private:
  PrepareModuleInputOptions o_;
};

struct PrepareModuleOutputOptions {
  Layouts output_layouts;
  Layouts desired_output_layouts;
  bool use_local_output = true;
};
class PrepareModuleOutput : public ParallelStyle {
 public:
  explicit PrepareModuleOutput(PrepareModuleOutputOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "PrepareModuleOutput"; }
  void apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
             const std::string& path, int src_data_rank) const override;

 private:
  PrepareModuleOutputOptions o_;
};

}  // namespace ember::dist
