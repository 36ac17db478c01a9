// Helpers shared by the tensor tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <ember/tensor/ops.h>

namespace ember::test {

/// Expects f() to throw E whose message contains every one of parts (op name, shapes, ...).
template <typename E = ember::Error, typename F>
void expect_error(F&& f, std::initializer_list<std::string_view> parts) {
  try {
    f();
    ADD_FAILURE() << "expected an exception mentioning '" << (parts.size() ? *parts.begin() : "")
                  << "'";
  } catch (const E& e) {
    const std::string msg = e.what();
    for (std::string_view p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
    }
  }
}

/// Expects got (any dtype) to equal want element-wise within tol * (1 + |want|), naming the first
/// differing index and both values.
inline void expect_close(const Tensor& got, const std::vector<double>& want, double tol,
                         const std::string& what) {
  std::vector<double> g = got.to_vector<double>();
  ASSERT_EQ(g.size(), want.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], want[i], tol * (1 + std::fabs(want[i])))
        << what << ": index " << i << " got " << g[i] << " want " << want[i];
  }
}

/// Deterministic values in [-1, 1), multiples of 2^-19, independent of Ember's own generator.
inline std::vector<double> lcg_values(int64_t n, uint64_t seed) {
  std::vector<double> v(n);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<double>((s >> 11) & ((1ull << 20) - 1)) / (1 << 19) - 1.0;
  }
  return v;
}

/// A tensor of `shape` and `dtype` filled with lcg_values.
inline Tensor rand_t(IntList shape, Dtype dtype, uint64_t seed) {
  Shape s(shape);
  return from_vector(lcg_values(s.numel(), seed)).reshape(shape).to(dtype);
}

}  // namespace ember::test
