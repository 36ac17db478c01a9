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

}  // namespace ember::detail
