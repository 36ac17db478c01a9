// Optimizers (SGD, Adam, AdamW) and gradient clipping: updates against PyTorch 1.13, parameter
// groups, zero_grad, state dicts and checkpoint round trips, and error messages.
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ember/nn/clip_grad.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/sgd.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops/foreach.h>
#include "tests/tensor/test_util.h"

namespace ember::nn::optim {
namespace {

using test::expect_close;
using test::expect_error;
using test::rand_t;

using Values = std::vector<std::vector<double>>;  // one list per parameter

// ---- the reference problem --------------------------------------------------------------------
// Three float32 parameters of shapes [3, 4], [5], [2] holding lcg_values(numel, 1 + i); at step s
// parameter i gets the gradient lcg_values(numel, 100 + 10 s + i), except that parameter 2 has
// no gradient on odd steps (so it is skipped there and its Adam step count lags). The expected
// values below are the parameters after 5 steps of torch.optim's optimizer, printed with %.9g
// (exact for float32) by this script run with Debian's PyTorch 1.13 (/usr/bin/python3):
//
//   import torch
//   def lcg_values(n, seed):  # tests/tensor/test_util.h's generator
//       M = (1 << 64) - 1
//       s = (seed * 6364136223846793005 + 1442695040888963407) & M
//       out = []
//       for _ in range(n):
//           s = (s * 6364136223846793005 + 1442695040888963407) & M
//           out.append(((s >> 11) & ((1 << 20) - 1)) / (1 << 19) - 1.0)
//       return out
//   SHAPES = [(3, 4), (5,), (2,)]
//   def make_params():
//       return [torch.tensor(lcg_values(torch.Size(s).numel(), 1 + i)).reshape(s).float()
//               .requires_grad_() for i, s in enumerate(SHAPES)]
//   def set_grads(params, step):
//       for i, p in enumerate(params):
//           p.grad = None if (i == 2 and step % 2 == 1) else torch.tensor(
//               lcg_values(p.numel(), 100 + 10 * step + i)).reshape(p.shape).float()
//   params = make_params(); opt = torch.optim.SGD(params, lr=0.1)  # etc., see each case
//   for s in range(5): set_grads(params, s); opt.step()

const std::vector<Shape> kShapes = {{3, 4}, {5}, {2}};

std::vector<Tensor> make_params() {
  std::vector<Tensor> ps;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    ps.push_back(rand_t(kShapes[i], kFloat32, 1 + i).requires_grad_());
  }
  return ps;
}

void set_grads(const std::vector<Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (i == 2 && step % 2 == 1) {
      params[i].set_grad(Tensor());
    } else {
      params[i].set_grad(
          rand_t(params[i].shape(), kFloat32, 100 + 10 * step + i).to(params[i].device()));
    }
  }
}

using Factory = std::function<std::unique_ptr<Optimizer>(const std::vector<Tensor>&)>;

void expect_params(const std::vector<Tensor>& params, const Values& want, double tol,
                   const std::string& what) {
  ASSERT_EQ(params.size(), want.size());
  for (size_t i = 0; i < params.size(); ++i) {
    expect_close(params[i], want[i], tol, what + " parameter " + std::to_string(i));
  }
}

struct RefCase {
  const char* name;
  Factory make;
  Values want;
};

// Relative tolerance: PyTorch's CPU kernels use fused multiply-adds in places and Ember's may
// not, so the last bit can differ per op.
constexpr double kTol = 1e-6;

std::vector<RefCase> reference_cases() {
  auto sgd = [](SGDOptions o) {
    return [o](const std::vector<Tensor>& p) { return std::make_unique<SGD>(p, o); };
  };
  auto adam = [](AdamOptions o) {
    return [o](const std::vector<Tensor>& p) { return std::make_unique<Adam>(p, o); };
  };
  auto adamw = [](AdamWOptions o) {
    return [o](const std::vector<Tensor>& p) { return std::make_unique<AdamW>(p, o); };
  };
  return {
      {"SGD(lr=0.1)", sgd({.lr = 0.1}),
       {{-0.902336001, -0.364696503, -0.713765144, -0.14157562, 0.515677631, 0.852897823,
         0.912921548, -0.911842406, 0.900083303, 0.28539142, 0.62692374, -0.858303845},
        {-0.890138268, -0.472937763, -0.569637835, -0.866928279, 0.851403058},
        {-0.86794126, -0.918190598}}},
      {"SGD(lr=0.1, momentum=0.9)", sgd({.lr = 0.1, .momentum = 0.9}),
       {{-0.714776635, -0.286780834, -0.793769002, -0.280119836, 0.566240847, 1.03367138,
         0.886054993, -0.861681759, 0.707792401, 0.377538681, -0.0129126469, -1.11883152},
        {-0.722446501, -0.21871689, -0.884397626, -1.09455156, 1.02289212},
        {-0.797563732, -0.795758605}}},
      {"SGD(lr=0.05, momentum=0.8, dampening=0.3)",
       sgd({.lr = 0.05, .momentum = 0.8, .dampening = 0.3}),
       {{-0.827516675, -0.426605105, -0.735216677, -0.140523523, 0.568500459, 0.825915873,
         0.856128573, -0.875159681, 0.898031652, 0.271156192, 0.618581772, -0.872589886},
        {-0.814216435, -0.544631243, -0.578060269, -0.901448071, 0.887295544},
        {-0.82149446, -0.871673763}}},
      {"SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)",
       sgd({.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}),
       {{-0.721031427, -0.173227742, -0.762650788, -0.285785496, 0.53448391, 1.09960449,
         0.9545753, -0.896095514, 0.644733369, 0.379421175, -0.25933072, -1.18449259},
        {-0.737934172, -0.0232299287, -0.96237731, -1.14521205, 1.03213751},
        {-0.811682105, -0.796227157}}},
      {"SGD(lr=0.1, momentum=0.5, weight_decay=0.1, maximize=True)",
       sgd({.lr = 0.1, .momentum = 0.5, .weight_decay = 0.1, .maximize = true}),
       {{-0.879149854, -0.617275655, -0.647034347, -0.0212584566, 0.508741438, 0.500319421,
         0.679015219, -0.766624749, 1.04295158, 0.180562451, 1.4349755, -0.492718309},
        {-0.837461174, -0.987223268, -0.154436171, -0.563514471, 0.628608525},
        {-0.83111006, -0.949497879}}},
      {"Adam(lr=0.01)", adam({.lr = 0.01}),
       {{-0.873763144, -0.477492988, -0.723294497, -0.118965849, 0.545364916, 0.752855003,
         0.833137333, -0.868996799, 0.965702415, 0.267401725, 0.911556304, -0.768944383},
        {-0.85127753, -0.659049213, -0.471608698, -0.794585943, 0.825308442},
        {-0.839224339, -0.904430211}}},
      {"Adam(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)",
       adam({.lr = 0.02, .betas = {0.8, 0.95}, .eps = 1e-6, .weight_decay = 0.1}),
       {{-0.840224802, -0.444641352, -0.710142016, -0.120641254, 0.545102596, 0.753535926,
         0.83179915, -0.863324702, 0.906601071, 0.265533209, 0.863427699, -0.78801626},
        {-0.819307089, -0.607422292, -0.501336336, -0.80831182, 0.831516206},
        {-0.82115835, -0.883829176}}},
      {"Adam(lr=0.01, amsgrad=True, maximize=True)",
       adam({.lr = 0.01, .amsgrad = true, .maximize = true}),
       {{-0.929688632, -0.503994286, -0.727473021, -0.115206979, 0.523047864, 0.736070931,
         0.816230953, -0.857931912, 0.984041691, 0.268567801, 1.00881195, -0.710124373},
        {-0.903387845, -0.755402386, -0.40265125, -0.740997553, 0.786008239},
        {-0.866654873, -0.942985713}}},
      {"AdamW(lr=0.01)", adamw({.lr = 0.01}),
       {{-0.873320878, -0.477245986, -0.722933829, -0.118909054, 0.545092881, 0.752483904,
         0.832722604, -0.868562818, 0.96521467, 0.267269999, 0.911086142, -0.768566787},
        {-0.850847304, -0.658705235, -0.471381992, -0.7941944, 0.824900568},
        {-0.838971078, -0.904156029}}},
      {"AdamW(lr=0.03, betas=(0.85, 0.99), weight_decay=0.2, amsgrad=True)",
       adamw({.lr = 0.03, .betas = {0.85, 0.99}, .weight_decay = 0.2, .amsgrad = true}),
       {{-0.797814965, -0.431532592, -0.697725534, -0.120320819, 0.548154533, 0.748921812,
         0.826352835, -0.854712367, 0.918082833, 0.259957999, 0.788634777, -0.802345991},
        {-0.779932201, -0.541146815, -0.525741696, -0.820531011, 0.838979244},
        {-0.79899323, -0.850777507}}},
      // SGD([{"params": [p0]}, {"params": [p1, p2], "lr": 0.01, "momentum": 0.5}],
      //     lr=0.1, momentum=0.9)
      {"SGD groups",
       [](const std::vector<Tensor>& p) {
         return std::make_unique<SGD>(
             std::vector<ParamGroup>{{{p[0]}}, {{p[1], p[2]}, {{"lr", 0.01}, {"momentum", 0.5}}}},
             SGDOptions{.lr = 0.1, .momentum = 0.9});
       },
       {{-0.714776635, -0.286780834, -0.793769002, -0.280119836, 0.566240847, 1.03367138,
         0.886054993, -0.861681759, 0.707792401, 0.377538681, -0.0129126469, -1.11883152},
        {-0.873908818, -0.673155308, -0.462639838, -0.782936215, 0.817361474},
        {-0.851405621, -0.917065322}}},
      // Adam([{"params": [p0, p2], "lr": 0.05, "betas": (0.5, 0.9)}, {"params": [p1]}], lr=0.01)
      {"Adam groups",
       [](const std::vector<Tensor>& p) {
         return std::make_unique<Adam>(
             std::vector<ParamGroup>{{{p[0], p[2]}, {{"lr", 0.05}, {"beta1", 0.5}, {"beta2", 0.9}}},
                                     {{p[1]}}},
             AdamOptions{.lr = 0.01});
       },
       {{-0.838584483, -0.357805759, -0.70632267, -0.127344221, 0.554562271, 0.797608912,
         0.887943804, -0.905043662, 0.930415392, 0.273435593, 0.731829107, -0.85909307},
        {-0.85127753, -0.659049213, -0.471608698, -0.794585943, 0.825308442},
        {-0.816290557, -0.843094349}}},
  };
}

void run_steps(Optimizer& opt, const std::vector<Tensor>& params, int from, int to) {
  for (int s = from; s < to; ++s) {
    set_grads(params, s);
    opt.step();
  }
}

TEST(Optim, MatchesPyTorch) {
  for (const RefCase& c : reference_cases()) {
    SCOPED_TRACE(c.name);
    std::vector<Tensor> params = make_params();
    std::vector<const void*> storage;
    for (const Tensor& p : params) storage.push_back(p.data_ptr());
    auto opt = c.make(params);
    run_steps(*opt, params, 0, 5);
    expect_params(params, c.want, kTol, c.name);
    for (size_t i = 0; i < params.size(); ++i) {
      // In place: same storage, still a leaf that requires grad, no history recorded.
      EXPECT_EQ(params[i].data_ptr(), storage[i]) << c.name << " parameter " << i;
      EXPECT_TRUE(params[i].is_leaf() && params[i].requires_grad()) << c.name;
    }
  }
}

TEST(Optim, AdamStateMatchesPyTorch) {
  // Adam(lr=0.01, amsgrad=True, maximize=True) after the 5 reference steps; PyTorch's state:
  // p1 step 5.0, p2 step 3.0 (skipped on odd steps), and for p1:
  std::vector<Tensor> params = make_params();
  Adam opt(params, {.lr = 0.01, .amsgrad = true, .maximize = true});
  run_steps(opt, params, 0, 5);
  const NamedTensors& st = opt.state(params[1]);
  std::vector<std::string> keys;
  for (const auto& [k, t] : st) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}));
  EXPECT_EQ(st[0].second.dim(), 0);
  EXPECT_EQ(st[0].second.dtype(), kFloat32);
  EXPECT_EQ(st[0].second.item<float>(), 5.0f);
  expect_close(st[1].second,
               {-0.0314379856, 0.206041247, -0.0975345746, -0.0738450587, 0.026690362}, kTol,
               "exp_avg");
  const std::vector<double> sq = {0.000597299717, 0.00136827806, 0.00168562366, 0.00190766645,
                                  0.00137051707};
  expect_close(st[2].second, sq, kTol, "exp_avg_sq");
  expect_close(st[3].second, sq, kTol, "max_exp_avg_sq");
  EXPECT_EQ(opt.state(params[2]).at(0).second.item<float>(), 3.0f);

  // The state dict: PyTorch's names and group layout.
  OptimizerState sd = opt.state_dict();
  EXPECT_EQ(sd.type, "Adam");
  std::vector<std::string> names;
  for (const auto& [n, t] : sd.state) names.push_back(n);
  EXPECT_EQ(names.size(), 12u);
  EXPECT_EQ(names[0], "state.0.step");
  EXPECT_EQ(names[5], "state.1.exp_avg");
  EXPECT_EQ(names[11], "state.2.max_exp_avg_sq");
  EXPECT_TRUE(sd.state[5].second.is_same(st[1].second)) << "state_dict should not copy";
  EXPECT_EQ(sd.param_groups,
            "[{\"amsgrad\":true,\"beta1\":0.9,\"beta2\":0.999,\"capturable\":false,"
            "\"eps\":1e-08,\"lr\":0.01,\"maximize\":true,\"weight_decay\":0.0,"
            "\"params\":[0,1,2]}]");
}

TEST(Optim, ZeroGrad) {
  std::vector<Tensor> params = make_params();
  SGD opt(params, {.lr = 0.1});
  set_grads(params, 0);
  Tensor g0 = params[0].grad();
  opt.zero_grad(/*set_to_none=*/false);
  EXPECT_TRUE(params[0].grad().is_same(g0)) << "zero_grad(false) must keep the grad tensor";
  expect_close(g0, std::vector<double>(12, 0.0), 0, "zeroed grad");
  expect_close(params[2].grad(), {0, 0}, 0, "zeroed grad 2");
  opt.zero_grad();
  for (const Tensor& p : params) EXPECT_FALSE(p.grad().defined());
  opt.zero_grad();  // no grads: nothing to do

  // A gradient built with create_graph has history; zero_grad(false) detaches it first.
  Tensor w = ones({2}).requires_grad_();
  SGD opt2({w}, {.lr = 0.1});
  Tensor loss = (w * w * w).sum();
  loss.backward({}, {}, /*create_graph=*/true);
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(w.grad().requires_grad());
  opt2.zero_grad(false);
  EXPECT_FALSE(w.grad().requires_grad());
  expect_close(w.grad(), {0, 0}, 0, "zeroed create_graph grad");
}

TEST(Optim, StepSkipsParamsWithoutGradAndTrainsAModule) {
  struct Line : Module {
    Line() {
      w = register_parameter("w", zeros({1}));
      b = register_parameter("b", zeros({1}));
      frozen = register_parameter("frozen", ones({1}), /*requires_grad=*/false);
    }
    Tensor forward(const Tensor& x) override { return x * w + b; }
    Tensor w, b, frozen;
  };
  auto m = std::make_shared<Line>();
  std::vector<Tensor> trainable;
  for (const Tensor& p : m->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  ASSERT_EQ(trainable.size(), 2u);
  SGD opt(trainable, {.lr = 0.1, .momentum = 0.9});
  opt.step();  // no grads yet: nothing happens, no state
  EXPECT_TRUE(opt.state(m->w).empty());
  // Fit y = 2x + 1 on four points.
  Tensor x = tensor({0.f, 1.f, 2.f, 3.f});
  Tensor y = x * 2.0 + 1.0;
  double first = 0, last = 0;
  for (int i = 0; i < 200; ++i) {
    Tensor loss = opt.step([&] {
      opt.zero_grad();
      Tensor d = (*m)(x) - y;
      Tensor l = (d * d).mean();
      l.backward();
      return l;
    });
    if (i == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, 1e-4 * first) << "first loss " << first << ", last " << last;
  EXPECT_NEAR(m->w.item<float>(), 2.0, 1e-2);
  EXPECT_NEAR(m->b.item<float>(), 1.0, 1e-2);
  EXPECT_EQ(m->frozen.item<float>(), 1.0f);
  EXPECT_TRUE(m->w.is_leaf());
}

TEST(Optim, AddParamGroupFillsDefaults) {
  std::vector<Tensor> params = make_params();
  Adam opt({params[0]}, {.lr = 0.01, .betas = {0.8, 0.9}});
  opt.add_param_group({{params[1], params[2]}, {{"lr", 0.5}}});
  ASSERT_EQ(opt.param_groups().size(), 2u);
  const ParamGroup& g = opt.param_groups()[1];
  EXPECT_EQ(g.lr(), 0.5);
  EXPECT_EQ(g.get("beta1"), 0.8);
  EXPECT_EQ(g.get("beta2"), 0.9);
  EXPECT_EQ(g.get("amsgrad"), 0.0);
  expect_error([&] { g.get("momentum"); }, {"no option 'momentum'", "beta1", "lr"});
  // The lr default of SGD is required; per-group lrs are enough.
  SGD ok(std::vector<ParamGroup>{{{params[0]}, {{"lr", 0.1}}}}, {});
  EXPECT_EQ(ok.param_groups()[0].lr(), 0.1);
}

TEST(Optim, Errors) {
  std::vector<Tensor> p = make_params();
  expect_error([&] { SGD({p[0]}, {.lr = -0.1}); }, {"[SGD]", "learning rate", "-0.1"});
  expect_error([&] { SGD({p[0]}, {}); }, {"[SGD]", "did not specify lr"});
  expect_error([&] { SGD({p[0]}, {.lr = 0.1, .momentum = -1}); }, {"[SGD]", "momentum", "-1"});
  expect_error([&] { SGD({p[0]}, {.lr = 0.1, .weight_decay = -0.5}); },
               {"[SGD]", "weight_decay", "-0.5"});
  expect_error([&] { SGD({p[0]}, {.lr = 0.1, .nesterov = true}); },
               {"[SGD]", "Nesterov", "momentum=0"});
  expect_error([&] { SGD({p[0]}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
               {"[SGD]", "Nesterov", "dampening=0.1"});
  expect_error([&] { Adam({p[0]}, {.betas = {1.5, 0.9}}); }, {"[Adam]", "index 0", "1.5"});
  expect_error([&] { Adam({p[0]}, {.betas = {0.9, -0.1}}); }, {"[Adam]", "index 1", "-0.1"});
  expect_error([&] { Adam({p[0]}, {.eps = -1e-8}); }, {"[Adam]", "epsilon", "-1e-08"});
  expect_error([&] { AdamW({p[0]}, {.lr = -1}); }, {"[AdamW]", "learning rate", "-1"});
  expect_error([&] { AdamW({p[0]}, {.weight_decay = -0.01}); }, {"[AdamW]", "weight_decay"});
  expect_error([&] { Adam(std::vector<Tensor>{}); }, {"[Adam]", "empty parameter list"});
  expect_error([&] { SGD({p[0], Tensor()}, {.lr = 0.1}); }, {"[SGD]", "parameter 1", "undefined"});
  {
    // A frozen parameter (no requires_grad) is accepted and never updated, as in PyTorch.
    Tensor frozen = ones({2});
    Tensor w = ones({2}).requires_grad_();
    SGD opt({frozen, w}, {.lr = 0.5});
    (w * frozen).sum().backward();
    opt.step();
    EXPECT_EQ(frozen.to_vector<float>(), (std::vector<float>{1, 1}));
    EXPECT_EQ(w.to_vector<float>(), (std::vector<float>{0.5, 0.5}));
  }
  expect_error([&] { SGD({p[0] * 2.0}, {.lr = 0.1}); }, {"[SGD]", "not a leaf"});
  expect_error<TypeError>([&] { SGD({zeros({2}, kInt64)}, {.lr = 0.1}); },
                          {"[SGD]", "int64", "floating"});
  expect_error([&] { SGD({p[0], p[1], p[0]}, {.lr = 0.1}); },
               {"[SGD]", "parameter 2", "same tensor as parameter 0"});
  expect_error([&] { SGD(std::vector<ParamGroup>{{{p[0]}}, {{p[1], p[0]}}}, {.lr = 0.1}); },
               {"[SGD]", "parameter 1 of group 1", "already in parameter group 0"});
  expect_error([&] { SGD(std::vector<ParamGroup>{{{p[0]}, {{"lrr", 0.1}}}}, {.lr = 0.1}); },
               {"[SGD]", "unknown option 'lrr'", "momentum"});
  expect_error([&] { SGD(std::vector<ParamGroup>{{{p[0]}, {{"lr", -2}}}}, {.lr = 0.1}); },
               {"[SGD]", "parameter group 0", "-2"});
  SGD opt({p[0]}, {.lr = 0.1});
  expect_error([&] { opt.add_param_group({{p[0]}}); }, {"already in parameter group 0"});
  EXPECT_EQ(opt.param_groups().size(), 1u) << "a rejected group must not be added";
}

TEST(Optim, CudaMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device (or built with EMBER_WITH_CUDA=OFF)";
  for (const RefCase& c : reference_cases()) {
    SCOPED_TRACE(c.name);
    std::vector<Tensor> cpu = make_params(), gpu;
    for (const Tensor& p : cpu) gpu.push_back(p.detach().to(Device("cuda")).requires_grad_());
    auto opt_cpu = c.make(cpu);
    auto opt_gpu = c.make(gpu);
    run_steps(*opt_cpu, cpu, 0, 5);
    run_steps(*opt_gpu, gpu, 0, 5);
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(gpu[i].is_cuda());
      expect_close(gpu[i].cpu(), cpu[i].to_vector<double>(), kTol,
                   std::string(c.name) + " CUDA vs CPU parameter " + std::to_string(i));
    }
    // The step count stays on the host; the moments live with the parameter.
    for (const auto& [key, t] : opt_gpu->state(gpu[0])) {
      EXPECT_EQ(t.is_cuda(), key != "step") << key;
    }
  }
  std::vector<Tensor> gpu;
  for (const Tensor& p : make_params()) gpu.push_back(p.detach().to(Device("cuda")).requires_grad_());
  set_grads(gpu, 0);
  Tensor total = nn::clip_grad_norm_(gpu, 0.5);
  EXPECT_TRUE(total.is_cuda());
  EXPECT_NEAR(total.item<double>(), 1.94548869, kTol * 2);
  expect_close(gpu[1].grad().cpu(),
               {-0.118807718, -0.0357074626, 0.0256873332, 0.208785444, -0.082380645}, kTol,
               "clipped CUDA grad");
}

// ---- state dicts ------------------------------------------------------------------------------

// What a checkpoint keeps: copies of the tensors and the metadata strings.
OptimizerState snapshot(const OptimizerState& s) {
  NamedTensors copies;
  for (const auto& [n, t] : s.state) copies.emplace_back(n, t.clone());
  return OptimizerState::from(copies, s.metadata());
}

std::vector<Tensor> clone_params(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// step_unless(found_inf): a step when the flag is 0, nothing at all when it is not (no state
// made, the parameters untouched), for the base (SGD reads the flag on the host) and Adam (which
// may decide on the device); a flag of another dtype or size is refused naming the optimizer.
TEST(Optim, StepUnlessSkipsOnAFlagAndChecksIt) {
  const std::vector<std::pair<const char*, Factory>> makers = {
      {"SGD", [](const std::vector<Tensor>& p) -> std::unique_ptr<Optimizer> {
         return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9});
       }},
      {"AdamW", [](const std::vector<Tensor>& p) -> std::unique_ptr<Optimizer> {
         return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01, .capturable = true});
       }},
  };
  for (const auto& [name, make] : makers) {
    SCOPED_TRACE(name);
    std::vector<Tensor> a = make_params(), b = clone_params(a);
    auto with = make(a), plain = make(b);
    EXPECT_EQ(with->supports_found_inf(), std::string(name) == "AdamW");
    set_grads(a, 0);
    with->step_unless(ones({1}));
    EXPECT_TRUE(with->state(a[0]).empty()) << "a skipped first step made state";
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(equal(a[i], b[i])) << "skipped, " << i;
    for (int s = 0; s < 3; ++s) {
      set_grads(a, s);
      set_grads(b, s);
      with->step_unless(zeros({1}));
      plain->step();
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(equal(a[i], b[i])) << "stepped, " << i;
    expect_error([&] { with->step_unless(zeros({2})); },
                 {std::string(name) + ".step_unless", "float32 tensor of one element", "[2]"});
    expect_error([&] { with->step_unless(zeros({1}, kFloat64)); },
                 {std::string(name) + ".step_unless", "got float64"});
  }
}

// capturable only changes where a CUDA parameter's step count lives; on the CPU it is a no-op.
TEST(Optim, CapturableIsANoOpOnCpuParameters) {
  std::vector<Tensor> a = make_params(), b = clone_params(a);
  AdamW with(a, {.lr = 0.01, .weight_decay = 0.1, .capturable = true});
  AdamW without(b, {.lr = 0.01, .weight_decay = 0.1});
  run_steps(with, a, 0, 5);
  run_steps(without, b, 0, 5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(equal(a[i], b[i])) << "parameter " << i;
  for (const auto& [key, t] : with.state(a[0])) EXPECT_TRUE(t.device().is_cpu()) << key;
}

// A capturable AdamW step captured in a CUDA graph and replayed matches eager steps, with the
// gradients refilled before each replay and the learning rate changed on the host between
// replays (as a scheduler does): the graph writes it to the device before each launch.
TEST(Optim, CudaCapturableAdamWReplaysInAGraphAsEagerSteps) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device (or built with EMBER_WITH_CUDA=OFF)";
  const Device dev("cuda");
  std::vector<Tensor> eager, graphed, grads;
  for (const Tensor& p : make_params()) {
    eager.push_back(p.detach().to(dev).requires_grad_());
    graphed.push_back(p.detach().to(dev).requires_grad_());
    grads.push_back(zeros_like(eager.back()));
    graphed.back().set_grad(grads.back());  // the graph's static input
  }
  AdamW eager_opt(eager, {.lr = 0.01, .weight_decay = 0.1});
  AdamW graph_opt(graphed, {.lr = 0.01, .weight_decay = 0.1, .capturable = true});
  auto fill_grads = [&](int s) {
    for (size_t i = 0; i < eager.size(); ++i) {
      Tensor g = rand_t(eager[i].shape(), kFloat32, 100 + 10 * s + i).to(dev);
      eager[i].set_grad(g);
      grads[i].copy_(g);
    }
  };
  for (int s = 0; s < 2; ++s) {  // warm-up: the state exists before the capture
    fill_grads(s);
    eager_opt.step();
    graph_opt.step();
  }
  cuda::CUDAGraph graph;
  cuda::graph(graph, [&] { graph_opt.step(); });
  for (int s = 2; s < 7; ++s) {
    const double lr = 0.01 * (1.0 - 0.1 * s);
    eager_opt.param_groups()[0].options["lr"] = lr;
    graph_opt.param_groups()[0].options["lr"] = lr;
    fill_grads(s);
    eager_opt.step();
    graph.replay();
  }
  for (size_t i = 0; i < eager.size(); ++i) {
    expect_close(graphed[i].cpu(), eager[i].cpu().to_vector<double>(), 1e-6,
                 "graph-replayed parameter " + std::to_string(i));
  }
  for (const auto& [key, t] : graph_opt.state(graphed[0])) {
    EXPECT_TRUE(t.is_cuda()) << key;
    if (key == "step") {
      EXPECT_EQ(t.item<float>(), 7.0f);
    }
  }
}

// As PyTorch: a non-capturable Adam on CUDA refuses a capture (its step count is a host value
// the graph would freeze) instead of failing on a host read inside it; the same optimizer steps
// on afterwards.
TEST(Optim, CudaNonCapturableAdamInACaptureIsRefused) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device (or built with EMBER_WITH_CUDA=OFF)";
  const Device dev("cuda");
  std::vector<Tensor> params;
  for (const Tensor& p : make_params()) {
    params.push_back(p.detach().to(dev).requires_grad_());
    params.back().set_grad(ones_like(params.back()));
  }
  AdamW opt(params, {.lr = 0.01});
  opt.step();  // the state exists before the capture
  cuda::CUDAGraph graph;
  expect_error<ValueError>(
      [&] { cuda::graph(graph, [&] { opt.step(); }); },
      {"AdamW.step", "parameter group 0 is not capturable", "capturable=true"});
  EXPECT_FALSE(graph.ready());
  opt.step();
  EXPECT_EQ(opt.state(params[0])[0].second.item<float>(), 2.0f);
}

TEST(Optim, StateDictRoundTripContinuesIdentically) {
  const std::vector<std::pair<const char*, Factory>> makers = {
      {"SGD nesterov", [](const std::vector<Tensor>& p) -> std::unique_ptr<Optimizer> {
         return std::make_unique<SGD>(
             std::vector<ParamGroup>{{{p[0], p[1]}}, {{p[2]}, {{"lr", 0.02}}}},
             SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
       }},
      {"Adam amsgrad", [](const std::vector<Tensor>& p) -> std::unique_ptr<Optimizer> {
         return std::make_unique<Adam>(p, AdamOptions{.lr = 0.01, .amsgrad = true});
       }},
      {"AdamW", [](const std::vector<Tensor>& p) -> std::unique_ptr<Optimizer> {
         return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01});
       }},
  };
  for (const auto& [name, make] : makers) {
    SCOPED_TRACE(name);
    // Uninterrupted: 6 steps.
    std::vector<Tensor> a = make_params();
    auto opt_a = make(a);
    run_steps(*opt_a, a, 0, 6);
    // Interrupted after 3: snapshot, then a fresh optimizer on copies of the parameters.
    std::vector<Tensor> b = make_params();
    auto opt_b = make(b);
    run_steps(*opt_b, b, 0, 3);
    OptimizerState saved = snapshot(opt_b->state_dict());
    opt_b->param_groups()[0].set_lr(123.0);  // must come back from the snapshot
    std::vector<Tensor> c = clone_params(b);
    auto opt_c = make(c);
    opt_c->load_state_dict(saved);
    EXPECT_EQ(opt_c->param_groups()[0].lr(), opt_a->param_groups()[0].lr());
    run_steps(*opt_c, c, 3, 6);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(equal(a[i], c[i])) << name << " parameter " << i << ": " << a[i] << " vs "
                                     << c[i];
    }
  }
}

// load_state_dict copies the state by default; with copy = false it adopts parameter-shaped
// tensors already on the parameter's device and dtype (what a checkpoint loader reads for it),
// and still copies one it must convert.
TEST(Optim, LoadStateDictCanAdoptTheTensors) {
  std::vector<Tensor> p = make_params();
  AdamW opt(p, AdamWOptions{.lr = 0.01});
  run_steps(opt, p, 0, 2);
  for (const bool copy : {true, false}) {
    OptimizerState saved = snapshot(opt.state_dict());
    std::vector<Tensor> q = clone_params(p);
    AdamW fresh(q, AdamWOptions{.lr = 0.01});
    fresh.load_state_dict(saved, copy);
    const std::string key = "state.0.exp_avg";
    Tensor given;
    for (const auto& [n, t] : saved.state) {
      if (n == key) given = t;
    }
    ASSERT_TRUE(given.defined());
    Tensor held;
    for (const auto& [k, t] : fresh.state(q[0])) {
      if (k == "exp_avg") held = t;
    }
    ASSERT_TRUE(held.defined());
    EXPECT_EQ(held.data_ptr() == given.data_ptr(), !copy) << "copy " << copy;
  }
}

TEST(Optim, StateDictThroughSafetensorsFile) {
  char tmpl[] = "/tmp/ember_optim_test_XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  ASSERT_NE(dir, nullptr) << "mkdtemp failed: " << std::strerror(errno);
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};
  const std::string path = std::string(dir) + "/optim.safetensors";

  std::vector<Tensor> a = make_params();
  Adam opt_a(a, {.lr = 0.01});
  run_steps(opt_a, a, 0, 2);
  const OptimizerState sd = opt_a.state_dict();
  save_safetensors(path, sd.state, sd.metadata());
  std::vector<Tensor> b = clone_params(a);  // the model's checkpoint
  run_steps(opt_a, a, 2, 4);

  SafetensorsFile f = load_safetensors(path);
  Adam opt_b(b, {.lr = 0.01});
  opt_b.load_state_dict(OptimizerState::from(f.tensors(), f.metadata()));
  run_steps(opt_b, b, 2, 4);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(equal(a[i], b[i])) << "parameter " << i;
}

TEST(Optim, LoadStateDictConvertsDtypeAndChecks) {
  std::vector<Tensor> p = make_params();
  SGD opt(p, {.lr = 0.1, .momentum = 0.9});
  run_steps(opt, p, 0, 2);
  OptimizerState sd = snapshot(opt.state_dict());

  // float64 parameters: the float32 buffers are converted on load.
  std::vector<Tensor> p64;
  for (const Tensor& t : p) p64.push_back(t.detach().to(kFloat64).requires_grad_());
  SGD opt64(p64, {.lr = 0.1, .momentum = 0.9});
  opt64.load_state_dict(sd);
  EXPECT_EQ(opt64.state(p64[0]).at(0).second.dtype(), kFloat64);

  expect_error([&] { Adam(p).load_state_dict(sd); }, {"[Adam::load_state_dict]", "SGD"});
  expect_error([&] { SGD({p[0], p[1]}, {.lr = 0.1}).load_state_dict(sd); },
               {"[SGD::load_state_dict]", "3 parameters", "has 2"});
  expect_error([&] { SGD(std::vector<ParamGroup>{{{p[0]}}, {{p[1], p[2]}}}, {.lr = 0.1})
                         .load_state_dict(sd); },
               {"1 parameter groups", "has 2"});
  // Wrong shapes and names: every problem is listed, and nothing changes.
  std::vector<Tensor> q = {zeros({4, 3}).requires_grad_(), zeros({5}).requires_grad_(),
                           zeros({2}).requires_grad_()};
  SGD other(q, {.lr = 0.5});
  OptimizerState bad = sd;
  bad.state.emplace_back("state.7.momentum_buffer", zeros({2}));
  bad.state.emplace_back("momentum.0", zeros({2}));
  expect_error([&] { other.load_state_dict(bad); },
               {"'state.0.momentum_buffer' has shape [3, 4] but parameter 0 has shape [4, 3]",
                "'state.7.momentum_buffer' refers to parameter 7",
                "'momentum.0' is not named state.<param index>.<key>"});
  EXPECT_EQ(other.param_groups()[0].lr(), 0.5);
  EXPECT_TRUE(other.state(q[1]).empty());
  OptimizerState garbled = sd;
  garbled.param_groups = "[{\"lr\": ";
  expect_error([&] { other.load_state_dict(garbled); }, {"not valid JSON"});
  garbled.param_groups =
      "[{\"lr\": -1, \"momentum\": 0, \"dampening\": 0, \"weight_decay\": 0, \"nesterov\": false, "
      "\"maximize\": false, \"params\": [0, 1, 2]}]";
  expect_error([&] { other.load_state_dict(garbled); }, {"learning rate", "-1"});
  expect_error([] { OptimizerState::from({}, {{"optimizer", "SGD"}}); }, {"param_groups"});
}

// ---- clip_grad --------------------------------------------------------------------------------
// Reference: make_params(); set_grads(params, 0);
//   total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=p); print p.grad for each.

TEST(ClipGrad, NormMatchesPyTorch) {
  struct Case {
    double norm_type, total;
    Values grads;
  };
  const std::vector<Case> cases = {
      {2.0, 1.94548869,
       {{-0.125077337, 0.0199294724, -0.0483947545, -0.13798964, -0.152145073, 0.0497143678,
         -0.0401216932, 0.0473182835, -0.0226647761, 0.164813742, 0.235816404, 0.11128024},
        {-0.118807718, -0.0357074626, 0.0256873332, 0.208785444, -0.082380645},
        {-0.112538092, -0.0913443938}}},
      {1.0, 7.12250328,
       {{-0.0341644809, 0.00544367265, -0.013218875, -0.037691433, -0.041557949, 0.013579323,
         -0.0109591139, 0.0129248397, -0.00619081175, 0.0450183526, 0.0644125119, 0.0303958468},
        {-0.0324519537, -0.0097533809, 0.00701641431, 0.0570290871, -0.0225020126},
        {-0.0307394248, -0.0249504335}}},
      {3.0, 1.34265566,
       {{-0.181235224, 0.0288775116, -0.0701232851, -0.199944943, -0.220455959, 0.0720353872,
         -0.0581357367, 0.0685634911, -0.0328409225, 0.23881267, 0.341694474, 0.161243424},
        {-0.172150627, -0.0517395847, 0.0372205675, 0.30252701, -0.119368337},
        {-0.16306603, -0.132356688}}},
      {nn::kInfNorm, 0.917556763,
       {{-0.265200377, 0.0422562845, -0.102610968, -0.292578191, -0.322591841, 0.105408929,
         -0.0850696638, 0.100328535, -0.0480559207, 0.349453092, 0.499999434, 0.235946506},
        {-0.251906931, -0.0757102147, 0.0544646233, 0.442685902, -0.17467095},
        {-0.238613516, -0.19367671}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("norm_type " + std::to_string(c.norm_type));
    std::vector<Tensor> p = make_params();
    set_grads(p, 0);
    Tensor total = nn::clip_grad_norm_(p, 0.5, c.norm_type);
    EXPECT_EQ(total.dim(), 0);
    EXPECT_NEAR(total.item<double>(), c.total, kTol * c.total);
    for (size_t i = 0; i < p.size(); ++i) {
      expect_close(p[i].grad(), c.grads[i], kTol, "clipped grad " + std::to_string(i));
    }
  }
}

TEST(ClipGrad, NoClippingNoGradsAndErrors) {
  std::vector<Tensor> p = make_params();
  set_grads(p, 0);
  std::vector<Tensor> before;
  for (const Tensor& t : p) before.push_back(t.grad().clone());
  Tensor total = nn::clip_grad_norm_(p, 100.0);
  EXPECT_NEAR(total.item<double>(), 1.94548869, kTol);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(equal(p[i].grad(), before[i])) << i;

  // Parameters without a grad are skipped; none at all gives a zero norm.
  set_grads(p, 1);  // p[2] has none
  nn::clip_grad_norm_(p, 0.1);
  EXPECT_FALSE(p[2].grad().defined());
  Tensor none = nn::clip_grad_norm_({zeros({3}).requires_grad_()}, 1.0);
  EXPECT_EQ(none.item<float>(), 0.0f);

  // error_if_nonfinite: throws before touching the grads.
  Tensor w = zeros({3}).requires_grad_();
  w.set_grad(tensor({1.f, INFINITY, 2.f}));
  expect_error([&] { nn::clip_grad_norm_({w}, 1.0, 2.0, true); },
               {"[clip_grad_norm_]", "non-finite", "inf"});
  EXPECT_EQ(w.grad().to_vector<float>()[0], 1.0f);
  Tensor inf_total = nn::clip_grad_norm_({w}, 1.0);  // allowed: scales by 0
  EXPECT_TRUE(std::isinf(inf_total.item<double>()));
  expect_error([&] { nn::clip_grad_norm_(p, -1.0); }, {"[clip_grad_norm_]", "max_norm", "-1"});
  // foreach_mul_ (the scaling clip_grad_norm_ does under no_grad) refuses a tensor that
  // requires grad while grad mode is on, and takes it without.
  Tensor leaf = ones({3}).requires_grad_();
  expect_error([&] { foreach_mul_({zeros({2}), leaf}, ones({})); },
               {"[foreach_mul_]", "tensor 1", "requires grad"});
  {
    NoGradGuard no_grad;
    foreach_mul_({leaf}, full({}, 2.0f));
  }
  EXPECT_EQ(leaf.sum().item<float>(), 6.0f);
  expect_error([&] { nn::clip_grad_norm_(p, 1.0, 0.0); }, {"[clip_grad_norm_]", "norm_type"});
  expect_error([&] { nn::clip_grad_value_(p, -0.5); }, {"[clip_grad_value_]", "-0.5"});
}

// The two halves of clip_grad_norm_ (PyTorch 2.6's get_total_norm and clip_grads_with_norm_):
// together they clip as clip_grad_norm_ does, and each names itself in its errors.
TEST(ClipGrad, TotalNormAndClipWithNormAreItsHalves) {
  std::vector<Tensor> a = make_params(), b = make_params();
  set_grads(a, 0);
  set_grads(b, 0);
  const Tensor want = nn::clip_grad_norm_(a, 0.5, 3.0);
  std::vector<Tensor> grads;
  for (const Tensor& t : b) grads.push_back(t.grad());
  const Tensor total = nn::get_total_norm(grads, 3.0);
  EXPECT_NEAR(total.item<double>(), want.item<double>(), 1e-6);
  nn::clip_grads_with_norm_(b, 0.5, total);
  for (size_t i = 0; i < a.size(); ++i) {
    expect_close(b[i].grad(), a[i].grad().to_vector<double>(), 1e-6, "grad " + std::to_string(i));
  }
  expect_error([&] { nn::get_total_norm(grads, 0.0); }, {"[get_total_norm]", "norm_type"});
  expect_error([&] { nn::get_total_norm({tensor({1.f, INFINITY})}, 2.0, true); },
               {"[get_total_norm]", "non-finite", "inf"});
  expect_error([&] { nn::clip_grads_with_norm_(b, -1.0, total); },
               {"[clip_grads_with_norm_]", "max_norm", "-1"});
  expect_error([&] { nn::clip_grads_with_norm_(b, 1.0, Tensor()); },
               {"clip_grads_with_norm_", "total_norm"});
}

TEST(ClipGrad, Value) {
  Tensor w = zeros({4}).requires_grad_();
  w.set_grad(tensor({-2.f, -0.25f, 0.5f, 3.f}));
  Tensor v = zeros({1}).requires_grad_();  // no grad: skipped
  nn::clip_grad_value_({w, v}, 0.5);
  expect_close(w.grad(), {-0.5, -0.25, 0.5, 0.5}, 0, "clip_grad_value_");
  EXPECT_FALSE(v.grad().defined());
}

}  // namespace
}  // namespace ember::nn::optim
