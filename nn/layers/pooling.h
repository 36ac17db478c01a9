// 2-d pooling layers. Input [N, C, H, W] or unbatched [C, H, W].
#pragma once

#include <optional>

#include <ember/nn/layers/layer_utils.h>
#include <ember/nn/module.h>

namespace ember::nn {

struct MaxPool2dOptions {
  std::optional<Size2> stride = std::nullopt;  ///< defaults to kernel_size
  Size2 padding = 0;                           ///< implicit -inf padding, at most half the kernel
  Size2 dilation = 1;
  bool ceil_mode = false;  ///< ceil instead of floor for the output size
};

/// torch.nn.MaxPool2d.   MaxPool2d(2) or MaxPool2d(3, {.stride = 2, .padding = 1}); a
/// two-value stride is written {.stride = Size2(2, 1)} (it is optional, so {2, 1} alone does not
/// convert).
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Size2 kernel_size, const MaxPool2dOptions& options = {});
  std::string name() const override { return "MaxPool2d"; }
  /// "kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=false"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const Size2 kernel_size, stride, padding, dilation;
  const bool ceil_mode;
};

struct AvgPool2dOptions {
  std::optional<Size2> stride = std::nullopt;  ///< defaults to kernel_size
  Size2 padding = 0;                           ///< implicit zero padding, at most half the kernel
  bool ceil_mode = false;
  bool count_include_pad = true;  ///< divide by the full window, padding included
};

/// torch.nn.AvgPool2d.
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Size2 kernel_size, const AvgPool2dOptions& options = {});
  std::string name() const override { return "AvgPool2d"; }
  /// "kernel_size=2, stride=2, padding=0"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const Size2 kernel_size, stride, padding;
  const bool ceil_mode, count_include_pad;
};

/// Average pooling to a fixed output size (torch.nn.AdaptiveAvgPool2d), e.g. 1 for global
/// average pooling.
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Size2 output_size);
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  /// "output_size=1" or "output_size=(5, 7)"
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  const Size2 output_size;
};

}  // namespace ember::nn
