// Gradients of the indexing and joining ops: index_select, gather, scatter_add(_), index_add_,
// embedding, cat, stack, split, split_with_sizes, chunk.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::expect_gradcheck;
using test::leaf;
using test::noncontig_leaf;
using TL = std::vector<Tensor>;

/// arange(1, n + 1) as float64 in `shape`: a gradient whose entries are all distinct.
Tensor ramp(IntList shape) {
  const Shape s(shape);
  return arange(1, s.numel() + 1, 1, kFloat64).reshape(shape);
}

/// The gradient of (f() * v).sum() with respect to x, recorded (create_graph), so gradcheck on
/// it checks the backward rule's own derivative with respect to both x and v.
Tensor grad_of(const std::function<Tensor()>& f, const Tensor& x, const Tensor& v) {
  EnableGradGuard grad_on;  // gradcheck evaluates fn under no-grad for finite differences
  return autograd::grad({f()}, {x}, {v}, std::nullopt, /*create_graph=*/true)[0];
}

// ---- index_select -----------------------------------------------------------------------------

TEST(IndexSelectGrad, Gradcheck) {
  const Tensor idx = tensor({2, 0, 2, 3});  // repeats accumulate
  for (int64_t dim : {0, 1, -1}) {
    SCOPED_TRACE("index_select dim " + std::to_string(dim));
    expect_gradcheck([&](const TL& in) { return index_select(in[0], dim, idx); },
                     {leaf({4, 4}, 1)});
    expect_gradcheck([&](const TL& in) { return index_select(in[0], dim, idx); },
                     {noncontig_leaf({4, 4}, 2)});
  }
  expect_gradcheck([&](const TL& in) { return index_select(in[0], 1, idx.to(kInt32)); },
                   {leaf({2, 5, 3}, 3)});
  expect_gradcheck([&](const TL& in) { return index_select(in[0], 0, tensor({0})); },
                   {leaf({}, 4)});
  expect_gradcheck([&](const TL& in) { return index_select(in[0], 0, tensor({1}).view({})); },
                   {leaf({3}, 5)});
}

TEST(IndexSelectGrad, MatchesPyTorch) {
  // torch: x = arange(12.).reshape(4, 3); (index_select(x, 0, [2, 0, 2]) * (arange(9) + 1)
  // .reshape(3, 3)).sum().backward(); x.grad
  Tensor x = leaf({4, 3}, 6);
  (index_select(x, 0, tensor({2, 0, 2})) * ramp({3, 3})).sum().backward();
  expect_close(x.grad(), {4, 5, 6, 0, 0, 0, 8, 10, 12, 0, 0, 0}, 0, "index_select");
  EXPECT_STREQ(index_select(x, 0, tensor({1})).grad_fn()->name(), "IndexSelectBackward");
}

TEST(IndexSelectGrad, DoubleBackward) {
  const Tensor idx = tensor({1, 1, 0});
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of([&] { return tanh(index_select(in[0], 1, idx)); }, in[0], in[1]);
      },
      {leaf({2, 3}, 7), leaf({2, 3}, 8)});
}

TEST(IndexSelectGrad, Float32GradientIsFloat32) {
  Tensor x64 = leaf({5, 3}, 9);
  Tensor x32 = x64.detach().to(kFloat32);
  x32.requires_grad_();
  const Tensor idx = tensor({4, 0, 4, 2});
  (tanh(index_select(x64, 0, idx)) * ramp({4, 3})).sum().backward();
  (tanh(index_select(x32, 0, idx)) * ramp({4, 3}).to(kFloat32)).sum().backward();
  EXPECT_EQ(x32.grad().dtype(), kFloat32);
  expect_close(x32.grad(), x64.grad().to_vector<double>(), 1e-5, "index_select float32");
}

// ---- gather -----------------------------------------------------------------------------------

TEST(GatherGrad, Gradcheck) {
  const Tensor idx1 = tensor({3, 3, 0, 1, 2, 2}).view({3, 2});
  expect_gradcheck([&](const TL& in) { return gather(in[0], 1, idx1); }, {leaf({3, 4}, 10)});
  expect_gradcheck([&](const TL& in) { return gather(in[0], -1, idx1); },
                   {noncontig_leaf({3, 4}, 11)});
  // Index smaller than self off the gathered dim; dim 0 with repeats.
  const Tensor idx0 = tensor({2, 0, 0, 0, 1, 2}).view({3, 2});
  expect_gradcheck([&](const TL& in) { return gather(in[0], 0, idx0); }, {leaf({3, 4}, 12)});
  expect_gradcheck([&](const TL& in) { return gather(in[0], 0, tensor({1}).view({})); },
                   {leaf({2}, 13)});
}

TEST(GatherGrad, MatchesPyTorch) {
  // torch: x = zeros(3, 4); gather(x, 1, [[3, 3], [0, 1], [2, 2]]).backward(arange(1., 7.)
  // .reshape(3, 2)); x.grad
  Tensor x = leaf({3, 4}, 14);
  gather(x, 1, tensor({3, 3, 0, 1, 2, 2}).view({3, 2})).backward(ramp({3, 2}));
  expect_close(x.grad(), {0, 0, 0, 3, 3, 4, 0, 0, 0, 0, 11, 0}, 0, "gather");
}

TEST(GatherGrad, DoubleBackward) {
  const Tensor idx = tensor({1, 0, 1, 1}).view({2, 2});
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of([&] { return tanh(gather(in[0], 0, idx)); }, in[0], in[1]);
      },
      {leaf({2, 3}, 15), leaf({2, 2}, 16)});
}

// ---- scatter_add ------------------------------------------------------------------------------

TEST(ScatterAddGrad, Gradcheck) {
  // index [2, 3] smaller than src [2, 5]: src positions outside it get no gradient.
  const Tensor idx = tensor({0, 1, 2, 2, 2, 0}).view({2, 3});
  expect_gradcheck([&](const TL& in) { return scatter_add(in[0], 0, idx, in[1]); },
                   {leaf({3, 4}, 17), leaf({2, 5}, 18)});
  expect_gradcheck([&](const TL& in) { return scatter_add(in[0], 1, idx, in[1]); },
                   {noncontig_leaf({2, 4}, 19), noncontig_leaf({3, 3}, 20)});
  // Only src requires grad; 0-d.
  expect_gradcheck(
      [&](const TL& in) {
        return scatter_add(zeros({3, 4}, kFloat64), 0, idx, in[0]);
      },
      {leaf({2, 3}, 21)});
  expect_gradcheck([&](const TL& in) { return scatter_add(in[0], 0, tensor({0}).view({}), in[1]); },
                   {leaf({}, 22), leaf({}, 23)});
}

TEST(ScatterAddGrad, SrcGradientIsZeroOutsideTheIndex) {
  // PyTorch 1.13 rejects this case in backward ("ScatterAddBackward0 returned an invalid
  // gradient ... got [2, 3] but expected shape compatible with [2, 5]"); here src's gradient
  // is g.gather(0, index) zero-padded to src's shape.
  Tensor self = leaf({3, 4}, 24);
  Tensor src = leaf({2, 5}, 25);
  Tensor out = scatter_add(self, 0, tensor({0, 1, 2, 2, 2, 0}).view({2, 3}), src);
  EXPECT_STREQ(out.grad_fn()->name(), "ScatterAddBackward");
  // The copy of self is part of the op: its edge goes straight to self's accumulator.
  EXPECT_STREQ(out.grad_fn()->next_edge(0).fn->name(), "AccumulateGrad");
  out.backward(ramp({3, 4}));
  expect_close(src.grad(), {1, 6, 11, 0, 0, 9, 10, 3, 0, 0}, 0, "scatter_add src");
  expect_close(self.grad(), ramp({3, 4}).to_vector<double>(), 0, "scatter_add self");
}

TEST(ScatterAddGrad, InPlace) {
  const Tensor idx = tensor({0, 1, 2, 2, 2, 0}).view({2, 3});
  expect_gradcheck(
      [&](const TL& in) {
        Tensor y = in[0] * 2.0;
        scatter_add_(y, 0, idx, in[1]);
        return y;
      },
      {leaf({3, 4}, 26), leaf({2, 3}, 27)});
  // Into a tensor that does not require grad: it joins the graph.
  Tensor src = leaf({2, 3}, 28);
  Tensor buf = zeros({3, 4}, kFloat64);
  scatter_add_(buf, 0, idx, src);
  EXPECT_TRUE(buf.requires_grad());
  buf.sum().backward();
  expect_close(src.grad(), {1, 1, 1, 1, 1, 1}, 0, "scatter_add_ into zeros");
  // A leaf that requires grad cannot be scattered into.
  Tensor l = leaf({3, 4}, 29);
  expect_error<autograd::AutogradError>([&] { scatter_add_(l, 0, idx, src); },
                                        {"[scatter_add_]", "leaf"});
  // Bad arguments are reported before the autograd check.
  expect_error([&] { scatter_add_(l, 0, tensor({0}), src); },
               {"[scatter_add_]", "same number of dims"});
}

TEST(ScatterAddGrad, DoubleBackward) {
  const Tensor idx = tensor({0, 1, 2, 2, 2, 0}).view({2, 3});
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of(
            [&] {
              return tanh(scatter_add(zeros({3, 3}, kFloat64), 0, idx, in[0]));
            },
            in[0], in[1]);
      },
      {leaf({2, 3}, 30), leaf({3, 3}, 31)});
}

// ---- index_add_ -------------------------------------------------------------------------------

TEST(IndexAddGrad, Gradcheck) {
  const Tensor idx = tensor({1, 3, 1});
  for (double alpha : {1.0, 2.5}) {
    SCOPED_TRACE("index_add_ alpha " + std::to_string(alpha));
    expect_gradcheck(
        [&](const TL& in) {
          Tensor y = in[0].clone();
          index_add_(y, 0, idx, in[1], alpha);
          return y;
        },
        {leaf({4, 3}, 32), leaf({3, 3}, 33)});
    expect_gradcheck(
        [&](const TL& in) {
          Tensor y = in[0] * 1.0;
          index_add_(y, 1, idx, in[1], alpha);
          return y;
        },
        {noncontig_leaf({2, 4}, 34), noncontig_leaf({2, 3}, 35)});
  }
  expect_gradcheck(
      [&](const TL& in) {
        Tensor y = in[0].clone();
        index_add_(y, 0, tensor({0}), in[1]);
        return y;
      },
      {leaf({}, 36), leaf({1}, 37)});
}

TEST(IndexAddGrad, MatchesPyTorch) {
  // torch: s = zeros(4, 3); src = zeros(3, 3); s.clone().index_add_(0, [1, 3, 1], src,
  // alpha=2.5).backward(arange(1., 13.).reshape(4, 3)); src.grad, s.grad
  Tensor s = leaf({4, 3}, 38);
  Tensor src = leaf({3, 3}, 39);
  Tensor y = s.clone();
  index_add_(y, 0, tensor({1, 3, 1}), src, 2.5);
  y.backward(ramp({4, 3}));
  expect_close(src.grad(), {10, 12.5, 15, 25, 27.5, 30, 10, 12.5, 15}, 0, "index_add_ src");
  expect_close(s.grad(), ramp({4, 3}).to_vector<double>(), 0, "index_add_ self");
}

TEST(IndexAddGrad, LeafErrorAndJoiningTheGraph) {
  Tensor src = leaf({2, 3}, 40);
  Tensor l = leaf({4, 3}, 41);
  expect_error<autograd::AutogradError>(
      [&] {
        index_add_(l, 0, tensor({0, 1}), src);
      },
      {"[index_add_]", "leaf"});
  Tensor buf = zeros({4, 3}, kFloat64);
  index_add_(buf, 0, tensor({2, 2}), src);
  ASSERT_TRUE(buf.requires_grad());
  (buf * ramp({4, 3})).sum().backward();
  expect_close(src.grad(), {7, 8, 9, 7, 8, 9}, 0, "index_add_ into zeros");
}

TEST(IndexAddGrad, DoubleBackward) {
  const Tensor idx = tensor({2, 0});
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of(
            [&] {
              Tensor y = zeros({3, 2}, kFloat64);
              index_add_(y, 0, idx, in[0], 1.5);
              return tanh(y);
            },
            in[0], in[1]);
      },
      {leaf({2, 2}, 42), leaf({3, 2}, 43)});
}

// ---- embedding --------------------------------------------------------------------------------

TEST(EmbeddingGrad, Gradcheck) {
  const Tensor ids = tensor({0, 4, 0, 3, 0, 1}).view({2, 3});
  expect_gradcheck([&](const TL& in) { return embedding(in[0], ids); }, {leaf({5, 2}, 44)});
  expect_gradcheck([&](const TL& in) { return embedding(in[0], ids.t()); },
                   {noncontig_leaf({5, 3}, 45)});
  expect_gradcheck([&](const TL& in) { return embedding(in[0], tensor({2}).view({})); },
                   {leaf({3, 2}, 46)});
}

TEST(EmbeddingGrad, MatchesPyTorch) {
  // torch: w = zeros(5, 2); F.embedding([[0, 4, 0], [3, 0, 1]], w).backward(arange(1., 13.)
  // .reshape(2, 3, 2)); w.grad
  Tensor w = leaf({5, 2}, 47);
  Tensor out = embedding(w, tensor({0, 4, 0, 3, 0, 1}).view({2, 3}));
  EXPECT_STREQ(out.grad_fn()->name(), "EmbeddingBackward");
  out.backward(ramp({2, 3, 2}));
  expect_close(w.grad(), {15, 18, 11, 12, 0, 0, 7, 8, 3, 4}, 0, "embedding");
}

TEST(EmbeddingGrad, DoubleBackward) {
  const Tensor ids = tensor({1, 1, 0});
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of([&] { return tanh(embedding(in[0], ids)); }, in[0], in[1]);
      },
      {leaf({2, 3}, 48), leaf({3, 3}, 49)});
  // embedding_backward itself records when its gradient input requires grad.
  Tensor g = leaf({3, 2}, 50);
  Tensor gw = embedding_backward(g, ids, 4);
  ASSERT_TRUE(gw.requires_grad());
  gw.sum().backward();
  expect_close(g.grad(), {1, 1, 1, 1, 1, 1}, 0, "embedding_backward");
}

// ---- cat and stack ----------------------------------------------------------------------------

TEST(CatGrad, Gradcheck) {
  for (int64_t dim : {0, 1, -1}) {
    SCOPED_TRACE("cat dim " + std::to_string(dim));
    expect_gradcheck([&](const TL& in) { return cat(in, dim); },
                     {leaf({2, 3}, 51), noncontig_leaf({2, 3}, 52), leaf({2, 3}, 53)});
  }
  expect_gradcheck([&](const TL& in) { return cat(in, 1); },
                   {leaf({2, 1, 2}, 54), leaf({2, 3, 2}, 55), leaf({2, 0, 2}, 56)});
  // Inputs that do not require grad, of another dtype (promoted), and the legacy 1-d empty
  // tensor that cat skips.
  const Tensor c32 = ones({1, 3}, kFloat32);
  const Tensor empty1d = zeros({0}, kFloat64);
  expect_gradcheck(
      [&](const TL& in) {
        return cat({in[0], c32, empty1d, in[1]}, 0);
      },
      {leaf({2, 3}, 57), leaf({1, 3}, 58)});
  expect_gradcheck([&](const TL& in) { return cat({in[0]}, 0); }, {leaf({3}, 59)});
}

TEST(CatGrad, RecordsOneNodeAndMixedDtypes) {
  Tensor a = leaf({2, 2}, 60);
  Tensor b = leaf({1, 2}, 61, kFloat32);
  Tensor out = cat({a, b, ones({1, 2}, kInt64)}, 0);  // float64
  ASSERT_TRUE(out.requires_grad());
  EXPECT_STREQ(out.grad_fn()->name(), "CatBackward");
  ASSERT_EQ(out.grad_fn()->num_outputs(), 3u);
  // The copies into the output recorded nothing of their own.
  EXPECT_STREQ(out.grad_fn()->next_edge(0).fn->name(), "AccumulateGrad");
  EXPECT_STREQ(out.grad_fn()->next_edge(1).fn->name(), "AccumulateGrad");
  EXPECT_FALSE(out.grad_fn()->next_edge(2).valid());
  out.backward(ramp({4, 2}));
  expect_close(a.grad(), {1, 2, 3, 4}, 0, "cat a");
  EXPECT_EQ(b.grad().dtype(), kFloat32);
  expect_close(b.grad(), {5, 6}, 0, "cat b (float32)");
  // Empty inputs and outputs still record.
  Tensor e = leaf({0, 2}, 62);
  Tensor eo = cat({e, e}, 0);
  EXPECT_TRUE(eo.requires_grad());
  eo.sum().backward();
  EXPECT_EQ(e.grad().shape(), Shape({0, 2}));
  Tensor e1 = leaf({0}, 63);
  EXPECT_TRUE(cat({e1}, 0).requires_grad());
}

TEST(CatGrad, DoubleBackward) {
  expect_gradcheck(
      [&](const TL& in) {
        return grad_of([&] { return tanh(cat({in[0], in[1]}, 1)); }, in[0], in[2]);
      },
      {leaf({2, 2}, 64), leaf({2, 1}, 65), leaf({2, 3}, 66)});
}

TEST(StackGrad, GradcheckAndGraph) {
  for (int64_t dim : {0, 1, 2, -1}) {
    SCOPED_TRACE("stack dim " + std::to_string(dim));
    expect_gradcheck([&](const TL& in) { return stack(in, dim); },
                     {leaf({2, 3}, 67), noncontig_leaf({2, 3}, 68)});
  }
  // stack = unsqueeze (ViewBackward) per input, then one CatBackward: nothing recorded twice.
  Tensor a = leaf({3}, 69);
  Tensor b = leaf({3}, 70);
  Tensor s = stack({a, b}, 0);
  EXPECT_STREQ(s.grad_fn()->name(), "CatBackward");
  ASSERT_EQ(s.grad_fn()->num_outputs(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& view = s.grad_fn()->next_edge(i).fn;
    ASSERT_NE(view, nullptr);
    EXPECT_STREQ(view->name(), "ViewBackward");
    EXPECT_STREQ(view->next_edge(0).fn->name(), "AccumulateGrad");
  }
}

// ---- split, split_with_sizes, chunk -----------------------------------------------------------

TEST(SplitGrad, Gradcheck) {
  auto all = [](const std::vector<Tensor>& v) { return v; };
  expect_gradcheck(autograd::GradcheckFn([&](const TL& in) { return all(split(in[0], 2, 1)); }),
                   {leaf({3, 5}, 71)});
  expect_gradcheck(autograd::GradcheckFn([&](const TL& in) { return all(split(in[0], 2, 0)); }),
                   {noncontig_leaf({3, 4}, 72)});
  expect_gradcheck(autograd::GradcheckFn([&](const TL& in) {
                     return all(split_with_sizes(in[0], {1, 0, 3}, -1));
                   }),
                   {leaf({2, 4}, 73)});
  expect_gradcheck(autograd::GradcheckFn([&](const TL& in) { return all(chunk(in[0], 3, 0)); }),
                   {leaf({5, 2}, 74)});
  // Using only some pieces: the others get no gradient.
  Tensor x = leaf({6}, 75);
  std::vector<Tensor> parts = chunk(x, 3);
  ASSERT_EQ(parts.size(), 3u);
  // One node for every piece (the cat of their gradients), as PyTorch's SplitBackward.
  EXPECT_STREQ(parts[1].grad_fn()->name(), "SplitBackward");
  EXPECT_EQ(parts[0].grad_fn(), parts[2].grad_fn());
  EXPECT_EQ(parts[2].output_nr(), 2u);
  (parts[1] * 3.0).sum().backward();
  expect_close(x.grad(), {0, 0, 3, 3, 0, 0}, 0, "chunk piece 1");
  // Pieces used twice and out of order, through later views (the fused-qkv pattern), and a
  // second backward through the first's graph (create_graph: the cat is recorded).
  Tensor w = leaf({2, 6}, 76);
  std::vector<Tensor> qkv = split(w, 2, 1);
  Tensor y = (qkv[2].t() * qkv[0].t()).sum() + (qkv[2] * 2.0).sum();
  Tensor g = autograd::grad({y}, {w}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  const std::vector<double> wv = w.to_vector<double>();
  std::vector<double> want(12, 0.0);
  for (int r = 0; r < 2; ++r) {
    want[r * 6 + 0] = wv[r * 6 + 4];        // d/dq = v
    want[r * 6 + 1] = wv[r * 6 + 5];
    want[r * 6 + 4] = wv[r * 6 + 0] + 2.0;  // d/dv = q + 2
    want[r * 6 + 5] = wv[r * 6 + 1] + 2.0;
  }
  expect_close(g, want, 1e-12, "split used twice");
  ASSERT_TRUE(g.requires_grad());
  const Tensor gg = autograd::grad({g.sum()}, {w})[0];
  expect_close(gg, {1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1}, 1e-12, "second derivative");
}

// ---- one_hot ----------------------------------------------------------------------------------

TEST(OneHotGrad, IsNotDifferentiable) {
  const Tensor oh = one_hot(tensor({0, 2, 1}), 3);
  EXPECT_EQ(oh.dtype(), kInt64);
  EXPECT_FALSE(oh.requires_grad());
}

// ---- CUDA == CPU ------------------------------------------------------------------------------

/// The gradients of fn(inputs) weighted by `v`, for leaves on `device` made from `inputs`.
std::vector<Tensor> grads_on(const std::function<Tensor(const TL&)>& fn, const TL& inputs,
                             const Tensor& v, Device device) {
  TL xs;
  for (const Tensor& t : inputs) {
    Tensor d = t.detach().to(device, /*non_blocking=*/false, /*copy=*/true);
    d.requires_grad_();
    xs.push_back(d);
  }
  const Tensor y = fn(xs);
  return autograd::grad({y}, xs, {v.to(device)});
}

TEST(IndexingGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Device dev("cuda");
  struct Case {
    std::string name;
    std::function<Tensor(const TL&)> fn;
    TL inputs;
    Shape out_shape;
  };
  const Tensor idx = tensor({2, 0, 2, 3});
  const Tensor gidx = tensor({0, 1, 2, 2, 2, 0}).view({2, 3});
  const Tensor ids = tensor({0, 4, 0, 3, 0, 1}).view({2, 3});
  auto on = [&](const Tensor& t, const TL& like) { return t.to(like[0].device()); };
  std::vector<Case> cases = {
      {"index_select",
       [&](const TL& in) { return index_select(in[0], 1, on(idx, in)); },
       {test::rand_t({3, 4}, kFloat32, 1)},
       {3, 4}},
      {"gather",
       [&](const TL& in) { return gather(in[0], 0, on(gidx, in)); },
       {test::rand_t({3, 4}, kFloat32, 2)},
       {2, 3}},
      {"scatter_add",
       [&](const TL& in) { return scatter_add(in[0], 0, on(gidx, in), in[1]); },
       {test::rand_t({3, 4}, kFloat32, 3), test::rand_t({2, 5}, kFloat32, 4)},
       {3, 4}},
      {"index_add_",
       [&](const TL& in) {
         Tensor y = in[0] * 1.0;
         index_add_(y, 0, on(idx, in), in[1], 2.0);
         return y;
       },
       {test::rand_t({4, 3}, kFloat64, 5), test::rand_t({4, 3}, kFloat64, 6)},
       {4, 3}},
      {"embedding",
       [&](const TL& in) { return embedding(in[0], on(ids, in)); },
       {test::rand_t({5, 2}, kFloat32, 7)},
       {2, 3, 2}},
      {"cat",
       [&](const TL& in) {
         return cat({in[0], in[1]}, 1);
       },
       {test::rand_t({2, 3}, kFloat32, 8), test::rand_t({2, 1}, kFloat32, 9)},
       {2, 4}},
      {"stack",
       [&](const TL& in) {
         return stack({in[0], in[1]}, 1);
       },
       {test::rand_t({2, 3}, kFloat32, 10), test::rand_t({2, 3}, kFloat32, 11)},
       {2, 2, 3}},
  };
  for (const Case& c : cases) {
    const Tensor v = test::rand_t(IntList(c.out_shape), c.inputs[0].dtype(), 99);
    const TL want = grads_on(c.fn, c.inputs, v, kCPU);
    const TL got = grads_on(c.fn, c.inputs, v, dev);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(got[i].is_cuda()) << c.name;
      expect_close(got[i], want[i].to_vector<double>(), 1e-5,
                   c.name + " input " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace ember
