// Helpers shared by the element-wise op tests (elementwise_test.cpp, elementwise_unary_test.cpp,
// elementwise_cuda_test.cpp): value checks against closed forms with NaN/Inf handled, tensors
// built from index functions, and per-dtype tolerances and casts.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include <ember/tensor/ops.h>

namespace ember::test {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline bool same_value(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

/// Checks every element of t (as double) against want; prints the index and both values.
inline void expect_values(const Tensor& t, const std::vector<double>& want, double tol = 0) {
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size())) << "shape " << t.shape();
  const std::vector<double> got = t.to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(same_value(got[i], want[i], tol))
        << "index " << i << ": got " << got[i] << ", want " << want[i] << " (dtype " << t.dtype()
        << ")";
  }
}

/// A float64 tensor of shape with values f(i) at row-major index i.
inline Tensor make(IntList shape, const std::function<double(int64_t)>& f, Dtype dt = kFloat64) {
  std::vector<double> v(Shape(shape).numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = f(static_cast<int64_t>(i));
  return from_vector(v, shape).to(dt);
}

/// Every dtype the element-wise ops take.
inline const Dtype kAllDtypes[] = {kBool,    kUInt8,    kInt32,   kInt64,
                                   kFloat16, kBFloat16, kFloat32, kFloat64};

inline double tol_for(Dtype dt) {
  switch (dt) {
    case kFloat16: return 1e-3;
    case kBFloat16: return 8e-3;
    case kFloat32: return 1e-6;
    case kFloat64: return 1e-14;
    default: return 0;
  }
}

/// Reference value of an integer/float result after a cast to dt (wraps for uint8).
inline double cast_to(double v, Dtype dt) {
  switch (dt) {
    case kBool: return v != 0;
    case kUInt8: return static_cast<double>(static_cast<uint8_t>(static_cast<int64_t>(v)));
    case kInt32: return static_cast<double>(static_cast<int32_t>(v));
    case kInt64: return static_cast<double>(static_cast<int64_t>(v));
    case kFloat16: return static_cast<float>(Half(static_cast<float>(v)));
    case kBFloat16: return static_cast<float>(BFloat16(static_cast<float>(v)));
    case kFloat32: return static_cast<float>(v);
    default: return v;
  }
}

}  // namespace ember::test
