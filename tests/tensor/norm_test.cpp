// layer_norm's front end (tensor/ops/norm.h): values against the closed form on the fused kernels'
// path and on the tensor-op path, and its errors. Gradients are checked where nn tests its
// LayerNorm layer (tests/nn/layers_test.cpp), which is this op.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <ember/tensor/detail/norm_kernels.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/threading.h>
#include "test_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;

// Rows of x normalised with the biased variance, then * w + b (per position of the row).
std::vector<double> closed_form(const std::vector<double>& x, int64_t row, double eps,
                                const std::vector<double>& w, const std::vector<double>& b) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / row; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < row; ++i) mean += x[r * row + i] / row;
    for (int64_t i = 0; i < row; ++i) var += std::pow(x[r * row + i] - mean, 2) / row;
    for (int64_t i = 0; i < row; ++i) {
      const double xhat = (x[r * row + i] - mean) / std::sqrt(var + eps);
      y[r * row + i] = xhat * (w.empty() ? 1.0 : w[i]) + (b.empty() ? 0.0 : b[i]);
    }
  }
  return y;
}

TEST(LayerNorm, MatchesTheClosedFormOnBothPaths) {
  const Tensor x = test::rand_t({4, 2, 3}, kFloat64, 1) * 3.0;
  const Tensor w = test::rand_t({2, 3}, kFloat64, 2), b = test::rand_t({2, 3}, kFloat64, 3);
  const auto want = closed_form(x.to_vector<double>(), 6, 1e-5, w.to_vector<double>(),
                                b.to_vector<double>());
  for (Dtype dt : {kFloat32, kFloat64}) {
    const double tol = dt == kFloat32 ? 1e-5 : 1e-13;
    // Contiguous: the fused row kernels. Strided: the tensor-op path.
    expect_close(layer_norm(x.to(dt), {2, 3}, w.to(dt), b.to(dt)), want, tol, "fused");
    const Tensor strided = x.to(dt).transpose(0, 1).contiguous().transpose(0, 1);
    ASSERT_FALSE(strided.is_contiguous());
    expect_close(layer_norm(strided, {2, 3}, w.to(dt), b.to(dt)), want, tol, "tensor ops");
  }
  // Without affine parameters, eps given; float16 runs the tensor-op path.
  const auto plain = closed_form(x.to_vector<double>(), 3, 0.1, {}, {});
  expect_close(layer_norm(x, {3}, {}, {}, 0.1), plain, 1e-13, "no affine");
  expect_close(layer_norm(x.to(kFloat16), {3}, {}, {}, 0.1), plain, 1e-2, "float16");
  EXPECT_EQ(layer_norm(x.to(kFloat16), {3}).dtype(), kFloat16);
}

// The weight's and bias's gradients sum over rows in chunks of threads: merged in the order the
// threads finished, their last bits changed from run to run (float64, whose sums are the
// outputs; float32's are rounded from them). Now bitwise the same every time.
TEST(LayerNorm, ParameterGradientsAreTheSameEveryRun) {
  const int64_t rows = 4096, n = 64;  // 8 chunks of the 512-row grain
  const Tensor x = test::rand_t({rows, n}, kFloat64, 4) * 3.0;
  const Tensor w = test::rand_t({n}, kFloat64, 5), b = test::rand_t({n}, kFloat64, 6);
  const Tensor dy = test::rand_t({rows, n}, kFloat64, 7);
  Tensor y = empty({rows, n}, kFloat64), mean = empty({rows}, kFloat64),
         rstd = empty({rows}, kFloat64);
  detail::layer_norm_forward_cpu(x, w, b, 1e-5, y, mean, rstd);
  // Eight threads, so eight partial sums (two would add the same either way round).
  const int saved = get_num_threads();
  set_num_threads(8);
  struct Restore {
    int n;
    ~Restore() { set_num_threads(n); }
  } restore{saved};
  std::vector<double> first_w, first_b;
  for (int run = 0; run < 20; ++run) {
    Tensor dw = empty({n}, kFloat64), db = empty({n}, kFloat64);
    detail::layer_norm_backward_cpu(dy, x, mean, rstd, w, Tensor(), dw, db);
    if (run == 0) {
      first_w = dw.to_vector<double>();
      first_b = db.to_vector<double>();
      continue;
    }
    ASSERT_EQ(dw.to_vector<double>(), first_w) << "run " << run;
    ASSERT_EQ(db.to_vector<double>(), first_b) << "run " << run;
  }
}

TEST(LayerNorm, ErrorsNameTheOpWhatWasExpectedAndWhatWasGot) {
  const Tensor x = ones({2, 5, 4});
  expect_error<TypeError>([] { layer_norm(ones({2, 3}, kInt64), {3}); },
                          {"[layer_norm]", "floating-point input", "int64"});
  expect_error([&] { layer_norm(x, {}); }, {"[layer_norm]", "non-empty normalized_shape"});
  expect_error([&] { layer_norm(x, {4, 5}); }, {"[layer_norm]", "[*, 4, 5]", "[2, 5, 4]"});
  expect_error([&] { layer_norm(ones({3}), {2, 3}); }, {"[layer_norm]", "[*, 2, 3]", "[3]"});
  expect_error([&] { layer_norm(x, {5, 4}, ones({4})); },
               {"[layer_norm]", "weight of shape [5, 4]", "got [4]"});
  expect_error([&] { layer_norm(x, {4}, ones({4}), ones({5})); },
               {"[layer_norm]", "bias of shape [4]", "got [5]"});
  expect_error([] { layer_norm(Tensor(), {3}); }, {"layer_norm", "input"});
  if (cuda::is_available()) {
    expect_error([&] { layer_norm(x, {4}, ones({4}).to(Device("cuda"))); },
                 {"[layer_norm]", "weight on cpu", "cuda"});
  }
}

}  // namespace
}  // namespace ember
