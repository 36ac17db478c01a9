#include <ember/nn/clip_grad.h>

#include <cmath>

#include <ember/autograd/autograd.h>

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
}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  EMBER_CHECK(max_norm >= 0, "[clip_grad_norm_] expected max_norm >= 0, got ", max_norm);
  EMBER_CHECK(norm_type > 0, "[clip_grad_norm_] expected norm_type > 0 (or kInfNorm), got ",
              norm_type);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = grads_of(params, "clip_grad_norm_");
  if (grads.empty()) return zeros({}, kFloat32);
  const Device device = grads[0].device();
  const bool inf = std::isinf(norm_type);

  // One norm per tensor, then the norm of those norms (PyTorch's two-level reduction, which
  // equals the norm of the concatenation). Empty gradients contribute nothing.
  std::vector<Tensor> norms;
  norms.reserve(grads.size());
  for (const Tensor& g : grads) {
    if (g.numel() == 0) continue;
    norms.push_back(norm(g, norm_type).to(device));
  }
  Tensor total;
  if (norms.empty()) {
    total = zeros({}, TensorOptions(grads[0].dtype()).device(device));
  } else if (norms.size() == 1) {
    total = norms[0];
  } else {
    Tensor stacked = stack(norms);
    total = inf ? max(stacked) : norm(stacked, norm_type);
  }
  if (error_if_nonfinite) {
    const double t = total.item<double>();
    EMBER_CHECK(std::isfinite(t), "[clip_grad_norm_] the total norm of order ", norm_type,
                " of the gradients is non-finite (", t,
                "), so it cannot be clipped; pass error_if_nonfinite=false to scale the "
                "gradients by it anyway");
  }
  // min(1, max_norm / (total + 1e-6)), computed on the device: no host round trip. Multiplying
  // by 1 when no clipping is needed is cheaper than asking the device whether it is.
  Tensor coef = clamp_max(rdiv(add(total, 1e-6), max_norm), 1.0);
  for (Tensor g : grads) {
    g.mul_(coef.device() == g.device() ? coef : coef.to(g.device()));
  }
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  EMBER_CHECK(clip_value >= 0, "[clip_grad_value_] expected clip_value >= 0, got ", clip_value);
  NoGradGuard no_grad;
  for (Tensor g : grads_of(params, "clip_grad_value_")) clamp_(g, -clip_value, clip_value);
}

}  // namespace ember::nn
