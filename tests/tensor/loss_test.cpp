// nll_loss and cross_entropy's front ends (tensor/ops/loss.h): values against closed forms, the
// fused 2-d cross_entropy against the composite path, and their errors. Gradients and the
// options are tested where nn tests its losses (tests/nn/loss_test.cpp), which are these ops.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <ember/tensor/ops.h>
#include "test_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;

TEST(Loss, CrossEntropyAndNllMatchTheClosedForm) {
  // loss_i = w[t_i] * (logsumexp(x_i) - x_i[t_i]); mean divides by the summed w[t_i] counted.
  const std::vector<double> xv = {0.5, -1.0, 2.0, 0.0, 3.0, -2.0, 1.0, 1.0, 1.0};
  const Tensor x = from_vector(xv).reshape({3, 3});
  const Tensor t = tensor({2, 0, -100});
  const Tensor w = from_vector(std::vector<double>{0.5, 2.0, 1.5});
  std::vector<double> per_row;
  double total = 0, weights = 0;
  for (int64_t i = 0; i < 2; ++i) {
    double lse = 0;
    for (int64_t c = 0; c < 3; ++c) lse += std::exp(xv[i * 3 + c]);
    const int64_t ti = i == 0 ? 2 : 0;
    const double wi = ti == 2 ? 1.5 : 0.5;
    per_row.push_back(wi * (std::log(lse) - xv[i * 3 + ti]));
    total += per_row.back();
    weights += wi;
  }
  per_row.push_back(0);  // ignored
  for (const Tensor& in : {x, x.t().contiguous().t()}) {  // the fused op takes both layouts
    expect_close(cross_entropy(in, t, w, -100, Reduction::kNone, 0), per_row, 1e-15, "none");
    expect_close(cross_entropy(in, t, w, -100, Reduction::kSum, 0), {total}, 1e-15, "sum");
    expect_close(cross_entropy(in, t, w, -100, Reduction::kMean, 0), {total / weights}, 1e-15,
                 "mean");
  }
  // The composite path ([N, C, 1]) and nll_loss of log_softmax give the same.
  for (Reduction r : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    for (double ls : {0.0, 0.3}) {
      const Tensor fused = cross_entropy(x, t, w, -100, r, ls);
      const Tensor composite =
          cross_entropy(x.unsqueeze(2), t.unsqueeze(1), w, -100, r, ls).reshape(fused.shape());
      expect_close(fused, composite.to_vector<double>(), 1e-14, "fused vs composite");
    }
    expect_close(nll_loss(log_softmax(x, 1), t, w, -100, r),
                 cross_entropy(x, t, w, -100, r, 0).to_vector<double>(), 1e-14, "nll_loss");
  }
  EXPECT_EQ(reduce_loss(x, Reduction::kMean).item<double>(), x.mean().item<double>());
}

TEST(Loss, ErrorsNameTheOpWhatWasExpectedAndWhatWasGot) {
  const Tensor x = ones({3, 4});
  const Reduction m = Reduction::kMean;
  expect_error<TypeError>([&] { cross_entropy(x, tensor({1, 2, 3}).to(kInt32), {}, -100, m, 0); },
                          {"[cross_entropy]", "int64", "int32"});
  expect_error([&] { cross_entropy(x, tensor({1, 2}), {}, -100, m, 0); },
               {"[cross_entropy]", "target of shape [3]", "[3, 4]", "got [2]"});
  expect_error<IndexError>([&] { cross_entropy(x, tensor({1, 4, 0}), {}, -100, m, 0); },
                           {"[cross_entropy]", "target 4", "flat index 1", "[0, 4)"});
  expect_error([&] { cross_entropy(x, tensor({1, 2, 3}), ones({3}), -100, m, 0); },
               {"[cross_entropy]", "weight", "[4]", "[3]"});
  expect_error([&] { cross_entropy(x, tensor({1, 2, 3}), {}, -100, m, 1.5); },
               {"[cross_entropy]", "label_smoothing", "1.5"});
  expect_error([&] { cross_entropy(x, ones({3, 3}), {}, -100, m, 0); },
               {"[cross_entropy]", "probabilities", "[3, 4]", "[3, 3]"});
  expect_error([&] { cross_entropy(x, ones({3, 4}), {}, 0, m, 0); },
               {"[cross_entropy]", "ignore_index", "0"});
  expect_error<TypeError>([&] { cross_entropy(tensor({1, 2}), tensor({0}), {}, -100, m, 0); },
                          {"[cross_entropy]", "floating", "int64"});
  expect_error<IndexError>([&] { nll_loss(x, tensor({-1, 0, 0}), {}, -100, m); },
                           {"[nll_loss]", "target -1", "ignore_index (-100)"});
  expect_error<TypeError>([&] { nll_loss(x, tensor({0, 0, 0}), ones({4}, kInt64), -100, m); },
                          {"[nll_loss]", "floating-point weight", "int64"});
}

}  // namespace
}  // namespace ember
