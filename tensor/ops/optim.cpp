// Front end of the fused optimizer updates (tensor/ops/optim.h): validation, the fused-kernel
// eligibility test, device dispatch, and the tensor-op fallback for everything else.
#include <ember/tensor/ops/optim.h>

#include <cmath>
#include <initializer_list>

#include <ember/tensor/detail/optim_kernels.h>
#include <ember/tensor/ops.h>

namespace ember::detail {

namespace {

void check_like(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  EMBER_CHECK(t.shape() == param.shape(), "[", op, "] expected ", name, " of the parameter's shape ",
              param.shape(), ", got ", t.shape());
  EMBER_CHECK(t.device() == param.device(), "[", op, "] ", name, " is on ", t.device(),
              " but the parameter is on ", param.device());
}

// The fused kernels need one floating dtype and dense, row-major data everywhere.
bool fusable(const Tensor& param, std::initializer_list<const Tensor*> others) {
  if (!param.is_floating_point() || !param.is_contiguous()) return false;
  for (const Tensor* t : others) {
    if (t->defined() && (t->dtype() != param.dtype() || !t->is_contiguous())) return false;
  }
  return true;
}

void bump(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->defined()) t->bump_version();
  }
}

// The unfused chain (PyTorch 1.13's single-tensor Adam), for layouts the kernels do not take.
void adam_fallback(const Tensor& param, const Tensor& grad_in, const Tensor& exp_avg_in,
                   const Tensor& exp_avg_sq_in, const Tensor& max_sq_in, const AdamStepArgs& a) {
  Tensor p = param, m = exp_avg_in, v = exp_avg_sq_in, vmax = max_sq_in;
  Tensor grad = a.maximize ? neg(grad_in) : grad_in;
  if (a.decoupled) {
    p.mul_(1 - a.lr * a.weight_decay);
  } else if (a.weight_decay != 0) {
    grad = add(grad, p, a.weight_decay);
  }
  m.mul_(a.beta1).add_(grad, 1 - a.beta1);
  Tensor g2 = mul(grad, 1 - a.beta2);  // addcmul_(g, g, 1-b2) = v + ((1-b2) * g) * g
  g2.mul_(grad);
  v.mul_(a.beta2).add_(g2);
  const double bc1 = 1 - std::pow(a.beta1, a.step);
  const double bc2 = 1 - std::pow(a.beta2, a.step);
  Tensor denom;
  if (a.amsgrad) {
    vmax.copy_(maximum(vmax, v));
    denom = sqrt(vmax);
  } else {
    denom = sqrt(v);
  }
  denom.div_(std::sqrt(bc2)).add_(a.eps);
  Tensor update = mul(m, -(a.lr / bc1));  // addcdiv_(m, denom, -step_size)
  update.div_(denom);
  p.add_(update);
}

void sgd_fallback(const Tensor& param, const Tensor& grad, const Tensor& buf_in,
                  const SgdStepArgs& a) {
  Tensor p = param, buf = buf_in;
  Tensor d_p = a.maximize ? neg(grad) : grad;
  if (a.weight_decay != 0) d_p = add(d_p, p, a.weight_decay);
  if (a.momentum != 0) {
    if (a.init_buffer) {
      buf.copy_(d_p);
    } else {
      buf.mul_(a.momentum).add_(d_p, 1 - a.dampening);
    }
    d_p = a.nesterov ? add(d_p, buf, a.momentum) : buf;
  }
  p.add_(d_p, -a.lr);
}

}  // namespace

void adam_update_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                  const AdamStepArgs& args) {
  const char* op = "adam_update_";
  check_defined(op, param, "param");
  check_like(op, param, grad, "grad");
  check_like(op, param, exp_avg, "exp_avg");
  check_like(op, param, exp_avg_sq, "exp_avg_sq");
  if (args.amsgrad) check_like(op, param, max_exp_avg_sq, "max_exp_avg_sq");
  const Tensor vmax = args.amsgrad ? max_exp_avg_sq : Tensor();
  const bool capturable = args.step_dev != nullptr;
  EMBER_CHECK(!capturable || param.is_cuda(), "[", op,
              "] a capturable step (step and lr on the device) needs a CUDA parameter, got one on ",
              param.device());
  EMBER_CHECK(args.found_inf_dev == nullptr || capturable, "[", op,
              "] a found_inf flag on the device needs a capturable step (step_dev and lr_dev)");
  EMBER_CHECK(!capturable || fusable(param, {&grad, &exp_avg, &exp_avg_sq, &vmax}), "[", op,
              "] a capturable step needs contiguous tensors of the parameter's floating dtype");
  if (!fusable(param, {&grad, &exp_avg, &exp_avg_sq, &vmax})) {
    adam_fallback(param, grad, exp_avg, exp_avg_sq, vmax, args);
    return;
  }
  if (param.numel() > 0) {
    if (param.is_cuda()) {
      adam_update_cuda(param, grad, exp_avg, exp_avg_sq, vmax, args);
    } else {
      adam_update_cpu(param, grad, exp_avg, exp_avg_sq, vmax, args);
    }
  }
  bump({&param, &exp_avg, &exp_avg_sq, &vmax});
}

void sgd_update_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                 const SgdStepArgs& args) {
  const char* op = "sgd_update_";
  check_defined(op, param, "param");
  check_like(op, param, grad, "grad");
  const bool momentum = args.momentum != 0;
  if (momentum) check_like(op, param, momentum_buffer, "momentum_buffer");
  const Tensor buf = momentum ? momentum_buffer : Tensor();
  if (!fusable(param, {&grad, &buf})) {
    sgd_fallback(param, grad, buf, args);
    return;
  }
  if (param.numel() > 0) {
    if (param.is_cuda()) {
      sgd_update_cuda(param, grad, buf, args);
    } else {
      sgd_update_cpu(param, grad, buf, args);
    }
  }
  bump({&param, &buf});
}

}  // namespace ember::detail
