// Shared helpers for the autograd tests.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "autograd/autograd.h"
#include "tests/tensor/test_util.h"

namespace ember::test {

/// A float64 leaf that requires grad, filled with lcg_values (values in [-1, 1)).
inline Tensor leaf(IntList shape, uint64_t seed, Dtype dtype = kFloat64) {
  Tensor t = rand_t(shape, dtype, seed);
  t.requires_grad_();
  return t;
}

/// A non-contiguous float64 leaf of `shape` (at least 2 dims): the transpose of a contiguous
/// tensor with the last two dims swapped.
inline Tensor noncontig_leaf(IntList shape, uint64_t seed) {
  Shape s(shape);
  const int64_t n = s.size();
  std::swap(s[n - 1], s[n - 2]);
  Tensor t = rand_t(s, kFloat64, seed).transpose(n - 1, n - 2);
  t.requires_grad_();
  return t;
}

/// Runs gradcheck and reports its message on failure.
inline void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                             const std::vector<Tensor>& inputs,
                             const autograd::GradcheckOptions& opts = {}) {
  const autograd::GradcheckResult r = autograd::gradcheck(fn, inputs, opts);
  EXPECT_TRUE(r.ok) << r.message;
}

inline void expect_gradcheck(const autograd::GradcheckFn& fn, const std::vector<Tensor>& inputs,
                             const autograd::GradcheckOptions& opts = {}) {
  const autograd::GradcheckResult r = autograd::gradcheck(fn, inputs, opts);
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace ember::test
