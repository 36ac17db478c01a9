// LR schedulers: lr (and momentum) sequences against PyTorch 1.13, checkpoint round trips, and
// error messages.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <ember/nn/optim/adam.h>
#include <ember/nn/optim/lr_scheduler.h>
#include <ember/nn/optim/sgd.h>
#include "tests/tensor/test_util.h"

namespace ember::nn::optim {
namespace {

using test::expect_error;

// The expected sequences were printed by this script with Debian's PyTorch 1.13
// (/usr/bin/python3): the value of each group right after construction and after each of
// `steps` calls of opt.step(); sched.step(), flattened (step-major, then group).
//
//   import torch, warnings
//   from torch.optim import SGD, Adam, lr_scheduler as L
//   def opt_sgd(lrs=(0.1, 0.02), momentum=0.0):
//       return SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs],
//                  lr=lrs[0], momentum=momentum)
//   def seq(opt, make, steps=20, key="lr"):
//       s = make(opt); out = []
//       for i in range(steps + 1):
//           if i > 0: opt.step(); s.step()
//           out += [g[key][0] if key == "betas" else g[key] for g in opt.param_groups]
//       print(", ".join(repr(v) for v in out))
//   seq(opt_sgd(), lambda o: L.StepLR(o, step_size=3, gamma=0.5))   # and so on, per test

std::unique_ptr<SGD> opt_sgd(std::vector<double> lrs = {0.1, 0.02}, double momentum = 0) {
  std::vector<ParamGroup> groups;
  for (double lr : lrs) groups.push_back({{zeros({1}).requires_grad_()}, {{"lr", lr}}});
  return std::make_unique<SGD>(groups, SGDOptions{.lr = lrs[0], .momentum = momentum});
}

// Steps the scheduler `steps` times and compares every group's `key` after each step (and
// after construction) with `want`. The formulas are PyTorch's own, evaluated in the same order,
// so they agree bit for bit with glibc's cos; the tolerance only allows for another libm.
void expect_sequence(Optimizer& opt, LRScheduler& sched, int steps,
                     const std::vector<double>& want, const std::string& key = "lr") {
  std::vector<double> got;
  for (int i = 0; i <= steps; ++i) {
    if (i > 0) {
      opt.step();
      sched.step();
    }
    for (const ParamGroup& g : opt.param_groups()) got.push_back(g.get(key));
    if (key == "lr") {
      EXPECT_EQ(sched.get_last_lr().size(), opt.param_groups().size());
    }
  }
  ASSERT_EQ(got.size(), want.size()) << sched.name() << " " << key;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-14 * std::fabs(want[i]) + 1e-18)
        << sched.name() << " " << key << ": value " << i << " (step "
        << i / opt.param_groups().size() << ") got " << got[i] << " want " << want[i];
  }
}

TEST(LRScheduler, StepLR) {
  // L.StepLR(o, step_size=3, gamma=0.5), 20 steps
  auto opt = opt_sgd();
  StepLR s(*opt, 3, 0.5);
  EXPECT_EQ(s.last_epoch(), 0);
  EXPECT_EQ(s.base_lrs(), (std::vector<double>{0.1, 0.02}));
  expect_sequence(*opt, s, 20,
                  {0.1, 0.02, 0.1, 0.02, 0.1, 0.02, 0.05, 0.01, 0.05, 0.01, 0.05, 0.01, 0.025,
                   0.005, 0.025, 0.005, 0.025, 0.005, 0.0125, 0.0025, 0.0125, 0.0025, 0.0125,
                   0.0025, 0.00625, 0.00125, 0.00625, 0.00125, 0.00625, 0.00125, 0.003125,
                   0.000625, 0.003125, 0.000625, 0.003125, 0.000625, 0.0015625, 0.0003125,
                   0.0015625, 0.0003125, 0.0015625, 0.0003125});
  EXPECT_EQ(s.last_epoch(), 20);
  EXPECT_EQ(s.get_last_lr(), (std::vector<double>{0.0015625, 0.0003125}));
  EXPECT_EQ(opt->param_groups()[0].get("initial_lr"), 0.1);
}

TEST(LRScheduler, MultiStepExponentialLambda) {
  {  // L.MultiStepLR(o, milestones=[7, 3, 7], gamma=0.1), 10 steps
    auto opt = opt_sgd();
    MultiStepLR s(*opt, {7, 3, 7}, 0.1);
    expect_sequence(*opt, s, 10,
                    {0.1, 0.02, 0.1, 0.02, 0.1, 0.02, 0.010000000000000002, 0.002,
                     0.010000000000000002, 0.002, 0.010000000000000002, 0.002,
                     0.010000000000000002, 0.002, 0.00010000000000000005, 2.0000000000000005e-05,
                     0.00010000000000000005, 2.0000000000000005e-05, 0.00010000000000000005,
                     2.0000000000000005e-05, 0.00010000000000000005, 2.0000000000000005e-05});
  }
  {  // L.ExponentialLR(o, gamma=0.9), 10 steps
    auto opt = opt_sgd();
    ExponentialLR s(*opt, 0.9);
    expect_sequence(
        *opt, s, 10,
        {0.1, 0.02, 0.09000000000000001, 0.018000000000000002, 0.08100000000000002,
         0.016200000000000003, 0.07290000000000002, 0.014580000000000003, 0.06561000000000002,
         0.013122000000000003, 0.05904900000000002, 0.011809800000000004, 0.05314410000000002,
         0.010628820000000004, 0.04782969000000002, 0.009565938000000005, 0.043046721000000024,
         0.008609344200000004, 0.03874204890000002, 0.007748409780000004, 0.03486784401000002,
         0.006973568802000004});
  }
  {  // L.LambdaLR(o, lambda e: 1.0 / (e + 1)), 10 steps
    auto opt = opt_sgd();
    LambdaLR s(*opt, [](int64_t e) { return 1.0 / static_cast<double>(e + 1); });
    expect_sequence(*opt, s, 10,
                    {0.1, 0.02, 0.05, 0.01, 0.03333333333333333, 0.006666666666666666, 0.025,
                     0.005, 0.020000000000000004, 0.004, 0.016666666666666666,
                     0.003333333333333333, 0.014285714285714285, 0.002857142857142857, 0.0125,
                     0.0025, 0.011111111111111112, 0.0022222222222222222, 0.010000000000000002,
                     0.002, 0.009090909090909092, 0.0018181818181818182});
  }
}

const std::vector<double> kCosine = {
    // L.CosineAnnealingLR(o, T_max=10, eta_min=0.001), 25 steps (down, then back up past T_max)
    0.1, 0.02, 0.09757729755661011, 0.01953503690480396, 0.0905463412215599, 0.018185661446562,
    0.07959536998847742, 0.016083959896778494, 0.0657963412215599, 0.013435661446561997, 0.0505,
    0.010499999999999995, 0.03520365877844011, 0.007564338553437996, 0.02140463001152259,
    0.004916040103221504, 0.010453658778440109, 0.0028143385534379994, 0.0034227024433899004,
    0.0014649630951960413, 0.001, 0.001, 0.0034227024433899004, 0.0014649630951960415,
    0.01045365877844014, 0.002814338553438007, 0.02140463001152267, 0.0049160401032215225,
    0.035203658778440255, 0.007564338553438029, 0.05050000000000022, 0.010500000000000044,
    0.06579634122156018, 0.013435661446562056, 0.07959536998847777, 0.016083959896778563,
    0.09054634122156031, 0.01818566144656208, 0.09757729755661054, 0.019535036904804046,
    0.10000000000000045, 0.020000000000000087, 0.09757729755661054, 0.019535036904804046,
    0.09054634122156033, 0.018185661446562088, 0.07959536998847778, 0.016083959896778566,
    0.0657963412215602, 0.01343566144656206, 0.050500000000000225, 0.010500000000000044};

TEST(LRScheduler, CosineAnnealingLR) {
  auto opt = opt_sgd();
  CosineAnnealingLR s(*opt, 10, 0.001);
  expect_sequence(*opt, s, 25, kCosine);
}

TEST(LRScheduler, LinearLR) {
  {  // L.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5), 8 steps
    auto opt = opt_sgd();
    LinearLR s(*opt, 0.1, 1.0, 5);
    expect_sequence(*opt, s, 8,
                    {0.010000000000000002, 0.002, 0.028000000000000004, 0.0056,
                     0.046000000000000006, 0.0092, 0.064, 0.012799999999999999, 0.082,
                     0.016399999999999998, 0.1, 0.019999999999999997, 0.1, 0.019999999999999997,
                     0.1, 0.019999999999999997, 0.1, 0.019999999999999997});
  }
  {  // L.LinearLR(o, start_factor=1.0, end_factor=0.25, total_iters=4), 6 steps
    auto opt = opt_sgd();
    LinearLR s(*opt, 1.0, 0.25, 4);
    expect_sequence(*opt, s, 6,
                    {0.1, 0.02, 0.08125, 0.01625, 0.0625, 0.012499999999999999, 0.04375,
                     0.008749999999999999, 0.024999999999999998, 0.004999999999999999,
                     0.024999999999999998, 0.004999999999999999, 0.024999999999999998,
                     0.004999999999999999});
  }
}

const std::vector<double> kWarmupCosine = {
    // L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 4), L.CosineAnnealingLR(o, T_max=12,
    // eta_min=1e-4)], milestones=[4]), 20 steps
    0.010000000000000002, 0.002, 0.03250000000000001, 0.006500000000000001,
    0.055000000000000014, 0.011000000000000001, 0.07750000000000003, 0.015500000000000002, 0.1,
    0.02, 0.09829799502313896, 0.01966096197157623, 0.09330796891903273, 0.01866695276765517,
    0.08536998372026805, 0.017085712472806148, 0.07502500000000001, 0.015025000000000002,
    0.06297801130287092, 0.012625249498770084, 0.05005000000000001, 0.010050000000000002,
    0.037121988697129106, 0.007474750501229922, 0.025075000000000017, 0.005075000000000004,
    0.014730016279731958, 0.0030142875271938537, 0.006792031080967289, 0.0014330472323448354,
    0.001802004976861044, 0.0004390380284237715, 0.0001, 0.0001, 0.0018020049768610379,
    0.0004390380284237703, 0.006792031080967282, 0.001433047232344834, 0.014730016279731932,
    0.003014287527193848, 0.025074999999999976, 0.005074999999999995};

std::unique_ptr<SequentialLR> warmup_cosine(Optimizer& opt) {
  auto warmup = std::make_shared<LinearLR>(opt, 0.1, 1.0, 4);
  auto cosine = std::make_shared<CosineAnnealingLR>(opt, 12, 1e-4);
  return std::make_unique<SequentialLR>(opt, std::vector<std::shared_ptr<LRScheduler>>{warmup, cosine},
                                        std::vector<int64_t>{4});
}

TEST(LRScheduler, SequentialWarmupThenCosine) {
  auto opt = opt_sgd();
  auto s = warmup_cosine(*opt);
  expect_sequence(*opt, *s, 20, kWarmupCosine);
}

TEST(LRScheduler, OneCycleLR) {
  {  // L.OneCycleLR(o, max_lr=0.1, total_steps=20) on SGD(momentum=0.9), 20 steps
    const std::vector<double> lr = {
        0.0040000000000000036, 0.013167184270002533, 0.037167184270002526, 0.06683281572999747,
        0.09083281572999748,   0.1,                  0.09874640062350874,  0.09504846320134738,
        0.089091617757105,     0.0811745653949763,   0.07169430017913009,  0.06112620219362893,
        0.0500002,             0.03887419780637107,  0.028306099820869922, 0.0188258346050237,
        0.010908782242895003,  0.004951936798652629, 0.0012539993764912555, 4e-07,
        0.0012539993764912555};
    const std::vector<double> momentum = {
        0.95, 0.9404508497187474, 0.9154508497187474, 0.8845491502812526, 0.8595491502812526,
        0.85, 0.8512536043909088, 0.854951556604879, 0.8609084258765984, 0.8688255099070633,
        0.878305813044122, 0.8888739533021842, 0.8999999999999999, 0.9111260466978157,
        0.9216941869558779, 0.9311744900929366, 0.9390915741234015, 0.945048443395121,
        0.9487463956090911, 0.95, 0.9487463956090911};
    auto twice = [](const std::vector<double>& v) {  // both groups hold the same values
      std::vector<double> r;
      for (double x : v) r.insert(r.end(), {x, x});
      return r;
    };
    for (const char* key : {"lr", "momentum"}) {
      auto opt = opt_sgd({0.1, 0.02}, 0.9);
      OneCycleLR s(*opt, {.max_lr = {0.1}, .total_steps = 20});
      expect_sequence(*opt, s, 20, twice(key == std::string("lr") ? lr : momentum), key);
      EXPECT_EQ(opt->param_groups()[1].get("max_lr"), 0.1);
      EXPECT_EQ(opt->param_groups()[1].get("min_lr"), 0.1 / 25 / 1e4);
      // Stepping past total_steps is an error, as in PyTorch.
      expect_error([&] { s.step(); }, {"[OneCycleLR]", "tried to step 22 times", "20"});
    }
  }
  {  // max_lr=[0.1, 0.5], total_steps=20, anneal_strategy="linear", three_phase=True,
     // pct_start=0.25
    const std::vector<double> lr = {
        0.004, 0.02, 0.028, 0.13999999999999999, 0.052000000000000005, 0.26,
        0.07600000000000001, 0.38, 0.1, 0.5, 0.07600000000000001, 0.38, 0.052000000000000005,
        0.26, 0.027999999999999997, 0.14, 0.0040000000000000036, 0.020000000000000018, 0.0036364,
        0.018182, 0.0032728, 0.016364, 0.0029092000000000002, 0.014546, 0.0025456000000000003,
        0.012728, 0.002182, 0.01091, 0.0018184000000000004, 0.009092, 0.0014548,
        0.007273999999999999, 0.0010912, 0.005455999999999999, 0.0007276000000000001,
        0.003637999999999999, 0.0003640000000000002, 0.0018199999999999987,
        4.0000000000022656e-07, 1.9999999999985307e-06, -0.0003631999999999993,
        -0.0018160000000000016};
    const std::vector<double> momentum = {
        0.95, 0.95, 0.9249999999999999, 0.9249999999999999, 0.8999999999999999,
        0.8999999999999999, 0.875, 0.875, 0.85, 0.85, 0.875, 0.875, 0.8999999999999999,
        0.8999999999999999, 0.9249999999999999, 0.9249999999999999, 0.95, 0.95, 0.95, 0.95,
        0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95,
        0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95};
    for (const char* key : {"lr", "momentum"}) {
      auto opt = opt_sgd({0.1, 0.02}, 0.9);
      OneCycleLR s(*opt, {.max_lr = {0.1, 0.5},
                          .total_steps = 20,
                          .pct_start = 0.25,
                          .anneal_strategy = "linear",
                          .three_phase = true});
      expect_sequence(*opt, s, 20, key == std::string("lr") ? lr : momentum, key);
    }
  }
  {  // Adam: beta1 cycles. max_lr=0.01, epochs=3, steps_per_epoch=5, div_factor=10,
     // final_div_factor=100, base_momentum=0.8, max_momentum=0.9; 15 steps
    const std::vector<double> lr = {
        0.0009999999999999992, 0.0026942958916356978, 0.006501344202803414, 0.009554359905560885,
        0.009944209976994517,  0.009505339495172583,  0.008666594099789982, 0.0075025000000000005,
        0.00611649206511179,   0.004631723182535811,  0.003180121583289857, 0.0018906684397156264,
        0.0008779373222916067, 0.00023191383509822678, 1e-05, 0.00023191383509822732};
    const std::vector<double> beta1 = {
        0.9, 0.8811744900929367, 0.8388739533021843, 0.804951556604879, 0.8005584586887436,
        0.804951556604879, 0.8133474064085088, 0.8250000000000001, 0.8388739533021843,
        0.8537365046793213, 0.8682670512183198, 0.8811744900929367, 0.8913119387157997,
        0.8977786402893071, 0.9, 0.8977786402893071};
    for (const char* key : {"lr", "beta1"}) {
      Adam opt({zeros({1}).requires_grad_()}, {.lr = 1e-3});
      OneCycleLR s(opt, {.max_lr = {0.01},
                         .epochs = 3,
                         .steps_per_epoch = 5,
                         .base_momentum = {0.8},
                         .max_momentum = {0.9},
                         .div_factor = 10,
                         .final_div_factor = 100});
      EXPECT_EQ(s.total_steps(), 15);
      expect_sequence(opt, s, 15, key == std::string("lr") ? lr : beta1, key);
    }
  }
}

TEST(LRScheduler, DrivesTheOptimizer) {
  // The lr a step uses is the scheduler's: p -= lr * 1 with lrs 0.1, 0.1, 0.05 (StepLR(2, 0.5)).
  Tensor p = zeros({1}).requires_grad_();
  SGD opt({p}, {.lr = 0.1});
  StepLR s(opt, 2, 0.5);
  for (int i = 0; i < 3; ++i) {
    p.set_grad(ones({1}));
    opt.step();
    s.step();
  }
  EXPECT_NEAR(p.item<float>(), -0.25, 1e-7);
}

// ---- checkpoints ------------------------------------------------------------------------------

struct Training {
  std::unique_ptr<SGD> opt;
  std::unique_ptr<LRScheduler> sched;
};

// Runs `total` steps straight, and again with a save after `cut` steps into a fresh optimizer
// and scheduler built by the same code; both must give the same lrs.
void expect_resume(const std::function<Training()>& make, int cut, int total) {
  Training a = make();
  std::vector<double> want;
  for (int i = 0; i < total; ++i) {
    a.opt->step();
    a.sched->step();
    want.push_back(a.opt->param_groups()[0].lr());
  }
  Training b = make();
  for (int i = 0; i < cut; ++i) {
    b.opt->step();
    b.sched->step();
  }
  OptimizerState opt_state = b.opt->state_dict();
  const std::string sched_state = b.sched->state_dict();
  Training c = make();
  c.opt->load_state_dict(opt_state);
  c.sched->load_state_dict(sched_state);
  EXPECT_EQ(c.sched->last_epoch(), cut);
  EXPECT_EQ(c.sched->get_last_lr(), b.sched->get_last_lr());
  for (int i = cut; i < total; ++i) {
    c.opt->step();
    c.sched->step();
    EXPECT_EQ(c.opt->param_groups()[0].lr(), want[i])
        << c.sched->name() << " step " << i + 1 << " after resuming at " << cut;
  }
}

TEST(LRScheduler, StateDictResume) {
  expect_resume(
      [] {
        Training r{opt_sgd(), nullptr};
        r.sched = std::make_unique<CosineAnnealingLR>(*r.opt, 10, 0.001);
        return r;
      },
      7, 25);
  expect_resume(
      [] {
        Training r{opt_sgd(), nullptr};
        r.sched = warmup_cosine(*r.opt);
        return r;
      },
      3, 20);
  expect_resume(
      [] {
        Training r{opt_sgd({0.1, 0.02}, 0.9), nullptr};
        r.sched = std::make_unique<OneCycleLR>(*r.opt, OneCycleLROptions{.max_lr = {0.1},
                                                                         .total_steps = 20});
        return r;
      },
      8, 20);
  auto opt = opt_sgd();
  StepLR s(*opt, 3);
  const std::string state = s.state_dict();
  EXPECT_NE(state.find("\"scheduler\":\"StepLR\""), std::string::npos) << state;
  EXPECT_NE(state.find("\"last_epoch\":0"), std::string::npos) << state;
  CosineAnnealingLR other(*opt, 5);
  expect_error([&] { other.load_state_dict(state); },
               {"[CosineAnnealingLR::load_state_dict]", "StepLR"});
  expect_error([&] { s.load_state_dict("{\"scheduler\": \"StepLR\"}"); },
               {"[StepLR::load_state_dict]", "no 'last_epoch'"});
  expect_error([&] { s.load_state_dict("[1"); }, {"[StepLR::load_state_dict]", "not valid JSON"});
  expect_error([&] {
    s.load_state_dict(
        "{\"scheduler\":\"StepLR\",\"last_epoch\":1,\"step_count\":2,\"base_lrs\":[0.1],"
        "\"last_lr\":[0.1,0.02]}");
  }, {"'base_lrs' must be an array of 2 numbers"});
  auto seq_opt = opt_sgd();
  auto seq = warmup_cosine(*seq_opt);
  expect_error([&] { seq->load_state_dict(state); }, {"[SequentialLR::load_state_dict]",
                                                      "'schedulers'"});
}

// A SequentialLR state whose second part is refused changes nothing: the parent and the first
// part were taken before the second refused.
TEST(LRScheduler, SequentialLoadIsAllOrNothing) {
  auto opt = opt_sgd();
  auto seq = warmup_cosine(*opt);
  for (int i = 0; i < 2; ++i) seq->step();
  nlohmann::json saved = nlohmann::json::parse(seq->state_dict());
  for (int i = 0; i < 5; ++i) seq->step();
  const std::string before = seq->state_dict();
  saved["schedulers"][1]["base_lrs"] = {1.0, 2.0, 3.0};  // the optimizer has 2 groups
  expect_error([&] { seq->load_state_dict(saved.dump()); },
               {"[CosineAnnealingLR::load_state_dict]", "'base_lrs'"});
  EXPECT_EQ(seq->state_dict(), before);
  EXPECT_EQ(seq->last_epoch(), 7);
}

TEST(LRScheduler, ResumeWithLastEpoch) {
  // Resuming by last_epoch needs the groups' initial_lr (from the optimizer's saved state).
  auto fresh = opt_sgd();
  expect_error([&] { CosineAnnealingLR(*fresh, 10, 0.001, /*last_epoch=*/4); },
               {"[CosineAnnealingLR]", "initial_lr", "param_groups[0]"});
  // With it, the first step uses the closed form (PyTorch's _step_count == 1 branch):
  // epoch 5 of T_max=10, eta_min=0.001 is kCosine's value 5.
  auto opt = opt_sgd();
  for (auto& g : opt->param_groups()) g.set("initial_lr", g.lr());
  CosineAnnealingLR s(*opt, 10, 0.001, 4);
  EXPECT_EQ(s.last_epoch(), 5);
  EXPECT_NEAR(s.get_last_lr()[0], kCosine[10], 1e-15);
  EXPECT_NEAR(s.get_last_lr()[1], kCosine[11], 1e-15);
}

TEST(LRScheduler, Errors) {
  auto opt = opt_sgd();
  expect_error([&] { StepLR(*opt, 0); }, {"[StepLR]", "step_size", "0"});
  expect_error([&] { CosineAnnealingLR(*opt, 0); }, {"[CosineAnnealingLR]", "T_max", "0"});
  expect_error([&] { LinearLR(*opt, 0.0); }, {"[LinearLR]", "start_factor", "0"});
  expect_error([&] { LinearLR(*opt, 0.5, 1.5); }, {"[LinearLR]", "end_factor", "1.5"});
  expect_error([&] { LinearLR(*opt, 0.5, 1.0, 0); }, {"[LinearLR]", "total_iters", "0"});
  expect_error([&] { LambdaLR(*opt, std::vector<LambdaLR::Lambda>{[](int64_t) { return 1.0; }}); },
               {"[LambdaLR]", "expected 2 lr_lambdas", "got 1"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1}}); },
               {"[OneCycleLR]", "total_steps OR (epochs AND steps_per_epoch)"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1}, .total_steps = -3}); },
               {"[OneCycleLR]", "total_steps", "-3"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1}, .epochs = 2}); },
               {"[OneCycleLR]", "steps_per_epoch", "0"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1}, .total_steps = 10, .pct_start = 1.5}); },
               {"[OneCycleLR]", "pct_start", "1.5"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1}, .total_steps = 10, .anneal_strategy = "exp"}); },
               {"[OneCycleLR]", "'cos' or 'linear'", "'exp'"});
  expect_error([&] { OneCycleLR(*opt, {.max_lr = {0.1, 0.2, 0.3}, .total_steps = 10}); },
               {"[OneCycleLR]", "expected 2 values for max_lr", "got 3"});
  expect_error([&] { OneCycleLR(*opt, {.total_steps = 10}); }, {"[OneCycleLR]", "max_lr"});

  // cycle_momentum needs an optimizer with a momentum: a minimal one without.
  struct PlainGD : Optimizer {
    explicit PlainGD(std::vector<Tensor> p) : Optimizer({{"lr", 0.1}}) {
      add_param_groups({ParamGroup(std::move(p))});
    }
    std::string name() const override { return "PlainGD"; }
    void step() override {}
    void check_options(const GroupOptions&, size_t) const override {}
  };
  PlainGD gd({zeros({1}).requires_grad_()});
  expect_error([&] { OneCycleLR(gd, {.max_lr = {0.1}, .total_steps = 10}); },
               {"[OneCycleLR]", "PlainGD", "momentum"});
  OneCycleLR no_momentum(gd, {.max_lr = {0.1}, .total_steps = 10, .cycle_momentum = false});
  EXPECT_NEAR(no_momentum.get_last_lr()[0], 0.004, 1e-15);

  auto other = opt_sgd();
  auto foreign = std::make_shared<StepLR>(*other, 2);
  auto mine = std::make_shared<StepLR>(*opt, 2);
  expect_error([&] { SequentialLR(*opt, {mine, foreign}, {3}); },
               {"[SequentialLR]", "scheduler 1", "another"});
  expect_error([&] { SequentialLR(*opt, {mine}, {3}); },
               {"[SequentialLR]", "1 schedulers and 1 milestones"});
}

}  // namespace
}  // namespace ember::nn::optim
