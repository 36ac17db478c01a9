// Division of 32-bit unsigned values by a divisor fixed at launch time, as a multiply-high, an
// add and a shift (Granlund and Montgomery's round-up method; PyTorch's IntDivider): the
// strided element-wise loops split each linear index into per-dim indices with it, where a
// hardware-less 32-bit division costs some twenty instructions. Plain C++ on the host (so CPU
// tests check the arithmetic the device runs), __umulhi on the device.
#pragma once

#include <cstdint>

#include <ember/tensor/half.h>  // EMBER_HD

namespace ember::detail {

struct FastDiv {
  uint32_t divisor = 1;
  uint32_t magic = 1;  ///< ceil(2^32 * 2^shift / divisor) - 2^32, which fits in 32 bits
  uint32_t shift = 0;  ///< ceil(log2(divisor))

  /// divisor in [1, 2^31 - 1]; div() is exact for n in [0, 2^31 - 1].
  static FastDiv make(uint32_t d) {
    FastDiv f;
    f.divisor = d;
    while ((uint64_t{1} << f.shift) < d) ++f.shift;
    f.magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }

  EMBER_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    // t <= n < 2^31, so t + n does not overflow 32 bits.
    return (__umulhi(n, magic) + n) >> shift;
#else
    const uint64_t t = (static_cast<uint64_t>(n) * magic) >> 32;
    return static_cast<uint32_t>((t + n) >> shift);
#endif
  }
};

}  // namespace ember::detail
