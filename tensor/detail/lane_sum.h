// The CPU's wide vector loops (softmax, attention, layer and batch norm, GELU and exp): the
// clones they are compiled as, and sums of short runs in a fixed order.
#pragma once

#include <cstdint>

// A loop compiled also for AVX-512 and AVX2 and picked at load time (GCC function
// multi-versioning), so the library still runs on any x86-64. The files using it compile without
// contraction (tensor/CMakeLists.txt) and sum in fixed lanes (lane_sum), so every version gives
// the same bits; those whose work is compute-bound also use the full 512-bit registers there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EMBER_WIDE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EMBER_WIDE_CLONES
#endif

namespace ember::detail {

/// Partial sums per run: 16 lanes fill one AVX-512 register of floats, two AVX2 ones, four SSE
/// ones, so the loop vectorises at every width the kernels are compiled for.
inline constexpr int kSumLanes = 16;

/// f(0) + ... + f(n-1) summed in kSumLanes partial sums (term i into lane i % kSumLanes), then
/// the lanes pairwise. A plain `s += f(i)` is a chain of dependent scalar adds that GCC may not
/// reorder (without -ffast-math), one add per add latency; this order is written out, so the loop
/// vectorises and every ISA version of a caller gives the same bits.
template <typename A, typename F>
[[gnu::always_inline]] inline A lane_sum(int64_t n, F f) {
  A s[kSumLanes] = {};
  int64_t k = 0;
  for (; k + kSumLanes <= n; k += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) s[j] += f(k + j);
  }
  for (int j = 0; k + j < n; ++j) s[j] += f(k + j);
  for (int w = kSumLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) s[j] += s[j + w];
  }
  return s[0];
}

/// e[0] + ... + e[n-1] in lane_sum's order.
template <typename A>
[[gnu::always_inline]] inline A lane_sum(const A* e, int64_t n) {
  return lane_sum<A>(n, [e](int64_t i) { return e[i]; });
}

}  // namespace ember::detail
