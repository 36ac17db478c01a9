// Small pieces the layers share: Size2 (a kernel size, stride, ... given as one int or as a
// (height, width) pair) and PyTorch-style repr formatting for extra_repr().
#pragma once

#include <cstdint>
#include <string>

#include <ember/tensor/ops/conv.h>

namespace ember::nn {

/// A 2-d size parameter given as one value for both dims (`3`) or as a pair (`{3, 5}`). It
/// remembers which, so extra_repr() prints it as the user wrote it ("2" or "(3, 5)"), as
/// PyTorch prints pooling options.
struct Size2 {
  Pair value{0, 0};
  bool scalar = true;

  Size2(int64_t v) : value{v, v}, scalar(true) {}  // NOLINT: implicit, so `3` works
  Size2(int64_t h, int64_t w) : value{h, w}, scalar(false) {}
  Size2(Pair p) : value(p), scalar(false) {}  // NOLINT
  int64_t h() const { return value[0]; }
  int64_t w() const { return value[1]; }
  /// "2" when given as one value, else "(2, 3)".
  std::string str() const;
};

}  // namespace ember::nn

// In ember::detail (not ember::nn::detail, which would hide ember::detail from code in ember::nn).
namespace ember::detail {
/// A double as Python's repr() writes it: "0.1", "1e-05", "1.0".
std::string repr_double(double v);
/// "true" / "false".
inline const char* repr_bool(bool b) { return b ? "true" : "false"; }
/// A pair as a Python tuple: "(3, 3)".
std::string repr_pair(const Pair& p);
}  // namespace ember::detail
