// A branch-free float exp for arguments <= 0, shared by the CPU softmax and attention kernels
// so that their loops over it vectorise (libm's expf is a call GCC cannot vectorise here).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ember::detail {

// The shared reduction: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite, two constants), n into
// *n, and exp(r) by a degree-6 polynomial (Cephes' expf coefficients).
inline float exp_reduced(float xc, int32_t* n) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float fn = (xc * 1.44269504088896341f + shifter) - shifter;
  const float r = (xc - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  *n = static_cast<int32_t>(fn);
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (and NaN), within ~2 ulp, written without calls or branches so loops over
// it vectorise: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for exp(r) (Cephes'
// expf coefficients), and 2^n built in the exponent bits. Results below float's normal range
// flush to 0, which softmax cannot tell from the true value next to the row's max term (1).
inline float exp_nonpos(float x) {
  constexpr float kLo = -87.33654f;  // log(FLT_MIN)
  const float xc = x < kLo ? kLo : x;
  int32_t n = 0;
  const float p = exp_reduced(xc, &n);
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float y = p * scale;
  return x < kLo ? 0.0f : (x != x ? x : y);
}

// exp(x) for every float x, within ~2 ulp, branch-free so that loops over it vectorise (libm's
// expf is a call per element): exp_nonpos's reduction and polynomial over the whole range, 2^n
// applied in two halves so that neither leaves the normal range; overflows to +inf above
// log(FLT_MAX), gives subnormals down to log of the smallest one, and 0 below (NaN stays NaN).
// The CPU's exp op and the functors built on it use this, every loop the same arithmetic, so a
// result does not depend on a tensor's layout or the CPU's vector width.
inline float exp_float(float x) {
  constexpr float kHi = 88.72283935546875f;  // above: inf
  constexpr float kLo = -103.97208404541016f;  // below: 0 (under the smallest subnormal)
  const float xc = x < kLo ? kLo : (x > kHi ? kHi : x);
  int32_t n = 0;
  const float p = exp_reduced(xc, &n);
  const int32_t n1 = n / 2, n2 = n - n1;  // n in [-150, 128]; each half in [-75, 64]: 2^n1, 2^n2 are normal
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  const float y = (p * s1) * s2;
  return x < kLo ? 0.0f : (x > kHi ? __builtin_inff() : (x != x ? x : y));
}

/// exp(v) for v <= 0 (a shifted softmax exponent): exp_nonpos for float, std::exp otherwise.
template <typename A>
inline A exp_shifted(A v) {
  if constexpr (std::is_same_v<A, float>) {
    return exp_nonpos(v);
  } else {
    return std::exp(v);
  }
}

}  // namespace ember::detail
