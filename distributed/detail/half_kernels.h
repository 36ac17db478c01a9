// float16 loops of the collectives' reductions and the fp16 hook, with the CPU's own conversions
// (F16C, on every x86-64 since 2013) where it has them: the scalar conversions of Half cost more
// than moving the bytes, so on a CPU job fp16 compression spent on converting what it saved on
// the link (docs/benchmarks.md). The results are the bits of Half's conversions (round to
// nearest even) in every version, but a NaN's payload, which may differ (a NaN stays a NaN).
// Internal: not installed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ember::dist::detail {

/// c[i] = a[i] + b[i], in float, rounded once (c may be a or b).
void half_sum(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n);
/// x[i] = x[i] / d, in float, rounded once.
void half_divide(uint16_t* x, size_t n, float d);
/// out[i] = Half(float(Half(x[i])) / d): a cast to float16, then a division in float16 (what
/// `x.to(kFloat16).div_(d)` computes), in one pass.
void float_to_half_divided(const float* x, uint16_t* out, size_t n, float d);
/// out[i] = float(x[i]) (exact).
void half_to_float(const uint16_t* x, float* out, size_t n);

}  // namespace ember::dist::detail
