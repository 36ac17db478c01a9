// 2-d convolution layer.
#pragma once

#include <ember/nn/layers/layer_utils.h>
#include <ember/nn/module.h>

namespace ember::nn {

/// Conv2d's options besides the channel counts and kernel size.
struct Conv2dOptions {
  Size2 stride = 1;
  Size2 padding = 0;  ///< zero padding on both sides of each spatial dim
  Size2 dilation = 1;
  int64_t groups = 1;  ///< in_channels and out_channels must both be divisible by it
  bool bias = true;
};

/// torch.nn.Conv2d: input [N, C_in, H, W] (or unbatched [C_in, H, W]) -> [N, C_out, H', W'].
/// weight [C_out, C_in / groups, kH, kW] and bias [C_out] start as PyTorch's: kaiming_uniform_
/// (a = sqrt(5)) and U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = C_in / groups * kH * kW.
///   Conv2d(3, 16, 3, {.padding = 1})
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
         const Conv2dOptions& options = {});
  std::string name() const override { return "Conv2d"; }
  /// PyTorch's: "3, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)"; padding, dilation,
  /// groups and bias appear only when not the default.
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  void reset_parameters();

  const int64_t in_channels, out_channels;
  const Pair kernel_size;
  const Conv2dOptions options;
  Tensor weight, bias;
};

}  // namespace ember::nn
