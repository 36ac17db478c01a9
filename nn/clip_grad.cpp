#include <ember/nn/clip_grad.h>

#include <cmath>

#include <ember/autograd/autograd.h>
#include <ember/tensor/ops/foreach.h>

namespace ember::nn {

namespace {
std::vector<Tensor> grads_of(const std::vector<Tensor>& params, const char* op) {
  std::vector<Tensor> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    EMBER_CHECK(params[i].defined(), "[", op, "] parameter ", i, " is an undefined tensor");
    Tensor g = params[i].grad();
    if (g.defined()) grads.push_back(g.detach());
  }
  return grads;
}

Tensor total_of(const std::vector<Tensor>& tensors, double norm_type, bool error_if_nonfinite,
                const char* op) {
  // One multi-tensor reduction on a GPU (tensor/ops/foreach.h) where per-tensor norms and their
  // stack would be about three launches per gradient.
  Tensor total = total_norm(tensors, norm_type);
  if (error_if_nonfinite) {
    const double t = total.item<double>();
    EMBER_CHECK(std::isfinite(t), "[", op, "] the total norm of order ", norm_type,
                " of the gradients is non-finite (", t,
                "), so it cannot be clipped; pass error_if_nonfinite=false to scale the "
                "gradients by it anyway");
  }
  return total;
}

// Multiplies `grads` by min(1, max_norm / (total + 1e-6)), computed on the device: no host round
// trip. Multiplying by 1 when no clipping is needed is cheaper than asking the device whether it
// is.
void scale_grads(const std::vector<Tensor>& grads, double max_norm, const Tensor& total) {
  if (grads.empty()) return;
  const Device device = grads[0].device();
  const Tensor t = total.device() == device ? total : total.to(device);
  foreach_mul_(grads, clamp_max(rdiv(add(t, 1e-6), max_norm), 1.0));
}
}  // namespace

Tensor get_total_norm(const std::vector<Tensor>& tensors, double norm_type,
                      bool error_if_nonfinite) {
  EMBER_CHECK(norm_type > 0, "[get_total_norm] expected norm_type > 0 (or kInfNorm), got ",
              norm_type);
  return total_of(tensors, norm_type, error_if_nonfinite, "get_total_norm");
}

void clip_grads_with_norm_(const std::vector<Tensor>& params, double max_norm,
                           const Tensor& total) {
  EMBER_CHECK(max_norm >= 0, "[clip_grads_with_norm_] expected max_norm >= 0, got ", max_norm);
  detail::check_defined("clip_grads_with_norm_", total, "total_norm");
  NoGradGuard no_grad;
  scale_grads(grads_of(params, "clip_grads_with_norm_"), max_norm, total);
}

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  EMBER_CHECK(max_norm >= 0, "[clip_grad_norm_] expected max_norm >= 0, got ", max_norm);
  EMBER_CHECK(norm_type > 0, "[clip_grad_norm_] expected norm_type > 0 (or kInfNorm), got ",
              norm_type);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = grads_of(params, "clip_grad_norm_");
  if (grads.empty()) return zeros({}, kFloat32);
  Tensor total = total_of(grads, norm_type, error_if_nonfinite, "clip_grad_norm_");
  scale_grads(grads, max_norm, total);
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  EMBER_CHECK(clip_value >= 0, "[clip_grad_value_] expected clip_value >= 0, got ", clip_value);
  NoGradGuard no_grad;
  for (Tensor g : grads_of(params, "clip_grad_value_")) clamp_(g, -clip_value, clip_value);
}

}  // namespace ember::nn
