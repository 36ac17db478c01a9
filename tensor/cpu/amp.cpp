// CPU kernel of the fused unscale (tensor/ops/amp.h), with the math of tensor/detail/amp_kernels.h.
#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/dtype.h>

namespace ember::detail {

void amp_unscale_cpu(const Tensor& grad, const Tensor& found_inf, double inv_scale) {
  const int64_t n = grad.numel();
  bool bad = false;
  EMBER_DISPATCH_FLOATING(grad.dtype(), "amp_unscale_", [&]<typename T>() {
    using A = acc_t<T>;
    const UnscaleFunctor<A> f{static_cast<A>(inv_scale)};
    T* g = static_cast<T*>(grad.data_ptr());
    // `|` rather than `||`: every element is unscaled whatever came before it.
    for (int64_t i = 0; i < n; ++i) bad = bad | f(g[i]);
  });
  if (bad) *static_cast<float*>(found_inf.data_ptr()) = 1.0f;
}

}  // namespace ember::detail
