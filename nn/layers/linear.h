// Linear and Identity layers.
#pragma once

#include <ember/nn/module.h>

namespace ember::nn {

/// y = x W^T + b (torch.nn.Linear). weight [out_features, in_features] and bias [out_features]
/// start as PyTorch's: kaiming_uniform_(a = sqrt(5)) for the weight, i.e.
/// U(-1/sqrt(in_features), 1/sqrt(in_features)), and the same bound for the bias, drawn from
/// the global generator. Input [*, in_features] -> [*, out_features].
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  std::string name() const override { return "Linear"; }
  /// "in_features=784, out_features=10, bias=true"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  /// Draws weight and bias again from the default initialisation.
  void reset_parameters();

  const int64_t in_features, out_features;
  Tensor weight, bias;  ///< bias is undefined when built with bias = false

 protected:
  /// Keeps weight and bias pointing at the parameters (set_parameter: weight tying).
  void on_parameter_set(const std::string& name, const Tensor& t) override;
};

/// Returns its input unchanged (torch.nn.Identity): a placeholder in a Sequential.
class Identity : public Module {
 public:
  std::string name() const override { return "Identity"; }
  Tensor forward(const Tensor& input) override { return input; }
};

}  // namespace ember::nn
