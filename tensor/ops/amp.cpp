// Front end of the fused unscale (tensor/ops/amp.h): validation and device dispatch.
#include <ember/tensor/ops/amp.h>

#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/error.h>
#include <ember/tensor/grad_mode.h>

namespace ember::detail {

void amp_unscale_(const Tensor& grad, const Tensor& found_inf, double inv_scale) {
  check_defined("amp_unscale_", grad, "grad");
  check_defined("amp_unscale_", found_inf, "found_inf");
  EMBER_CHECK(grad.is_floating_point(), "[amp_unscale_] expected a floating-point grad, got ",
              grad.dtype());
  EMBER_CHECK(found_inf.dtype() == kFloat32 && found_inf.numel() == 1 &&
                  found_inf.device() == grad.device() && found_inf.is_contiguous(),
              "[amp_unscale_] expected found_inf to be a float32 tensor of one element on ",
              grad.device(), ", got ", found_inf.dtype(), " of shape ", found_inf.shape(), " on ",
              found_inf.device());
  if (grad.numel() == 0) return;
  // Gradients are dense in practice; any other layout goes through a contiguous copy.
  Tensor g = grad.is_contiguous() ? grad : grad.contiguous();
  if (g.is_cuda()) {
    amp_unscale_cuda(g, found_inf, inv_scale);
  } else {
    amp_unscale_cpu(g, found_inf, inv_scale);
  }
  if (!g.is_same(grad)) {
    NoGradGuard no_grad;
    Tensor(grad).copy_(g);
  } else {
    grad.bump_version();
  }
  found_inf.bump_version();
}

}  // namespace ember::detail
