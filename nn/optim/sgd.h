// SGD with momentum, dampening, Nesterov momentum, weight decay and maximize
// (torch.optim.SGD, its single-tensor path: the same update, in the same order of operations).
#pragma once

#include <optional>

#include <ember/nn/optim/optimizer.h>

namespace ember::nn::optim {

/// SGD's hyperparameters (the defaults of every group). Use designated initializers:
/// `SGD(model->parameters(), {.lr = 0.1, .momentum = 0.9})`.
struct SGDOptions {
  /// Learning rate; required unless every group sets its own.
  std::optional<double> lr = std::nullopt;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool maximize = false;
};

/// For each parameter p with gradient g (per group: lr, momentum mu, dampening tau,
/// weight_decay wd):
///   g = maximize ? -g : g;  g += wd * p
///   b = (first step) ? g : mu * b + (1 - tau) * g        (only if mu != 0)
///   g = nesterov ? g + mu * b : b
///   p -= lr * g
/// State: "momentum_buffer" per parameter (only with momentum).
class SGD : public Optimizer {
 public:
  /// Throws ValueError for lr, momentum or weight_decay < 0, or nesterov without momentum or
  /// with dampening, and for bad parameters (see Optimizer::add_param_group).
  SGD(std::vector<ParamGroup> groups, const SGDOptions& options);
  SGD(std::vector<Tensor> params, const SGDOptions& options)
      : SGD(std::vector<ParamGroup>{ParamGroup(std::move(params))}, options) {}

  std::string name() const override { return "SGD"; }
  using Optimizer::step;
  void step() override;

 protected:
  void check_options(const GroupOptions& options, size_t group_index) const override;
};

}  // namespace ember::nn::optim
