// The backward engine, leaves, grad modes, hooks, callbacks, custom functions and gradcheck.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/autograd/grad_util.h"

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::leaf;

TEST(Engine, LinearChainAccumulatesIntoLeaves) {
  Tensor x = tensor({1.0, 2.0, 3.0});
  Tensor w = leaf({3}, 1);
  Tensor b = leaf({}, 2);
  Tensor loss = (x * w + b).sum();
  EXPECT_TRUE(loss.requires_grad());
  EXPECT_FALSE(loss.is_leaf());
  ASSERT_NE(loss.grad_fn(), nullptr);
  EXPECT_STREQ(loss.grad_fn()->name(), "SumBackward");
  loss.backward();
  expect_close(w.grad(), {1, 2, 3}, 0, "dloss/dw");
  expect_close(b.grad(), {3}, 0, "dloss/db (summed over the broadcast)");
  EXPECT_FALSE(x.grad().defined());
  EXPECT_TRUE(w.is_leaf());
}

TEST(Engine, BroadcastGradientsAreSummedBackToInputShape) {
  Tensor a = leaf({3, 1}, 3);
  Tensor b = leaf({4}, 4);
  (a + b).sum().backward();
  EXPECT_EQ(a.grad().shape(), Shape({3, 1}));
  expect_close(a.grad(), {4, 4, 4}, 0, "a");
  expect_close(b.grad(), {3, 3, 3, 3}, 0, "b");
}

TEST(Engine, GradientsAccumulateAcrossBackwardCalls) {
  Tensor w = leaf({2}, 5);
  (w * 3.0).sum().backward();
  (w * 3.0).sum().backward();
  expect_close(w.grad(), {6, 6}, 0, "two passes");
  w.set_grad({});
  EXPECT_FALSE(w.grad().defined());
}

TEST(Engine, NonScalarBackwardNeedsAGradient) {
  Tensor w = leaf({2}, 6);
  Tensor y = w * 2.0;
  expect_error<autograd::AutogradError>([&] { y.backward(); },
                                        {"implicitly created", "one-element", "[2]"});
  y.backward(tensor({1.0, 10.0}, kFloat64));
  expect_close(w.grad(), {2, 20}, 0, "explicit gradient");
  expect_error([&] { (w * 2.0).backward(ones({3}, kFloat64)); }, {"shape", "[3]", "[2]"});
}

TEST(Engine, BackwardOnTensorWithoutGradFnFails) {
  Tensor x = ones({1});
  expect_error<autograd::AutogradError>([&] { x.backward(); },
                                        {"does not require grad", "grad_fn"});
}

TEST(Engine, SecondBackwardThroughFreedGraphFails) {
  Tensor x = leaf({3}, 7);
  Tensor loss = x.tanh().sum();
  loss.backward();
  expect_error<autograd::AutogradError>([&] { loss.backward(); },
                                        {"second time", "TanhBackward", "retain_graph"});
}

TEST(Engine, RetainGraphAllowsASecondPass) {
  Tensor x = leaf({3}, 8);
  Tensor loss = x.tanh().sum();
  loss.backward({}, /*retain_graph=*/true);
  const std::vector<double> once = x.grad().to_vector<double>();
  loss.backward();
  const std::vector<double> twice = x.grad().to_vector<double>();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(twice[i], 2 * once[i], 1e-12);
}

TEST(Engine, SavedTensorsAreFreedAfterBackward) {
  for (bool retain : {false, true}) {
    Tensor x = leaf({1000}, 9);
    std::weak_ptr<Storage> saved;
    Tensor loss;
    {
      Tensor h = (x * 2.0).tanh();  // TanhBackward saves its output h
      saved = h.storage();
      loss = h.sum();
    }
    ASSERT_FALSE(saved.expired()) << "the graph should hold the saved output";
    loss.backward({}, retain);
    EXPECT_EQ(saved.expired(), !retain) << "retain_graph=" << retain;
  }
}

TEST(Engine, GraphIsFreedWithItsOutput) {
  Tensor x = leaf({10}, 10);
  std::weak_ptr<autograd::Node> node;
  {
    Tensor y = x.tanh();
    node = y.grad_fn();
    ASSERT_FALSE(node.expired());
  }
  EXPECT_TRUE(node.expired());
}

TEST(Engine, MultipleRootsWithGradients) {
  Tensor x = leaf({2}, 11);
  Tensor y1 = x * 2.0;
  Tensor y2 = x * 3.0;
  autograd::backward({y1, y2}, {ones({2}, kFloat64), full({2}, 10.0, kFloat64)});
  expect_close(x.grad(), {32, 32}, 0, "2*1 + 3*10");
}

TEST(Engine, RootThatIsAnAncestorOfAnotherRoot) {
  Tensor x = leaf({}, 12);
  Tensor y = x * 2.0;
  Tensor z = y * 3.0;
  autograd::backward({y, z});
  expect_close(x.grad(), {8}, 0, "dy/dx + dz/dx");
}

TEST(Engine, GradReturnsWithoutTouchingDotGrad) {
  Tensor x = leaf({3}, 13);
  Tensor w = leaf({3}, 14);
  Tensor y = (x * w).sum();
  auto g = autograd::grad({y}, {x});
  ASSERT_EQ(g.size(), 1u);
  expect_close(g[0], w.to_vector<double>(), 0, "dy/dx");
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

TEST(Engine, GradWithRespectToIntermediate) {
  Tensor x = leaf({2}, 15);
  Tensor h = x * 3.0;
  Tensor y = (h * h).sum();
  auto g = autograd::grad({y}, {h, x});
  expect_close(g[0], (h * 2.0).to_vector<double>(), 1e-12, "dy/dh");
  expect_close(g[1], (h * 6.0).to_vector<double>(), 1e-12, "dy/dx");
}

TEST(Engine, GradOfUnusedInput) {
  Tensor x = leaf({2}, 16);
  Tensor unused = leaf({2}, 17);
  Tensor y = (x * 2.0).sum();
  expect_error<autograd::AutogradError>(
      [&] { autograd::grad({y}, {x, unused}, {}, true); }, {"inputs[1]", "allow_unused"});
  auto g = autograd::grad({y}, {x, unused}, {}, std::nullopt, false, /*allow_unused=*/true);
  EXPECT_TRUE(g[0].defined());
  EXPECT_FALSE(g[1].defined());
}

TEST(Engine, BackwardWithInputsAccumulatesOnlyThere) {
  Tensor a = leaf({2}, 18);
  Tensor b = leaf({2}, 19);
  (a * b).sum().backward({}, {}, false, {a});
  EXPECT_TRUE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(Engine, CreateGraphGivesSecondDerivatives) {
  Tensor x = leaf({3}, 20);
  Tensor y = (x * x * x).sum();
  auto g = autograd::grad({y}, {x}, {}, std::nullopt, /*create_graph=*/true);
  ASSERT_TRUE(g[0].requires_grad());
  expect_close(g[0], (x * x * 3.0).to_vector<double>(), 1e-12, "3x^2");
  auto gg = autograd::grad({g[0].sum()}, {x});
  expect_close(gg[0], (x * 6.0).to_vector<double>(), 1e-12, "6x");
}

TEST(Engine, SecondDerivativeThroughSavedOutput) {
  Tensor x = leaf({3}, 21);
  Tensor y = x.tanh().sum();
  auto g = autograd::grad({y}, {x}, {}, std::nullopt, true);  // 1 - tanh^2
  auto gg = autograd::grad({g[0].sum()}, {x});                // -2 tanh (1 - tanh^2)
  const std::vector<double> xs = x.to_vector<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double t = std::tanh(xs[i]);
    EXPECT_NEAR(gg[0].to_vector<double>()[i], -2 * t * (1 - t * t), 1e-12);
  }
}

// ---- grad mode, detach ------------------------------------------------------------------------

TEST(GradMode, NoGradGuardRecordsNothing) {
  Tensor w = leaf({2}, 22);
  {
    NoGradGuard no_grad;
    EXPECT_FALSE(GradMode::is_enabled());
    Tensor y = w * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    {
      EnableGradGuard enable;
      EXPECT_TRUE((w * 2.0).requires_grad());
    }
    EXPECT_FALSE((w * 2.0).requires_grad());
  }
  EXPECT_TRUE(GradMode::is_enabled());
  {
    InferenceMode inference;
    EXPECT_FALSE((w * 2.0).requires_grad());
  }
  EXPECT_TRUE((w * 2.0).requires_grad());
}

TEST(GradMode, IsPerThread) {
  NoGradGuard no_grad;
  bool other_thread_enabled = false;
  std::thread t([&] { other_thread_enabled = GradMode::is_enabled(); });
  t.join();
  EXPECT_TRUE(other_thread_enabled);
}

TEST(GradMode, DetachSharesDataButNotHistory) {
  Tensor w = leaf({2}, 23);
  Tensor y = w * 2.0;
  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.data_ptr(), y.data_ptr());
  EXPECT_TRUE(y.requires_grad());
  y.detach_();
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(y.is_leaf());
}

TEST(GradMode, RequiresGradRules) {
  expect_error<TypeError>([] { zeros({2}, kInt64).requires_grad_(); },
                          {"floating point", "int64"});
  Tensor w = leaf({2}, 24);
  Tensor y = w * 2.0;
  expect_error<autograd::AutogradError>([&] { y.requires_grad_(false); },
                                        {"leaf", "MulBackward"});
  w.requires_grad_(false);
  EXPECT_FALSE((w * 2.0).requires_grad());
}

TEST(GradMode, IntegerResultsDoNotRequireGrad) {
  Tensor w = leaf({3}, 25);
  EXPECT_FALSE(gt(w, 0.0).requires_grad());
}

// ---- in-place ops -----------------------------------------------------------------------------

TEST(InPlace, LeafThatRequiresGradCannotBeModified) {
  Tensor w = leaf({2}, 26);
  expect_error<autograd::AutogradError>([&] { w.add_(1.0); }, {"add_", "leaf", "NoGradGuard"});
  {
    NoGradGuard no_grad;
    w.add_(1.0);  // how optimizers update parameters
  }
  EXPECT_EQ(w.version(), 1u);
}

TEST(InPlace, ModifiedSavedTensorIsReported) {
  Tensor x = leaf({3}, 27);
  Tensor y = x.tanh();  // saves y
  Tensor loss = y.sum();
  y.mul_(2.0);
  expect_error<autograd::AutogradError>(
      [&] { loss.backward(); },
      {"modified by an in-place operation", "output 0 of TanhBackward", "version"});
}

TEST(InPlace, OnNonLeafIsDifferentiated) {
  Tensor x = leaf({2}, 28);
  Tensor y = x * 2.0;
  y.mul_(3.0);
  y.add_(x);
  y.sum().backward();
  expect_close(x.grad(), {7, 7}, 0, "d(6x + x)/dx");
}

TEST(InPlace, TensorThatDidNotRequireGradJoinsTheGraph) {
  Tensor w = leaf({2}, 29);
  Tensor acc = zeros({2}, kFloat64);
  acc.add_(w * 2.0);
  EXPECT_TRUE(acc.requires_grad());
  acc.sum().backward();
  expect_close(w.grad(), {2, 2}, 0, "through add_");
}

TEST(InPlace, CopyIntoSendsGradientToSource) {
  Tensor w = leaf({3}, 30);
  Tensor buf = zeros({2, 3}, kFloat64);
  buf.copy_(w);  // broadcast copy
  (buf * 2.0).sum().backward();
  expect_close(w.grad(), {4, 4, 4}, 0, "two rows, times 2");
}

// ---- hooks and callbacks ----------------------------------------------------------------------

TEST(Hooks, LeafHookReplacesGradientBeforeAccumulation) {
  Tensor w = leaf({2}, 31);
  Tensor seen;
  w.register_hook([&](const Tensor& g) {
    seen = g;
    return g * 10.0;
  });
  (w * 3.0).sum().backward();
  expect_close(seen, {3, 3}, 0, "hook input");
  expect_close(w.grad(), {30, 30}, 0, "replaced gradient");
}

TEST(Hooks, NonLeafHookAndRemoval) {
  Tensor w = leaf({2}, 32);
  Tensor h = w * 2.0;
  int calls = 0;
  const unsigned id = h.register_hook([&](const Tensor& g) {
    ++calls;
    return g * 0.5;
  });
  h.sum().backward({}, true);
  expect_close(w.grad(), {1, 1}, 0, "halved");
  EXPECT_EQ(calls, 1);
  h.remove_hook(id);
  w.set_grad({});
  h.sum().backward();
  expect_close(w.grad(), {2, 2}, 0, "hook removed");
  EXPECT_EQ(calls, 1);
}

TEST(Hooks, RetainGradOnIntermediate) {
  Tensor w = leaf({2}, 33);
  Tensor h = w * 2.0;
  h.retain_grad();
  EXPECT_TRUE(h.retains_grad());
  h.register_hook([](const Tensor& g) { return g * 3.0; });
  (h * 5.0).sum().backward();
  expect_close(h.grad(), {15, 15}, 0, "retained grad sees the hooked value");
  expect_close(w.grad(), {30, 30}, 0, "leaf");
}

TEST(Hooks, PostAccumulateGradHookSeesAccumulatedGrad) {
  Tensor w = leaf({2}, 34);
  std::vector<double> seen;
  int calls = 0;
  w.register_post_accumulate_grad_hook([&](const Tensor& p) {
    ++calls;
    seen = p.grad().to_vector<double>();
  });
  (w * 4.0).sum().backward();
  (w * 4.0).sum().backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(seen, (std::vector<double>{8, 8}));
  Tensor h = w * 2.0;
  expect_error([&] { h.register_post_accumulate_grad_hook([](const Tensor&) {}); },
               {"leaf tensors"});
}

TEST(Hooks, RemovedPostAccumulateGradHookNoLongerRunsAndIsReleased) {
  Tensor w = leaf({2}, 39);
  auto token = std::make_shared<int>(0);  // owned by the removed hook's closure too
  int removed_calls = 0;
  int kept_calls = 0;
  int pre_calls = 0;
  const unsigned removed =
      w.register_post_accumulate_grad_hook([&removed_calls, token](const Tensor&) {
        ++removed_calls;
      });
  w.register_post_accumulate_grad_hook([&](const Tensor&) { ++kept_calls; });
  w.register_hook([&](const Tensor&) {
    ++pre_calls;
    return Tensor();
  });
  (w * 4.0).sum().backward();
  EXPECT_EQ(removed_calls, 1);
  EXPECT_EQ(token.use_count(), 2);
  w.remove_hook(removed);
  EXPECT_EQ(token.use_count(), 1) << "remove_hook must drop the hook, not just skip it";
  (w * 4.0).sum().backward();
  EXPECT_EQ(removed_calls, 1) << "a removed post-accumulate-grad hook ran";
  EXPECT_EQ(kept_calls, 2) << "removing one hook removed another";
  EXPECT_EQ(pre_calls, 2) << "removing a post-accumulate-grad hook removed a gradient hook";
  expect_close(w.grad(), {8, 8}, 0, "accumulated");
}

TEST(Hooks, PostAccumulateGradHookMayRemoveHooksWhileRunning) {
  Tensor w = leaf({2}, 41);
  int first_calls = 0, second_calls = 0;
  unsigned first = 0, second = 0;
  // The first hook removes itself and the one after it; both still run in this pass.
  first = w.register_post_accumulate_grad_hook([&](const Tensor&) {
    ++first_calls;
    w.remove_hook(first);
    w.remove_hook(second);
  });
  second = w.register_post_accumulate_grad_hook([&](const Tensor&) { ++second_calls; });
  (w * 2.0).sum().backward();
  EXPECT_EQ(first_calls, 1);
  EXPECT_EQ(second_calls, 1);
  (w * 2.0).sum().backward();
  EXPECT_EQ(first_calls, 1) << "a hook that removed itself ran again";
  EXPECT_EQ(second_calls, 1) << "a hook removed during the pass ran again";
  expect_close(w.grad(), {4, 4}, 0, "accumulated");
}

TEST(Hooks, QueuedCallbackRunsAfterAllGradientsAreAccumulated) {
  Tensor a = leaf({2}, 35);
  Tensor b = leaf({2}, 36);
  std::vector<std::string> events;
  bool both_ready = false;
  a.register_post_accumulate_grad_hook([&](const Tensor&) {
    events.push_back("a");
    autograd::queue_callback([&] {
      events.push_back("callback");
      both_ready = a.grad().defined() && b.grad().defined();
    });
  });
  b.register_post_accumulate_grad_hook([&](const Tensor&) { events.push_back("b"); });
  Tensor h = (a * b).tanh();
  (h * a).sum().backward();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events.back(), "callback");
  EXPECT_TRUE(both_ready);
  expect_error([] { autograd::queue_callback([] {}); }, {"during a backward pass"});
}

TEST(Hooks, LeafGradientsAccumulateAsSoonAsReady) {
  // w1 is used first in the forward pass, so its gradient is ready last; w2's accumulator
  // must run before the remaining graph above w1 (DDP relies on this ordering).
  Tensor w1 = leaf({2}, 37);
  Tensor w2 = leaf({2}, 38);
  std::vector<std::string> order;
  Tensor h = (w1 * 2.0).tanh();
  h.register_hook([&](const Tensor& g) {
    order.push_back("h");
    return Tensor();
  });
  w2.register_post_accumulate_grad_hook([&](const Tensor&) { order.push_back("w2"); });
  w1.register_post_accumulate_grad_hook([&](const Tensor&) { order.push_back("w1"); });
  (h * w2).sum().backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "h", "w1"}));
}

// ---- custom functions -------------------------------------------------------------------------

struct Cube : autograd::Function<Cube> {
  static Tensor forward(autograd::Context* ctx, const Tensor& x, double scale) {
    ctx->save_for_backward({x});
    ctx->saved_data["scale"] = scale;
    return x * x * x * scale;
  }
  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const Tensor x = ctx->saved()[0];
    const double scale = std::any_cast<double>(ctx->saved_data["scale"]);
    return {g[0] * x * x * (3.0 * scale)};
  }
};

struct WrongCube : autograd::Function<WrongCube> {
  static Tensor forward(autograd::Context* ctx, const Tensor& x) {
    ctx->save_for_backward({x});
    return x * x * x;
  }
  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const Tensor x = ctx->saved()[0];
    return {g[0] * x * x * 2.0};  // should be 3
  }
};

struct TwoGrads : autograd::Function<TwoGrads> {
  static Tensor forward(autograd::Context*, const Tensor& x) { return x * 2.0; }
  static autograd::TensorList backward(autograd::Context*, autograd::TensorList g) {
    return {g[0], g[0]};
  }
};

struct SplitHalves : autograd::Function<SplitHalves> {
  static std::vector<Tensor> forward(autograd::Context*, const Tensor& x) {
    return {x.narrow(0, 0, 1).clone(), x.narrow(0, 1, 1).clone()};
  }
  static autograd::TensorList backward(autograd::Context*, autograd::TensorList g) {
    return {cat({g[0], g[1]})};
  }
};

TEST(CustomFunction, ForwardBackwardAndGradcheck) {
  Tensor x = leaf({4}, 39);
  Tensor y = Cube::apply(x, 2.0);
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_NE(std::string(y.grad_fn()->name()).find("CubeBackward"), std::string::npos);
  y.sum().backward();
  const auto xs = x.to_vector<double>();
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_NEAR(x.grad().to_vector<double>()[i], 6 * xs[i] * xs[i], 1e-12);
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return Cube::apply(in[0], 0.5); },
                         {leaf({3}, 40)});
}

TEST(CustomFunction, GradcheckCatchesAWrongBackward) {
  const auto r = autograd::gradcheck(
      [](const std::vector<Tensor>& in) { return WrongCube::apply(in[0]); }, {leaf({3}, 41)});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("Jacobian mismatch"), std::string::npos) << r.message;
}

TEST(CustomFunction, WrongNumberOfGradientsIsAnError) {
  Tensor x = leaf({2}, 42);
  expect_error<autograd::AutogradError>([&] { TwoGrads::apply(x).sum().backward(); },
                                        {"TwoGradsBackward", "returned 2 gradients", "1 Tensor"});
}

TEST(CustomFunction, MultipleOutputsGetZerosForMissingGradients) {
  Tensor x = leaf({2}, 43);
  auto outs = SplitHalves::apply(x);
  ASSERT_EQ(outs.size(), 2u);
  (outs[1] * 5.0).sum().backward();
  expect_close(x.grad(), {0, 5}, 0, "second half only");
}

TEST(CustomFunction, NoRecordingWithoutGradInputs) {
  Tensor y = Cube::apply(ones({2}, kFloat64), 1.0);
  EXPECT_FALSE(y.requires_grad());
}

TEST(CustomFunction, ModifiedSavedInputIsReported) {
  Tensor w = leaf({2}, 44);
  Tensor x = w * 1.0;
  Tensor y = Cube::apply(x, 1.0);
  x.add_(1.0);
  expect_error<autograd::AutogradError>([&] { y.sum().backward(); },
                                        {"modified by an in-place operation", "CubeBackward"});
}

// ---- gradcheck itself -------------------------------------------------------------------------

TEST(Gradcheck, RejectsNonFloat64Inputs) {
  Tensor x = leaf({2}, 45, kFloat32);
  expect_error<TypeError>([&] { autograd::gradcheck([](const std::vector<Tensor>& in) { return in[0] * 2.0; }, {x}); },
                          {"float64", "float32"});
}

TEST(Gradcheck, NonContiguousInput) {
  Tensor x = test::noncontig_leaf({3, 4}, 46);
  ASSERT_FALSE(x.is_contiguous());
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return in[0].tanh() * in[0]; }, {x});
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

TEST(Engine, LongChainIsBuiltRunAndFreedWithoutDeepRecursion) {
  // 200k nodes: recursive destruction or traversal would overflow an 8 MiB stack.
  Tensor x = test::leaf({1}, 47);
  std::weak_ptr<autograd::Node> first;
  {
    Tensor h = x;
    for (int i = 0; i < 200000; ++i) {
      h = h * 1.0;
      if (i == 0) first = h.grad_fn();
    }
    h.sum().backward();
    test::expect_close(x.grad(), {1}, 0, "gradient through the chain");
  }
  EXPECT_TRUE(first.expired());
  {
    Tensor h = x;
    for (int i = 0; i < 200000; ++i) h = h * 1.0;
  }  // dropped without backward: the whole graph dies here
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

TEST(Engine, ConcurrentBackwardPassesShareAParameter) {
  Tensor w = test::leaf({4}, 48);
  constexpr int kPasses = 200;
  auto work = [&] {
    for (int i = 0; i < kPasses; ++i) (w * 2.0).tanh().sum().backward();
  };
  std::thread t1(work), t2(work);
  t1.join();
  t2.join();
  const auto ws = w.to_vector<double>();
  const auto gs = w.grad().to_vector<double>();
  for (size_t i = 0; i < ws.size(); ++i) {
    const double t = std::tanh(2 * ws[i]);
    EXPECT_NEAR(gs[i], 2 * kPasses * 2 * (1 - t * t), 1e-9) << "index " << i;
  }
}

TEST(Engine, ReentrantBackwardFromAHookSharesTheParameter) {
  Tensor w = test::leaf({2}, 49);
  Tensor h = w * 3.0;
  h.register_hook([&](const Tensor&) {
    EnableGradGuard grad;        // backward runs hooks with grad mode off, as PyTorch does
    (w * 5.0).sum().backward();  // a second pass reaching w's accumulator mid-pass
    return Tensor();
  });
  h.sum().backward();
  test::expect_close(w.grad(), {8, 8}, 0, "3 + 5");
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

TEST(Gradcheck, SeveralOutputsWhoseGraphSavesTheInputs) {
  // Perturbing inputs for finite differences must not break the saved inputs of the graph
  // whose Jacobian is still being read.
  test::expect_gradcheck(
      autograd::GradcheckFn([](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{in[0] * in[1], (in[0] * in[0]).sum()};
      }),
      {test::leaf({3}, 50), test::leaf({3}, 51)});
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

TEST(Hooks, InBackwardIsTrueOnlyDuringAPass) {
  Tensor w = test::leaf({2}, 52);
  bool inside = false;
  w.register_hook([&](const Tensor&) {
    inside = autograd::in_backward();
    return Tensor();
  });
  EXPECT_FALSE(autograd::in_backward());
  (w * 2.0).sum().backward();
  EXPECT_TRUE(inside);
  EXPECT_FALSE(autograd::in_backward());
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

using test::expect_close;
using test::expect_error;
using test::leaf;

namespace split {

// x * w with w broadcast over rows; counts which gradients its backward computed.
struct Scale : autograd::Function<Scale> {
  static inline int x_grads = 0;
  static inline int w_grads = 0;
  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const autograd::TensorList s = ctx->saved();
    autograd::TensorList r(2);
    if (ctx->needs_input_grad(0)) {
      ++x_grads;
      r[0] = g[0] * s[1];
    }
    if (ctx->needs_input_grad(1)) {
      ++w_grads;
      r[1] = (g[0] * s[0]).sum({0});
    }
    return r;
  }
};

struct Net {
  Tensor w1 = leaf({4, 5}, 11), b1 = leaf({5}, 12), s = leaf({5}, 13), w2 = leaf({5, 3}, 14),
         pos = leaf({3}, 15);
  std::vector<Tensor> weights() const { return {w1, b1, s, w2, pos}; }
  // Two matmuls, a custom op, a weight used twice (s), and a weight-only branch (pos) added
  // to the output.
  Tensor operator()(const Tensor& x) const {
    Tensor h = relu(matmul(x, w1) + b1);
    h = Scale::apply(h, s) * s;
    return matmul(tanh(h), w2) + pos * pos;
  }
};

void expect_same_grads(const Net& a, const Net& b) {
  const auto wa = a.weights(), wb = b.weights();
  for (size_t i = 0; i < wa.size(); ++i) {
    ASSERT_TRUE(wa[i].grad().defined()) << "weight " << i;
    expect_close(wa[i].grad(), wb[i].grad().to_vector<double>(), 1e-12, "weight " + std::to_string(i));
  }
}

}  // namespace split

// backward_input gives the input's gradient without computing any weight gradient, and
// WeightGrad::run then gives every weight what one backward() gives, each gradient computed
// once.
TEST(SplitBackward, TwoHalvesEqualOneBackwardAndComputeEachGradientOnce) {
  split::Net net, ref;
  const Tensor x0 = test::rand_t({6, 4}, kFloat64, 16);
  const Tensor gy = test::rand_t({6, 3}, kFloat64, 17);
  Tensor xr = x0.clone().requires_grad_();
  autograd::backward({ref(xr)}, {gy});

  Tensor x = x0.clone().requires_grad_();
  const Tensor y = net(x);
  split::Scale::x_grads = split::Scale::w_grads = 0;
  autograd::WeightGrad rest;
  const std::vector<Tensor> dx = autograd::backward_input({y}, {gy}, {x}, net.weights(), rest);
  EXPECT_TRUE(rest.pending());
  expect_close(dx[0], xr.grad().to_vector<double>(), 1e-12, "input gradient");
  EXPECT_FALSE(x.grad().defined());
  for (const Tensor& w : net.weights()) EXPECT_FALSE(w.grad().defined());
  EXPECT_EQ(split::Scale::x_grads, 1);
  EXPECT_EQ(split::Scale::w_grads, 0);

  rest.run();
  EXPECT_FALSE(rest.pending());
  EXPECT_EQ(split::Scale::x_grads, 1);
  EXPECT_EQ(split::Scale::w_grads, 1);
  split::expect_same_grads(net, ref);
  EXPECT_FALSE(x.grad().defined());
  expect_error([&] { rest.run(); }, {"[WeightGrad::run] nothing to run"});
}

// The first stage of a pipeline has no input that needs a gradient: the whole pass waits for
// the weight half. Post-accumulate hooks (DDP's) run in the weight half, once per weight.
TEST(SplitBackward, NoInputDefersEverythingAndHooksRunInTheWeightHalf) {
  split::Net net, ref;
  const Tensor x = test::rand_t({6, 4}, kFloat64, 18);
  const Tensor gy = test::rand_t({6, 3}, kFloat64, 19);
  autograd::backward({ref(x)}, {gy});
  int fired = 0;
  for (const Tensor& w : net.weights()) w.register_post_accumulate_grad_hook([&](const Tensor&) { ++fired; });
  autograd::WeightGrad rest;
  EXPECT_TRUE(autograd::backward_input({net(x)}, {gy}, {}, net.weights(), rest).empty());
  EXPECT_EQ(fired, 0);
  for (const Tensor& w : net.weights()) EXPECT_FALSE(w.grad().defined());
  rest.run();
  EXPECT_EQ(fired, 5);
  split::expect_same_grads(net, ref);

  // Weight gradients accumulate over micro-batches as backward()'s do; a pending weight half
  // must run before the next split.
  Tensor x2 = x.clone().requires_grad_();
  autograd::WeightGrad one, two;
  autograd::backward_input({net(x2)}, {gy}, {x2}, net.weights(), one);
  expect_error([&] { autograd::backward_input({net(x2)}, {gy}, {x2}, net.weights(), one); },
               {"[backward_input] the WeightGrad given still holds the weight half"});
  autograd::backward_input({net(x2)}, {gy}, {x2}, net.weights(), two);
  two.run();
  one.run();
  autograd::backward({ref(x)}, {gy});
  autograd::backward({ref(x)}, {gy});
  split::expect_same_grads(net, ref);
}

// grad() with respect to the input alone no longer computes weight gradients.
TEST(SplitBackward, GradOfTheInputSkipsWeightGradients) {
  split::Net net;
  Tensor x = test::rand_t({6, 4}, kFloat64, 20).requires_grad_();
  split::Scale::x_grads = split::Scale::w_grads = 0;
  autograd::grad({net(x).sum()}, {x});
  EXPECT_EQ(split::Scale::x_grads, 1);
  EXPECT_EQ(split::Scale::w_grads, 0);
}

// Found by a review of the engine (each failed before its fix).

// Two threads' passes share a parameter: this pass reaches w's accumulator through thousands of
// edges while the other thread's passes over w start and end. A node first met while the other
// pass owned it keeps its state in this pass's own map even after that pass ends (it used to get
// a second, fresh state, run on its first gradient and crash or drop the rest).
TEST(Engine, ConcurrentPassesShareAParameterUsedManyTimes) {
  Tensor w = ones({1}, kFloat64);
  w.requires_grad_();
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop) autograd::grad({(w * 2.0).sum()}, {w});
  });
  struct Join {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Join() {
      stop = true;
      t.join();
    }
  } join{stop, other};
  for (int it = 0; it < 60; ++it) {
    Tensor acc = zeros({1}, kFloat64);
    for (int i = 0; i < 2000; ++i) acc = acc + w;
    ASSERT_EQ(autograd::grad({acc.sum()}, {w})[0].item<double>(), 2000.0) << "iteration " << it;
  }
}

// With create_graph, .grad is a copy: the incoming gradient may be another tensor's too (an add
// hands one tensor to both inputs) or the caller's, and a later backward accumulates in place.
TEST(Engine, CreateGraphGradientsAreCopiesThatLaterPassesAccumulateInto) {
  Tensor a = leaf({3}, 1), b = leaf({3}, 2);
  Tensor g = ones({3});
  (a + b).backward(g, false, /*create_graph=*/true);
  (a * 2.0).sum().backward();
  expect_close(a.grad(), {3, 3, 3}, 0, "a.grad");
  expect_close(b.grad(), {1, 1, 1}, 0, "b.grad");
  expect_close(g, {1, 1, 1}, 0, "the caller's gradient");
  // A sum's gradient is an expanded scalar: .grad takes it as a copy it can add into.
  Tensor c = leaf({3}, 3);
  (c * 1.0).sum().backward({}, false, true);
  (c * 1.0).sum().backward();
  expect_close(c.grad(), {2, 2, 2}, 0, "c.grad");
  // The same for a retained gradient.
  Tensor y = a * 1.0;
  y.retain_grad();
  (y + y * 0.0).backward(g, false, true);
  (y * 3.0).sum().backward();
  expect_close(y.grad(), {4, 4, 4}, 0, "y.grad");
  expect_close(g, {1, 1, 1}, 0, "the caller's gradient after retain_grad");
}

// The fused attention saves its mask with the mask's version: changed in place before the
// backward, it is an error (PyTorch's too), not a silently different gradient.
TEST(Engine, AttentionMaskChangedInPlaceBeforeBackwardIsAnError) {
  manual_seed(0);
  Tensor q = randn({1, 4, 8}, kFloat64), k = randn({1, 4, 8}, kFloat64),
         v = randn({1, 4, 8}, kFloat64);
  for (Tensor* t : {&q, &k, &v}) t->requires_grad_();
  Tensor mask = zeros({4, 4}, kFloat64);
  Tensor out = scaled_dot_product_attention(q, k, v, mask);
  ASSERT_STREQ(out.grad_fn()->name(), "ScaledDotProductAttentionBackward");
  {
    NoGradGuard no_grad;
    mask.fill_(-1e9);
  }
  expect_error([&] { out.sum().backward(); },
               {"modified by an in-place operation", "ScaledDotProductAttentionBackward"});
}

// retain_grad() then an in-place op: the retained gradient is the new value's (PyTorch moves
// the hook to the in-place op's node).
TEST(Engine, RetainGradFollowsAnInPlaceOp) {
  Tensor x = leaf({2}, 1);
  Tensor y = x * 3.0;
  y.retain_grad();
  y.mul_(2.0);
  (y * 5.0).sum().backward();
  expect_close(y.grad(), {5, 5}, 0, "y.grad");
}

// A hook that removes itself while the hooks run: the rest still run, none is called through
// a removed entry.
TEST(Engine, AHookThatRemovesItselfLetsTheOthersRun) {
  for (bool on_leaf : {false, true}) {
    Tensor x = leaf({2}, 1);
    Tensor y = on_leaf ? x : x * 1.0;
    int first = 0, second = 0;
    unsigned h = 0;
    h = y.register_hook([&](const Tensor&) {
      ++first;
      y.remove_hook(h);
      return Tensor();
    });
    y.register_hook([&](const Tensor& g) {
      ++second;
      return g * 10.0;
    });
    (y * 3.0).sum().backward();
    EXPECT_EQ(first, 1) << on_leaf;
    EXPECT_EQ(second, 1) << on_leaf;
    expect_close(x.grad(), {30, 30}, 0, on_leaf ? "leaf" : "non-leaf");
  }
}

// A handle removes its own hook, also after an in-place op gave the tensor a new node with
// hooks of its own.
TEST(Engine, RemoveHookAfterAnInPlaceOpRemovesThatHook) {
  Tensor x = leaf({2}, 1);
  Tensor y = x * 1.0;
  int a = 0, b = 0;
  const unsigned ha = y.register_hook([&](const Tensor&) {
    ++a;
    return Tensor();
  });
  y.mul_(2.0);
  const unsigned hb = y.register_hook([&](const Tensor&) {
    ++b;
    return Tensor();
  });
  EXPECT_NE(ha, hb);
  y.remove_hook(ha);
  y.sum().backward();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
}

// A backward that returns every gradient whatever needs_input_grad says (allowed): in the split
// backward's input half the weight's gradient reaches its accumulator, which that half does not
// run, so its hooks run once, in the weight half.
struct ScaleAll : autograd::Function<ScaleAll> {
  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& w) {
    ctx->save_for_backward({x, w});
    return x * w;
  }
  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const auto s = ctx->saved();
    return {g[0] * s[1], g[0] * s[0]};
  }
};

TEST(SplitBackward, AWeightsHooksRunOnceWhenABackwardIgnoresNeedsInputGrad) {
  Tensor w = ones({3}, kFloat64);
  w.requires_grad_();
  Tensor x0 = ones({3}, kFloat64);
  x0.requires_grad_();
  Tensor x = x0 * 1.0;
  int calls = 0;
  w.register_hook([&](const Tensor&) {
    ++calls;
    return Tensor();
  });
  autograd::WeightGrad rest;
  autograd::backward_input({ScaleAll::apply(x, w).sum()}, {}, {x}, {w}, rest);
  EXPECT_EQ(calls, 0);
  rest.run();
  EXPECT_EQ(calls, 1);
  expect_close(w.grad(), {1, 1, 1}, 0, "w.grad");
}

// An in-place op on a view of a temporary (allowed: no base to lose its gradient) leaves a view
// whose history describes its data.
TEST(Engine, AViewOfATemporaryChangedInPlaceIsUsable) {
  Tensor x = ones({4}, kFloat64);
  x.requires_grad_();
  Tensor v = (x * 2.0).view({2, 2});
  v.mul_(3.0);
  (v * v).sum().backward();
  expect_close(x.grad(), {72, 72, 72, 72}, 0, "x.grad");
}

}  // namespace
}  // namespace ember
