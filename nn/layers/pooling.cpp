#include <ember/nn/layers/pooling.h>

namespace ember::nn {

namespace {

void check_size(const char* op, const char* what, const Size2& s, int64_t min) {
  EMBER_CHECK(s.h() >= min && s.w() >= min, "[", op, "] ", what, " must be ",
              min > 0 ? "positive" : "non-negative", ", got ", s.str());
}

void check_padding(const char* op, const Size2& padding, const Size2& kernel) {
  EMBER_CHECK(padding.h() * 2 <= kernel.h() && padding.w() * 2 <= kernel.w(), "[", op,
              "] padding should be at most half of the kernel size, got padding=", padding.str(),
              ", kernel_size=", kernel.str());
}

// Runs a batched pooling op on [N, C, H, W] or unbatched [C, H, W] input.
template <typename F>
Tensor pool(const char* op, const Tensor& input, F&& f) {
  detail::check_defined(op, input, "input");
  EMBER_CHECK(input.dim() == 3 || input.dim() == 4, "[", op,
              "] expected input of shape [N, C, H, W] or [C, H, W], got ", input.shape());
  if (input.dim() == 4) return f(input);
  return f(input.unsqueeze(0)).squeeze(0);
}

}  // namespace

MaxPool2d::MaxPool2d(Size2 kernel_size, const MaxPool2dOptions& options)
    : kernel_size(kernel_size),
      stride(options.stride.value_or(kernel_size)),
      padding(options.padding),
      dilation(options.dilation),
      ceil_mode(options.ceil_mode) {
  check_size("MaxPool2d", "kernel_size", kernel_size, 1);
  check_size("MaxPool2d", "stride", stride, 1);
  check_size("MaxPool2d", "padding", padding, 0);
  check_size("MaxPool2d", "dilation", dilation, 1);
  check_padding("MaxPool2d", padding, kernel_size);
}

std::string MaxPool2d::extra_repr() const {
  return detail::str_cat("kernel_size=", kernel_size.str(), ", stride=", stride.str(),
                         ", padding=", padding.str(), ", dilation=", dilation.str(),
                         ", ceil_mode=", detail::repr_bool(ceil_mode));
}

Tensor MaxPool2d::forward(const Tensor& input) {
  Pool2dParams p;
  p.kernel = kernel_size.value;
  p.stride = stride.value;
  p.padding = padding.value;
  p.dilation = dilation.value;
  p.ceil_mode = ceil_mode;
  return pool("MaxPool2d", input, [&](const Tensor& x) { return max_pool2d(x, p); });
}

AvgPool2d::AvgPool2d(Size2 kernel_size, const AvgPool2dOptions& options)
    : kernel_size(kernel_size),
      stride(options.stride.value_or(kernel_size)),
      padding(options.padding),
      ceil_mode(options.ceil_mode),
      count_include_pad(options.count_include_pad) {
  check_size("AvgPool2d", "kernel_size", kernel_size, 1);
  check_size("AvgPool2d", "stride", stride, 1);
  check_size("AvgPool2d", "padding", padding, 0);
  check_padding("AvgPool2d", padding, kernel_size);
}

std::string AvgPool2d::extra_repr() const {
  return detail::str_cat("kernel_size=", kernel_size.str(), ", stride=", stride.str(),
                         ", padding=", padding.str());
}

Tensor AvgPool2d::forward(const Tensor& input) {
  Pool2dParams p;
  p.kernel = kernel_size.value;
  p.stride = stride.value;
  p.padding = padding.value;
  p.ceil_mode = ceil_mode;
  p.count_include_pad = count_include_pad;
  return pool("AvgPool2d", input, [&](const Tensor& x) { return avg_pool2d(x, p); });
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Size2 output_size) : output_size(output_size) {
  check_size("AdaptiveAvgPool2d", "output_size", output_size, 0);
}

std::string AdaptiveAvgPool2d::extra_repr() const { return "output_size=" + output_size.str(); }

Tensor AdaptiveAvgPool2d::forward(const Tensor& input) {
  return pool("AdaptiveAvgPool2d", input,
              [&](const Tensor& x) { return adaptive_avg_pool2d(x, output_size.value); });
}

}  // namespace ember::nn
