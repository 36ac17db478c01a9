// The float16 loops (distributed/detail/half_kernels.h) against Half's scalar conversions: the
// same bits for every float16 value, and for floats around every float16 boundary (rounding
// ties, subnormals, the overflow threshold), at lengths that leave a tail after the 8-wide loop.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <ember/distributed/detail/half_kernels.h>
#include <ember/tensor/half.h>

namespace ember::dist::detail {
namespace {

float to_f(uint16_t h) { return ember::detail::f16_bits_to_f32(h); }
uint16_t to_h(float f) { return ember::detail::f32_to_f16_bits(f); }

// Equal bits, or both NaN (a NaN's payload may differ between the versions).
::testing::AssertionResult same_half(uint16_t got, uint16_t want) {
  if (got == want || (std::isnan(to_f(got)) && std::isnan(to_f(want)))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got 0x" << std::hex << got << ", want 0x" << want;
}

std::vector<uint16_t> every_half() {
  std::vector<uint16_t> v(65536 + 5);  // + 5: a tail after the 8-wide loop
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

// Floats at and beside float16's boundaries: every float16 value, the midpoints between
// neighbours (ties to even), a float either side of each midpoint, and specials.
std::vector<float> boundary_floats() {
  std::vector<float> v;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    for (float sign : {1.0f, -1.0f}) {
      const float a = to_f(static_cast<uint16_t>(h)), b = to_f(static_cast<uint16_t>(h + 1));
      const float mid = a + (b - a) / 2;
      v.insert(v.end(), {sign * a, sign * mid, sign * std::nextafter(mid, 0.0f),
                         sign * std::nextafter(mid, 1e9f)});
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  v.insert(v.end(), {65504.0f, 65519.99f, 65520.0f, 1e9f, inf, -inf,
                     std::numeric_limits<float>::quiet_NaN(), 1e-30f, -1e-30f, 0.0f, -0.0f});
  v.push_back(3.0f);  // an odd length
  return v;
}

TEST(HalfKernels, HalfToFloatIsExactForEveryValue) {
  const std::vector<uint16_t> h = every_half();
  std::vector<float> got(h.size());
  half_to_float(h.data(), got.data(), h.size());
  for (size_t i = 0; i < h.size(); ++i) {
    const float want = to_f(h[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      uint32_t g, w;
      std::memcpy(&g, &got[i], 4);
      std::memcpy(&w, &want, 4);
      ASSERT_EQ(g, w) << "float16 0x" << std::hex << h[i];
    }
  }
}

TEST(HalfKernels, SumEqualsTheScalarSumForEveryValue) {
  const std::vector<uint16_t> a = every_half();
  for (const float other : {0.0f, 1.0f, -3.5f, 0.000061f, 65504.0f, 1e-7f}) {
    std::vector<uint16_t> b(a.size(), to_h(other)), c(a.size());
    half_sum(c.data(), a.data(), b.data(), a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(same_half(c[i], to_h(to_f(a[i]) + to_f(b[i])))) << "a 0x" << std::hex << a[i];
    }
  }
  // In place, as the collectives call it (c is a).
  std::vector<uint16_t> x = a, y(a.size(), to_h(2.0f));
  half_sum(x.data(), x.data(), y.data(), x.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(same_half(x[i], to_h(to_f(a[i]) + 2.0f)));
}

TEST(HalfKernels, DivideEqualsTheScalarDivisionForEveryValue) {
  for (const float d : {2.0f, 3.0f, 7.0f}) {
    std::vector<uint16_t> x = every_half();
    half_divide(x.data(), x.size(), d);
    for (size_t i = 0; i < x.size(); ++i) {
      const auto h = static_cast<uint16_t>(i);
      ASSERT_TRUE(same_half(x[i], to_h(to_f(h) / d))) << "0x" << std::hex << h << " / " << d;
    }
  }
}

TEST(HalfKernels, CastAndDivideIsTheCastThenTheDivision) {
  const std::vector<float> x = boundary_floats();
  for (const float d : {1.0f, 3.0f, 4.0f}) {
    std::vector<uint16_t> got(x.size());
    float_to_half_divided(x.data(), got.data(), x.size(), d);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(same_half(got[i], to_h(to_f(to_h(x[i])) / d))) << x[i] << " / " << d;
    }
  }
}

}  // namespace
}  // namespace ember::dist::detail
