// Fused optimizer updates behind tensor/ops/optim.h (internal): the per-element math of one Adam or
// SGD step as __host__ __device__ functors shared by the CPU loop (cpu/optim.cpp) and the CUDA
// kernel (cuda/optim.cu), and the backend entry points the front end (tensor/ops/optim.cpp) calls.
//
// Note [Fused optimizer arithmetic]
// Each functor reproduces, element by element and in the same order, the tensor ops of
// PyTorch 1.13's single-tensor optimizer path; every intermediate is rounded to the compute
// type A (float for float32/float16/bfloat16 parameters, double for float64) and every scalar
// is first converted to A, as PyTorch's element-wise kernels do. So on the CPU float32 results
// are bit-identical to the unfused chain (no FMA contraction: the build is ISO C++, where GCC
// does not contract), and 16-bit parameters are only rounded once, at the end. nvcc contracts
// a * b + c into FMAs by default, so on CUDA the results agree with the CPU's to rounding (the
// tests compare within 1e-6), not bit for bit, as PyTorch's CUDA optimizers do.
#pragma once

#include <math.h>

#include <cstdint>

#include <ember/tensor/half.h>
#include <ember/tensor/ops/optim.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

template <typename A>
EMBER_HD inline A optim_sqrt(A v) {
  if constexpr (sizeof(A) == 4) return ::sqrtf(v); else return ::sqrt(v);
}

/// One Adam step on one element; scalars already converted to A (Note [Fused optimizer
/// arithmetic]). Mirrors adam.cpp's tensor-op chain:
///   g = maximize ? -g : g; p *= 1 - lr*wd (AdamW) | g = g + wd * p (Adam)
///   m = m * b1 + (1 - b1) * g;  v = v * b2 + ((1 - b2) * g) * g;  vmax = max(vmax, v)
///   denom = sqrt(v or vmax) / bc2_sqrt + eps;  p = p + ((-step_size) * m) / denom
template <typename A>
struct AdamFunctor {
  A beta1, one_minus_beta1, beta2, one_minus_beta2, decay, wd, bc2_sqrt, eps, neg_step_size;
  bool amsgrad, maximize, decoupled, use_wd;

  // Stage 1: the moments (and amsgrad's running max), from the old parameter value.
  template <typename T>
  EMBER_HD void moments(T p_in, T g_in, T& m_ref, T& v_ref, T* vmax_ref) const {
    const A p = static_cast<A>(p_in);
    A g = static_cast<A>(g_in);
    if (maximize) g = -g;
    if (!decoupled && use_wd) g = g + wd * p;  // skipped for wd == 0: 0 * inf would be nan
    A m = static_cast<A>(m_ref) * beta1;
    m = m + one_minus_beta1 * g;
    A g2 = g * one_minus_beta2;
    g2 = g2 * g;
    A v = static_cast<A>(v_ref) * beta2;
    v = v + g2;
    m_ref = T(m);
    v_ref = T(v);
    if (amsgrad) {
      const A old = static_cast<A>(*vmax_ref);
      *vmax_ref = T((v > old || v != v) ? v : old);  // torch.maximum: NaN propagates
    }
  }
  // Stage 2: the new parameter from the old one, the stored m and sqrt of the stored v (or
  // vmax). Split from stage 1 so the CPU loop can take the square roots in between with SIMD.
  template <typename T>
  EMBER_HD T finish(T p_in, T m_in, A root) const {
    A p = static_cast<A>(p_in);
    if (decoupled) p = p * decay;
    A denom = root / bc2_sqrt;
    denom = denom + eps;
    A upd = static_cast<A>(m_in) * neg_step_size;
    upd = upd / denom;
    return T(p + upd);
  }
  template <typename T>
  EMBER_HD void operator()(T& p_ref, T g_in, T& m_ref, T& v_ref, T* vmax_ref) const {
    moments(p_ref, g_in, m_ref, v_ref, vmax_ref);
    p_ref = finish(p_ref, m_ref, optim_sqrt(static_cast<A>(amsgrad ? *vmax_ref : v_ref)));
  }
};

/// One SGD step on one element (mirrors sgd.cpp's chain):
///   d = maximize ? -g : g;  d = d + wd * p;
///   buf = init ? d : buf * momentum + (1 - dampening) * d;  d = nesterov ? d + momentum * buf : buf
///   p = p + (-lr) * d
template <typename A>
struct SgdFunctor {
  A neg_lr, momentum, one_minus_dampening, wd;
  bool use_wd, use_momentum, nesterov, maximize, init_buffer;

  template <typename T>
  EMBER_HD void operator()(T& p_ref, T g_in, T* buf_ref) const {
    A p = static_cast<A>(p_ref);
    A d = static_cast<A>(g_in);
    if (maximize) d = -d;
    if (use_wd) d = d + wd * p;
    if (use_momentum) {
      A b;
      if (init_buffer) {
        b = d;
      } else {
        b = static_cast<A>(*buf_ref) * momentum;
        b = b + one_minus_dampening * d;
      }
      *buf_ref = T(b);
      d = nesterov ? d + momentum * b : b;
    }
    p_ref = T(p + neg_lr * d);
  }
};

/// The functor of step `step` at learning rate `lr`, the other hyperparameters from s (the CUDA
/// kernel of a capturable step calls it with the values it reads on the device).
template <typename A>
EMBER_HD AdamFunctor<A> make_adam_functor(const AdamStepArgs& s, double lr, double step) {
  const double bc1 = 1 - ::pow(s.beta1, step);
  const double bc2 = 1 - ::pow(s.beta2, step);
  return {A(s.beta1),         A(1 - s.beta1),          A(s.beta2),
          A(1 - s.beta2),     A(1 - lr * s.weight_decay), A(s.weight_decay),
          A(::sqrt(bc2)),     A(s.eps),                A(-(lr / bc1)),
          s.amsgrad,          s.maximize,              s.decoupled,
          s.weight_decay != 0};
}

template <typename A>
AdamFunctor<A> make_adam_functor(const AdamStepArgs& s) {
  return make_adam_functor<A>(s, s.lr, s.step);
}

template <typename A>
SgdFunctor<A> make_sgd_functor(const SgdStepArgs& s) {
  return {A(-s.lr),       A(s.momentum),       A(1 - s.dampening), A(s.weight_decay),
          s.weight_decay != 0, s.momentum != 0, s.nesterov,        s.maximize,
          s.init_buffer};
}

// Backend entry points. All tensors are contiguous, of one floating dtype and shape, on one
// device; max_exp_avg_sq is defined iff amsgrad, momentum_buffer iff momentum != 0.
void adam_update_cpu(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                     const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                     const AdamStepArgs& args);
void adam_update_cuda(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                      const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                      const AdamStepArgs& args);
void sgd_update_cpu(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                    const SgdStepArgs& args);
void sgd_update_cuda(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                     const SgdStepArgs& args);

}  // namespace ember::detail
