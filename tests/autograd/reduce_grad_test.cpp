// Backward rules of the reductions and softmax (autograd/functions_reduce.cpp): gradcheck over
// dims / keepdim / non-contiguous inputs, PyTorch's values and subgradient conventions (ties,
// zeros), double backward, single recording, float32 and CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ember/tensor/detail/record.h>
#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::leaf;
using test::noncontig_leaf;
using Fn = std::function<Tensor(const Tensor&)>;

/// gradcheck of f at x, failures naming `what`.
void check(const std::string& what, const Fn& f, const Tensor& x,
           const autograd::GradcheckOptions& opts = {}) {
  SCOPED_TRACE(what);
  test::expect_gradcheck([&](const std::vector<Tensor>& in) { return f(in[0]); }, {x}, opts);
}

/// gradcheck of x -> d(sum(w * f(x)))/dx with create_graph, i.e. of the second derivative.
void check_double(const std::string& what, const Fn& f, const Tensor& x) {
  SCOPED_TRACE(what + " (double backward)");
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        EnableGradGuard enable;  // gradcheck evaluates under NoGradGuard
        const Tensor y = f(in[0]);
        const Tensor w = mul(arange(1, y.numel() + 1, 1, kFloat64).reshape(y.shape()), 0.25);
        return autograd::grad({(y * w).sum()}, {in[0]}, {}, std::nullopt, true)[0];
      },
      {x});
}

/// A float64 leaf of `shape` with values `v`.
Tensor leaf_of(const std::vector<double>& v, IntList shape) {
  Tensor t = from_vector(v).reshape(shape);
  t.requires_grad_();
  return t;
}

/// A float64 leaf with lcg values pushed at least 0.25 away from 0 (for |x|^p, sign, ...).
Tensor away_from_zero(IntList shape, uint64_t seed) {
  std::vector<double> v = test::lcg_values(Shape(shape).numel(), seed);
  for (double& e : v) e += e >= 0 ? 0.25 : -0.25;
  return leaf_of(v, shape);
}

/// The gradient of sum(f(x) * w) with w = 1, 2, 3, ... over f(x)'s elements: the weighting the
/// PyTorch reference values below were computed with, so every output gets its own weight.
Tensor weighted_grad(const Fn& f, const std::vector<double>& v, IntList shape) {
  Tensor x = leaf_of(v, shape);
  const Tensor y = f(x);
  const Tensor w = arange(1, y.numel() + 1, 1, kFloat64).reshape(y.shape());
  (y * w).sum().backward();
  return x.grad();
}

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// Reference values: /usr/bin/python3 with torch 1.13,
//   x = torch.tensor(V, dtype=torch.float64, requires_grad=True); y = f(x)
//   w = torch.arange(1, y.numel() + 1, dtype=torch.float64).reshape(y.shape)
//   (y * w).sum().backward(); x.grad.flatten().tolist()
const std::vector<double> kM = {1, -3, 2, 2, 0, -1};  // shape [2, 3]

// ---- sum, mean --------------------------------------------------------------------------------

// Each op records one attribute type (OpAttrsOf). Recording an op chosen at run time with
// attributes of another type is a bug in Ember, caught when it is recorded instead of being
// read back as the wrong type.
TEST(RecordAttrs, WrongAttributeTypeIsCaughtWhenRecorded) {
  Tensor x = leaf({2, 3}, 1);
  Tensor out = x.detach().sum();
  try {
    detail::record(OpId::Sum, {&x}, {&out}, DimAttrs{.dim = 0});
    ADD_FAILURE() << "recording Sum with DimAttrs did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("internal assert failed"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(out.requires_grad());
  detail::record(OpId::Sum, {&x}, {&out}, ReduceAttrs{});
  ASSERT_TRUE(out.requires_grad());
  EXPECT_STREQ(out.grad_fn()->name(), "SumBackward");
}

TEST(SumMeanGrad, Gradcheck) {
  for (const char* op : {"sum", "mean"}) {
    const bool is_sum = std::string(op) == "sum";
    auto red = [is_sum](IntList dims, bool keepdim) {
      return [=, d = Shape(dims)](const Tensor& x) {
        return is_sum ? sum(x, d, keepdim) : mean(x, d, keepdim);
      };
    };
    const std::string o = op;
    check(o + " all", red({}, false), leaf({3, 4}, 1));
    check(o + " all keepdim", red({}, true), leaf({3, 4}, 2));
    check(o + " dim 1", red({1}, false), leaf({2, 3, 4}, 3));
    check(o + " dims {0, 2} keepdim", red({0, 2}, true), leaf({2, 3, 4}, 4));
    check(o + " dims {-1, 0}", red({-1, 0}, false), leaf({2, 3, 4}, 5));
    check(o + " non-contiguous", red({0}, false), noncontig_leaf({3, 5}, 6));
    check(o + " 0-d", red({}, false), leaf({}, 7));
    check(o + " 0-d dim 0", red({0}, true), leaf({}, 8));
    check(o + " 0-d dim -1", red({-1}, false), leaf({}, 12));
  }
}

TEST(SumMeanGrad, ValuesMatchPyTorch) {
  // mean(0) of [2, 3]
  expect_close(weighted_grad([](const Tensor& x) { return mean(x, {0}); }, kM, {2, 3}),
               {0.5, 1, 1.5, 0.5, 1, 1.5}, 1e-15, "mean(0)");
  // Tensor methods record too.
  Tensor x = leaf({2, 3}, 9);
  x.mean().backward();
  expect_close(x.grad(), std::vector<double>(6, 1.0 / 6), 1e-15, "Tensor::mean");
}

TEST(SumMeanGrad, DoubleBackward) {
  // d/dx of a mean's gradient is 0; through x^2 it is not.
  check_double("mean(x * x, 1)", [](const Tensor& x) { return mean(x * x, {1}); },
               leaf({2, 3}, 10));
  check_double("sum(x * x)", [](const Tensor& x) { return sum(x * x); }, leaf({4}, 11));
}

// ---- prod -------------------------------------------------------------------------------------

TEST(ProdGrad, Gradcheck) {
  check("prod all", [](const Tensor& x) { return prod(x); }, leaf({3, 4}, 20));
  check("prod dim 1", [](const Tensor& x) { return prod(x, {1}); }, leaf({3, 4}, 21));
  check("prod dim -1 keepdim", [](const Tensor& x) { return prod(x, {-1}, true); },
        leaf({2, 3, 4}, 22));
  check("prod dims {0, 2}", [](const Tensor& x) { return prod(x, {0, 2}); }, leaf({2, 3, 4}, 23));
  check("prod non-contiguous", [](const Tensor& x) { return prod(x, {0}); },
        noncontig_leaf({3, 4}, 24));
  check("prod 0-d", [](const Tensor& x) { return prod(x); }, leaf({}, 25));
}

TEST(ProdGrad, ZerosGradcheck) {
  // Exactly one zero and exactly two zeros, over everything and per row / over several dims.
  const std::vector<double> one = {0.5, -0.75, 0.0, 1.25, 0.9, -0.6};
  const std::vector<double> two = {0.5, 0.0, 0.0, 1.25, 0.9, -0.6};
  for (const auto& [what, v] : {std::pair{"one zero", one}, std::pair{"two zeros", two}}) {
    const std::string w = what;
    check("prod all, " + w, [](const Tensor& x) { return prod(x); }, leaf_of(v, {6}));
    check("prod dim 1, " + w, [](const Tensor& x) { return prod(x, {1}); }, leaf_of(v, {2, 3}));
    check("prod dim 0 keepdim, " + w, [](const Tensor& x) { return prod(x, {0}, true); },
          leaf_of(v, {3, 2}));
    check("prod dims {0, 2}, " + w, [](const Tensor& x) { return prod(x, {0, 2}); },
          leaf_of(v, {2, 1, 3}));
  }
  // Rows with no, one and two zeros side by side.
  const std::vector<double> rows = {0.5, 0.8, -0.7, 0.0, 0.9, -0.6, 0.0, 0.0, 1.1};
  check("prod dim 1, mixed rows", [](const Tensor& x) { return prod(x, {1}); },
        leaf_of(rows, {3, 3}));
  check("prod dim 0, mixed columns", [](const Tensor& x) { return prod(x.t(), {0}); },
        leaf_of(rows, {3, 3}));
}

TEST(ProdGrad, ZerosValuesMatchPyTorch) {
  auto all = [](const Tensor& x) { return prod(x); };
  expect_close(weighted_grad(all, {2, 0, 3, 4}, {4}), {0, 24, 0, 0}, 0, "prod, one zero");
  expect_close(weighted_grad(all, {2, 0, 3, 0}, {4}), {0, 0, 0, 0}, 0, "prod, two zeros");
  expect_close(weighted_grad([](const Tensor& x) { return prod(x, {1}); },
                             {1, 2, 0, 3, 4, 5}, {2, 3}),
               {0, 0, 2, 40, 30, 24}, 0, "prod(1)");
}

TEST(ProdGrad, DoubleBackwardWithAndWithoutZeros) {
  check_double("prod all, no zero", [](const Tensor& x) { return prod(x); },
               away_from_zero({5}, 26));
  check_double("prod dim 1, no zero", [](const Tensor& x) { return prod(x, {1}); },
               away_from_zero({2, 3}, 27));
  const std::vector<double> rows = {0.5, 0.8, -0.7, 0.0, 0.9, -0.6, 0.0, 0.0, 1.1};
  check_double("prod dim 1, rows with 0, 1, 2 zeros", [](const Tensor& x) { return prod(x, {1}); },
               leaf_of(rows, {3, 3}));
  check_double("prod all, one zero", [](const Tensor& x) { return prod(x); },
               leaf_of({0.5, 0.0, -0.7, 1.2}, {2, 2}));
  check_double("prod all, two zeros", [](const Tensor& x) { return prod(x); },
               leaf_of({0.5, 0.0, -0.7, 0.0}, {2, 2}));
}

// ---- max / min / amax / amin ------------------------------------------------------------------

TEST(MaxMinGrad, Gradcheck) {
  check("max()", [](const Tensor& x) { return max(x); }, leaf({3, 4}, 30));
  check("min()", [](const Tensor& x) { return min(x); }, noncontig_leaf({3, 4}, 31));
  check("Tensor::max()", [](const Tensor& x) { return x.max(); }, leaf({5}, 32));
  check("amax dim 1", [](const Tensor& x) { return amax(x, {1}); }, leaf({3, 4}, 33));
  check("amax dims {0, 2} keepdim", [](const Tensor& x) { return amax(x, {0, 2}, true); },
        leaf({2, 3, 4}, 34));
  check("amin all", [](const Tensor& x) { return amin(x); }, leaf({2, 3}, 35));
  check("amin dim -1", [](const Tensor& x) { return amin(x, {-1}); }, noncontig_leaf({3, 4}, 36));
  for (bool keepdim : {false, true}) {
    const std::string k = keepdim ? " keepdim" : "";
    check("max(dim 1)" + k, [=](const Tensor& x) { return max(x, 1, keepdim).first; },
          leaf({3, 4}, 37));
    check("min(dim 0)" + k, [=](const Tensor& x) { return min(x, 0, keepdim).first; },
          leaf({3, 4}, 38));
    check("max(dim -1) 3-d" + k, [=](const Tensor& x) { return max(x, -1, keepdim).first; },
          leaf({2, 3, 4}, 39));
  }
  check("max(dim) non-contiguous", [](const Tensor& x) { return max(x, 0).first; },
        noncontig_leaf({3, 4}, 40));
  check("min(dim) 0-d", [](const Tensor& x) { return min(x, 0).first; }, leaf({}, 41));
  check("max() 0-d", [](const Tensor& x) { return max(x); }, leaf({}, 42));
}

TEST(MaxMinGrad, TiesShareTheGradientEvenly) {
  expect_close(weighted_grad([](const Tensor& x) { return max(x); }, {1, 3, 3, 2}, {4}),
               {0, 0.5, 0.5, 0}, 0, "max() ties");
  expect_close(weighted_grad([](const Tensor& x) { return min(x); }, {1, 3, 1, 2}, {4}),
               {0.5, 0, 0.5, 0}, 0, "min() ties");
  expect_close(weighted_grad([](const Tensor& x) { return amax(x, {1}); },
                             {1, 3, 3, 5, 4, 5}, {2, 3}),
               {0, 0.5, 0.5, 1, 0, 1}, 0, "amax(1) ties");
  expect_close(weighted_grad([](const Tensor& x) { return amin(x, {0}); },
                             {1, 3, 2, 1, 4, 2}, {2, 3}),
               {0.5, 2, 1.5, 0.5, 0, 1.5}, 0, "amin(0) ties");
  // A NaN is the max; the gradient goes to it.
  expect_close(weighted_grad([](const Tensor& x) { return max(x); }, {1, kNaN, 3}, {3}),
               {0, 1, 0}, 0, "max() with NaN");
}

TEST(TopKGrad, ValuesCarryTheGradientBackToTheirPositions) {
  check(
      "topk(2, dim 1)", [](const Tensor& x) { return topk(x, 2, 1).first; }, leaf({3, 4}, 43));
  check(
      "topk(2, dim 0, smallest)", [](const Tensor& x) { return topk(x, 2, 0, false).first; },
      noncontig_leaf({3, 4}, 44));
  // [3, 2]: of the tied 2s the lower position is taken, and only it gets a gradient.
  expect_close(
      weighted_grad([](const Tensor& x) { return topk(x, 2).first; }, {0.5, 2, -1, 3, 2}, {5}),
      {0, 2, 0, 1, 0}, 0, "topk ties");
}

TEST(MaxMinGrad, DimFormSendsTheGradientToTheSelectedIndex) {
  // Ties: max(dim) picks the first maximum, which gets all of the gradient.
  expect_close(weighted_grad([](const Tensor& x) { return max(x, 1).first; },
                             {1, 3, 3, 5, 4, 5}, {2, 3}),
               {0, 1, 0, 2, 0, 0}, 0, "max(1) ties");
  expect_close(weighted_grad([](const Tensor& x) { return min(x, 0).first; },
                             {1, 3, 3, 5, 4, 2}, {2, 3}),
               {1, 2, 0, 0, 0, 3}, 0, "min(0)");
  // The indices never require grad; using both outputs works.
  Tensor x = leaf({3, 4}, 43);
  auto [v, i] = max(x, 1, true);
  EXPECT_TRUE(v.requires_grad());
  EXPECT_FALSE(i.requires_grad());
  ASSERT_NE(v.grad_fn(), nullptr);
  EXPECT_STREQ(v.grad_fn()->name(), "MaxBackward");
  (v * i.to(kFloat64)).sum().backward();
  const Tensor want = scatter_add(zeros({3, 4}, kFloat64), 1, i, i.to(kFloat64));
  expect_close(x.grad(), want.to_vector<double>(), 0, "max(1, keepdim) weighted by index");
}

TEST(MaxMinGrad, DoubleBackward) {
  check_double("max(dim) of x * x", [](const Tensor& x) { return max(x * x, 1).first; },
               away_from_zero({3, 4}, 44));
  check_double("amax of x * x", [](const Tensor& x) { return amax(x * x, {0}); },
               away_from_zero({3, 4}, 45));
}

// ---- var, std ---------------------------------------------------------------------------------

TEST(VarStdGrad, Gradcheck) {
  for (const bool is_std : {false, true}) {
    const std::string o = is_std ? "std" : "var";
    auto red = [is_std](IntList dims, int64_t c, bool keepdim) {
      return [=, d = Shape(dims)](const Tensor& x) {
        return is_std ? ember::std(x, d, c, keepdim) : var(x, d, c, keepdim);
      };
    };
    check(o + " all", red({}, 1, false), leaf({3, 4}, 50));
    check(o + " dim 1", red({1}, 1, false), leaf({3, 4}, 51));
    check(o + " dim 0 correction 0 keepdim", red({0}, 0, true), leaf({3, 4}, 52));
    check(o + " dims {0, 2} correction 2", red({0, 2}, 2, false), leaf({2, 3, 4}, 53));
    check(o + " non-contiguous", red({-1}, 1, false), noncontig_leaf({3, 5}, 54));
  }
}

TEST(VarStdGrad, ValuesMatchPyTorch) {
  expect_close(weighted_grad([](const Tensor& x) { return var(x, {1}); }, kM, {2, 3}),
               {1.0, -3.0, 2.0, 3.3333333333333335, -0.6666666666666666, -2.6666666666666665},
               1e-14, "var(1)");
  expect_close(
      weighted_grad([](const Tensor& x) { return ember::std(x, {1}, 0); }, kM, {2, 3}),
      {0.15430334996209188, -0.46291004988627565, 0.30860669992418377, 0.890870806374748,
       -0.1781741612749496, -0.7126966450997984},
      1e-14, "std(1, correction=0)");
  // A row with std 0 gets gradient 0 (not nan).
  expect_close(weighted_grad([](const Tensor& x) { return ember::std(x, {1}); },
                             {1, 1, 1, 2, 0, -1}, {2, 3}),
               {0, 0, 0, 1.0910894511799618, -0.21821789023599236, -0.8728715609439694}, 1e-14,
               "std(1) with a constant row");
}

TEST(VarStdGrad, DoubleBackward) {
  check_double("var(1)", [](const Tensor& x) { return var(x, {1}); }, leaf({2, 4}, 55));
  check_double("std()", [](const Tensor& x) { return ember::std(x); }, leaf({5}, 56));
}

// ---- norm -------------------------------------------------------------------------------------

TEST(NormGrad, Gradcheck) {
  for (const double p : {2.0, 1.0, 3.0, 1.5, 0.5, -2.0, kInf, -kInf}) {
    const std::string o = "norm p=" + std::to_string(p);
    check(o + " all", [p](const Tensor& x) { return norm(x, p); }, away_from_zero({3, 4}, 60));
    check(o + " dim 1", [p](const Tensor& x) { return norm(x, p, {1}); },
          away_from_zero({3, 4}, 61));
    check(o + " dims {0, 2} keepdim", [p](const Tensor& x) { return norm(x, p, {0, 2}, true); },
          away_from_zero({2, 3, 4}, 62));
    Tensor nc = away_from_zero({4, 3}, 63).detach().t();
    nc.requires_grad_();
    check(o + " non-contiguous", [p](const Tensor& x) { return norm(x, p, {0}); }, nc);
  }
}

TEST(NormGrad, ValuesMatchPyTorch) {
  auto w = [](double p, IntList dims, const std::vector<double>& v) {
    return weighted_grad([=, d = Shape(dims)](const Tensor& x) { return norm(x, p, d); }, v,
                         {2, 3});
  };
  expect_close(w(3, {}, kM),
               {0.07904207343311251, -0.7113786608980126, 0.31616829373245003,
                0.31616829373245003, 0.0, -0.07904207343311251},
               1e-14, "norm(3)");
  expect_close(w(1, {}, kM), {1, -1, 1, 1, 0, -1}, 0, "norm(1): sign, 0 at 0");
  expect_close(w(0.5, {}, kM),
               {6.5604779323150675, -3.787693700234704, 4.638958433764683, 4.638958433764683,
                0.0, -6.5604779323150675},
               1e-13, "norm(0.5): 0 at 0");
  expect_close(w(1.5, {}, kM),
               {0.4269055055386463, -0.7394220256238121, 0.6037355557844961, 0.6037355557844961,
                0.0, -0.4269055055386463},
               1e-14, "norm(1.5)");
  // Ties at |x| = 3 share the inf-norm's gradient.
  expect_close(w(kInf, {}, {1, -3, 3, 2, 0, -1}), {0, -0.5, 0.5, 0, 0, 0}, 0, "norm(inf) ties");
  // Where the norm is 0 the gradient is 0, not nan.
  expect_close(w(2, {1}, {0, 0, 0, 3, 4, 0}), {0, 0, 0, 1.2, 1.6, 0}, 1e-15, "norm(2) at 0");
  expect_close(w(3, {1}, {0, 0, 0, 3, 4, 0}).select(0, 0), {0, 0, 0}, 0, "norm(3) at 0");
  expect_close(w(0, {}, kM), {0, 0, 0, 0, 0, 0}, 0, "norm(0)");
}

TEST(NormGrad, DoubleBackward) {
  check_double("norm(2)", [](const Tensor& x) { return norm(x); }, away_from_zero({5}, 64));
  check_double("norm(3, dim 1)", [](const Tensor& x) { return norm(x, 3, {1}); },
               away_from_zero({2, 3}, 65));
}

// ---- logsumexp, softmax, log_softmax ----------------------------------------------------------

TEST(SoftmaxGrad, Gradcheck) {
  check("logsumexp dim 1", [](const Tensor& x) { return logsumexp(x, {1}); }, leaf({3, 4}, 70));
  check("logsumexp dims {0, 2} keepdim", [](const Tensor& x) { return logsumexp(x, {0, 2}, true); },
        leaf({2, 3, 4}, 71));
  check("logsumexp non-contiguous", [](const Tensor& x) { return logsumexp(x, {0}); },
        noncontig_leaf({3, 4}, 72));
  for (const bool log : {false, true}) {
    const std::string o = log ? "log_softmax" : "softmax";
    auto f = [log](int64_t dim) {
      return [=](const Tensor& x) { return log ? log_softmax(x, dim) : softmax(x, dim); };
    };
    check(o + " dim 1", f(1), leaf({3, 4}, 73));
    check(o + " dim 0", f(0), leaf({3, 4}, 74));
    check(o + " dim -2 of 3-d", f(-2), leaf({2, 3, 4}, 75));
    check(o + " non-contiguous", f(-1), noncontig_leaf({3, 4}, 76));
    check(o + " 0-d", f(0), leaf({}, 77));
  }
}

TEST(SoftmaxGrad, ValuesMatchPyTorch) {
  expect_close(weighted_grad([](const Tensor& x) { return logsumexp(x, {1}); }, kM, {2, 3}),
               {0.2676231541498623, 0.004901689049672923, 0.7274751568004647, 1.687589468962679,
                0.22839039876918896, 0.0840201322681321},
               1e-14, "logsumexp(1)");
  expect_close(weighted_grad([](const Tensor& x) { return softmax(x, 1); }, kM, {2, 3}),
               {-0.3906901975413473, -0.0022540515258626195, 0.3929442490672102,
                -0.1672530531420433, 0.09155996006542783, 0.0756930930766152},
               1e-14, "softmax(1)");
  expect_close(weighted_grad([](const Tensor& x) { return log_softmax(x, 0); }, kM, {2, 3}),
               {-0.3447071068499755, 1.6680188877570326, -5.5731671414019, 0.3447071068499755,
                -1.6680188877570328, 5.573167141401899},
               1e-14, "log_softmax(0)");
}

TEST(SoftmaxGrad, DoubleBackward) {
  check_double("softmax(1)", [](const Tensor& x) { return softmax(x, 1); }, leaf({2, 4}, 78));
  check_double("log_softmax(0)", [](const Tensor& x) { return log_softmax(x, 0); },
               leaf({3, 2}, 79));
  check_double("logsumexp(1)", [](const Tensor& x) { return logsumexp(x, {1}); }, leaf({2, 3}, 80));
}

// ---- recording --------------------------------------------------------------------------------

/// Sequence number of a fresh node: nodes made in between show up as a gap.
uint64_t next_sequence_nr(const Tensor& x) { return (x * 1.0).grad_fn()->sequence_nr(); }

TEST(ReduceRecording, OneNodeWithTheOriginalInput) {
  // Non-contiguous inputs and middle-dim reductions make the kernels copy / permute their
  // input; none of that may be recorded, and the node's edge goes straight to the leaf.
  Tensor x = noncontig_leaf({3, 4}, 90);
  Tensor x3 = leaf({2, 3, 4}, 91);
  Tensor s = leaf({}, 92);
  const std::vector<std::pair<std::string, std::function<Tensor()>>> ops = {
      {"SoftmaxBackward", [&] { return softmax(x, 0); }},
      {"LogSoftmaxBackward", [&] { return log_softmax(s, 0); }},
      {"SumBackward", [&] { return sum(x3, {1}); }},
      {"MeanBackward", [&] { return mean(x, {0}); }},
      {"ProdBackward", [&] { return prod(x3, {0, 2}); }},
      {"AmaxBackward", [&] { return amax(x3, {1}); }},
      {"VarBackward", [&] { return var(x3, {1}); }},
      {"StdBackward", [&] { return ember::std(x, {0}); }},
      {"NormBackward", [&] { return norm(x3, 3.0, {1}); }},
      {"LogsumexpBackward", [&] { return logsumexp(x3, {1}); }},
      {"MaxBackward", [&] { return max(s, 0).first; }},
      {"MinBackward", [&] { return min(x); }},
  };
  for (const auto& [name, op] : ops) {
    const uint64_t before = next_sequence_nr(x);
    const Tensor y = op();
    ASSERT_NE(y.grad_fn(), nullptr) << name;
    EXPECT_STREQ(y.grad_fn()->name(), name.c_str());
    EXPECT_EQ(y.grad_fn()->sequence_nr(), before + 1) << name << " recorded extra nodes";
    ASSERT_EQ(y.grad_fn()->num_outputs(), 1u) << name;
    EXPECT_STREQ(y.grad_fn()->next_edge(0).fn->name(), "AccumulateGrad") << name;
  }
}

TEST(ReduceRecording, IndexAndPredicateResultsRecordNothing) {
  Tensor x = noncontig_leaf({3, 4}, 93);
  const uint64_t before = next_sequence_nr(x);
  const Tensor r[] = {argmax(x), argmin(x, 0), argmax(x, 1, true), any(x), all(x)};
  for (const Tensor& t : r) {
    EXPECT_FALSE(t.requires_grad());
    EXPECT_EQ(t.grad_fn(), nullptr);
  }
  EXPECT_EQ(next_sequence_nr(x), before + 1) << "argmax/argmin/any/all made nodes";
}

TEST(ReduceRecording, NoGradModeRecordsNothing) {
  Tensor x = leaf({3, 4}, 94);
  NoGradGuard no_grad;
  EXPECT_FALSE(softmax(x, 1).requires_grad());
  EXPECT_FALSE(max(x, 0).first.requires_grad());
  EXPECT_FALSE(prod(x).requires_grad());
}

// ---- float32 ----------------------------------------------------------------------------------

TEST(ReduceGradFloat32, MatchesFloat64) {
  const std::vector<std::pair<std::string, Fn>> ops = {
      {"sum", [](const Tensor& x) { return sum(x, {1}); }},
      {"mean", [](const Tensor& x) { return mean(x); }},
      {"prod", [](const Tensor& x) { return prod(x, {0}); }},
      {"max", [](const Tensor& x) { return max(x); }},
      {"min(dim)", [](const Tensor& x) { return min(x, 1).first; }},
      {"amax", [](const Tensor& x) { return amax(x, {0}); }},
      {"var", [](const Tensor& x) { return var(x, {1}); }},
      {"std", [](const Tensor& x) { return ember::std(x); }},
      {"norm", [](const Tensor& x) { return norm(x, 2.0, {1}); }},
      {"norm p=3", [](const Tensor& x) { return norm(x, 3.0); }},
      {"logsumexp", [](const Tensor& x) { return logsumexp(x, {1}); }},
      {"softmax", [](const Tensor& x) { return softmax(x, 1); }},
      {"log_softmax", [](const Tensor& x) { return log_softmax(x, 0); }},
  };
  const Tensor base = test::rand_t({3, 5}, kFloat64, 95);
  for (const auto& [name, f] : ops) {
    Tensor x64 = base.clone().requires_grad_();
    Tensor x32 = base.to(kFloat32).requires_grad_();
    const Tensor y64 = f(x64), y32 = f(x32);
    const Tensor w = test::rand_t(y64.shape(), kFloat64, 96);
    (y64 * w).sum().backward();
    (y32 * w.to(kFloat32)).sum().backward();
    ASSERT_EQ(x32.grad().dtype(), kFloat32) << name;
    expect_close(x32.grad(), x64.grad().to_vector<double>(), 1e-5, name + " float32");
  }
}

// ---- CUDA -------------------------------------------------------------------------------------

TEST(ReduceGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  }
  const std::vector<std::pair<std::string, Fn>> ops = {
      {"sum", [](const Tensor& x) { return sum(x, {0, 2}); }},
      {"mean", [](const Tensor& x) { return mean(x, {1}, true); }},
      {"prod", [](const Tensor& x) { return prod(x, {2}); }},
      {"max", [](const Tensor& x) { return max(x); }},
      {"max(dim)", [](const Tensor& x) { return max(x, 1).first; }},
      {"amin", [](const Tensor& x) { return amin(x, {0, 1}); }},
      {"var", [](const Tensor& x) { return var(x, {2}); }},
      {"std", [](const Tensor& x) { return ember::std(x, {0}, 0); }},
      {"norm", [](const Tensor& x) { return norm(x, 2.0, {1}); }},
      {"norm p=inf", [](const Tensor& x) { return norm(x, kInf, {2}); }},
      {"logsumexp", [](const Tensor& x) { return logsumexp(x, {2}); }},
      {"softmax", [](const Tensor& x) { return softmax(x, 1); }},
      {"log_softmax", [](const Tensor& x) { return log_softmax(x, -1); }},
  };
  // One zero per [*, *, 4] row for prod's zero handling, elsewhere lcg values.
  std::vector<double> v = test::lcg_values(2 * 3 * 4, 97);
  v[5] = 0;
  v[13] = 0;
  v[14] = 0;
  const Tensor base = from_vector(v).reshape({2, 3, 4});
  for (const auto& [name, f] : ops) {
    for (const Dtype dt : {kFloat64, kFloat32}) {
      Tensor xc = base.to(dt, /*copy=*/true).requires_grad_();
      Tensor xg = base.to(cuda_device(0), dt).requires_grad_();
      const Tensor yc = f(xc), yg = f(xg);
      const Tensor w = test::rand_t(yc.shape(), dt, 98);
      (yc * w).sum().backward();
      (yg * w.cuda()).sum().backward();
      ASSERT_TRUE(xg.grad().is_cuda()) << name;
      ASSERT_EQ(xg.grad().dtype(), dt) << name;
      expect_close(xg.grad().cpu(), xc.grad().to_vector<double>(), dt == kFloat64 ? 1e-12 : 1e-5,
                   name + " CUDA vs CPU");
    }
  }
}

}  // namespace
}  // namespace ember
