// Tensor-level kernels of mixed-precision training (internal to Ember: used by
// nn/amp/grad_scaler.cpp).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// In place, in one pass: grad *= inv_scale, and found_inf (a float32 tensor of one element on
/// grad's device) becomes 1 if grad holds an inf or NaN (it is never reset to 0 here, so one
/// found_inf collects a whole set of gradients). On CUDA the flag is written on the device
/// without a synchronisation. Throws ValueError naming "amp_unscale_" for an undefined or
/// non-floating grad, or a found_inf of another dtype, size or device. Bumps grad's version.
void amp_unscale_(const Tensor& grad, const Tensor& found_inf, double inv_scale);

/// amp_unscale_ with the factor read from `inv_scale`, a float32 scalar on grad's device, when
/// the op runs rather than when it is queued (the capturable GradScaler's, Note [CUDA graphs]).
void amp_unscale_(const Tensor& grad, const Tensor& found_inf, const Tensor& inv_scale);

/// torch's _amp_update_scale_, in place on the scalars' device without a synchronisation:
/// `scale` (float32) backs off by backoff_factor if `found_inf` (float32, one element) is
/// non-zero, else grows by growth_factor once `growth_tracker` (int32) counts growth_interval
/// clean steps; the tracker is reset or counted as torch's is. All three on one device.
void amp_update_scale_(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval);
/// The same rule on host values (the GradScaler that keeps its scale on the host).
void amp_update_scale(float& scale, int64_t& growth_tracker, bool found_inf, double growth_factor,
                      double backoff_factor, int64_t growth_interval);

}  // namespace ember::detail
