// Flatten layer.
#pragma once

#include <ember/nn/module.h>

namespace ember::nn {

/// Flattens dims start_dim..end_dim into one (torch.nn.Flatten; by default all but the batch
/// dim). A view when the input's strides allow, else a copy.
class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1)
      : start_dim(start_dim), end_dim(end_dim) {}
  std::string name() const override { return "Flatten"; }
  /// "start_dim=1, end_dim=-1"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const int64_t start_dim, end_dim;
};

}  // namespace ember::nn
