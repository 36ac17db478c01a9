#include <ember/nn/layers/layer_utils.h>

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace ember::nn {

std::string Size2::str() const {
  return scalar ? std::to_string(value[0]) : detail::repr_pair(value);
}

}  // namespace ember::nn

namespace ember::detail {

std::string repr_pair(const Pair& p) {
  std::string s = "(";
  s.append(std::to_string(p[0])).append(", ").append(std::to_string(p[1])).append(")");
  return s;
}

// Python's float repr: the shortest digits that round-trip, written in fixed notation when the
// decimal exponent is in [-4, 16) (always with a fractional part) and in scientific notation
// with at least two exponent digits otherwise. (Built with append: GCC 12 warns falsely,
// -Wrestrict, on chains of std::string operator+.)
std::string repr_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  const std::string s(buf, res.ptr);  // e.g. "-1.2345e-05"
  const size_t e = s.find('e');
  std::string out;
  if (s[0] == '-') out.push_back('-');
  std::string digits;
  for (size_t i = out.size(); i < e; ++i) {
    if (s[i] != '.') digits.push_back(s[i]);
  }
  const int exp = std::atoi(s.c_str() + e + 1);
  const int n = static_cast<int>(digits.size());
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (n <= exp + 1) {
        out.append(digits).append(exp + 1 - n, '0').append(".0");
      } else {
        out.append(digits, 0, exp + 1).append(".").append(digits, exp + 1);
      }
    } else {
      out.append("0.").append(-exp - 1, '0').append(digits);
    }
    return out;
  }
  out.push_back(digits[0]);
  if (n > 1) out.append(".").append(digits, 1);
  const int a = std::abs(exp);
  out.append(exp < 0 ? "e-" : "e+");
  if (a < 10) out.push_back('0');
  out.append(std::to_string(a));
  return out;
}

}  // namespace ember::detail
