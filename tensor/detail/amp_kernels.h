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

/// torch's _amp_update_scale_ on one scale: back off after an inf, grow after `interval` clean
/// steps in a row (the products taken in double and stored in float32, a growth to inf refused).
/// Tracker: int32_t on a device (torch's tensor), int64_t for the host scaler.
template <typename Tracker>
EMBER_HD inline void amp_update_scale(float* scale, Tracker* growth_tracker, float found_inf,
                                      double growth_factor, double backoff_factor,
                                      int64_t interval) {
  if (found_inf != 0.0f) {
    *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *growth_tracker = 0;
    return;
  }
  const int64_t clean = static_cast<int64_t>(*growth_tracker) + 1;
  if (clean == interval) {
    const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
    if (isfinite(grown)) *scale = grown;
    *growth_tracker = 0;
  } else {
    *growth_tracker = static_cast<Tracker>(clean);
  }
}

// Backend entry points: grad is contiguous and floating; found_inf is a float32 tensor of one
// element on grad's device, set to 1 when grad holds an inf or NaN and left alone otherwise.
// On CUDA, a non-null inv_scale_dev is read on the device instead of inv_scale.
void amp_unscale_cpu(const Tensor& grad, const Tensor& found_inf, double inv_scale);
void amp_unscale_cuda(const Tensor& grad, const Tensor& found_inf, double inv_scale,
                      const float* inv_scale_dev = nullptr);
/// amp_update_scale on CUDA scalars (scale float32, growth_tracker int32, found_inf float32).
void amp_update_scale_cuda(const Tensor& scale, const Tensor& growth_tracker,
                           const Tensor& found_inf, double growth_factor, double backoff_factor,
                           int64_t interval);

}  // namespace ember::detail
