// Shared helpers for the autograd tests.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include <ember/autograd/autograd.h>
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

inline std::string name_of(const Tensor& t) {
  return t.grad_fn() ? t.grad_fn()->name() : "(none)";
}

/// True when input i of t's grad_fn comes straight from a leaf (no intermediate node recorded).
inline bool edge_is_leaf(const Tensor& t, size_t i) {
  const auto& e = t.grad_fn()->next_edge(i);
  return e.valid() && std::string(e.fn->name()) == "AccumulateGrad";
}

/// A function of float64 inputs of the given shapes, for expect_cuda_grads_match_cpu.
struct GradCase {
  const char* name;
  std::vector<Shape> shapes;
  std::function<Tensor(const std::vector<Tensor>&)> f;
};

/// The gradients of f(inputs) weighted by go, computed on `dev` and returned on the CPU.
inline std::vector<Tensor> grads_on(const GradCase& c, const std::vector<Tensor>& inputs,
                                    Device dev, const Tensor& go) {
  std::vector<Tensor> in;
  for (const Tensor& t : inputs) in.push_back(t.to(dev).detach().requires_grad_());
  c.f(in).backward(go.to(dev));
  std::vector<Tensor> g;
  for (const Tensor& t : in) {
    EXPECT_EQ(t.grad().device(), dev);
    g.push_back(t.grad().cpu());
  }
  return g;
}

/// Each case's gradients on CUDA device 0 equal the CPU ones (random float64 inputs).
template <typename Cases>
void expect_cuda_grads_match_cpu(const Cases& cases) {
  uint64_t seed = 1;
  for (const GradCase& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<Tensor> inputs;
    for (const Shape& s : c.shapes) inputs.push_back(rand_t(s, kFloat64, seed++));
    const Tensor go = rand_t(c.f(inputs).shape(), kFloat64, seed++);
    const auto want = grads_on(c, inputs, kCPU, go);
    const auto got = grads_on(c, inputs, cuda_device(0), go);
    for (size_t i = 0; i < want.size(); ++i) {
      expect_close(got[i], want[i].to_vector<double>(), 1e-10,
                   std::string(c.name) + " cuda grad of input " + std::to_string(i));
    }
  }
}

}  // namespace ember::test
