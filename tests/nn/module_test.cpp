// Module: registration order, naming, modes, conversion, zero_grad, state dicts, forward hooks.
#include <gtest/gtest.h>

#include <ember/autograd/autograd.h>
#include <ember/nn/layers/container.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/module.h>
#include "tests/tensor/test_util.h"

namespace ember::nn {
namespace {

using test::expect_error;

struct Affine : Module {
  Affine(int64_t in, int64_t out, bool bias = true) {
    weight = register_parameter("weight", ones({out, in}));
    this->bias = register_parameter("bias", bias ? zeros({out}) : Tensor());
    register_buffer("calls", zeros({}, kInt64));
    register_buffer("scratch", zeros({2}), /*persistent=*/false);
  }
  std::string name() const override { return "Affine"; }
  Tensor forward(const Tensor& x) override {
    Tensor y = matmul(x, weight.t());
    return bias.defined() ? y + bias : y;
  }
  Tensor weight, bias;
};

struct Net : Module {
  Net() {
    a = register_module("a", std::make_shared<Affine>(3, 4));
    b = register_module("b", std::make_shared<Affine>(4, 2, false));
    register_parameter("scale", ones({}));
  }
  std::string name() const override { return "Net"; }
  Tensor forward(const Tensor& x) override { return (*b)((*a)(x)) * tensor("scale"); }
  std::shared_ptr<Affine> a, b;
};

std::vector<std::string> names(const NamedTensors& v) {
  std::vector<std::string> r;
  for (const auto& [n, t] : v) r.push_back(n);
  return r;
}

TEST(Module, NamesAndOrder) {
  auto net = std::make_shared<Net>();
  EXPECT_EQ(names(net->named_parameters()),
            (std::vector<std::string>{"scale", "a.weight", "a.bias", "b.weight"}));
  EXPECT_EQ(names(net->named_parameters(false)), (std::vector<std::string>{"scale"}));
  EXPECT_EQ(names(net->named_buffers()),
            (std::vector<std::string>{"a.calls", "a.scratch", "b.calls", "b.scratch"}));
  EXPECT_EQ(names(net->state_dict()),
            (std::vector<std::string>{"scale", "a.weight", "a.bias", "a.calls", "b.weight",
                                      "b.calls"}));
  EXPECT_EQ(net->children().size(), 2u);
  std::vector<std::string> mods;
  for (auto& [n, m] : net->named_modules()) mods.push_back(n);
  EXPECT_EQ(mods, (std::vector<std::string>{"", "a", "b"}));
  for (const Tensor& p : net->parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(Module, RegistrationErrors) {
  Affine m(2, 2);
  expect_error([&] { m.register_parameter("weight", ones({1})); }, {"already has", "weight"});
  expect_error([&] { m.register_parameter("a.b", ones({1})); }, {"no '.'", "a.b"});
  expect_error([&] { m.tensor("nope"); }, {"Affine", "nope"});
  expect_error<NotImplementedError>([] { Module().forward(ones({1})); }, {"forward"});
}

TEST(Module, TrainEvalApplyAndPrint) {
  auto net = std::make_shared<Net>();
  EXPECT_TRUE(net->a->is_training());
  net->eval();
  EXPECT_FALSE(net->a->is_training());
  EXPECT_FALSE(net->is_training());
  std::vector<std::string> order;
  net->apply([&](Module& m) { order.push_back(m.name()); });
  EXPECT_EQ(order, (std::vector<std::string>{"Affine", "Affine", "Net"}));
  EXPECT_EQ(net->str(), "Net(\n  (a): Affine()\n  (b): Affine()\n)");
}

TEST(Module, ForwardBackwardZeroGrad) {
  auto net = std::make_shared<Net>();
  net->forward(ones({5, 3})).sum().backward();
  for (const Tensor& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
  net->zero_grad(/*set_to_none=*/false);
  for (const Tensor& p : net->parameters()) EXPECT_EQ(p.grad().sum().item<float>(), 0.0f);
  net->zero_grad();
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
}

// zero_grad(set_to_none=false) cuts a create_graph gradient's history (PyTorch's detach_()):
// the next double backward must not reach the last step's graph.
TEST(Module, ZeroGradWithoutNoneCutsTheGradientsHistory) {
  auto lin = std::make_shared<Linear>(2, 1, /*bias=*/false);
  {
    NoGradGuard no_grad;
    Tensor(lin->weight).fill_(1.0);
  }
  Tensor penalty_grad;
  for (int it = 0; it < 2; ++it) {
    lin->zero_grad(/*set_to_none=*/false);
    lin->forward(full({1, 2}, it + 1.0)).pow(2).sum().backward({}, true, true);
    EXPECT_TRUE(lin->weight.grad().requires_grad());
    penalty_grad = autograd::grad({lin->weight.grad().pow(2).sum()}, {lin->weight})[0];
  }
  // Second step, w = (1, 1), x = (2, 2): grad = 2 (w . x) x = (16, 16) and
  // d sum(grad^2) / dw_j = 4 sum_i grad_i x_i x_j = 512 (640 with the first step's graph).
  EXPECT_DOUBLE_EQ(penalty_grad.to_vector<double>()[0], 512.0);
  lin->zero_grad(false);
  EXPECT_FALSE(lin->weight.grad().requires_grad());
}

TEST(Module, ToDtypeKeepsHandles) {
  auto net = std::make_shared<Net>();
  Tensor w = net->a->weight;  // e.g. held by an optimizer
  net->forward(ones({1, 3})).sum().backward();
  net->to(kFloat64);
  EXPECT_EQ(w.dtype(), kFloat64);
  EXPECT_EQ(w.grad().dtype(), kFloat64);
  EXPECT_TRUE(w.requires_grad());
  EXPECT_EQ(net->a->tensor("calls").dtype(), kInt64) << "integral buffers keep their dtype";
  net->zero_grad();
  net->forward(ones({1, 3}, kFloat64)).sum().backward();
  EXPECT_EQ(w.grad().dtype(), kFloat64);
  expect_error<TypeError>([&] { net->to(kInt32); }, {"floating", "int32"});
}

TEST(Module, ModuleOnTheStack) {
  Affine m(2, 2);
  m.to(kFloat64);  // needs no shared_ptr
  EXPECT_EQ(m.weight.dtype(), kFloat64);
  expect_error([&] { m.modules(); }, {"named_modules", "make_shared"});
}

TEST(Module, StateDictRoundTrip) {
  auto src = std::make_shared<Net>();
  {
    NoGradGuard no_grad;
    src->a->weight.copy_(arange(0, 12).reshape({4, 3}));
    src->tensor("scale").fill_(3);
  }
  auto dst = std::make_shared<Net>();
  void* before = dst->a->weight.data_ptr();
  dst->load_state_dict(src->state_dict());
  EXPECT_TRUE(equal(dst->a->weight, src->a->weight));
  EXPECT_EQ(dst->tensor("scale").item<float>(), 3.0f);
  EXPECT_EQ(dst->a->weight.data_ptr(), before) << "loaded in place, not replaced";
  EXPECT_FALSE(src->a->weight.is_same(dst->a->weight));
}

TEST(Module, LoadStateDictReportsEveryProblem) {
  auto net = std::make_shared<Net>();
  NamedTensors sd = net->state_dict();
  sd.erase(sd.begin());                        // drop "scale"
  sd.emplace_back("c.weight", ones({1}));      // unexpected
  sd[0].second = ones({7});                    // "a.weight" with the wrong shape
  expect_error([&] { net->load_state_dict(sd); },
               {"Net", "missing keys: \"scale\"", "unexpected keys: \"c.weight\"",
                "size mismatch for a.weight", "[7]", "[4, 3]"});
  sd[0].second = ones({4, 3});
  net->load_state_dict(sd, /*strict=*/false);  // missing/unexpected ignored
  EXPECT_EQ(net->a->weight.sum().item<float>(), 12.0f);
}

// Forward hooks run when a module is called, in registration order, around forward; a pre-hook
// may replace the inputs and a hook the outputs; forward() itself skips them; Sequential calls
// its children with their hooks; remove_forward_hook stops one.
TEST(Module, ForwardHooks) {
  auto a = std::make_shared<Affine>(3, 4);
  std::vector<std::string> log;
  float seen = 0;  // the input sum the forward hook saw
  const unsigned pre = a->register_forward_pre_hook([&](Module& m, std::vector<Tensor>& in) {
    log.push_back("pre " + m.name());
    in[0] = in[0] * 2.0;
  });
  a->register_forward_hook(
      [&](Module&, const std::vector<Tensor>& in, std::vector<Tensor>& out) {
        log.push_back("post");
        seen = in[0].sum().item<float>();
        out[0] = out[0] + 1.0;
      });
  const Tensor x = ones({2, 3});
  EXPECT_EQ((*a)(x).sum().item<float>(), 2 * 4 * (3 * 2) + 8.0f);
  EXPECT_EQ(log, (std::vector<std::string>{"pre Affine", "post"}));
  EXPECT_EQ(seen, 12.0f) << "the forward hook sees the replaced input";
  EXPECT_EQ(a->forward(x).sum().item<float>(), 2 * 4 * 3.0f) << "forward() runs no hooks";
  Sequential seq(a);
  EXPECT_EQ(seq.forward(x).sum().item<float>(), 2 * 4 * (3 * 2) + 8.0f);
  a->remove_forward_hook(pre);
  log.clear();
  EXPECT_EQ((*a)(x).sum().item<float>(), 2 * 4 * 3 + 8.0f);
  EXPECT_EQ(log, (std::vector<std::string>{"post"}));
  // call(): the hooks around a computation of another signature.
  const auto out = a->call({x, x}, [&](std::vector<Tensor>& in) {
    return std::vector<Tensor>{a->forward(in[0]) + a->forward(in[1])};
  });
  EXPECT_EQ(out.at(0).sum().item<float>(), 2 * 2 * 4 * 3 + 8.0f);
  expect_error<ValueError>([&] { a->register_forward_hook(nullptr); }, {"the hook is empty"});
}

// A forward of several inputs and outputs (PyTorch's forward(x, mask) returning a tuple):
// module(x, mask) runs forward_many between the hooks; a one-tensor module answers it too.
struct Masked : Module {
  std::string name() const override { return "Masked"; }
  std::vector<Tensor> forward_many(const std::vector<Tensor>& in) override {
    EMBER_CHECK(in.size() == 2, "[Masked] takes x and mask, got ", in.size());
    return {in[0] * in[1], in[1].sum()};
  }
};

TEST(Module, ForwardOfSeveralInputsAndOutputs) {
  auto m = std::make_shared<Masked>();
  std::vector<std::string> log;
  m->register_forward_pre_hook([&](Module&, std::vector<Tensor>& in) {
    log.push_back("pre " + std::to_string(in.size()));
    in[0] = in[0] + 1.0;
  });
  m->register_forward_hook([&](Module&, const std::vector<Tensor>&, std::vector<Tensor>& out) {
    log.push_back("post " + std::to_string(out.size()));
  });
  const Tensor x = ones({2, 3}), mask = tensor({1.0f, 0.0f, 1.0f});
  const std::vector<Tensor> out = (*m)(x, mask);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].sum().item<float>(), 2 * 2 * 2.0f) << "the pre-hook's replaced input";
  EXPECT_EQ(out[1].item<float>(), 2.0f);
  EXPECT_EQ(log, (std::vector<std::string>{"pre 2", "post 2"}));
  EXPECT_EQ((*m)(std::vector<Tensor>{x, mask}).size(), 2u);
  expect_error<NotImplementedError>([&] { (void)(*m)(x); }, {"[Masked] has no forward(Tensor)"});

  // A one-tensor module through the list form: its forward, as a one-element list.
  auto a = std::make_shared<Affine>(3, 4);
  const std::vector<Tensor> one = (*a)(std::vector<Tensor>{x});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_TRUE(equal(one[0], a->forward(x)));
  expect_error<ValueError>([&] { (void)(*a)(x, mask); },
                           {"[Affine] was called with 2 tensors, but its forward takes one",
                            "override forward_many"});
}

}  // namespace
}  // namespace ember::nn
