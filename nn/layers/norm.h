// Normalisation layers: BatchNorm1d, BatchNorm2d, LayerNorm.
#pragma once

#include <optional>
#include <vector>

#include <ember/nn/module.h>

namespace ember::nn {

struct BatchNormOptions {
  double eps = 1e-5;
  /// Weight of the current batch in the running statistics; nullopt means a cumulative moving
  /// average (momentum 1 / num_batches_tracked), as momentum=None in PyTorch.
  std::optional<double> momentum = 0.1;
  bool affine = true;               ///< learnable weight (ones) and bias (zeros)
  bool track_running_stats = true;  ///< keep running_mean, running_var, num_batches_tracked
};

/// The shared implementation of BatchNorm1d and BatchNorm2d (PyTorch's _BatchNorm).
///
/// Training mode normalises each channel with the batch mean and biased variance and, when
/// tracking, updates the buffers running_mean (zeros), running_var (ones; updated with the
/// unbiased batch variance) and num_batches_tracked (int64, 0-d). Eval mode normalises with the
/// running statistics; without tracking it always uses batch statistics. state_dict names:
/// weight, bias, running_mean, running_var, num_batches_tracked (absent when not affine / not
/// tracking), as in PyTorch.
class BatchNorm : public Module {
 public:
  BatchNorm(int64_t num_features, const BatchNormOptions& options);
  /// "16, eps=1e-05, momentum=0.1, affine=true, track_running_stats=true"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  /// running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_running_stats();
  /// reset_running_stats() and weight = 1, bias = 0.
  void reset_parameters();

  const int64_t num_features;
  const BatchNormOptions options;
  Tensor weight, bias;                                    ///< undefined unless affine
  Tensor running_mean, running_var, num_batches_tracked;  ///< undefined unless tracking

 protected:
  /// Throws ValueError unless input has the dims this layer expects.
  virtual void check_input_dim(const Tensor& input) const = 0;
};

/// Batch normalisation over input [N, C] or [N, C, L] (torch.nn.BatchNorm1d).
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm(num_features, options) {}
  std::string name() const override { return "BatchNorm1d"; }

 protected:
  void check_input_dim(const Tensor& input) const override;
};

/// Batch normalisation over input [N, C, H, W] (torch.nn.BatchNorm2d).
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm(num_features, options) {}
  std::string name() const override { return "BatchNorm2d"; }

 protected:
  void check_input_dim(const Tensor& input) const override;
};

struct LayerNormOptions {
  double eps = 1e-5;
  bool elementwise_affine = true;  ///< learnable weight (ones) and bias (zeros)
};

/// Layer normalisation over the last normalized_shape.size() dims (torch.nn.LayerNorm), with
/// biased variance; weight and bias have normalized_shape.
///   LayerNorm(512), LayerNorm({4, 5}, {.eps = 1e-6})
class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::vector<int64_t> normalized_shape, const LayerNormOptions& options = {});
  explicit LayerNorm(int64_t normalized_size, const LayerNormOptions& options = {})
      : LayerNorm(std::vector<int64_t>{normalized_size}, options) {}
  std::string name() const override { return "LayerNorm"; }
  /// "(10,), eps=1e-05, elementwise_affine=true"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  void reset_parameters();

  const std::vector<int64_t> normalized_shape;
  const LayerNormOptions options;
  Tensor weight, bias;  ///< undefined unless elementwise_affine
};

}  // namespace ember::nn
