// Scalar: a number passed to an op (add(t, 2), clamp(t, 0.0, 6.0), full(..., true)).
// Remembers whether it was bool, integral or floating, because that decides type promotion.
#pragma once

#include <cstdint>
#include <ostream>
#include <type_traits>

#include <ember/tensor/dtype.h>

namespace ember {

class Scalar {
 public:
  Scalar() : kind_(ScalarKind::Integral), i_(0) {}
  Scalar(bool v) : kind_(ScalarKind::Bool), i_(v) {}  // NOLINT
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Scalar(T v) : kind_(ScalarKind::Integral), i_(static_cast<int64_t>(v)) {}  // NOLINT
  template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  Scalar(T v) : kind_(ScalarKind::Floating), d_(static_cast<double>(v)) {}  // NOLINT
  Scalar(Half v) : Scalar(static_cast<float>(v)) {}                   // NOLINT
  Scalar(BFloat16 v) : Scalar(static_cast<float>(v)) {}               // NOLINT

  ScalarKind kind() const { return kind_; }
  bool is_floating() const { return kind_ == ScalarKind::Floating; }
  double to_double() const { return kind_ == ScalarKind::Floating ? d_ : static_cast<double>(i_); }
  int64_t to_int() const { return kind_ == ScalarKind::Floating ? static_cast<int64_t>(d_) : i_; }
  /// The value converted to the element type T (bool: nonzero).
  template <typename T> T to() const {
    if constexpr (std::is_same_v<T, bool>) {
      return kind_ == ScalarKind::Floating ? d_ != 0.0 : i_ != 0;
    } else if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(to_int());
    } else {
      return T(to_double());
    }
  }
  /// The dtype PyTorch gives a tensor made from this scalar alone (bool, int64 or float32).
  Dtype default_dtype() const {
    return kind_ == ScalarKind::Bool ? kBool : kind_ == ScalarKind::Integral ? kInt64 : kDefaultFloat;
  }

 private:
  ScalarKind kind_;
  union {
    int64_t i_;
    double d_;
  };
};

std::ostream& operator<<(std::ostream& os, const Scalar& s);

}  // namespace ember
