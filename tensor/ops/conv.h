// Convolution and pooling over NCHW tensors: oneDNN on the CPU, cuDNN on CUDA. Forward plus the
// backward pieces autograd needs. Shapes and parameters follow torch.nn.functional.
#pragma once

#include <array>
#include <optional>

#include <ember/tensor/tensor.h>

namespace ember {

using Pair = std::array<int64_t, 2>;

struct Conv2dParams {
  Pair stride{1, 1};
  Pair padding{0, 0};
  Pair dilation{1, 1};
  int64_t groups = 1;
};

/// input [N, C, H, W], weight [O, C/groups, kH, kW], bias [O] or undefined -> [N, O, H', W'].
Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias = {},
              const Conv2dParams& p = {});
/// Gradient w.r.t. the input, given grad_output [N, O, H', W'].
Tensor conv2d_backward_input(const Tensor& grad_output, IntList input_shape, const Tensor& weight,
                             const Conv2dParams& p = {});
/// Gradient w.r.t. the weight.
Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, IntList weight_shape,
                              const Conv2dParams& p = {});

struct Pool2dParams {
  Pair kernel{2, 2};
  std::optional<Pair> stride;  ///< defaults to kernel
  Pair padding{0, 0};
  Pair dilation{1, 1};         ///< max pooling only
  bool ceil_mode = false;
  bool count_include_pad = true;  ///< average pooling only
};

/// Max pooling; returns (output, indices) where indices (int64, flat within each H*W plane as
/// in PyTorch) feed max_pool2d_backward.
std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, const Pool2dParams& p);
Tensor max_pool2d(const Tensor& input, const Pool2dParams& p);
Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& input, const Tensor& indices,
                           const Pool2dParams& p);
Tensor avg_pool2d(const Tensor& input, const Pool2dParams& p);
Tensor avg_pool2d_backward(const Tensor& grad_output, const Tensor& input, const Pool2dParams& p);
/// Average pooling to a fixed output size (torch.nn.functional.adaptive_avg_pool2d).
Tensor adaptive_avg_pool2d(const Tensor& input, Pair output_size);
Tensor adaptive_avg_pool2d_backward(const Tensor& grad_output, const Tensor& input);

}  // namespace ember
