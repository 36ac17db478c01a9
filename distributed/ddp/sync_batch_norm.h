// SyncBatchNorm: batch normalisation whose batch statistics span every rank of a process group
// (torch.nn.SyncBatchNorm), and convert_sync_batchnorm to swap it into a model.
//
//   auto model = dist::convert_sync_batchnorm(make_model());   // BatchNorm* -> SyncBatchNorm
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model);
//
// In training mode, with a group of more than one rank, each rank computes the per-channel count,
// mean and sum of squared deviations of its local batch; one allgather (float64, [count, mean,
// M2] per rank, merged with Chan's parallel-variance formula) gives every rank the statistics of
// the concatenated batch, which normalise the local batch and update the running statistics
// (unbiased variance, as BatchNorm). Backward all-reduces the per-channel sums of grad_out and
// grad_out * (x - mean) once (float64), so the input gradient is the one of the whole batch; the
// weight and bias gradients stay local sums (DistributedDataParallel averages them, as in
// torch). Ranks may hold different local batch sizes, empty ones included. With a mean loss
// and equal slices, DDP + SyncBatchNorm on N ranks trains exactly like one process on
// the whole batch (see docs/sync_batch_norm.md).
//
// Eval mode (or a group of size 1) is plain BatchNorm, with no communication. Every rank of the
// group must call forward (and backward) the same number of times in the same order, as for any
// collective; each collective wait is bounded by the group's timeout.
#pragma once

#include <memory>
#include <string>

#include <ember/distributed/process_group.h>
#include <ember/nn/layers/norm.h>

namespace ember::dist {

class SyncBatchNorm : public nn::BatchNorm {
 public:
  /// Same parameters, buffers and state_dict names as BatchNorm (weight, bias, running_mean,
  /// running_var, num_batches_tracked). `group` null: the default group, looked up at each
  /// training-mode forward. Throws ValueError for num_features <= 0 or eps < 0.
  SyncBatchNorm(int64_t num_features, const nn::BatchNormOptions& options = {},
                std::shared_ptr<ProcessGroup> group = nullptr);

  std::string name() const override { return "SyncBatchNorm"; }

  /// input [N, C, *] (any number of trailing dims, N may be 0 on some ranks). Training mode:
  /// normalises with the statistics of all ranks' inputs (one allgather; collective), and the
  /// returned tensor's backward issues one allreduce. Eval mode or world size 1: BatchNorm.
  /// Throws ValueError for fewer than 2 dims or a channel count other than num_features
  /// (naming both), before any communication; ValueError when training with no group given
  /// and no default group; ValueError on every rank if all ranks together hold one value per
  /// channel; the group's errors (DistTimeoutError, ...) if a peer fails.
  Tensor forward(const Tensor& input) override;

  /// The group given at construction (null: the default group).
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }

 protected:
  void check_input_dim(const Tensor& input) const override;

 private:
  std::shared_ptr<ProcessGroup> group_;
};

/// Replaces every nn::BatchNorm (BatchNorm1d, BatchNorm2d, and SyncBatchNorm, which gets the
/// new group) in the tree rooted at `module` by a SyncBatchNorm that holds the same parameter
/// and buffer tensors (same handles: optimizers and state_dict keys are unaffected) and the same
/// options and training mode; returns the converted tree (torch's
/// SyncBatchNorm.convert_sync_batchnorm). Use the returned module: a BatchNorm root, and every
/// Sequential / ModuleList on the path to a BatchNorm, is replaced by a new object holding the
/// converted children (nn::Module cannot swap a child in place); subtrees without a BatchNorm
/// are kept as they are. Throws ValueError naming the path if a BatchNorm sits inside another
/// kind of module (e.g. a user-defined one), since it cannot be swapped there; convert before
/// wrapping in DistributedDataParallel.
std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace ember::dist
