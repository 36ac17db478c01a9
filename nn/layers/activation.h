// Activation layers: element-wise nonlinearities and (log-)softmax over a dim.
#pragma once

#include <string>

#include <ember/nn/module.h>

namespace ember::nn {

/// max(x, 0).
class ReLU : public Module {
 public:
  std::string name() const override { return "ReLU"; }
  Tensor forward(const Tensor& input) override;
};

/// x * Phi(x) (approximate = "none", the erf form) or its tanh approximation ("tanh").
class GELU : public Module {
 public:
  /// Throws ValueError unless approximate is "none" or "tanh".
  explicit GELU(std::string approximate = "none");
  std::string name() const override { return "GELU"; }
  /// "approximate='none'"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const std::string approximate;
};

/// x * sigmoid(x) (swish).
class SiLU : public Module {
 public:
  std::string name() const override { return "SiLU"; }
  Tensor forward(const Tensor& input) override;
};

class Tanh : public Module {
 public:
  std::string name() const override { return "Tanh"; }
  Tensor forward(const Tensor& input) override;
};

class Sigmoid : public Module {
 public:
  std::string name() const override { return "Sigmoid"; }
  Tensor forward(const Tensor& input) override;
};

/// softmax over `dim` (negative counts from the end).
class Softmax : public Module {
 public:
  explicit Softmax(int64_t dim) : dim(dim) {}
  std::string name() const override { return "Softmax"; }
  /// "dim=1"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const int64_t dim;
};

/// log_softmax over `dim`; pairs with NLLLoss.
class LogSoftmax : public Module {
 public:
  explicit LogSoftmax(int64_t dim) : dim(dim) {}
  std::string name() const override { return "LogSoftmax"; }
  /// "dim=1"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const int64_t dim;
};

}  // namespace ember::nn
