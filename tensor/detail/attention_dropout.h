// The dropout decision the fused attention kernels share (Note [Fused attention] in
// attention_kernels.h), kept apart from that header so the front end does not pull in philox.h.
#pragma once

#include <cstdint>

#include <ember/tensor/detail/philox.h>

namespace ember::detail {

/// True when dropout with probability p keeps the element whose Philox word is `word`.
EMBER_HD inline bool attention_keep(uint32_t word, float p) { return uniform_f32(word) >= p; }

}  // namespace ember::detail
