// nn::functional::batch_norm's fused CPU path (Note [BatchNorm as one op] in tensor/ops/norm.cpp)
// against its tensor-op path on the same values: outputs, every gradient and the running
// statistics, training and evaluation, with and without weight and bias, float32 and float64;
// gradcheck of the fused op, and its double backward. BatchNorm's values against PyTorch's are
// in layers_test.cpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/autograd/autograd.h>
#include <ember/nn/functional.h>
#include "tests/autograd/grad_util.h"

namespace ember::nn {
namespace {

namespace F = functional;
using test::expect_close;
using test::expect_gradcheck;
using test::rand_t;

// The same values as x, not contiguous: the last two dims stored swapped, which the fused path
// does not take.
Tensor strided_copy(const Tensor& x) {
  const int64_t n = x.dim();
  return x.transpose(n - 1, n - 2).contiguous().transpose(n - 1, n - 2);
}

struct Outcome {
  Tensor y, dx, dweight, dbias, running_mean, running_var;
  std::string node;
};

Outcome run(const Tensor& values, bool contiguous, bool training, bool affine, Dtype dtype) {
  const int64_t c = values.size(1);
  Tensor x = contiguous ? values.clone() : strided_copy(values);
  x.requires_grad_();
  Tensor w, b;
  if (affine) {
    w = (rand_t({c}, dtype, 7) + 1.5).requires_grad_();
    b = rand_t({c}, dtype, 8).requires_grad_();
  }
  Outcome r;
  r.running_mean = rand_t({c}, dtype, 9);
  r.running_var = rand_t({c}, dtype, 10) + 2.0;
  r.y = F::batch_norm(x, r.running_mean, r.running_var, w, b, training, 0.1, 1e-5);
  r.node = r.y.grad_fn()->name();
  // A loss whose gradient is not the same everywhere.
  (r.y * rand_t(values.shape(), dtype, 11)).sum().backward();
  r.dx = x.grad();
  if (affine) {
    r.dweight = w.grad();
    r.dbias = b.grad();
  }
  return r;
}

TEST(BatchNormFused, MatchesTheTensorOpPath) {
  for (Dtype dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 2e-5 : 1e-12;
    // Runs of 42 and of 16 (the shortest the fused path takes), 1-d and 2-d spatial dims.
    for (const Shape& shape : {Shape{4, 3, 6, 7}, Shape{5, 2, 16}}) {
      const Tensor values = rand_t(shape, dtype, 1) * 3.0 + 0.5;
      for (bool training : {true, false}) {
        for (bool affine : {true, false}) {
          const std::string what = std::string(dtype_name(dtype)) + " " +
                                   ::testing::PrintToString(shape) +
                                   (training ? " training" : " eval") + (affine ? " affine" : "");
          const Outcome fused = run(values, true, training, affine, dtype);
          const Outcome ops = run(values, false, training, affine, dtype);
          EXPECT_EQ(fused.node, "BatchNormBackward") << what;
          EXPECT_NE(ops.node, "BatchNormBackward") << what;
          expect_close(fused.y, ops.y.to_vector<double>(), tol, what + " y");
          expect_close(fused.dx, ops.dx.to_vector<double>(), tol, what + " dx");
          if (affine) {
            expect_close(fused.dweight, ops.dweight.to_vector<double>(), tol, what + " dweight");
            expect_close(fused.dbias, ops.dbias.to_vector<double>(), tol, what + " dbias");
          }
          expect_close(fused.running_mean, ops.running_mean.to_vector<double>(), tol,
                       what + " running_mean");
          expect_close(fused.running_var, ops.running_var.to_vector<double>(), tol,
                       what + " running_var");
        }
      }
    }
  }
}

TEST(BatchNormFused, Gradcheck) {
  const Tensor rm = rand_t({3}, kFloat64, 3), rv = rand_t({3}, kFloat64, 4) + 2.0;
  for (bool training : {true, false}) {
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          Tensor m = rm.clone(), v = rv.clone();
          return F::batch_norm(in[0], m, v, in[1], in[2], training, 0.1, 1e-5);
        },
        {test::leaf({2, 3, 4, 5}, 1), test::leaf({3}, 2), test::leaf({3}, 5)});
  }
}

// Under create_graph backward is recorded tensor ops, the batch statistics recomputed from x:
// the gradient of dx is right too.
TEST(BatchNormFused, DoubleBackward) {
  for (bool training : {true, false}) {
    expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          // gradcheck's finite differences call this without inputs that require grad.
          const EnableGradGuard grad_on;
          const Tensor x = in[0].requires_grad() ? in[0] : in[0].detach().requires_grad_();
          Tensor m = zeros({3}, kFloat64), v = ones({3}, kFloat64);
          const Tensor y = F::batch_norm(x, m, v, in[1], {}, training, 0.1, 1e-5);
          const Tensor loss = (y * y * y).sum();
          return autograd::grad({loss}, {x}, {}, true, /*create_graph=*/true)[0];
        },
        {test::leaf({2, 3, 4, 5}, 6), test::leaf({3}, 7)});
  }
}

}  // namespace
}  // namespace ember::nn
