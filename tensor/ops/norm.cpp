// layer_norm's front end: validation, autocast, and the fused row kernels (cpu/norm.cpp,
// cuda/norm.cu) or the same math in tensor ops; its backward is LayerNormBackward
// (autograd/functions_nn.cpp).
//
// Note [LayerNorm as one op]: the composite form (mean, var, sub, mul, ...) would save three
// input-sized tensors for backward and make one pass over memory per op. This op saves only x,
// weight and, after the fused kernels, the per-row mean and rstd. Elsewhere (other dtypes,
// strided inputs) forward and backward are built from tensor ops, backward with the textbook
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * weight.
// Under create_graph, backward always takes the tensor-op path, recomputing mean and rstd from
// the saved x with recorded ops, so double backward stays exact (the forward's no-grad
// statistics would silently cut that dependence).
//
// Note [BatchNorm as one op]: nn::functional::batch_norm written in tensor ops (mean, var, a
// broadcast multiply and add) saves input-sized intermediates and makes a pass over memory per
// op, forward and backward. On contiguous CPU float32/float64 inputs it is instead one recorded
// op whose kernels (cpu/norm.cpp) read each (sample, channel) run in place: the statistics in one
// pass each, y in one, and backward's two sums per channel and dx in one more. It saves x,
// weight and the per-channel mean and invstd. Under create_graph, backward is built from
// recorded tensor ops, recomputing the batch statistics from x when training (as layer_norm's,
// Note [LayerNorm as one op]). Other inputs (CUDA, other dtypes, strided, short runs) keep the
// tensor-op form in nn/functional.cpp.
#include <ember/tensor/ops/norm.h>

#include <string>
#include <vector>

#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/reduce.h>

namespace ember {

namespace detail {

LayerNormStats layer_norm_stats(const Tensor& x, int64_t normalized_dims, double eps) {
  std::vector<int64_t> dims;
  for (int64_t d = x.dim() - normalized_dims; d < x.dim(); ++d) dims.push_back(d);
  const Tensor mean = x.mean(dims, /*keepdim=*/true);
  const Tensor rstd = rsqrt(var(x, dims, /*correction=*/0, /*keepdim=*/true) + eps);
  return {(x - mean) * rstd, rstd};
}
}  // namespace detail

namespace {

constexpr const char* kOp = "layer_norm";

/// The fused kernels apply: contiguous float32/float64 tensors of one dtype on one device (the
/// CPU or a CUDA device).
bool fusable(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  auto ok = [&](const Tensor& t) {
    return !t.defined() ||
           (t.device() == x.device() && t.is_contiguous() && t.dtype() == x.dtype());
  };
  return (x.is_cpu() || x.is_cuda()) && x.is_contiguous() &&
         (x.dtype() == kFloat32 || x.dtype() == kFloat64) && x.numel() > 0 && ok(weight) &&
         ok(bias);
}

void check_arguments(const Tensor& input, IntList normalized_shape, const Tensor& weight,
                     const Tensor& bias) {
  const int64_t k = normalized_shape.size();
  EMBER_CHECK(k >= 1, "[layer_norm] expected a non-empty normalized_shape");
  bool match = input.dim() >= k;
  for (int64_t i = 0; match && i < k; ++i) {
    match = input.size(input.dim() - k + i) == normalized_shape[i];
  }
  if (!match) {
    std::string want = "[*";
    for (int64_t s : normalized_shape) want += ", " + std::to_string(s);
    throw ValueError(detail::str_cat("[layer_norm] expected input of shape ", want,
                                     "] (normalized_shape ", normalized_shape, "), got ",
                                     input.shape()));
  }
  auto check_param = [&](const Tensor& t, const char* name) {
    if (!t.defined()) return;
    EMBER_CHECK(t.shape() == normalized_shape, "[layer_norm] expected ", name, " of shape ",
                normalized_shape, ", got ", t.shape());
    EMBER_CHECK(t.device() == input.device(), "[layer_norm] expected ", name, " on ",
                input.device(), " (the input's device), got ", t.device());
  };
  check_param(weight, "weight");
  check_param(bias, "bias");
}

}  // namespace

Tensor layer_norm(const Tensor& input, IntList normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  detail::check_defined(kOp, input, "input");
  EMBER_CHECK_TYPE(TypeError, input.is_floating_point(),
                   "[layer_norm] expected a floating-point input, got ", input.dtype());
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, input, weight, bias)) {
    return layer_norm(ac[0], normalized_shape, ac[1], ac[2], eps);
  }
  check_arguments(input, normalized_shape, weight, bias);
  const int64_t k = normalized_shape.size();
  Tensor y, mean, rstd;
  {
    // One recorded op: nothing computed here records.
    NoGradGuard no_grad;
    if (fusable(input, weight, bias)) {
      int64_t row = 1;
      for (int64_t s : normalized_shape) row *= s;
      const int64_t rows = input.numel() / row;
      y = detail::make_empty(input.shape(), input.dtype(), input.device());
      mean = detail::make_empty({rows}, input.dtype(), input.device());
      rstd = detail::make_empty({rows}, input.dtype(), input.device());
      (input.is_cuda() ? detail::layer_norm_forward_cuda : detail::layer_norm_forward_cpu)(
          input.view({rows, row}), weight.defined() ? weight.view({row}) : Tensor(),
          bias.defined() ? bias.view({row}) : Tensor(), eps, y.view({rows, row}), mean, rstd);
    } else {
      y = detail::layer_norm_stats(input, k, eps).xhat;
      if (weight.defined()) y.mul_(weight);
      if (bias.defined()) y.add_(bias);
    }
  }
  if (detail::should_record(input, weight, bias)) {
    detail::record<OpId::LayerNorm>({&input, &weight, &bias}, {&y},
                                    {.normalized_dims = k, .eps = eps, .mean = mean, .rstd = rstd});
  }
  return y;
}

namespace detail {

bool batch_norm_fusable(const Tensor& input, const Tensor& weight, const Tensor& bias,
                        const Tensor& running_mean, const Tensor& running_var, bool training) {
  auto ok = [&](const Tensor& t) {
    return !t.defined() || (t.is_cpu() && t.is_contiguous() && t.dtype() == input.dtype());
  };
  if (!input.is_cpu() || !input.is_contiguous() || input.dim() < 2 || input.numel() == 0 ||
      (input.dtype() != kFloat32 && input.dtype() != kFloat64) || !ok(weight) || !ok(bias)) {
    return false;
  }
  const int64_t run = input.numel() / (input.size(0) * input.size(1));
  // Shorter runs (BatchNorm1d over [N, C]) reduce faster as the tensor ops' column sums.
  if (run < 16) return false;
  return training || (running_mean.defined() && running_var.defined() && running_mean.is_cpu() &&
                      running_var.is_cpu());
}

BatchNormFused batch_norm_fused(const Tensor& input, const Tensor& weight, const Tensor& bias,
                                const Tensor& running_mean, const Tensor& running_var,
                                bool training, double eps) {
  const int64_t channels = input.size(1);
  BatchNormFused out;
  Tensor mean, invstd;
  {
    NoGradGuard no_grad;
    out.y = make_empty(input.shape(), input.dtype(), input.device());
    if (training) {
      mean = make_empty({channels}, input.dtype(), input.device());
      invstd = make_empty({channels}, input.dtype(), input.device());
      out.var = make_empty({channels}, input.dtype(), input.device());
      out.mean = mean;
    } else {
      mean = running_mean.to(input.dtype()).contiguous();
      invstd = rsqrt(running_var.to(input.dtype()) + eps).contiguous();
    }
    const Tensor x = input.view({input.size(0), channels, -1});
    batch_norm_forward_cpu(x, weight, bias, training, eps, mean, out.var, invstd,
                           out.y.view(x.shape()));
  }
  if (should_record(input, weight, bias)) {
    record<OpId::BatchNorm>({&input, &weight, &bias}, {&out.y},
                            {.training = training, .eps = eps, .mean = mean, .invstd = invstd});
  }
  return out;
}

}  // namespace detail

}  // namespace ember
