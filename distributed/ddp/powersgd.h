// PowerSGD gradient compression (Vogels et al., NeurIPS 2019) as DDP communication hooks:
// torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.
//
//   auto state = std::make_shared<dist::PowerSGDState>(
//       dist::PowerSGDOptions{.matrix_approximation_rank = 2, .start_powerSGD_iter = 100});
//   ddp.register_comm_hook(state, dist::powersgd_hook);
//   ...
//   auto tensors = model->state_dict();
//   for (auto& [k, t] : state->state_dict()) tensors.emplace_back("powersgd." + k, t);
//   nn::save_safetensors("ckpt.safetensors", tensors);
//
// Each gradient that is a matrix worth compressing (n x m, viewed as shape[0] x the rest) is
// replaced by a rank-r approximation P Q^T: P = M Q is summed over ranks and orthogonalised,
// Q = M^T P is summed, and M ~ P Q^T / world_size. Two all-reduces of (n + m) r elements instead
// of one of n m. Vectors (biases) and small matrices are all-reduced uncompressed, in the same
// all-reduce as the Ps. The first start_powerSGD_iter iterations use a plain all-reduce.
//
// Every collective is issued from DDP's thread: the P all-reduce when the bucket launches, the
// Q all-reduce at the end of backward (GradBucket::defer), so any bucket layout works with any
// number of ranks (Note [comm hook ordering] in comm_hooks.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/nn/module.h>

namespace ember::dist {

/// PowerSGDState's hyperparameters (torch's constructor arguments of the same names).
struct PowerSGDOptions {
  /// r: the rank of the approximation (lower: stronger compression).
  int64_t matrix_approximation_rank = 1;
  /// Iterations (counted in backward passes with a hook call) of plain all-reduce first.
  int64_t start_powerSGD_iter = 1000;
  /// A matrix is compressed only if (n + m) r * min_compression_rate < n m.
  double min_compression_rate = 2;
  /// Add last iteration's local compression error to the gradient before compressing.
  bool use_error_feedback = true;
  /// Start each iteration's power iteration from last iteration's Q (else a fresh random Q).
  bool warm_start = true;
  /// Added to each column's norm in the Gram-Schmidt orthogonalisation (0: a zero column stays
  /// zero instead of becoming NaN).
  double orthogonalization_epsilon = 0;
  /// Seeds the initial Qs; every rank must use the same seed.
  uint64_t random_seed = 0;
};

/// The hyperparameters and state of the PowerSGD hooks: the iteration count, the local error
/// and Q of each compressed gradient, and compression statistics. Keyed by parameter index
/// (powersgd_hook) or by the bucket's parameter set (batched_powersgd_hook), never by bucket
/// index, so the state stays valid across DDP's bucket rebuild and a restart.
/// Threads: used by the hooks on DDP's thread; read it between iterations.
class PowerSGDState {
 public:
  /// Throws ValueError for a rank < 1, start_powerSGD_iter < 0, a negative
  /// min_compression_rate or orthogonalization_epsilon.
  explicit PowerSGDState(PowerSGDOptions options = {});

  const PowerSGDOptions& options() const { return options_; }
  /// Iterations seen so far (incremented when the last bucket of an iteration is hooked).
  int64_t iteration() const { return iter_; }

  struct CompressionStats {
    /// numel_before / numel_after (0 before any compressed iteration).
    double rate = 0;
    /// Elements the compressed iterations would have all-reduced without compression.
    int64_t numel_before = 0;
    /// Elements they did all-reduce (uncompressed tensors + Ps + Qs).
    int64_t numel_after = 0;
  };
  /// Totals over every compressed iteration (torch's compression_stats()).
  CompressionStats compression_stats() const;

  /// Everything needed to continue identically after a restart: "iteration", the statistics,
  /// the options ("option.<name>", float64 scalars) and per key "error.<key>" and "q.<key>".
  /// Tensors are copies (CPU or the gradients' device), safe to save with nn::save_safetensors.
  nn::NamedTensors state_dict() const;
  /// Restores what state_dict() returned (the options too). Throws ValueError naming an entry
  /// it does not know or a missing "iteration".
  void load_state_dict(const nn::NamedTensors& state);

 private:
  friend std::shared_ptr<Future> powersgd_hook(PowerSGDState&, GradBucket&);
  friend std::shared_ptr<Future> batched_powersgd_hook(PowerSGDState&, GradBucket&);
  /// Bumps the iteration after the last bucket (torch's maybe_increase_iter).
  void end_bucket(const GradBucket& bucket);

  PowerSGDOptions options_;
  int64_t iter_ = 0;
  int64_t numel_before_ = 0;
  int64_t numel_after_ = 0;
  std::map<std::string, Tensor> error_;  // key -> local error, shaped like the gradient
  std::map<std::string, Tensor> q_;      // key -> [m, r]
};

/// Layer-wise PowerSGD (torch's powerSGD_hook): for ddp.register_comm_hook(state, powersgd_hook).
/// Before options().start_powerSGD_iter it is allreduce_hook. Issues two all-reduces per bucket.
std::shared_ptr<Future> powersgd_hook(PowerSGDState& state, GradBucket& bucket);

/// Whole-bucket PowerSGD (torch's batched_powerSGD_hook): the bucket, zero-padded to s*s with
/// s = ceil(sqrt(numel)), is compressed as one s x s matrix. Faster, usually less accurate
/// unless the rank is 1. State is keyed by GradBucket::key().
std::shared_ptr<Future> batched_powersgd_hook(PowerSGDState& state, GradBucket& bucket);

}  // namespace ember::dist
