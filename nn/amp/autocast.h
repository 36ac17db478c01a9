// nn::amp: torch.amp's names in one place. The autocast guard itself lives in the tensor layer
// (tensor/autocast.h), where the ops that consult it are.
#pragma once

#include <ember/nn/amp/grad_scaler.h>
#include <ember/tensor/autocast.h>

namespace ember::nn::amp {

/// torch.autocast(device_type, dtype, enabled, cache_enabled) as a scope guard; see
/// ember::AutocastGuard.
using autocast = ::ember::AutocastGuard;

}  // namespace ember::nn::amp
