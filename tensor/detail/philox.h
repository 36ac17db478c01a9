// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// mapping from its 32-bit words to the values each random op writes.
//
// Note [Random streams]
// A Generator is (seed, offset). An op that needs `w` 32-bit words per element reserves
// ceil(numel * w / 4) counter values with Generator::advance, receives the first (`base`), and
// element i reads words [i * w, (i + 1) * w) of the stream philox(key = seed, counter = base +
// word / 4). Every value therefore depends only on (seed, base, i): CPU threads and GPU blocks
// may split the work any way they like and the CPU and the GPU write the same numbers (normals
// may differ in the last bits where the device's log/sin/cos round differently from libm).
// Words per element: uniform/bernoulli float32-and-narrower 1, float64 2; normal: 1 word per
// element for float32-and-narrower (pairs of elements share a Box-Muller pair of words), 2 for
// float64; randint 1 when the range fits in 32 bits, else 2.
#pragma once

#include <cmath>
#include <cstdint>

#include <ember/tensor/half.h>

namespace ember::detail {

struct Philox4 {
  uint32_t v[4];
};

EMBER_HD inline uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

/// The four 32-bit words for 128-bit counter `ctr` under 64-bit key `key` (10 rounds).
EMBER_HD inline Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = ctr.v[0], c1 = ctr.v[1], c2 = ctr.v[2], c3 = ctr.v[3];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = philox_mulhilo(kM0, c0, &hi0);
    const uint32_t lo1 = philox_mulhilo(kM1, c2, &hi1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

/// Words for counter value `block` of the stream keyed by `seed`.
EMBER_HD inline Philox4 philox_block(uint64_t seed, uint64_t block) {
  Philox4 c{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u}};
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

/// Where an op's counter range starts (Note [Random streams]): the seed and the first counter
/// value, or, for an op captured into a CUDA graph (Note [CUDA graphs]), the graph's device
/// words `replay` = {seed, first counter of this replay}, which it writes before each launch,
/// with `offset` the op's counter range within the graph.
struct PhiloxArgs {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const uint64_t* replay = nullptr;
  EMBER_HD uint64_t key() const { return replay ? replay[0] : seed; }
  EMBER_HD uint64_t first() const { return replay ? replay[1] + offset : offset; }
};

/// Random word `w` of the stream starting at counter value `base` (a whole block is computed;
/// loops that need all four words of a block should call philox_block once instead).
EMBER_HD inline uint32_t philox_word(uint64_t seed, uint64_t base, uint64_t w) {
  return philox_block(seed, base + w / 4).v[w % 4];
}

// ---- words -> values ----

/// [0, 1) with `bits` random bits (24 for float32, 11 for float16, 8 for bfloat16: every
/// value is then exact in the target type and strictly below 1).
EMBER_HD inline float uniform_f32(uint32_t x, int bits = 24) {
  return static_cast<float>(x >> (32 - bits)) * (1.0f / static_cast<float>(1u << bits));
}
/// [0, 1) with 53 random bits from two words.
EMBER_HD inline double uniform_f64(uint32_t a, uint32_t b) {
  const uint64_t x = (static_cast<uint64_t>(a) << 32 | b) >> 11;
  return static_cast<double>(x) * (1.0 / 9007199254740992.0);  // 2^-53
}

/// Mantissa bits (plus the implicit one) of T's values in [0, 1): the bits a uniform draw uses.
template <typename T>
constexpr int uniform_bits() {
  if constexpr (std::is_same_v<T, Half>) {
    return 11;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return 8;
  } else {
    return 24;
  }
}

/// c ? a : b by bit masks: no branch, so loops over it vectorise on the CPU.
EMBER_HD inline float select_bits(bool c, float a, float b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return bits_f32((f32_bits(a) & mask) | (f32_bits(b) & ~mask));
}

/// ln(x) for x in [2^-24, 1] (Box-Muller's u1) in plain float arithmetic, within ~2 ulp of the
/// exact value. Written out rather than calling logf so that the CPU loop vectorises and the CPU
/// and the GPU evaluate the same expression.
EMBER_HD inline float bm_log(float x) {
  const uint32_t b = f32_bits(x);
  int e = static_cast<int>((b >> 23) & 0xffu) - 127;
  float m = bits_f32((b & 0x7fffffu) | 0x3f800000u);  // x = m * 2^e, m in [1, 2)
  const bool big = m > 1.41421356f;
  m = select_bits(big, m * 0.5f, m);  // m in [sqrt(1/2), sqrt(2)): |t| <= 0.172
  e += static_cast<int>(big);
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  // ln(m) = 2 atanh(t) = 2 (t + t^3/3 + t^5/5 + ...)
  const float p = t * (2.0f + t2 * (0.666666667f + t2 * (0.4f + t2 * (0.285714286f +
                                                                  t2 * 0.222222222f))));
  return static_cast<float>(e) * 0.693147181f + p;
}

/// sin and cos of 2 pi u for u in [0, 1), within ~2 ulp: the quadrant and the fold to
/// [0, pi/4] are exact on u's 24-bit grid, then Taylor polynomials.
EMBER_HD inline void bm_sincos_2pi(float u, float* s, float* c) {
  const float x = u * 4.0f;
  const int q = static_cast<int>(x);
  const float f = x - static_cast<float>(q);  // [0, 1): the angle within the quadrant / (pi/2)
  const bool hi = f > 0.5f;
  const float a = select_bits(hi, 1.0f - f, f) * 1.57079632679f;  // [0, pi/4]
  const float a2 = a * a;
  const float sa = a * (1.0f + a2 * (-1.66666667e-1f + a2 * (8.33333333e-3f +
                         a2 * (-1.98412698e-4f + a2 * 2.75573192e-6f))));
  const float ca = 1.0f + a2 * (-0.5f + a2 * (4.16666667e-2f + a2 * (-1.38888889e-3f +
                         a2 * (2.48015873e-5f + a2 * -2.75573192e-7f))));
  const float s0 = select_bits(hi, ca, sa);  // sin(pi/2 - a) = cos(a)
  const float c0 = select_bits(hi, sa, ca);
  // Rotate by q quarter turns.
  const bool odd = (q & 1) != 0;
  const float s1 = select_bits(odd, c0, s0);
  const float c1 = select_bits(odd, s0, c0);
  *s = select_bits(q >= 2, -s1, s1);
  *c = select_bits(((q + 1) & 2) != 0, -c1, c1);  // q == 1 or q == 2
}

/// Box-Muller's two halves: r^2 = -2 ln(u1) with u1 = 1 - uniform in (0, 1] (so the log is
/// finite), and (sin, cos) of 2 pi u2.
EMBER_HD inline float bm_radius_sq(uint32_t a) { return -2.0f * bm_log(1.0f - uniform_f32(a)); }
EMBER_HD inline void bm_angle(uint32_t b, float* s, float* c) { bm_sincos_2pi(uniform_f32(b), s, c); }

/// Box-Muller: two standard normals from two words (float).
EMBER_HD inline void box_muller_f32(uint32_t a, uint32_t b, float* z0, float* z1) {
  const float r = sqrtf(bm_radius_sq(a));
  float sn, cs;
  bm_angle(b, &sn, &cs);
  *z0 = r * cs;
  *z1 = r * sn;
}

EMBER_HD inline void box_muller_f64(const Philox4& w, double* z0, double* z1) {
  const double u1 = 1.0 - uniform_f64(w.v[0], w.v[1]);
  const double u2 = uniform_f64(w.v[2], w.v[3]);
  const double r = sqrt(-2.0 * log(u1));
  const double th = 6.28318530717958647692 * u2;
  *z0 = r * cos(th);
  *z1 = r * sin(th);
}

}  // namespace ember::detail
