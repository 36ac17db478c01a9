// Adam and AdamW (torch.optim.Adam / AdamW, their single-tensor path: the same update, in the
// same order of operations, with the step count kept as a float32 tensor as PyTorch 1.13 does).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <ember/nn/optim/optimizer.h>

namespace ember::nn::optim {

/// Adam's hyperparameters (the defaults of every group), e.g.
/// `Adam(model->parameters(), {.lr = 3e-4, .betas = {0.9, 0.95}})`. Groups store the betas as
/// options "beta1" and "beta2".
struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  /// Adam: L2 penalty added to the gradient. AdamW: decoupled decay of the parameter.
  double weight_decay = 0;
  bool amsgrad = false;
  bool maximize = false;
  /// PyTorch's capturable: for CUDA parameters the step count lives on the device and the step
  /// reads it and the learning rate there, so that the step can be captured in a CUDA graph and
  /// replayed (Note [CUDA graphs]); a group's learning rate set on the host (a scheduler) is
  /// written to the device before each replay. No effect on CPU parameters.
  bool capturable = false;
};

/// AdamW's hyperparameters: AdamOptions with PyTorch's AdamW default weight_decay of 1e-2.
struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
  bool capturable = false;  ///< as AdamOptions::capturable
};

/// For each parameter p with gradient g, step t (counted per parameter from 1):
///   g = maximize ? -g : g;   g += wd * p                    (Adam's L2 penalty)
///   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
///   vmax = max(vmax, v)                                      (amsgrad; v := vmax below)
///   denom = sqrt(v) / sqrt(1 - beta2^t) + eps
///   p -= lr / (1 - beta1^t) * m / denom
/// State per parameter: "step" (a float32 scalar on the CPU; on the parameter's CUDA device when
/// capturable), "exp_avg", "exp_avg_sq" and,
/// with amsgrad, "max_exp_avg_sq". A step is one fused pass per parameter (tensor/ops/optim.h:
/// reads the parameter, gradient and moments once, writes them once, allocates nothing) when
/// they are contiguous and of one dtype, else a chain of in-place tensor ops.
class Adam : public Optimizer {
 public:
  /// Throws ValueError for lr, eps or weight_decay < 0, a beta outside [0, 1), and for bad
  /// parameters (see Optimizer::add_param_group).
  Adam(std::vector<ParamGroup> groups, const AdamOptions& options = {});
  Adam(std::vector<Tensor> params, const AdamOptions& options = {})
      : Adam(std::vector<ParamGroup>{ParamGroup(std::move(params))}, options) {}

  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }
  using Optimizer::step;
  void step() override;
  /// A capturable group's CUDA parameters skip on the device (the kernel reads the flag, and the
  /// step count advances by 0 or 1 there); the others read the flag once on the host.
  void step_unless(const Tensor& found_inf) override;
  bool supports_found_inf() const override { return true; }

 protected:
  Adam(std::vector<ParamGroup> groups, const AdamOptions& options, bool decoupled);
  void check_options(const GroupOptions& options, size_t group_index) const override;

 private:
  // A capturable group's learning rate on its device: one float64 scalar per (group, device),
  // rewritten when the host value changes, and before each replay of a graph that captured it.
  struct DeviceLr {
    size_t group;
    Device device;
    Tensor value;
    double written = 0;
    bool valid = false;
  };
  const double* device_lr(size_t group, const Device& device);
  void step_impl(const Tensor* found_inf);

  bool decoupled_ = false;
  std::vector<std::unique_ptr<DeviceLr>> device_lr_;
};

/// Adam with decoupled weight decay (Loshchilov & Hutter): before the Adam update,
///   p *= 1 - lr * weight_decay
/// and the gradient gets no L2 term. Same state as Adam.
class AdamW : public Adam {
 public:
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options = {});
  AdamW(std::vector<Tensor> params, const AdamWOptions& options = {})
      : AdamW(std::vector<ParamGroup>{ParamGroup(std::move(params))}, options) {}
};

}  // namespace ember::nn::optim
