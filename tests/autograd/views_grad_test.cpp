// Gradients of the view and copy methods of Tensor: view, reshape, flatten, permute, transpose,
// t, narrow, slice, select, expand, squeeze, unsqueeze, as_strided, contiguous, clone, to and
// copy_; views sharing the version counter; in-place ops on views.
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

/// arange(1, n + 1) as float64 in `shape`.
Tensor ramp(IntList shape) {
  const Shape s(shape);
  return arange(1, s.numel() + 1, 1, kFloat64).reshape(shape);
}

/// A float64 leaf holding arange(1, n + 1) in `shape`.
Tensor ramp_leaf(IntList shape) {
  Tensor t = ramp(shape);
  t.requires_grad_();
  return t;
}

/// The gradient of (f() * v).sum() with respect to x, recorded (create_graph) so that gradcheck
/// on it checks the backward rule's own derivative (with respect to x and to v).
Tensor grad_of(const std::function<Tensor()>& f, const Tensor& x, const Tensor& v) {
  EnableGradGuard grad_on;  // gradcheck evaluates fn under no-grad for finite differences
  return autograd::grad({f()}, {x}, {v}, std::nullopt, /*create_graph=*/true)[0];
}

/// Gradchecks `fn` on a contiguous and a non-contiguous leaf of `shape`.
void check_both(const std::string& what, IntList shape,
                const std::function<Tensor(const Tensor&)>& fn, uint64_t seed) {
  SCOPED_TRACE(what);
  expect_gradcheck([&](const TL& in) { return fn(in[0]); }, {leaf(shape, seed)});
  expect_gradcheck([&](const TL& in) { return fn(in[0]); }, {noncontig_leaf(shape, seed + 1)});
}

// ---- shape views ------------------------------------------------------------------------------

TEST(ViewGrad, ViewReshapeFlatten) {
  check_both(
      "view", {2, 3, 4},
      [](const Tensor& x) {
        return x.contiguous().view({4, -1});
      },
      1);
  expect_gradcheck([](const TL& in) { return in[0].view({3, 2, 1}); }, {leaf({6}, 3)});
  expect_gradcheck([](const TL& in) { return in[0].view({}); }, {leaf({1, 1}, 4)});
  check_both(
      "reshape", {2, 3, 4}, [](const Tensor& x) { return x.reshape({-1}); }, 5);
  check_both(
      "reshape", {2, 3, 4},
      [](const Tensor& x) {
        return x.reshape({3, 8});
      },
      7);
  check_both(
      "flatten", {2, 3, 4}, [](const Tensor& x) { return x.flatten(); }, 9);
  check_both(
      "flatten(0, 1)", {2, 3, 4}, [](const Tensor& x) { return x.flatten(0, 1); }, 11);
  expect_gradcheck([](const TL& in) { return in[0].flatten(); }, {leaf({}, 13)});
}

TEST(ViewGrad, ReshapeViewAndCopyPaths) {
  Tensor x = leaf({3, 4}, 14);
  Tensor v = x.reshape({12});  // strides allow a view
  EXPECT_STREQ(v.grad_fn()->name(), "ViewBackward");
  EXPECT_STREQ(v.grad_fn()->next_edge(0).fn->name(), "AccumulateGrad");
  Tensor c = x.t().reshape({12});  // a copy, then a view of it
  EXPECT_STREQ(c.grad_fn()->name(), "ViewBackward");
  EXPECT_STREQ(c.grad_fn()->next_edge(0).fn->name(), "CloneBackward");
  (c * ramp({12})).sum().backward();
  // c[k] = x.t()[k / 3][k % 3] = x[k % 3][k / 3]: x[i][j] gets k + 1 = 3 j + i + 1.
  expect_close(x.grad(), {1, 4, 7, 10, 2, 5, 8, 11, 3, 6, 9, 12}, 0, "reshape copy path");
}

TEST(ViewGrad, PermuteTransposeT) {
  check_both(
      "permute", {2, 3, 4},
      [](const Tensor& x) {
        return x.permute({2, 0, 1});
      },
      20);
  check_both(
      "permute negative", {2, 3, 4},
      [](const Tensor& x) {
        return x.permute({-1, 1, 0});
      },
      22);
  check_both(
      "transpose", {2, 3, 4}, [](const Tensor& x) { return x.transpose(0, 2); }, 24);
  check_both(
      "transpose(-1, -2)", {2, 3}, [](const Tensor& x) { return x.transpose(-1, -2); }, 26);
  check_both(
      "t", {3, 2}, [](const Tensor& x) { return x.t(); }, 28);
  expect_gradcheck([](const TL& in) { return in[0].t(); }, {leaf({3}, 30)});
}

TEST(ViewGrad, SqueezeUnsqueezeExpand) {
  check_both(
      "squeeze", {2, 1, 3}, [](const Tensor& x) { return x.unsqueeze(0).squeeze(); }, 40);
  check_both(
      "squeeze(1)", {1, 3}, [](const Tensor& x) { return x.unsqueeze(1).squeeze(1); }, 42);
  check_both(
      "squeeze(0) of size 2", {2, 3}, [](const Tensor& x) { return x.squeeze(0); }, 44);
  check_both(
      "unsqueeze(-1)", {2, 3}, [](const Tensor& x) { return x.unsqueeze(-1); }, 46);
  check_both(
      "expand", {3, 1},
      [](const Tensor& x) {
        return x.expand({2, 3, 4});
      },
      48);
  check_both(
      "expand -1", {1, 2},
      [](const Tensor& x) {
        return x.expand({3, -1});
      },
      50);
  expect_gradcheck([](const TL& in) { return in[0].expand({2, 2}); }, {leaf({}, 52)});
  Tensor x = leaf({3, 1}, 53);
  x.expand({2, 3, 4}).sum().backward();
  expect_close(x.grad(), {8, 8, 8}, 0, "expand sums back");
}

// ---- narrow, slice, select --------------------------------------------------------------------

TEST(ViewGrad, NarrowSliceSelect) {
  check_both(
      "narrow", {4, 5}, [](const Tensor& x) { return x.narrow(1, 1, 3); }, 60);
  check_both(
      "narrow negative start", {4, 5}, [](const Tensor& x) { return x.narrow(0, -2, 2); }, 62);
  check_both(
      "slice step 2", {4, 5}, [](const Tensor& x) { return x.slice(1, 1, 5, 2); }, 64);
  check_both(
      "slice step 3 open end", {7, 2}, [](const Tensor& x) { return x.slice(0, 0, {}, 3); }, 66);
  check_both(
      "slice negative bounds", {6, 2}, [](const Tensor& x) { return x.slice(0, -5, -1, 2); }, 68);
  check_both(
      "slice end past size", {4, 3}, [](const Tensor& x) { return x.slice(0, 2, 100); }, 70);
  check_both(
      "empty slice", {4, 3}, [](const Tensor& x) { return x.slice(0, 3, 1) * 1.0; }, 72);
  check_both(
      "select", {3, 4}, [](const Tensor& x) { return x.select(1, 2); }, 74);
  check_both(
      "select negative index", {3, 4}, [](const Tensor& x) { return x.select(0, -1); }, 76);
  check_both(
      "select negative dim", {3, 4}, [](const Tensor& x) { return x[1].select(-1, -3); }, 78);
  expect_gradcheck([](const TL& in) { return in[0].select(0, 1); }, {leaf({3}, 80)});
}

TEST(ViewGrad, SliceAndSelectValues) {
  Tensor x = leaf({3, 4}, 81);
  (x.slice(1, 1, {}, 2) * ramp({3, 2})).sum().backward();
  expect_close(x.grad(), {0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6}, 0, "slice step 2");
  Tensor y = leaf({3, 4}, 82);
  (y.select(0, -1) * ramp({4})).sum().backward();
  expect_close(y.grad(), {0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4}, 0, "select -1");
}

TEST(ViewGrad, DoubleBackwardThroughSliceAndSelect) {
  // torch: x = arange(1., 13.).reshape(3, 4); g = grad((x[:, 1::2] ** 3).sum(), x,
  // create_graph=True); grad(g.sum(), x) -> 6 x at the sliced positions, 0 elsewhere.
  Tensor x = ramp_leaf({3, 4});
  Tensor y = x.slice(1, 1, {}, 2);
  Tensor g = autograd::grad({(y * y * y).sum()}, {x}, {}, std::nullopt, true)[0];
  ASSERT_TRUE(g.requires_grad());
  Tensor gg = autograd::grad({g.sum()}, {x})[0];
  expect_close(gg, {0, 12, 0, 24, 0, 36, 0, 48, 0, 60, 0, 72}, 0, "slice double backward");
  // torch: the same with x.select(1, -1).
  Tensor x2 = ramp_leaf({3, 4});
  Tensor s = x2.select(1, -1);
  Tensor g2 = autograd::grad({(s * s * s).sum()}, {x2}, {}, std::nullopt, true)[0];
  Tensor gg2 = autograd::grad({g2.sum()}, {x2})[0];
  expect_close(gg2, {0, 0, 0, 24, 0, 0, 0, 48, 0, 0, 0, 72}, 0, "select double backward");
  // And as gradchecks of the gradient itself (with respect to x and the incoming gradient).
  expect_gradcheck(
      [](const TL& in) {
        return grad_of([&] { return tanh(in[0].slice(0, 1, 5, 2)); }, in[0], in[1]);
      },
      {leaf({5, 2}, 83), leaf({2, 2}, 84)});
  expect_gradcheck(
      [](const TL& in) { return grad_of([&] { return tanh(in[0].select(1, -2)); }, in[0], in[1]); },
      {leaf({2, 3}, 85), leaf({2}, 86)});
  expect_gradcheck(
      [](const TL& in) {
        return grad_of([&] { return tanh(in[0].narrow(0, 1, 2)); }, in[0], in[1]);
      },
      {noncontig_leaf({4, 3}, 87), leaf({2, 3}, 88)});
}

TEST(ViewGrad, DoubleBackwardThroughOtherViews) {
  expect_gradcheck(
      [](const TL& in) {
        return grad_of([&] { return tanh(in[0].t().reshape({6}).expand({2, 6})); }, in[0], in[1]);
      },
      {leaf({2, 3}, 89), leaf({2, 6}, 90)});
  expect_gradcheck(
      [](const TL& in) {
        return grad_of([&] { return tanh(in[0].as_strided({3, 2}, {1, 1})); }, in[0], in[1]);
      },
      {leaf({4}, 91), leaf({3, 2}, 92)});
}

// ---- as_strided -------------------------------------------------------------------------------

TEST(AsStridedGrad, Gradcheck) {
  expect_gradcheck([](const TL& in) { return in[0].as_strided({2, 3}, {3, 1}); }, {leaf({6}, 100)});
  expect_gradcheck(
      [](const TL& in) {
        return in[0].as_strided({3, 2}, {1, 3}, 0);
      },
      {leaf({2, 3}, 101)});
  // Overlapping output: sliding windows and a stride-0 dim.
  expect_gradcheck([](const TL& in) { return in[0].as_strided({3, 3}, {1, 1}); }, {leaf({5}, 102)});
  expect_gradcheck(
      [](const TL& in) {
        return in[0].as_strided({2, 4, 2}, {2, 0, 1}, 1);
      },
      {leaf({6}, 103)});
  // An input that is itself a view: with a storage offset, and non-contiguous.
  expect_gradcheck([](const TL& in) { return in[0].narrow(0, 2, 6).as_strided({3}, {2}, 3); },
                   {leaf({10}, 104)});
  expect_gradcheck(
      [](const TL& in) {
        return in[0].as_strided({2, 2}, {1, 3}, 1);
      },
      {noncontig_leaf({3, 2}, 105)});
  expect_gradcheck([](const TL& in) { return in[0].as_strided({0, 3}, {3, 1}); }, {leaf({6}, 106)});
}

TEST(AsStridedGrad, MatchesPyTorchWithOverlap) {
  // torch: x = tensor([1., 2, 3, 4, 5]); x.as_strided((3, 3), (1, 1)).backward(arange(1., 10.)
  // .reshape(3, 3)); x.grad
  Tensor x = leaf({5}, 107);
  Tensor y = x.as_strided({3, 3}, {1, 1});
  EXPECT_STREQ(y.grad_fn()->name(), "AsStridedBackward");
  y.backward(ramp({3, 3}));
  expect_close(x.grad(), {1, 6, 15, 14, 9}, 0, "overlapping output");
  // torch: x = tensor([1., 2, 3, 4]); x.expand(3, 4).as_strided((2, 3), (1, 1))
  // .backward(arange(1., 7.).reshape(2, 3)); x.grad. The expanded input reaches each storage
  // element three times, and the gradient is shared among them.
  Tensor w = leaf({4}, 108);
  w.expand({3, 4}).as_strided({2, 3}, {1, 1}).backward(ramp({2, 3}));
  expect_close(w.grad(), {1, 6, 8, 6}, 1e-15, "overlapping input");
}

// ---- copies -----------------------------------------------------------------------------------

TEST(CopyGrad, ContiguousCloneTo) {
  check_both(
      "contiguous", {3, 4}, [](const Tensor& x) { return x.contiguous(); }, 120);
  check_both(
      "clone", {3, 4}, [](const Tensor& x) { return x.clone(); }, 122);
  check_both(
      "to(float64, copy)", {3, 4}, [](const Tensor& x) { return x.to(kFloat64, true); }, 124);
  Tensor x = leaf({3, 4}, 126);
  Tensor nc = x.t();
  EXPECT_STREQ(nc.contiguous().grad_fn()->name(), "CloneBackward");
  EXPECT_STREQ(x.clone().grad_fn()->name(), "CloneBackward");
  Tensor f = x.to(kFloat32);
  EXPECT_STREQ(f.grad_fn()->name(), "ToCopyBackward");
  (f * ramp({3, 4}).to(kFloat32)).sum().backward();
  EXPECT_EQ(x.grad().dtype(), kFloat64);
  expect_close(x.grad(), ramp({12}).to_vector<double>(), 0, "to(float32) gradient");
  // Through float32 and back, with a step float32 can resolve.
  autograd::GradcheckOptions loose;
  loose.eps = 1e-3;
  loose.atol = 1e-3;
  expect_gradcheck([](const TL& in) { return in[0].to(kFloat32).to(kFloat64); }, {leaf({4}, 127)},
                   loose);
  // Integral results carry no history.
  EXPECT_FALSE(x.to(kInt64).requires_grad());
}

TEST(CopyGrad, CopyIntoBroadcastsAndConverts) {
  expect_gradcheck(
      [](const TL& in) {
        Tensor dst = zeros({2, 3}, kFloat64);
        dst.copy_(in[0]);
        return dst;
      },
      {leaf({3}, 130)});
  expect_gradcheck(
      [](const TL& in) {
        Tensor dst = zeros({4, 2, 3}, kFloat64);
        dst.copy_(in[0]);
        return dst;
      },
      {noncontig_leaf({2, 1}, 131)});
  // self's old values are overwritten: its own inputs get no gradient through the copy.
  expect_gradcheck(
      [](const TL& in) {
        Tensor y = in[0] * 2.0;
        y.copy_(in[1]);
        return y + in[0];
      },
      {leaf({2, 3}, 132), leaf({1, 3}, 133)});
  Tensor src = leaf({3}, 134);
  Tensor dst = zeros({2, 3}, kFloat32);
  dst.copy_(src);
  EXPECT_STREQ(dst.grad_fn()->name(), "CopyBackward");
  (dst * ramp({2, 3}).to(kFloat32)).sum().backward();
  EXPECT_EQ(src.grad().dtype(), kFloat64);
  expect_close(src.grad(), {5, 7, 9}, 0, "copy_ into float32, broadcast");
}

TEST(CopyGrad, Float32GradientMatchesFloat64) {
  Tensor x64 = leaf({3, 4}, 140);
  Tensor x32 = x64.detach().to(kFloat32);
  x32.requires_grad_();
  auto f = [](const Tensor& x) {
    return tanh(x.t().slice(0, 1, {}, 2).reshape({-1}).expand({2, 6})).sum();
  };
  f(x64).backward();
  f(x32).backward();
  EXPECT_EQ(x32.grad().dtype(), kFloat32);
  expect_close(x32.grad(), x64.grad().to_vector<double>(), 1e-5, "views in float32");
}

// ---- views share the version counter ----------------------------------------------------------

TEST(ViewVersion, SavedViewOfModifiedBaseIsReported) {
  Tensor x = leaf({2, 3}, 150);
  Tensor y = x * 2.0;
  Tensor v = y.view({6});
  Tensor z = v * v;  // saves v
  const uint32_t before = v.version();
  y.add_(1.0);  // y is not a view: allowed, and bumps the counter v shares
  EXPECT_EQ(v.version(), y.version());
  EXPECT_GT(v.version(), before);
  expect_error<autograd::AutogradError>([&] { z.sum().backward(); },
                                        {"modified by an in-place operation", "MulBackward"});
}

TEST(ViewVersion, BaseModifiedThroughAnotherViewIsReported) {
  Tensor x = leaf({2, 3}, 151);
  Tensor y = x * 2.0;
  Tensor first = y.select(0, 0);
  Tensor z = first * first;  // saves the view of row 0
  {
    NoGradGuard no_grad;
    y.select(0, 1).zero_();  // another row, same storage
  }
  expect_error<autograd::AutogradError>([&] { z.sum().backward(); },
                                        {"modified by an in-place operation"});
  // The other way round: the base is saved, a view of it is modified.
  Tensor w = x * 3.0;
  Tensor u = w * w;  // saves w
  {
    NoGradGuard no_grad;
    w.narrow(1, 0, 1).fill_(0.0);
  }
  expect_error<autograd::AutogradError>([&] { u.sum().backward(); },
                                        {"modified by an in-place operation"});
}

// ---- in-place ops on views --------------------------------------------------------------------

TEST(ViewInPlace, OnAViewOfATensorThatRequiresGradIsNotImplemented) {
  const char* msg =
      "in-place operations on a view are not supported when autograd records them";
  Tensor x = leaf({2, 3}, 160);
  Tensor y = x * 2.0;
  expect_error<NotImplementedError>(
      [&] {
        y.narrow(1, 0, 2).copy_(ones({2, 2}, kFloat64));
      },
      {"[copy_]", msg, "is a view"});
  expect_error<NotImplementedError>([&] { x.view({6}).copy_(ones({6}, kFloat64)); },
                                    {"[copy_]", msg});
  expect_error<NotImplementedError>(
      [&] {
        Tensor row = y.select(0, 0);
        index_add_(row, 0, tensor({0}), ones({1}, kFloat64));
      },
      {"[index_add_]", msg});
  expect_error<NotImplementedError>([&] { y.t().mul_(2.0); }, {msg});
  // The base itself (not a view) may be modified; a clone of the view may too.
  Tensor c = y.narrow(1, 0, 2).clone();
  c.mul_(2.0);
  (c.sum() + y.sum()).backward();
  expect_close(x.grad(), {6, 6, 2, 6, 6, 2}, 0, "through the clone of a view");
}

TEST(ViewInPlace, ViewOfATensorThatDoesNotRequireGradIsRefusedToo) {
  // buf would silently get no gradient if the copy were recorded on the view alone.
  Tensor w = leaf({2}, 161);
  Tensor buf = zeros({3, 2}, kFloat64);
  expect_error<NotImplementedError>([&] { buf.select(0, 1).copy_(w); },
                                    {"[copy_]", "is a view"});
  // Without anything that requires grad, views are written in place as usual.
  buf.select(0, 1).copy_(ones({2}, kFloat64));
  EXPECT_EQ(buf.sum().item<double>(), 2.0);
}

TEST(ViewInPlace, OutputsThatAreInternallyViewsMayBeModified) {
  // sum() returns a reshaped view of its own fresh buffer: nothing else sees that storage.
  Tensor x = leaf({3}, 162);
  Tensor loss = x.sum();
  loss += (x * x).sum();
  loss.backward();
  const auto xs = x.to_vector<double>();
  expect_close(x.grad(), {1 + 2 * xs[0], 1 + 2 * xs[1], 1 + 2 * xs[2]}, 1e-12, "sum + sum sq");
}

TEST(ViewInPlace, StaleViewIsReportedWhenUsedAfterItsBaseChanged) {
  Tensor x = leaf({2, 3}, 163);
  Tensor y = x * 2.0;
  Tensor v = y.select(0, 0);
  Tensor early = v * 3.0;  // used before the change: fine
  y.mul_(2.0);
  expect_error<NotImplementedError>([&] { (v * 1.0).sum(); },
                                    {"is a view", "SelectBackward", "modified in place"});
  early.sum().backward();
  expect_close(x.grad(), {6, 6, 6, 0, 0, 0}, 0, "gradient of the view taken before");
}

// ---- CUDA == CPU ------------------------------------------------------------------------------

TEST(ViewsGradCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Device dev("cuda");
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> cases = {
      {"reshape copy", [](const Tensor& x) { return x.t().reshape({-1}); }},
      {"permute",
       [](const Tensor& x) {
         return x.permute({1, 0});
       }},
      {"slice", [](const Tensor& x) { return x.slice(1, 1, {}, 2); }},
      {"select", [](const Tensor& x) { return x.select(0, -1); }},
      {"expand",
       [](const Tensor& x) {
         return x.unsqueeze(0).expand({3, 4, 6});
       }},
      {"as_strided overlap",
       [](const Tensor& x) {
         return x.as_strided({5, 4}, {2, 1}, 1);
       }},
      {"as_strided of expand",
       [](const Tensor& x) {
         return x.expand({2, 4, 6}).as_strided({3, 5}, {1, 1});
       }},
      {"to float32", [](const Tensor& x) { return x.to(kFloat32); }},
      {"copy_ to cpu",
       [](const Tensor& x) {
         Tensor d = zeros({2, 4, 6}, kFloat64);
         d.copy_(x);
         return d;
       }},
  };
  const Tensor base = test::rand_t({4, 6}, kFloat64, 170);
  for (const auto& [name, fn] : cases) {
    Tensor xc = base.clone();
    xc.requires_grad_();
    Tensor xd = base.to(dev);
    xd.requires_grad_();
    const Tensor yc = fn(xc);
    const Tensor yd = fn(xd);
    const Tensor v = test::rand_t(IntList(yc.shape()), yc.dtype(), 171);
    const Tensor gc = autograd::grad({yc}, {xc}, {v})[0];
    const Tensor gd = autograd::grad({yd}, {xd}, {v.to(yd.device())})[0];
    ASSERT_TRUE(gd.is_cuda()) << name;
    expect_close(gd, gc.to_vector<double>(), 1e-6, name);
  }
}

}  // namespace
}  // namespace ember
