// Front end of convolution and pooling: argument validation with PyTorch's rules and messages,
// output sizes, contiguous NCHW operands, then a CPU (oneDNN / own loops) or CUDA (cuDNN / own
// kernels) backend from detail/conv_kernels.h.
#include <ember/tensor/ops/conv.h>

#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/record.h>

namespace ember {

namespace {

using detail::ConvGeom;
using detail::PoolGeom;

void check_floating(const char* op, const Tensor& t, const char* name) {
  EMBER_CHECK_TYPE(TypeError, is_floating(t.dtype()), "[", op, "] expected ", name,
                   " of a floating dtype (float32, float64, float16 or bfloat16), got ", t.dtype());
}

// `b` (when defined) must be on a's device with a's dtype.
void check_same(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  if (!b.defined()) return;
  EMBER_CHECK(a.device() == b.device(), "[", op, "] expected ", an, " and ", bn,
              " on the same device, got ", an, " on ", a.device(), " and ", bn, " on ", b.device());
  EMBER_CHECK_TYPE(TypeError, a.dtype() == b.dtype(), "[", op, "] expected ", an, " and ", bn,
                   " to have the same dtype, got ", a.dtype(), " and ", b.dtype());
}

void check_4d(const char* op, IntList shape, const char* what) {
  EMBER_CHECK(shape.size() == 4, "[", op, "] expected ", what, " to be 4-d, got shape ", shape);
}

ConvGeom conv_geom(const char* op, IntList in, IntList w, const Conv2dParams& p) {
  check_4d(op, in, "input [N, C, H, W]");
  check_4d(op, w, "weight [O, C / groups, kH, kW]");
  EMBER_CHECK(p.stride[0] > 0 && p.stride[1] > 0, "[", op, "] expected a positive stride, got [",
              p.stride[0], ", ", p.stride[1], "]");
  EMBER_CHECK(p.padding[0] >= 0 && p.padding[1] >= 0, "[", op,
              "] expected a non-negative padding, got [", p.padding[0], ", ", p.padding[1], "]");
  EMBER_CHECK(p.dilation[0] > 0 && p.dilation[1] > 0, "[", op,
              "] expected a positive dilation, got [", p.dilation[0], ", ", p.dilation[1], "]");
  EMBER_CHECK(p.groups > 0, "[", op, "] expected a positive groups, got ", p.groups);
  for (int64_t v : in) EMBER_CHECK(v >= 0, "[", op, "] invalid input shape ", in);
  for (int64_t v : w) EMBER_CHECK(v >= 0, "[", op, "] invalid weight shape ", w);
  EMBER_CHECK(w[0] % p.groups == 0, "[", op, "] Given groups=", p.groups,
              ", expected weight to be divisible by ", p.groups,
              " at dimension 0, but got weight of size ", w, " instead");
  EMBER_CHECK(in[1] == w[1] * p.groups, "[", op, "] Given groups=", p.groups, ", weight of size ",
              w, ", expected input", in, " to have ", w[1] * p.groups, " channels, but got ", in[1],
              " channels instead");
  ConvGeom g;
  g.n = in[0], g.c = in[1], g.h = in[2], g.w = in[3];
  g.o = w[0], g.kh = w[2], g.kw = w[3];
  g.sh = p.stride[0], g.sw = p.stride[1];
  g.ph = p.padding[0], g.pw = p.padding[1];
  g.dh = p.dilation[0], g.dw = p.dilation[1];
  g.groups = p.groups;
  EMBER_CHECK(g.kh > 0 && g.kw > 0, "[", op, "] expected a non-empty kernel, got weight of size ",
              w);
  const int64_t ekh = g.dh * (g.kh - 1) + 1, ekw = g.dw * (g.kw - 1) + 1;
  const int64_t ph = g.h + 2 * g.ph, pw = g.w + 2 * g.pw;
  EMBER_CHECK(ph >= ekh && pw >= ekw, "[", op, "] Calculated padded input size per channel: (", ph,
              " x ", pw, "). Kernel size: (", ekh, " x ", ekw,
              "). Kernel size can't be greater than actual input size (input ", in, ")");
  g.oh = (ph - ekh) / g.sh + 1;
  g.ow = (pw - ekw) / g.sw + 1;
  return g;
}

Shape out_shape(const ConvGeom& g) { return {g.n, g.o, g.oh, g.ow}; }

void check_grad_output(const char* op, const Tensor& grad_output, IntList expected) {
  EMBER_CHECK(grad_output.shape() == expected, "[", op, "] expected grad_output of shape ",
              expected, ", got ", grad_output.shape());
}

}  // namespace

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias,
              const Conv2dParams& p) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kLowPrecision, input, weight, bias)) {
    return conv2d(ac[0], ac[1], ac[2], p);
  }
  const char* op = "conv2d";
  detail::check_defined(op, input, "input");
  detail::check_defined(op, weight, "weight");
  check_floating(op, input, "input");
  check_same(op, input, "input", weight, "weight");
  check_same(op, input, "input", bias, "bias");
  const ConvGeom g = conv_geom(op, input.shape(), weight.shape(), p);
  if (bias.defined()) {
    EMBER_CHECK(bias.dim() == 1 && bias.size(0) == g.o, "[conv2d] Given weight of size ",
                weight.shape(), ", expected bias to be 1-dimensional with ", g.o,
                " elements, but got bias of size ", bias.shape(), " instead");
  }
  Tensor out = detail::make_empty(out_shape(g), input.dtype(), input.device());
  if (out.numel() > 0) {
    NoGradGuard no_grad;  // contiguous() and the bias copy belong to this op's node
    if (input.numel() == 0 || weight.numel() == 0) {  // an empty sum: just the bias
      if (bias.defined()) {
        out.copy_(bias.view({1, g.o, 1, 1}).expand(out.shape()));
      } else {
        out.zero_();
      }
    } else {
      const Tensor x = input.contiguous(), w = weight.contiguous();
      const Tensor b = bias.defined() ? bias.contiguous() : bias;
      if (out.is_cuda()) {
        detail::conv2d_cuda(out, x, w, b, g);
      } else {
        detail::conv2d_cpu(out, x, w, b, g);
      }
    }
  }
  if (detail::should_record(input, weight, bias)) {
    detail::record<OpId::Conv2d>({&input, &weight, &bias}, {&out}, p);
  }
  return out;
}

Tensor conv2d_backward_input(const Tensor& grad_output, IntList input_shape, const Tensor& weight,
                             const Conv2dParams& p) {
  const char* op = "conv2d_backward_input";
  detail::check_defined(op, grad_output, "grad_output");
  detail::check_defined(op, weight, "weight");
  check_floating(op, grad_output, "grad_output");
  check_same(op, grad_output, "grad_output", weight, "weight");
  const ConvGeom g = conv_geom(op, input_shape, weight.shape(), p);
  check_grad_output(op, grad_output, out_shape(g));
  Tensor grad_input = detail::make_empty(input_shape, grad_output.dtype(), grad_output.device());
  if (grad_input.numel() == 0) return grad_input;
  if (grad_output.numel() == 0 || weight.numel() == 0) return grad_input.zero_();
  NoGradGuard no_grad;  // backward kernels record nothing
  const Tensor go = grad_output.contiguous(), w = weight.contiguous();
  if (go.is_cuda()) {
    detail::conv2d_backward_input_cuda(grad_input, go, w, g);
  } else {
    detail::conv2d_backward_input_cpu(grad_input, go, w, g);
  }
  return grad_input;
}

Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input, IntList weight_shape,
                              const Conv2dParams& p) {
  const char* op = "conv2d_backward_weight";
  detail::check_defined(op, grad_output, "grad_output");
  detail::check_defined(op, input, "input");
  check_floating(op, grad_output, "grad_output");
  check_same(op, grad_output, "grad_output", input, "input");
  const ConvGeom g = conv_geom(op, input.shape(), weight_shape, p);
  check_grad_output(op, grad_output, out_shape(g));
  Tensor grad_weight = detail::make_empty(weight_shape, grad_output.dtype(), grad_output.device());
  if (grad_weight.numel() == 0) return grad_weight;
  if (grad_output.numel() == 0 || input.numel() == 0) return grad_weight.zero_();
  NoGradGuard no_grad;  // backward kernels record nothing
  const Tensor go = grad_output.contiguous(), x = input.contiguous();
  if (go.is_cuda()) {
    detail::conv2d_backward_weight_cuda(grad_weight, go, x, g);
  } else {
    detail::conv2d_backward_weight_cpu(grad_weight, go, x, g);
  }
  return grad_weight;
}

// ---- pooling ---------------------------------------------------------------------------------

namespace {

// PyTorch's pooling_output_shape: floor or ceil mode, where in ceil mode the last window must
// start inside the input or its left padding.
int64_t pool_out_size(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dilation,
                      bool ceil_mode) {
  const int64_t num = in + 2 * pad - dilation * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  int64_t out = (num >= 0 ? num / stride : -((-num + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

PoolGeom pool_geom(const char* op, const Tensor& input, const Pool2dParams& p, bool is_max) {
  check_4d(op, input.shape(), "input [N, C, H, W]");
  const Pair stride = p.stride.value_or(p.kernel);
  const Pair dilation = is_max ? p.dilation : Pair{1, 1};
  EMBER_CHECK(p.kernel[0] > 0 && p.kernel[1] > 0, "[", op,
              "] expected a positive kernel size, got [", p.kernel[0], ", ", p.kernel[1], "]");
  EMBER_CHECK(stride[0] > 0 && stride[1] > 0, "[", op, "] expected a positive stride, got [",
              stride[0], ", ", stride[1], "]");
  EMBER_CHECK(dilation[0] > 0 && dilation[1] > 0, "[", op, "] expected a positive dilation, got [",
              dilation[0], ", ", dilation[1], "]");
  EMBER_CHECK(p.padding[0] >= 0 && p.padding[1] >= 0 && p.padding[0] <= p.kernel[0] / 2 &&
                  p.padding[1] <= p.kernel[1] / 2,
              "[", op, "] pad should be non-negative and at most half of kernel size, got pad [",
              p.padding[0], ", ", p.padding[1], "] and kernel size [", p.kernel[0], ", ",
              p.kernel[1], "]");
  PoolGeom g;
  g.planes = input.size(0) * input.size(1);
  g.h = input.size(2), g.w = input.size(3);
  g.kh = p.kernel[0], g.kw = p.kernel[1];
  g.sh = stride[0], g.sw = stride[1];
  g.ph = p.padding[0], g.pw = p.padding[1];
  g.dh = dilation[0], g.dw = dilation[1];
  g.count_include_pad = p.count_include_pad;
  g.oh = pool_out_size(g.h, g.kh, g.ph, g.sh, g.dh, p.ceil_mode);
  g.ow = pool_out_size(g.w, g.kw, g.pw, g.sw, g.dw, p.ceil_mode);
  EMBER_CHECK(g.oh >= 1 && g.ow >= 1, "[", op, "] given input of shape ", input.shape(),
              ", the calculated output size (", g.oh, " x ", g.ow, ") is too small");
  return g;
}

Shape pool_out_shape(const Tensor& input, const PoolGeom& g) {
  return {input.size(0), input.size(1), g.oh, g.ow};
}

void check_pool_input(const char* op, const Tensor& input) {
  detail::check_defined(op, input, "input");
  check_floating(op, input, "input");
}

// Checks of a backward call: grad_output matches the forward output and input.
void check_pool_backward(const char* op, const Tensor& grad_output, const Tensor& input,
                         const PoolGeom& g) {
  detail::check_defined(op, grad_output, "grad_output");
  check_same(op, grad_output, "grad_output", input, "input");
  check_grad_output(op, grad_output, pool_out_shape(input, g));
}

}  // namespace

std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, const Pool2dParams& p) {
  const char* op = "max_pool2d";
  check_pool_input(op, input);
  const PoolGeom g = pool_geom(op, input, p, true);
  Tensor out = detail::make_empty(pool_out_shape(input, g), input.dtype(), input.device());
  Tensor idx = detail::make_empty(pool_out_shape(input, g), kInt64, input.device());
  if (out.numel() > 0) {
    NoGradGuard no_grad;  // the contiguous copy belongs to this op's node
    const Tensor x = input.contiguous();
    if (x.is_cuda()) {
      detail::max_pool2d_cuda(out, idx, x, g);
    } else {
      detail::max_pool2d_cpu(out, idx, x, g);
    }
  }
  if (detail::should_record(input)) {
    detail::record<OpId::MaxPool2d>({&input}, {&out, &idx}, p);
  }
  return {out, idx};
}

Tensor max_pool2d(const Tensor& input, const Pool2dParams& p) {
  // Under recording the backward pass needs the indices: the recorded variant.
  if (detail::should_record(input)) return max_pool2d_with_indices(input, p).first;
  const char* op = "max_pool2d";
  check_pool_input(op, input);
  const PoolGeom g = pool_geom(op, input, p, true);
  Tensor out = detail::make_empty(pool_out_shape(input, g), input.dtype(), input.device());
  if (out.numel() == 0) return out;
  const Tensor x = input.contiguous();
  if (x.is_cuda()) {
    detail::max_pool2d_cuda(out, Tensor(), x, g);
  } else {
    detail::max_pool2d_cpu(out, Tensor(), x, g);
  }
  return out;
}

Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& input, const Tensor& indices,
                           const Pool2dParams& p) {
  const char* op = "max_pool2d_backward";
  check_pool_input(op, input);
  const PoolGeom g = pool_geom(op, input, p, true);
  check_pool_backward(op, grad_output, input, g);
  detail::check_defined(op, indices, "indices");
  EMBER_CHECK_TYPE(TypeError, indices.dtype() == kInt64, "[", op,
                   "] expected indices of dtype int64, got ", indices.dtype());
  EMBER_CHECK(indices.device() == input.device(), "[", op,
              "] expected indices on the same device as input, got indices on ", indices.device(),
              " and input on ", input.device());
  EMBER_CHECK(indices.shape() == grad_output.shape(), "[", op, "] expected indices of shape ",
              grad_output.shape(), ", got ", indices.shape());
  Tensor grad_input = detail::make_empty(input.shape(), input.dtype(), input.device());
  if (grad_input.numel() == 0) return grad_input;
  NoGradGuard no_grad;  // backward kernels record nothing
  const Tensor go = grad_output.contiguous(), idx = indices.contiguous();
  if (go.is_cuda()) {
    detail::max_pool2d_backward_cuda(grad_input, go, idx, g);
  } else {
    detail::max_pool2d_backward_cpu(grad_input, go, idx, g);
  }
  return grad_input;
}

Tensor avg_pool2d(const Tensor& input, const Pool2dParams& p) {
  const char* op = "avg_pool2d";
  check_pool_input(op, input);
  const PoolGeom g = pool_geom(op, input, p, false);
  Tensor out = detail::make_empty(pool_out_shape(input, g), input.dtype(), input.device());
  if (out.numel() > 0) {
    NoGradGuard no_grad;  // the contiguous copy belongs to this op's node
    const Tensor x = input.contiguous();
    if (x.is_cuda()) {
      detail::avg_pool2d_cuda(out, x, g);
    } else {
      detail::avg_pool2d_cpu(out, x, g);
    }
  }
  if (detail::should_record(input)) {
    detail::record<OpId::AvgPool2d>({&input}, {&out}, p);
  }
  return out;
}

Tensor avg_pool2d_backward(const Tensor& grad_output, const Tensor& input, const Pool2dParams& p) {
  const char* op = "avg_pool2d_backward";
  check_pool_input(op, input);
  const PoolGeom g = pool_geom(op, input, p, false);
  check_pool_backward(op, grad_output, input, g);
  Tensor grad_input = detail::make_empty(input.shape(), input.dtype(), input.device());
  if (grad_input.numel() == 0) return grad_input;
  NoGradGuard no_grad;  // backward kernels record nothing
  const Tensor go = grad_output.contiguous();
  if (go.is_cuda()) {
    detail::avg_pool2d_backward_cuda(grad_input, go, g);
  } else {
    detail::avg_pool2d_backward_cpu(grad_input, go, g);
  }
  return grad_input;
}

namespace {
PoolGeom adaptive_geom(const char* op, const Tensor& input, Pair output_size) {
  check_4d(op, input.shape(), "input [N, C, H, W]");
  EMBER_CHECK(output_size[0] > 0 && output_size[1] > 0, "[", op,
              "] expected a positive output size, got [", output_size[0], ", ", output_size[1],
              "]");
  EMBER_CHECK(input.size(2) > 0 && input.size(3) > 0, "[", op,
              "] expected input to have non-zero size for non-batch dimensions, got shape ",
              input.shape());
  PoolGeom g;
  g.planes = input.size(0) * input.size(1);
  g.h = input.size(2), g.w = input.size(3);
  g.oh = output_size[0], g.ow = output_size[1];
  return g;
}
}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& input, Pair output_size) {
  const char* op = "adaptive_avg_pool2d";
  check_pool_input(op, input);
  const PoolGeom g = adaptive_geom(op, input, output_size);
  Tensor out = detail::make_empty(pool_out_shape(input, g), input.dtype(), input.device());
  if (out.numel() > 0) {
    NoGradGuard no_grad;  // the contiguous copy belongs to this op's node
    const Tensor x = input.contiguous();
    if (x.is_cuda()) {
      detail::adaptive_avg_pool2d_cuda(out, x, g);
    } else {
      detail::adaptive_avg_pool2d_cpu(out, x, g);
    }
  }
  if (detail::should_record(input)) detail::record(OpId::AdaptiveAvgPool2d, {&input}, {&out});
  return out;
}

Tensor adaptive_avg_pool2d_backward(const Tensor& grad_output, const Tensor& input) {
  const char* op = "adaptive_avg_pool2d_backward";
  check_pool_input(op, input);
  detail::check_defined(op, grad_output, "grad_output");
  check_4d(op, grad_output.shape(), "grad_output");
  const PoolGeom g = adaptive_geom(op, input, {grad_output.size(2), grad_output.size(3)});
  check_pool_backward(op, grad_output, input, g);
  Tensor grad_input = detail::make_empty(input.shape(), input.dtype(), input.device());
  if (grad_input.numel() == 0) return grad_input;
  NoGradGuard no_grad;  // backward kernels record nothing
  const Tensor go = grad_output.contiguous();
  if (go.is_cuda()) {
    detail::adaptive_avg_pool2d_backward_cuda(grad_input, go, g);
  } else {
    detail::adaptive_avg_pool2d_backward_cpu(grad_input, go, g);
  }
  return grad_input;
}

}  // namespace ember
