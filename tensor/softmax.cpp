// softmax / log_softmax front end; kernels in cpu/softmax.cpp and cuda/softmax.cu.
#include <ember/tensor/autocast.h>
#include <ember/tensor/detail/record.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/reduce.h>

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

}  // namespace ember
