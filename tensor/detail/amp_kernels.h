// The fused found-inf check and unscale behind GradScaler (nn/amp/grad_scaler.h): the
// per-element math as a __host__ __device__ functor shared by the CPU loop (cpu/amp.cpp) and
// the CUDA kernel (cuda/amp.cu), and the backend entry points tensor/ops/amp.cpp calls.
#pragma once

#include <math.h>

#include <ember/tensor/half.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

/// One gradient element of torch's _amp_foreach_non_finite_check_and_unscale_: the value is
/// read in the compute type A, multiplied by inv_scale (skipped when it is 1, as torch does),
/// and written back; returns true when the value read was inf or NaN.
template <typename A>
struct UnscaleFunctor {
  A inv_scale;

  template <typename T>
  EMBER_HD bool operator()(T& g) const {
    const A v = static_cast<A>(g);
    g = T(inv_scale == A(1) ? v : v * inv_scale);
    return !isfinite(v);
  }
};

// Backend entry points: grad is contiguous and floating; found_inf is a float32 tensor of one
// element on grad's device, set to 1 when grad holds an inf or NaN and left alone otherwise.
void amp_unscale_cpu(const Tensor& grad, const Tensor& found_inf, double inv_scale);
void amp_unscale_cuda(const Tensor& grad, const Tensor& found_inf, double inv_scale);

}  // namespace ember::detail
