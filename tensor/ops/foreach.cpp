// Front end of the list operations (tensor/ops/foreach.h): validation, the multi-tensor CUDA path
// where every tensor allows it, the per-tensor ops otherwise.
#include <ember/tensor/ops/foreach.h>

#include <cmath>

#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember {

namespace detail {
// tensor/cuda/foreach.cu (no_cuda_foreach.cpp without CUDA). Each takes a non-empty list of
// contiguous tensors of one floating dtype on one CUDA device.
Tensor total_norm_cuda(const std::vector<Tensor>& tensors, double p);
void foreach_mul_cuda(const std::vector<Tensor>& tensors, const Tensor& scale);
}  // namespace detail

namespace {

void check_list(const char* op, const std::vector<Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    EMBER_CHECK(tensors[i].defined(), "[", op, "] tensor ", i, " of the list is undefined");
    EMBER_CHECK_TYPE(TypeError, tensors[i].is_floating_point(), "[", op, "] expected floating ",
                     "tensors, got tensor ", i, " of dtype ", tensors[i].dtype());
  }
}

// Every tensor contiguous, of one dtype, on one CUDA device: what the multi-tensor kernels take.
bool one_cuda_group(const std::vector<Tensor>& tensors) {
  const Tensor& first = tensors.front();
  if (!first.is_cuda()) return false;
  for (const Tensor& t : tensors) {
    if (t.device() != first.device() || t.dtype() != first.dtype() || !t.is_contiguous()) {
      return false;
    }
  }
  return true;
}

}  // namespace

Tensor total_norm(const std::vector<Tensor>& tensors, double p) {
  check_list("total_norm", tensors);
  EMBER_CHECK(p > 0 && !std::isnan(p), "[total_norm] expected p > 0 or inf, got ", p);
  NoGradGuard no_grad;
  if (tensors.empty()) return zeros({}, kFloat32);
  if (one_cuda_group(tensors)) return detail::total_norm_cuda(tensors, p);
  const Device device = tensors.front().device();
  Dtype dtype = tensors.front().dtype();
  std::vector<Tensor> norms;
  norms.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    dtype = promote_types(dtype, t.dtype());
    if (t.numel() > 0) norms.push_back(norm(t, p).to(device));
  }
  if (norms.empty()) return zeros({}, TensorOptions(dtype).device(device));
  for (Tensor& n : norms) n = n.to(dtype);
  if (norms.size() == 1) return norms[0];
  Tensor stacked = stack(norms);
  return std::isinf(p) ? max(stacked) : norm(stacked, p);
}

void foreach_mul_(const std::vector<Tensor>& tensors, const Tensor& scale) {
  check_list("foreach_mul_", tensors);
  detail::check_defined("foreach_mul_", scale, "scale");
  EMBER_CHECK(scale.numel() == 1, "[foreach_mul_] expected a one-element scale, got shape ",
              scale.shape());
  EMBER_CHECK_TYPE(TypeError, scale.is_floating_point(),
                   "[foreach_mul_] expected a floating scale, got ", scale.dtype());
  if (GradMode::is_enabled()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      EMBER_CHECK(!tensors[i].requires_grad(), "[foreach_mul_] tensor ", i, " requires grad: an ",
                  "in-place multiply of it cannot be recorded (run it under NoGradGuard)");
    }
  }
  if (tensors.empty()) return;
  if (one_cuda_group(tensors) && scale.device() == tensors.front().device()) {
    detail::foreach_mul_cuda(tensors, scale);
    for (const Tensor& t : tensors) t.bump_version();
    return;
  }
  const Tensor s = scale.reshape({});
  for (Tensor t : tensors) t.mul_(s.device() == t.device() ? s : s.to(t.device()));
}

}  // namespace ember
