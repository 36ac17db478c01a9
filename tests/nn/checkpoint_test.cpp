// save_checkpoint / load_checkpoint: a resumed run continues bit for bit like an uninterrupted
// one; metadata round-trips; mismatches are reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include <ember/nn/nn.h>
#include "tests/temp_dir.h"
#include "tests/tensor/test_util.h"

namespace ember::nn {
namespace {

using test::expect_error;
using test::TempDir;
namespace fs = std::filesystem;

std::shared_ptr<Sequential> make_model() {
  return std::make_shared<Sequential>(std::make_shared<Linear>(6, 8),
                                      std::make_shared<BatchNorm1d>(8), std::make_shared<ReLU>(),
                                      std::make_shared<Linear>(8, 3));
}

void train_steps(Sequential& model, optim::Optimizer& opt, int steps, uint64_t seed) {
  for (int i = 0; i < steps; ++i) {
    const Tensor x = test::rand_t({16, 6}, kFloat32, seed + i);
    const Tensor y = (test::rand_t({16}, kFloat32, seed + 100 + i).abs() * 2.99).to(kInt64);
    opt.zero_grad();
    functional::cross_entropy(model.forward(x), y).backward();
    opt.step();
  }
}

TEST(Checkpoint, ResumedRunMatchesUninterruptedRunBitForBit) {
  TempDir dir;
  manual_seed(1);
  auto a = make_model();
  manual_seed(1);
  auto b = make_model();
  optim::Adam opt_a(a->parameters(), {.lr = 0.01, .weight_decay = 0.01});
  optim::Adam opt_b(b->parameters(), {.lr = 0.01, .weight_decay = 0.01});
  train_steps(*a, opt_a, 3, 10);
  train_steps(*b, opt_b, 3, 10);
  save_checkpoint(dir.file("ckpt.safetensors"), *b, &opt_b, {{"epoch", "3"}, {"note", "résumé"}});

  manual_seed(99);  // a fresh process would initialise differently
  auto c = make_model();
  optim::Adam opt_c(c->parameters(), {.lr = 0.5});
  const auto meta = load_checkpoint(dir.file("ckpt.safetensors"), *c, &opt_c);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"epoch", "3"}, {"note", "résumé"}}));

  train_steps(*a, opt_a, 3, 20);
  train_steps(*c, opt_c, 3, 20);
  const auto sa = a->state_dict(), sc = c->state_dict();
  ASSERT_EQ(sa.size(), sc.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sc[i].first);
    EXPECT_TRUE(equal(sa[i].second, sc[i].second)) << sa[i].first << " differs after resuming";
  }
}

// Optimizer state keyed by parameter name (an FSDP checkpoint's layout) goes to whichever index
// the loading optimizer gives each parameter: here the parameters in reverse order, with the
// saved lr. A name that is no parameter the optimizer steps is refused by name.
TEST(Checkpoint, OptimizerStateByParameterNameFollowsTheNames) {
  TempDir dir;
  manual_seed(1);
  auto a = make_model();
  optim::Adam opt_a(a->parameters(), {.lr = 0.01});
  train_steps(*a, opt_a, 3, 10);
  save_checkpoint(dir.file("ckpt.safetensors"), *a, &opt_a);
  // The same file with "optim.state.<i>.<key>" renamed "optim.<parameter name>.<key>".
  const SafetensorsFile f = load_safetensors(dir.file("ckpt.safetensors"));
  const NamedTensors params = a->named_parameters();
  NamedTensors renamed;
  for (const auto& [n, t] : f.tensors()) {
    if (n.rfind("optim.state.", 0) != 0) {
      renamed.emplace_back(n, t);
      continue;
    }
    const size_t dot = n.find('.', 12);
    const std::string& param = params.at(std::stoul(n.substr(12, dot - 12))).first;
    renamed.emplace_back("optim." + param + n.substr(dot), t);
  }
  auto meta = f.metadata();
  meta["optim.state_keys"] = "parameter_names";
  save_safetensors(dir.file("by_name.safetensors"), renamed, meta);

  manual_seed(99);
  auto c = make_model();
  std::vector<Tensor> reversed = c->parameters();
  std::reverse(reversed.begin(), reversed.end());
  optim::Adam opt_c(reversed, {.lr = 0.5});
  load_checkpoint(dir.file("by_name.safetensors"), *c, &opt_c);
  EXPECT_EQ(opt_c.param_groups()[0].lr(), 0.01);
  train_steps(*a, opt_a, 3, 20);
  train_steps(*c, opt_c, 3, 20);
  const auto sa = a->state_dict(), sc = c->state_dict();
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_TRUE(equal(sa[i].second, sc[i].second)) << sa[i].first << " differs after resuming";
  }

  renamed.emplace_back("optim.9.weight.exp_avg", renamed.back().second);
  save_safetensors(dir.file("stray.safetensors"), renamed, meta);
  auto d = make_model();
  optim::Adam opt_d(d->parameters(), {});
  expect_error([&] { load_checkpoint(dir.file("stray.safetensors"), *d, &opt_d); },
               {"load_checkpoint", "'optim.9.weight.exp_avg'",
                "belongs to no parameter the optimizer steps"});
}

TEST(Checkpoint, ModelOnlyFileIsAPlainStateDict) {
  TempDir dir;
  auto m = make_model();
  save_checkpoint(dir.file("m.safetensors"), *m);
  const SafetensorsFile f = load_safetensors(dir.file("m.safetensors"));
  std::vector<std::string> names;
  for (const auto& [n, t] : f.tensors()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias",
                                             "1.running_mean", "1.running_var",
                                             "1.num_batches_tracked", "3.weight", "3.bias"}));
  EXPECT_TRUE(f.metadata().empty());
  auto other = make_model();
  optim::SGD opt(other->parameters(), {.lr = 0.1});
  expect_error([&] { load_checkpoint(dir.file("m.safetensors"), *other, &opt); },
               {"[load_checkpoint]", "no optimizer state"});
  load_checkpoint(dir.file("m.safetensors"), *other);
  EXPECT_TRUE(equal(other->state_dict()[0].second, m->state_dict()[0].second));
}

// Extra tensors (a communication hook's state) travel in the same file under "extra.", come
// back by name, and stay out of the model's state.
TEST(Checkpoint, ExtraTensorsRoundTrip) {
  TempDir dir;
  auto m = make_model();
  optim::SGD opt(m->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*m, opt, 2, 7);
  const Tensor e = test::rand_t({3, 4}, kFloat32, 11);
  save_checkpoint(dir.file("c.safetensors"), *m, &opt, {{"step", "2"}},
                  {{"hook.error.0", e}, {"hook.iteration", full({1}, 5.0, kFloat64)}});
  EXPECT_TRUE(load_safetensors(dir.file("c.safetensors")).contains("extra.hook.error.0"));
  auto other = make_model();
  optim::SGD opt2(other->parameters(), {.lr = 0.1, .momentum = 0.9});
  NamedTensors extra;
  const auto meta = load_checkpoint(dir.file("c.safetensors"), *other, &opt2, &extra);
  EXPECT_EQ(meta.at("step"), "2");
  ASSERT_EQ(extra.size(), 2u);
  EXPECT_EQ(extra[0].first, "hook.error.0");
  EXPECT_TRUE(equal(extra[0].second, e));
  EXPECT_EQ(extra[1].second.to_vector<double>(), std::vector<double>{5.0});
  // Without the out-parameter they are ignored (and never reach load_state_dict).
  auto third = make_model();
  load_checkpoint(dir.file("c.safetensors"), *third, nullptr);
  EXPECT_TRUE(equal(third->state_dict()[0].second, m->state_dict()[0].second));
}

TEST(Checkpoint, Errors) {
  TempDir dir;
  auto m = make_model();
  expect_error([&] { save_checkpoint(dir.file("x"), *m, nullptr, {{"optim.lr", "1"}}); },
               {"[save_checkpoint]", "optim.lr", "reserved"});
  save_checkpoint(dir.file("m.safetensors"), *m);
  auto smaller = std::make_shared<Sequential>(std::make_shared<Linear>(6, 8));
  expect_error([&] { load_checkpoint(dir.file("m.safetensors"), *smaller); },
               {"unexpected keys", "1.running_mean"});
  optim::SGD sgd(m->parameters(), {.lr = 0.1, .momentum = 0.9});
  train_steps(*m, sgd, 1, 1);
  save_checkpoint(dir.file("sgd.safetensors"), *m, &sgd);
  optim::Adam adam(m->parameters(), {.lr = 0.1});
  expect_error([&] { load_checkpoint(dir.file("sgd.safetensors"), *m, &adam); }, {"SGD", "Adam"});
  // Saved parameter groups that are not groups (an edited or damaged file) are named, not
  // passed on as the JSON library's exception.
  for (const char* bad : {"[1]", "{\"lr\": 1}", "[\"not json\""}) {
    const SafetensorsFile f = load_safetensors(dir.file("sgd.safetensors"));
    auto meta = f.metadata();
    ASSERT_TRUE(meta.count("optim.param_groups"));
    meta["optim.param_groups"] = bad;
    save_safetensors(dir.file("bad.safetensors"), f.tensors(), meta);
    expect_error([&] { load_checkpoint(dir.file("bad.safetensors"), *m, &sgd); },
                 {"[SGD::load_state_dict] param_groups"});
  }
}

}  // namespace
}  // namespace ember::nn
