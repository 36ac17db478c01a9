// Dropout layer.
#pragma once

#include <ember/nn/module.h>

namespace ember::nn {

/// Inverted dropout (torch.nn.Dropout): in training mode zeroes each element with probability p
/// (from the global generator) and scales the others by 1 / (1 - p); the identity in eval mode.
/// inplace overwrites the input.
class Dropout : public Module {
 public:
  /// Throws ValueError unless 0 <= p <= 1.
  explicit Dropout(double p = 0.5, bool inplace = false);
  std::string name() const override { return "Dropout"; }
  /// "p=0.5, inplace=false"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const double p;
  const bool inplace;
};

}  // namespace ember::nn
