// 16-bit floating-point storage types: Half (IEEE binary16) and BFloat16. Both convert to and
// from float exactly as CUDA's __half/__nv_bfloat16 do (round to nearest even), on host and
// device, so CPU tests check the same bits the GPU produces. Arithmetic happens in float.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define EMBER_HD __host__ __device__
#else
#define EMBER_HD
#endif

namespace ember {

namespace detail {
EMBER_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
EMBER_HD inline float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

EMBER_HD inline uint16_t f32_to_f16_bits(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                                // subnormal or zero
    // Scale into the subnormal range with float arithmetic, which rounds to nearest even.
    float a = bits_f32(abs) + 0.5f;  // 0.5 = 2^-1: aligns 2^-24 units to the mantissa's LSB
    return static_cast<uint16_t>(sign | (f32_bits(a) - 0x3f000000u));
  }
  uint32_t mant_odd = (abs >> 13) & 1u;
  abs += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (abs >> 13));
}

EMBER_HD inline float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

EMBER_HD inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}
EMBER_HD inline float bf16_bits_to_f32(uint16_t b) {
  return bits_f32(static_cast<uint32_t>(b) << 16);
}
}  // namespace detail

/// IEEE 754 binary16. Storage type: converts implicitly to float for arithmetic.
struct alignas(2) Half {
  uint16_t x = 0;
  Half() = default;
  EMBER_HD Half(float f) : x(detail::f32_to_f16_bits(f)) {}  // NOLINT: implicit like __half
  EMBER_HD Half(double d) : Half(static_cast<float>(d)) {}
  EMBER_HD Half(int v) : Half(static_cast<float>(v)) {}
  EMBER_HD Half(int64_t v) : Half(static_cast<float>(v)) {}
  EMBER_HD operator float() const { return detail::f16_bits_to_f32(x); }
  EMBER_HD static Half from_bits(uint16_t b) {
    Half h;
    h.x = b;
    return h;
  }
};

/// bfloat16: float32's exponent with a 7-bit mantissa. Storage type like Half.
struct alignas(2) BFloat16 {
  uint16_t x = 0;
  BFloat16() = default;
  EMBER_HD BFloat16(float f) : x(detail::f32_to_bf16_bits(f)) {}  // NOLINT
  EMBER_HD BFloat16(double d) : BFloat16(static_cast<float>(d)) {}
  EMBER_HD BFloat16(int v) : BFloat16(static_cast<float>(v)) {}
  EMBER_HD BFloat16(int64_t v) : BFloat16(static_cast<float>(v)) {}
  EMBER_HD operator float() const { return detail::bf16_bits_to_f32(x); }
  EMBER_HD static BFloat16 from_bits(uint16_t b) {
    BFloat16 h;
    h.x = b;
    return h;
  }
};

/// The type arithmetic on T is done in: float for the 16-bit floats, T otherwise.
template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
template <> struct AccType<BFloat16> { using type = float; };
template <typename T> using acc_t = typename AccType<T>::type;

}  // namespace ember

#include <type_traits>

namespace ember::detail {
template <typename T>
inline constexpr bool is_reduced_float_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

/// Converts one element between any two of Ember's element types, as a dtype cast does:
/// 16-bit floats go through float, anything to bool tests for nonzero.
template <typename To, typename From>
EMBER_HD inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_reduced_float_v<From>) {
    return convert<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (is_reduced_float_v<To>) {
    return To(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}
}  // namespace ember::detail
