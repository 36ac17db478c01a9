#include <ember/nn/layers/conv.h>

#include <cmath>

#include <ember/nn/init.h>

namespace ember::nn {

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Size2 kernel_size,
               const Conv2dOptions& options)
    : in_channels(in_channels),
      out_channels(out_channels),
      kernel_size(kernel_size.value),
      options(options) {
  const int64_t g = options.groups;
  EMBER_CHECK(g > 0, "[Conv2d] groups must be a positive integer, got ", g);
  EMBER_CHECK(in_channels > 0 && out_channels > 0,
              "[Conv2d] expected positive channel counts, got in_channels=", in_channels,
              ", out_channels=", out_channels);
  EMBER_CHECK(in_channels % g == 0,
              "[Conv2d] in_channels must be divisible by groups, got in_channels=", in_channels,
              ", groups=", g);
  EMBER_CHECK(out_channels % g == 0,
              "[Conv2d] out_channels must be divisible by groups, got out_channels=", out_channels,
              ", groups=", g);
  EMBER_CHECK(kernel_size.h() > 0 && kernel_size.w() > 0,
              "[Conv2d] kernel_size must be positive, got ", kernel_size.str());
  EMBER_CHECK(options.stride.h() > 0 && options.stride.w() > 0,
              "[Conv2d] stride must be positive, got ", options.stride.str());
  EMBER_CHECK(options.padding.h() >= 0 && options.padding.w() >= 0,
              "[Conv2d] padding must be non-negative, got ", options.padding.str());
  EMBER_CHECK(options.dilation.h() > 0 && options.dilation.w() > 0,
              "[Conv2d] dilation must be positive, got ", options.dilation.str());
  weight = register_parameter(
      "weight", empty({out_channels, in_channels / g, kernel_size.h(), kernel_size.w()}));
  bias = register_parameter("bias", options.bias ? empty({out_channels}) : Tensor());
  reset_parameters();
}

void Conv2d::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const int64_t fan_in = init::calculate_fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

std::string Conv2d::extra_repr() const {
  // PyTorch's _ConvNd.extra_repr: tuples throughout, defaults left out.
  std::string s = detail::str_cat(in_channels, ", ", out_channels,
                                  ", kernel_size=", detail::repr_pair(kernel_size),
                                  ", stride=", detail::repr_pair(options.stride.value));
  if (options.padding.value != Pair{0, 0}) {
    s += ", padding=" + detail::repr_pair(options.padding.value);
  }
  if (options.dilation.value != Pair{1, 1}) {
    s += ", dilation=" + detail::repr_pair(options.dilation.value);
  }
  if (options.groups != 1) s += ", groups=" + std::to_string(options.groups);
  if (!bias.defined()) s += ", bias=false";
  return s;
}

Tensor Conv2d::forward(const Tensor& input) {
  detail::check_defined("Conv2d", input, "input");
  EMBER_CHECK(input.dim() == 3 || input.dim() == 4,
              "[Conv2d] expected input of shape [N, C, H, W] or [C, H, W], got ", input.shape());
  const bool unbatched = input.dim() == 3;
  const Tensor x = unbatched ? input.unsqueeze(0) : input;
  EMBER_CHECK(x.size(1) == in_channels, "[Conv2d] expected input with ", in_channels,
              " channels (dim ", unbatched ? 0 : 1, "), got shape ", input.shape());
  Conv2dParams p;
  p.stride = options.stride.value;
  p.padding = options.padding.value;
  p.dilation = options.dilation.value;
  p.groups = options.groups;
  Tensor y = conv2d(x, weight, bias, p);
  return unbatched ? y.squeeze(0) : y;
}

}  // namespace ember::nn
