#include <ember/distributed/detail/half_kernels.h>

#include <ember/tensor/half.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EMBER_HALF_F16C 1
#endif

namespace ember::dist::detail {

namespace {

inline float to_f(uint16_t h) { return ember::detail::f16_bits_to_f32(h); }
inline uint16_t to_h(float f) { return ember::detail::f32_to_f16_bits(f); }

#ifdef EMBER_HALF_F16C
// Eight at a time with F16C; the tail in the scalar conversions (the same bits).
#define EMBER_F16C __attribute__((target("avx2,f16c")))
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

EMBER_F16C inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
EMBER_F16C inline void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRound));
}

EMBER_F16C void sum_f16c(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(c + i, _mm256_add_ps(load8(a + i), load8(b + i)));
  for (; i < n; ++i) c[i] = to_h(to_f(a[i]) + to_f(b[i]));
}

EMBER_F16C void divide_f16c(uint16_t* x, size_t n, float d) {
  const __m256 vd = _mm256_set1_ps(d);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store8(x + i, _mm256_div_ps(load8(x + i), vd));
  for (; i < n; ++i) x[i] = to_h(to_f(x[i]) / d);
}

EMBER_F16C void float_to_half_divided_f16c(const float* x, uint16_t* out, size_t n, float d) {
  const __m256 vd = _mm256_set1_ps(d);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), kRound);  // the cast
    store8(out + i, _mm256_div_ps(_mm256_cvtph_ps(h), vd));             // the division
  }
  for (; i < n; ++i) out[i] = to_h(to_f(to_h(x[i])) / d);
}

EMBER_F16C void half_to_float_f16c(const uint16_t* x, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(x + i));
  for (; i < n; ++i) out[i] = to_f(x[i]);
}

bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

}  // namespace

void half_sum(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
#ifdef EMBER_HALF_F16C
  if (has_f16c()) return sum_f16c(c, a, b, n);
#endif
  for (size_t i = 0; i < n; ++i) c[i] = to_h(to_f(a[i]) + to_f(b[i]));
}

void half_divide(uint16_t* x, size_t n, float d) {
#ifdef EMBER_HALF_F16C
  if (has_f16c()) return divide_f16c(x, n, d);
#endif
  for (size_t i = 0; i < n; ++i) x[i] = to_h(to_f(x[i]) / d);
}

void float_to_half_divided(const float* x, uint16_t* out, size_t n, float d) {
#ifdef EMBER_HALF_F16C
  if (has_f16c()) return float_to_half_divided_f16c(x, out, n, d);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = to_h(to_f(to_h(x[i])) / d);
}

void half_to_float(const uint16_t* x, float* out, size_t n) {
#ifdef EMBER_HALF_F16C
  if (has_f16c()) return half_to_float_f16c(x, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = to_f(x[i]);
}

}  // namespace ember::dist::detail
