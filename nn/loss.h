// Loss modules: thin wrappers over the losses in nn/functional.h that keep their options (and
// per-class weights, as buffers that follow the module's to()). Call them as loss(input,
// target); forward(input) alone is not available.
#pragma once

#include <string>

#include <ember/nn/functional.h>
#include <ember/nn/module.h>

namespace ember::nn {

/// Common base: forward(input, target) and operator()(input, target).
class Loss : public Module {
 public:
  virtual Tensor forward(const Tensor& input, const Tensor& target) = 0;
  Tensor operator()(const Tensor& input, const Tensor& target) { return forward(input, target); }
  using Module::forward;  // the one-argument form throws NotImplementedError
};

/// torch.nn.CrossEntropyLoss: logits [N, C] (or [N, C, d1, ...], [C]) and int64 class indices
/// (or class probabilities); see functional::cross_entropy. options.weight becomes the buffer
/// "weight".   CrossEntropyLoss({.label_smoothing = 0.1})
class CrossEntropyLoss : public Loss {
 public:
  explicit CrossEntropyLoss(functional::CrossEntropyOptions options = {});
  std::string name() const override { return "CrossEntropyLoss"; }
  Tensor forward(const Tensor& input, const Tensor& target) override;
  functional::CrossEntropyOptions options;
};

/// torch.nn.NLLLoss on log-probabilities; see functional::nll_loss. options.weight becomes the
/// buffer "weight".
class NLLLoss : public Loss {
 public:
  explicit NLLLoss(functional::NLLLossOptions options = {});
  std::string name() const override { return "NLLLoss"; }
  Tensor forward(const Tensor& input, const Tensor& target) override;
  functional::NLLLossOptions options;
};

/// torch.nn.MSELoss: squared error with reduction "mean", "sum" or "none".
class MSELoss : public Loss {
 public:
  /// Throws ValueError for an unknown reduction.
  explicit MSELoss(std::string reduction = "mean");
  std::string name() const override { return "MSELoss"; }
  Tensor forward(const Tensor& input, const Tensor& target) override;
  const std::string reduction;
};

/// torch.nn.BCEWithLogitsLoss; see functional::binary_cross_entropy_with_logits.
/// options.weight and options.pos_weight become the buffers "weight" and "pos_weight".
class BCEWithLogitsLoss : public Loss {
 public:
  explicit BCEWithLogitsLoss(functional::BCEWithLogitsOptions options = {});
  std::string name() const override { return "BCEWithLogitsLoss"; }
  Tensor forward(const Tensor& input, const Tensor& target) override;
  functional::BCEWithLogitsOptions options;
};

}  // namespace ember::nn
