// Backward rules of the matrix products (mm, bmm, addmm, matmul): gradcheck in float64, double
// backward, values against PyTorch, and CUDA against CPU. Convolution and pooling are in
// conv_grad_test.cpp.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::edge_is_leaf;
using test::expect_close;
using test::expect_cuda_grads_match_cpu;
using test::GradCase;
using test::expect_error;
using test::expect_gradcheck;
using test::leaf;
using test::name_of;
using test::noncontig_leaf;
using test::rand_t;
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

/// A float64 leaf whose dims are stored in the order `perm` (so its strides are permuted): for
/// operands whose leading dims cannot be merged into one.
Tensor permuted_leaf(IntList shape, IntList perm, uint64_t seed) {
  Shape stored(shape), p(perm);
  Shape inverse(p);
  for (int64_t i = 0; i < static_cast<int64_t>(p.size()); ++i) {
    stored[i] = Shape(shape)[p[i]];
    inverse[p[i]] = i;
  }
  Tensor t = rand_t(stored, kFloat64, seed).permute(inverse);
  t.requires_grad_();
  return t;
}

/// Gradcheck of the first derivatives: fn's gradients (taken with create_graph, weighted by a
/// fixed random grad_output) as functions of the inputs. Checks double backward.
void expect_gradgradcheck(const Fn& fn, const std::vector<Tensor>& inputs,
                          const std::string& what) {
  auto first = [&](const std::vector<Tensor>& in) {
    EnableGradGuard enable;  // gradcheck evaluates under no_grad
    Tensor y = fn(in);
    std::vector<Tensor> wrt;
    for (const Tensor& t : in) {
      if (t.defined() && t.requires_grad()) wrt.push_back(t);
    }
    const Tensor go = rand_t(y.shape(), kFloat64, 99);
    return autograd::grad({y}, wrt, {go}, std::nullopt, /*create_graph=*/true,
                          /*allow_unused=*/true);
  };
  const autograd::GradcheckResult r = autograd::gradcheck(autograd::GradcheckFn(first), inputs);
  EXPECT_TRUE(r.ok) << what << ": " << r.message;
}


// ---- mm, bmm, addmm ---------------------------------------------------------------------------

TEST(MmGrad, Gradcheck) {
  Fn f = [](const std::vector<Tensor>& in) { return mm(in[0], in[1]); };
  expect_gradcheck(f, {leaf({3, 4}, 1), leaf({4, 2}, 2)});
  expect_gradcheck(f, {noncontig_leaf({3, 4}, 3), noncontig_leaf({4, 5}, 4)});
  expect_gradcheck(f, {leaf({3, 4}, 5), rand_t({4, 2}, kFloat64, 6)});  // only a
  expect_gradcheck(f, {rand_t({1, 4}, kFloat64, 7), leaf({4, 1}, 8)});  // only b
  expect_gradcheck(f, {leaf({0, 3}, 9), leaf({3, 2}, 10)});             // empty rows
  expect_gradcheck(f, {leaf({2, 0}, 11), leaf({0, 3}, 12)});            // empty sum

  Tensor a = leaf({2, 3}, 13), b = leaf({3, 4}, 14);
  Tensor y = mm(a, b);
  EXPECT_EQ(name_of(y), "MmBackward");
  EXPECT_TRUE(edge_is_leaf(y, 0) && edge_is_leaf(y, 1));
}

TEST(MmGrad, DoubleBackward) {
  expect_gradgradcheck([](const std::vector<Tensor>& in) { return mm(in[0], in[1]); },
                       {leaf({3, 4}, 1), noncontig_leaf({4, 2}, 2)}, "mm");
  // A second-order quantity: d/da of sum((a @ b)^2)'s gradient norm.
  Tensor a = leaf({2, 2}, 3), b = leaf({2, 2}, 4);
  Tensor y = mm(a, b);
  Tensor ga = autograd::grad({(y * y).sum()}, {a}, {}, std::nullopt, true)[0];
  EXPECT_TRUE(ga.requires_grad());
  (ga * ga).sum().backward();
  EXPECT_TRUE(b.grad().defined());
}

TEST(BmmGrad, Gradcheck) {
  Fn f = [](const std::vector<Tensor>& in) { return bmm(in[0], in[1]); };
  expect_gradcheck(f, {leaf({2, 3, 4}, 1), leaf({2, 4, 5}, 2)});
  expect_gradcheck(f, {noncontig_leaf({3, 2, 4}, 3), noncontig_leaf({3, 4, 2}, 4)});
  expect_gradcheck(f, {permuted_leaf({2, 3, 4}, {1, 0, 2}, 5), leaf({2, 4, 1}, 6)});
  expect_gradgradcheck(f, {leaf({2, 2, 3}, 7), leaf({2, 3, 2}, 8)}, "bmm");
  Tensor y = bmm(leaf({1, 2, 2}, 9), leaf({1, 2, 2}, 10));
  EXPECT_EQ(name_of(y), "BmmBackward");
}

TEST(AddmmGrad, GradcheckOverBiasShapesAndScalars) {
  const Shape bias_shapes[] = {{3, 4}, {4}, {1, 4}, {3, 1}, {1, 1}, {}};
  const std::pair<double, double> beta_alpha[] = {{1, 1}, {0.5, 2}, {-1.5, 0.25}};
  uint64_t seed = 1;
  for (const Shape& bs : bias_shapes) {
    for (auto [beta, alpha] : beta_alpha) {
      Fn f = [=](const std::vector<Tensor>& in) { return addmm(in[0], in[1], in[2], beta, alpha); };
      SCOPED_TRACE("addmm bias " + detail::str_cat(bs) + " beta " + std::to_string(beta) +
                   " alpha " + std::to_string(alpha));
      expect_gradcheck(f, {leaf(bs, seed), leaf({3, 2}, seed + 1), leaf({2, 4}, seed + 2)});
      seed += 3;
    }
  }
  Fn f = [](const std::vector<Tensor>& in) { return addmm(in[0], in[1], in[2], 0.5, 2.0); };
  expect_gradcheck(
      f, {noncontig_leaf({3, 4}, 40), noncontig_leaf({3, 2}, 41), noncontig_leaf({2, 4}, 42)});
  expect_gradgradcheck(f, {leaf({4}, 43), leaf({3, 2}, 44), leaf({2, 4}, 45)}, "addmm");
}

TEST(AddmmGrad, RecordsOneNodeAndZeroBetaGivesZeroBiasGrad) {
  Tensor bias = leaf({4}, 1), a = leaf({3, 2}, 2), b = leaf({2, 4}, 3);
  Tensor y = addmm(bias, a, b);
  EXPECT_EQ(name_of(y), "AddmmBackward");
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(edge_is_leaf(y, i)) << "addmm input " << i;
  // beta = 0: the bias is ignored (even NaN), its gradient is zero as in PyTorch.
  Tensor nan_bias = full({4}, std::nan(""), kFloat64).requires_grad_();
  addmm(nan_bias, a, b, /*beta=*/0).sum().backward();
  expect_close(nan_bias.grad(), {0, 0, 0, 0}, 0, "addmm beta=0 bias grad");
}

// linear's weight enters as weight.t() (column-major): its gradient is computed transposed so
// that it comes out contiguous like the weight (PyTorch's layout contract), for mm and addmm,
// and its values are those of the plain formula a^T @ g.
TEST(MmGrad, TransposedOperandGetsAGradientInItsOwnLayout) {
  for (bool with_bias : {false, true}) {
    Tensor x = leaf({5, 3}, 1), w = leaf({4, 3}, 2), bias = leaf({4}, 3);
    Tensor y = with_bias ? addmm(bias, x, w.t()) : mm(x, w.t());
    Tensor g = rand_t({5, 4}, kFloat64, 4);
    y.backward(g);
    ASSERT_TRUE(w.grad().is_contiguous()) << "with_bias " << with_bias;
    expect_close(w.grad(), mm(g.t(), x.detach()).to_vector<double>(), 1e-12, "weight grad");
    expect_close(x.grad(), mm(g, w.detach()).to_vector<double>(), 1e-12, "input grad");
    // And a column-major first operand: (w x^T) with w.t() on the left.
    Tensor a = leaf({3, 4}, 5), b = leaf({3, 2}, 6);
    Tensor z = mm(a.t(), b);
    Tensor gz = rand_t({4, 2}, kFloat64, 7);
    z.backward(gz);
    ASSERT_TRUE(a.grad().is_contiguous());
    expect_close(a.grad(), mm(b.detach(), gz.t()).to_vector<double>(), 1e-12, "first operand grad");
  }
}

TEST(AddmmGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): bias, a, b = lcg leaves [3] seed 14, [2, 4] seed 15,
  // [4, 3] seed 16 (float32); y = torch.addmm(bias, a, b, beta=0.5, alpha=2.0);
  // y.backward(lcg [2, 3] seed 17).
  Tensor bias = leaf({3}, 14, kFloat32), a = leaf({2, 4}, 15, kFloat32),
         b = leaf({4, 3}, 16, kFloat32);
  Tensor y = addmm(bias, a, b, 0.5, 2.0);
  y.backward(rand_t({2, 3}, kFloat32, 17));
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  expect_close(bias.grad(), {-0.519893646, 0.461496353, 0.311443329}, 1e-5, "addmm bias grad");
  expect_close(a.grad(),
               {0.662933826, -0.123582743, -0.101003647, 0.333809733, 0.434742421, 1.28274846,
                2.6276269, -0.056074433},
               1e-5, "addmm a grad");
  expect_close(b.grad(),
               {0.219471082, 0.53605485, 0.619564056, -0.211770713, -0.417515069, -0.495342612,
                1.62449849, -1.58884096, -1.12402475, -1.16623878, 0.694079816, 0.348064363},
               1e-5, "addmm b grad");
}

TEST(MmOut, RefusesInputsThatRequireGrad) {
  Tensor out = zeros({2, 2}, kFloat64);
  Tensor a = leaf({2, 3}, 1), b = rand_t({3, 2}, kFloat64, 2);
  expect_error([&] { mm_out(out, a, b); }, {"[mm_out]", "requires grad"});
  expect_error([&] { mm_out(out, b.t(), a.t()); }, {"[mm_out]", "requires grad"});
  Tensor w = leaf({2, 2}, 3);
  expect_error([&] { mm_out(w, a.detach(), b); }, {"[mm_out]", "requires grad"});
  {
    NoGradGuard no_grad;  // allowed when nothing would be recorded
    mm_out(out, a, b);
  }
  expect_close(out, mm(a, b).detach().to_vector<double>(), 1e-12, "mm_out under no_grad");
}

TEST(LinalgGrad, NothingRecordedWithoutGrad) {
  Tensor a = rand_t({2, 3}, kFloat64, 1), b = rand_t({3, 2}, kFloat64, 2);
  EXPECT_FALSE(mm(a, b).requires_grad());
  EXPECT_FALSE(matmul(a, b).requires_grad());
  Tensor l = leaf({2, 3}, 3);
  NoGradGuard no_grad;
  EXPECT_FALSE(mm(l, b).requires_grad());
  EXPECT_FALSE(matmul(l.unsqueeze(0), b).requires_grad());
  EXPECT_FALSE(addmm(rand_t({2}, kFloat64, 4), l, b).requires_grad());
}

// ---- matmul -----------------------------------------------------------------------------------

TEST(MatmulGrad, GradcheckEveryShapeCase) {
  Fn f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  struct Case {
    Shape a, b;
  };
  const Case cases[] = {
      {{4}, {4}},                 // dot
      {{4}, {4, 3}},              // vector @ matrix
      {{3, 4}, {4}},              // matrix @ vector
      {{3, 4}, {4, 2}},           // mm
      {{2, 3, 4}, {4, 2}},        // batched @ matrix: folded into one GEMM
      {{2, 3, 4}, {4}},           // batched @ vector: folded
      {{4}, {2, 4, 3}},           // vector @ batched
      {{2, 3, 4}, {2, 4, 2}},     // bmm
      {{2, 1, 3, 4}, {3, 4, 2}},  // broadcast batch dims
      {{1, 3, 4}, {2, 1, 4, 2}},  // broadcast both ways, different ranks
      {{3, 4}, {2, 4, 2}},        // matrix @ batched
      {{2, 3, 4}, {1, 4, 2}},     // size-1 batch of b
      {{0, 3, 4}, {4, 2}},        // empty batch
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE("matmul " + detail::str_cat(c.a, " @ ", c.b));
    expect_gradcheck(f, {leaf(c.a, seed), leaf(c.b, seed + 1)});
    if (c.a.size() >= 2 && c.b.size() >= 2) {
      expect_gradcheck(f, {noncontig_leaf(c.a, seed + 2), noncontig_leaf(c.b, seed + 3)});
    }
    seed += 4;
  }
  // Leading dims that do not merge: the general (batched, b expanded) path.
  expect_gradcheck(f, {permuted_leaf({2, 3, 4}, {1, 0, 2}, 60), leaf({4, 2}, 61)});
  expect_gradcheck(f, {permuted_leaf({2, 3, 4}, {1, 0, 2}, 62), leaf({4}, 63)});
  expect_gradcheck(f, {permuted_leaf({2, 3, 2, 4}, {2, 0, 1, 3}, 64), noncontig_leaf({4, 3}, 65)});
}

TEST(MatmulGrad, DoubleBackward) {
  Fn f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  expect_gradgradcheck(f, {leaf({3}, 1), leaf({3, 2}, 2)}, "matmul 1-d @ 2-d");
  expect_gradgradcheck(f, {leaf({2, 2, 3}, 3), leaf({3, 2}, 4)}, "matmul 3-d @ 2-d");
  expect_gradgradcheck(f, {leaf({2, 1, 2, 3}, 5), leaf({2, 3, 2}, 6)}, "matmul broadcast");
}

TEST(MatmulGrad, GraphComposesFromRecordedOps) {
  Tensor a = leaf({3, 4}, 1), b = leaf({4, 2}, 2);
  Tensor y = matmul(a, b);
  EXPECT_EQ(name_of(y), "MmBackward");
  EXPECT_TRUE(edge_is_leaf(y, 0) && edge_is_leaf(y, 1));
  EXPECT_EQ(name_of(matmul(leaf({2, 1, 3, 4}, 3), b)), "ViewBackward");  // folded, reshaped back
  EXPECT_EQ(name_of(matmul(leaf({2, 3, 4}, 4), leaf({2, 4, 2}, 5))), "BmmBackward");
  EXPECT_EQ(name_of(matmul(leaf({4}, 6), leaf({4}, 7))), "ViewBackward");
  // Only b requires grad: a's views are not recorded, b's edge is still found.
  Tensor c = rand_t({2, 3, 4}, kFloat64, 8);
  Tensor w = leaf({4, 2}, 9);
  matmul(c, w).sum().backward();
  expect_close(w.grad(), mm(c.reshape({6, 4}).t(), ones({6, 2}, kFloat64)).to_vector<double>(),
               1e-12, "matmul 3-d @ 2-d weight grad");
}

TEST(MatmulGrad, MatchesPyTorchFloat32) {
  // /usr/bin/python3 (torch 1.13): a = lcg [2, 1, 2, 3] seed 5, b = lcg [3, 3, 2] seed 6
  // (float32 leaves); y = torch.matmul(a, b) ([2, 3, 2, 2]); y.backward(lcg y.shape seed 7).
  Tensor a = leaf({2, 1, 2, 3}, 5, kFloat32), b = leaf({3, 3, 2}, 6, kFloat32);
  Tensor y = matmul(a, b);
  ASSERT_EQ(y.shape(), Shape({2, 3, 2, 2}));
  y.backward(rand_t(y.shape(), kFloat32, 7));
  EXPECT_EQ(a.grad().dtype(), kFloat32);
  EXPECT_EQ(b.grad().dtype(), kFloat32);
  expect_close(a.grad(),
               {0.4875606, -0.695407987, -0.122045867, 0.532631874, -0.400971115, 0.458880574,
                0.119948804, -0.387023211, 0.0364375263, -0.71345377, -0.791613758, 0.220602155},
               1e-5, "matmul broadcast a grad");
  expect_close(b.grad(),
               {1.48364794, 0.428766072, 0.278433412, -0.22688733, -1.35814738, -0.333904088,
                0.241197094, 0.436618328, 0.316441834, -0.879812539, -0.368250936, -0.0740131736,
                -0.773867667, -0.532244861, 0.422745019, -0.618660688, 0.551287532, 0.728043675},
               1e-5, "matmul broadcast b grad");
}


// ---- CUDA -------------------------------------------------------------------------------------

TEST(LinalgGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  // float64, so cuBLAS gradients compare tightly with the CPU ones (no TF32).
  const GradCase cases[] = {
      {"mm", {{3, 4}, {2, 4}}, [](const std::vector<Tensor>& in) { return mm(in[0], in[1].t()); }},
      {"bmm",
       {{2, 3, 4}, {2, 4, 2}},
       [](const std::vector<Tensor>& in) { return bmm(in[0], in[1]); }},
      {"matmul broadcast",
       {{2, 1, 3, 4}, {3, 4, 2}},
       [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }},
      {"matmul 3-d @ 2-d",
       {{2, 3, 4}, {4, 5}},
       [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }},
      {"addmm",
       {{5}, {3, 4}, {4, 5}},
       [](const std::vector<Tensor>& in) { return addmm(in[0], in[1], in[2], 0.5, 2.0); }},
  };
  expect_cuda_grads_match_cpu(cases);
}

}  // namespace
}  // namespace ember