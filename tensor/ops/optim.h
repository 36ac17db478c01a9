// Fused optimizer updates (internal to Ember: used by nn/optim/). Each call updates one
// parameter and its state in place in a single pass over memory, instead of the chain of
// element-wise ops an optimizer step is written in. Values match that chain (the order of
// operations of PyTorch 1.13's single-tensor optimizers; Note [Fused optimizer arithmetic] in
// tensor/detail/optim_kernels.h).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// Host-side description of one Adam/AdamW step (step counts from 1).
struct AdamStepArgs {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  double step = 1;
  bool amsgrad = false, maximize = false;
  bool decoupled = false;  ///< AdamW: p *= 1 - lr * wd instead of g += wd * p
  /// Capturable steps (CUDA only): the step count and the learning rate are read on the device
  /// from these scalars (float32 step, float64 lr) instead of `step` and `lr`, so that a CUDA
  /// graph replaying the update uses each replay's values (Note [CUDA graphs]).
  const float* step_dev = nullptr;
  const double* lr_dev = nullptr;
  /// With step_dev: the update does nothing when this float32 flag is non-zero (GradScaler).
  const float* found_inf_dev = nullptr;
};

/// Host-side description of one SGD step.
struct SgdStepArgs {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false, maximize = false;
  bool init_buffer = false;  ///< first step with momentum: buf = d_p (PyTorch's clone)
};

/// One Adam/AdamW step: updates param, exp_avg, exp_avg_sq and (with args.amsgrad)
/// max_exp_avg_sq in place, reading grad. `args.step` is the step number after incrementing
/// (1 on the first step). Runs the fused CPU/CUDA kernel when every tensor is contiguous, of
/// the parameter's (floating) dtype, shape and device; otherwise falls back to the equivalent
/// tensor ops. Throws ValueError naming "adam_update_" for undefined tensors, mismatched shapes
/// or devices, or a missing max_exp_avg_sq with amsgrad. Must run with grad mode off (it does
/// not record), like any optimizer step. Bumps the version of every tensor it writes.
void adam_update_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                  const AdamStepArgs& args);

/// One SGD step: updates param and (with momentum) momentum_buffer in place, reading grad.
/// With args.init_buffer the buffer (already allocated, any values) is set to the first d_p
/// as PyTorch's clone does. Fused/fallback and errors as adam_update_ ("sgd_update_").
void sgd_update_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                 const SgdStepArgs& args);

}  // namespace ember::detail
