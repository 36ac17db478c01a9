// softmax / log_softmax front end and their gradient; kernels in cpu/softmax.cpp and
// cuda/softmax.cu.
#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/reduce.h>

namespace ember {

namespace {

Tensor softmax_impl(const char* op, const Tensor& t, int64_t dim, bool log) {
  detail::check_defined(op, t, "input");
  EMBER_CHECK_TYPE(TypeError, t.is_floating_point(), "[", op,
                   "] expected a floating-point input (float16, bfloat16, float32 or float64), "
                   "got ",
                   t.dtype());
  const int64_t d = wrap_dim(op, dim, t.dim());
  // Kernels see contiguous tensors with at least one dim.
  Tensor in = t.contiguous();
  if (in.dim() == 0) in = in.view({1});
  Tensor out = detail::make_empty(in.shape(), in.dtype(), in.device());
  if (out.numel() > 0) {
    if (in.is_cuda()) {
      detail::softmax_cuda(out, in, d, log);
    } else {
      detail::softmax_cpu(out, in, d, log);
    }
  }
  return t.dim() == 0 ? out.view({}) : out;
}

// Records one node with `t` as input: the internal contiguous() and views run with grad mode
// off so they record nothing (Note [Reductions record once] in reduce.cpp).
Tensor softmax_recorded(const char* op, const Tensor& t, int64_t dim, bool log) {
  if (!detail::should_record(t)) return softmax_impl(op, t, dim, log);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = softmax_impl(op, t, dim, log);
  }
  detail::record(log ? OpId::LogSoftmax : OpId::Softmax, {&t}, {&out},
                 DimAttrs{.dim = wrap_dim(op, dim, t.dim())});
  return out;
}

}  // namespace

Tensor softmax(const Tensor& t, int64_t dim) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) return softmax(ac[0], dim);
  return softmax_recorded("softmax", t, dim, false);
}
Tensor log_softmax(const Tensor& t, int64_t dim) {
  if (auto ac = detail::autocast_inputs(AutocastPolicy::kFloat32, t)) {
    return log_softmax(ac[0], dim);
  }
  return softmax_recorded("log_softmax", t, dim, true);
}

Tensor softmax_backward(const Tensor& grad, const Tensor& output, int64_t dim, bool log) {
  const char* op = "softmax_backward";
  detail::check_defined(op, grad, "grad");
  detail::check_defined(op, output, "output");
  EMBER_CHECK_TYPE(TypeError, grad.is_floating_point() && output.is_floating_point(), "[", op,
                   "] expected floating-point grad and output, got ", grad.dtype(), " and ",
                   output.dtype());
  EMBER_CHECK(grad.shape() == output.shape(), "[", op,
              "] expected grad of the output's shape ", output.shape(), ", got ", grad.shape());
  EMBER_CHECK(grad.device() == output.device(), "[", op, "] expected grad on ", output.device(),
              " (the output's device), got ", grad.device());
  const int64_t d = wrap_dim(op, dim, output.dim());
  // On CUDA over the last dim: one fused kernel for the chain below. With grad mode on the
  // chain runs, so that it is recorded for double backward.
  if (output.is_cuda() && output.dim() >= 1 && d == output.dim() - 1 &&
      grad.dtype() == output.dtype() && !GradMode::is_enabled()) {
    return detail::softmax_backward_cuda(grad, output, log);
  }
  if (log) return sub(grad, mul(exp(output), sum(grad, {d}, /*keepdim=*/true)));
  return mul(output, sub(grad, sum(mul(grad, output), {d}, /*keepdim=*/true)));
}

}  // namespace ember
