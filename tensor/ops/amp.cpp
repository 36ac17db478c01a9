// Front end of the fused unscale (tensor/ops/amp.h): validation and device dispatch.
#include <ember/tensor/ops/amp.h>

#include <ember/tensor/detail/amp_kernels.h>
#include <ember/tensor/error.h>
#include <ember/tensor/grad_mode.h>

namespace ember::detail {

namespace {
void check_scalar(const char* op, const Tensor& t, const char* name, Dtype dtype,
                  const Device& device) {
  check_defined(op, t, name);
  EMBER_CHECK(t.dtype() == dtype && t.numel() == 1 && t.device() == device && t.is_contiguous(),
              "[", op, "] expected ", name, " to be a ", dtype, " tensor of one element on ",
              device, ", got ", t.dtype(), " of shape ", t.shape(), " on ", t.device());
}

// Both amp_unscale_ overloads: inv_scale_dev (CUDA only), when set, is read in place of
// inv_scale when the kernel runs.
void unscale(const Tensor& grad, const Tensor& found_inf, double inv_scale,
             const float* inv_scale_dev) {
  check_defined("amp_unscale_", grad, "grad");
  check_defined("amp_unscale_", found_inf, "found_inf");
  EMBER_CHECK(grad.is_floating_point(), "[amp_unscale_] expected a floating-point grad, got ",
              grad.dtype());
  check_scalar("amp_unscale_", found_inf, "found_inf", kFloat32, grad.device());
  if (grad.numel() == 0) return;
  // Gradients are dense in practice; any other layout goes through a contiguous copy.
  Tensor g = grad.is_contiguous() ? grad : grad.contiguous();
  if (g.is_cuda()) {
    amp_unscale_cuda(g, found_inf, inv_scale, inv_scale_dev);
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

}  // namespace

void amp_unscale_(const Tensor& grad, const Tensor& found_inf, const Tensor& inv_scale) {
  check_defined("amp_unscale_", grad, "grad");
  check_scalar("amp_unscale_", inv_scale, "inv_scale", kFloat32, grad.device());
  // On the CPU the factor can be read now; on CUDA the kernel reads it when it runs.
  if (!grad.is_cuda()) {
    amp_unscale_(grad, found_inf, static_cast<double>(inv_scale.data<float>()[0]));
  } else {
    unscale(grad, found_inf, 1.0, static_cast<const float*>(inv_scale.data_ptr()));
  }
}

void amp_update_scale_(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  constexpr const char* op = "amp_update_scale_";
  check_defined(op, scale, "scale");
  check_scalar(op, scale, "scale", kFloat32, scale.device());
  check_scalar(op, growth_tracker, "growth_tracker", kInt32, scale.device());
  check_scalar(op, found_inf, "found_inf", kFloat32, scale.device());
  if (scale.is_cuda()) {
    amp_update_scale_cuda(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                          growth_interval);
  } else {
    amp_update_scale(static_cast<float*>(scale.data_ptr()),
                     static_cast<int32_t*>(growth_tracker.data_ptr()), found_inf.data<float>()[0],
                     growth_factor, backoff_factor, growth_interval);
  }
  scale.bump_version();
  growth_tracker.bump_version();
}

void amp_update_scale(float& scale, int64_t& growth_tracker, bool found_inf, double growth_factor,
                      double backoff_factor, int64_t growth_interval) {
  amp_update_scale(&scale, &growth_tracker, found_inf ? 1.0f : 0.0f, growth_factor, backoff_factor,
                   growth_interval);
}

void amp_unscale_(const Tensor& grad, const Tensor& found_inf, double inv_scale) {
  unscale(grad, found_inf, inv_scale, nullptr);
}

}  // namespace ember::detail
