// examples/gpt_model.h, the model that examples/gpt trains and bench_cuda measures: its state-dict
// names (which examples/gpt's checkpoints are written under), its public blocks (the modules
// registered as blocks.<i>), the seeded weights and the shape of forward().
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ember/nn/amp/autocast.h>
#include <ember/nn/clip_grad.h>
#include <ember/nn/functional.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/random.h>
#include "examples/gpt_model.h"

namespace {

using ember::examples::GPT;
using ember::examples::GPTConfig;

const GPTConfig kTiny{.layers = 2, .heads = 2, .dim = 8, .context = 4};

TEST(GptModel, StateDictNamesAreTheCheckpointsNames) {
  GPT model(kTiny);
  std::vector<std::string> names;
  for (const auto& [name, t] : model.state_dict()) names.push_back(name);
  std::vector<std::string> expected = {"wte.weight", "wpe.weight"};
  for (const std::string b : {"blocks.0.", "blocks.1."}) {
    for (const char* p : {"ln1.weight", "ln1.bias", "qkv.weight", "qkv.bias", "proj.weight",
                          "proj.bias", "ln2.weight", "ln2.bias", "fc.weight", "fc.bias",
                          "fc_proj.weight", "fc_proj.bias"}) {
      expected.push_back(b + p);
    }
  }
  expected.push_back("ln_f.weight");
  expected.push_back("ln_f.bias");
  EXPECT_EQ(names, expected);
}

TEST(GptModel, BlocksAreTheRegisteredModulesInOrder) {
  GPT model(kTiny);
  ASSERT_EQ(model.blocks.size(), 2u);
  std::shared_ptr<ember::nn::Module> registered;
  for (const auto& [name, child] : model.named_children()) {
    if (name == "blocks") registered = child;
  }
  ASSERT_NE(registered, nullptr);
  const auto children = registered->children();
  ASSERT_EQ(children.size(), model.blocks.size());
  for (size_t i = 0; i < children.size(); ++i) {
    EXPECT_EQ(children[i].get(), model.blocks[i].get()) << "block " << i;
  }
}

TEST(GptModel, TheSameSeedGivesTheSameWeights) {
  ember::manual_seed(7);
  GPT a(kTiny);
  ember::manual_seed(7);
  GPT b(kTiny);
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_TRUE(ember::equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
}

TEST(GptModel, ForwardGivesLogitsPerPositionAndTheHeadIsTied) {
  GPT model(kTiny);
  EXPECT_EQ(model.context(), 4);
  const ember::Tensor tokens = ember::from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(model.forward(tokens).shape(), ember::Shape({2, 3, kTiny.vocab}));
  int64_t n = 0;
  for (const ember::Tensor& p : model.parameters()) n += p.numel();
  // Tied head: no parameter beyond the embeddings, the blocks and ln_f.
  const int64_t d = kTiny.dim;
  const int64_t block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) +
                        (4 * d * d + d);
  EXPECT_EQ(n, kTiny.vocab * d + kTiny.context * d + kTiny.layers * block + 2 * d);
}

// parameter_count is the model's own count (the tied head once) for any shape, and at GPT-2
// 124M's shape with llm.c's padded vocabulary it is llm.c's 124,475,904; flops_per_token is
// 6N + 12 L d T.
TEST(GptModel, ParameterCountAndFlopsPerTokenAreTheClosedForms) {
  for (const GPTConfig& c :
       {kTiny, GPTConfig{.vocab = 300, .layers = 3, .heads = 4, .dim = 12, .context = 7}}) {
    GPT model(c);
    int64_t n = 0;
    for (const ember::Tensor& p : model.parameters()) n += p.numel();
    EXPECT_EQ(ember::examples::parameter_count(c), n) << c.vocab << " " << c.layers;
    EXPECT_EQ(ember::examples::flops_per_token(c, 5), 6 * n + 12 * c.layers * c.dim * 5);
  }
  const GPTConfig gpt2{.vocab = 50304, .layers = 12, .heads = 12, .dim = 768, .context = 1024};
  EXPECT_EQ(ember::examples::parameter_count(gpt2), 124475904);
  EXPECT_EQ(ember::examples::flops_per_token(gpt2, 1024),
            6 * int64_t{124475904} + 12 * 12 * 768 * 1024);
}

// Every length reads the prefix of one positions tensor: a shorter forward after a longer one
// gives what a fresh model gives, and a sequence past the context is refused naming both.
TEST(GptModel, AnyLengthUpToTheContextAndNoLonger) {
  ember::manual_seed(3);
  GPT model(kTiny);
  ember::manual_seed(3);
  GPT fresh(kTiny);
  model.eval();
  fresh.eval();
  const ember::Tensor four = ember::from_vector(std::vector<int64_t>{1, 2, 3, 4}, {1, 4});
  const ember::Tensor two = ember::from_vector(std::vector<int64_t>{5, 6}, {1, 2});
  (void)model.forward(four);
  EXPECT_EQ(model.forward(two).to_vector<float>(), fresh.forward(two).to_vector<float>());
  const ember::Tensor five = ember::from_vector(std::vector<int64_t>{1, 2, 3, 4, 5}, {1, 5});
  try {
    (void)model.forward(five);
    ADD_FAILURE() << "a sequence of 5 tokens at context 4 was accepted";
  } catch (const ember::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("5 tokens is longer than the model's context of 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(GptModel, DimNotAMultipleOfHeadsIsRefused) {
  GPTConfig c = kTiny;
  c.heads = 3;
  EXPECT_THROW(GPT{c}, ember::ValueError);
}

}  // namespace

// Note [CUDA graphs]: a whole training step of the GPT (bf16 autocast, dropout, the fused
// cross-entropy, clipping, capturable AdamW under a changing learning rate) captured once and
// replayed on new batches gives the losses and weights of the same steps run eagerly.
TEST(GptModelCuda, TrainingStepCapturedInACudaGraphMatchesEagerSteps) {
  if (!ember::cuda::is_available()) GTEST_SKIP() << ember::cuda::unavailable_reason();
  using namespace ember;
  const Device gpu("cuda");
  const GPTConfig cfg{
      .vocab = 96, .layers = 2, .heads = 2, .dim = 32, .context = 16, .dropout = 0.1};
  manual_seed(5);
  GPT eager(cfg);
  manual_seed(5);
  GPT graphed(cfg);
  eager.to(gpu);
  graphed.to(gpu);
  nn::optim::AdamW eager_opt(eager.parameters(), {.lr = 1e-3});
  nn::optim::AdamW graph_opt(graphed.parameters(), {.lr = 1e-3, .capturable = true});
  auto step = [&](GPT& model, nn::optim::AdamW& opt, const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss;
    {
      const nn::amp::autocast amp(gpu, kBFloat16);
      Tensor logits = model(x);
      loss = nn::functional::cross_entropy(logits.view({-1, cfg.vocab}), y.view({-1}));
    }
    loss.backward();
    nn::clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    return loss;
  };
  Generator data(11);
  auto batch = [&] {
    return randint(0, cfg.vocab, {4, cfg.context}, TensorOptions(kInt64), &data);
  };
  // One eager step of each model on the same batch and the same dropout draws.
  auto eager_step = [&](const Tensor& x, const Tensor& y) {
    const uint64_t offset = default_generator().offset();
    const float want = step(eager, eager_opt, x.to(gpu), y.to(gpu)).item<float>();
    default_generator().set_offset(offset);
    return want;
  };
  Tensor xs = zeros({4, cfg.context}, TensorOptions(kInt64).device(gpu)), ys = zeros_like(xs);
  for (int s = 0; s < 2; ++s) {  // warm-up
    Tensor x = batch(), y = batch();
    const float want = eager_step(x, y);
    xs.copy_(x);
    ys.copy_(y);
    EXPECT_NEAR(step(graphed, graph_opt, xs, ys).item<float>(), want, 1e-4f) << "warm-up " << s;
  }
  cuda::CUDAGraph graph;
  Tensor loss;
  cuda::graph(graph, [&] { loss = step(graphed, graph_opt, xs, ys); });
  for (int s = 0; s < 4; ++s) {
    const double lr = 1e-3 * (1.0 - 0.2 * s);
    eager_opt.param_groups()[0].options["lr"] = lr;
    graph_opt.param_groups()[0].options["lr"] = lr;
    Tensor x = batch(), y = batch();
    const float want = eager_step(x, y);
    xs.copy_(x);
    ys.copy_(y);
    graph.replay();
    EXPECT_NEAR(loss.item<float>(), want, 1e-4f) << "replay " << s;
  }
  const auto pe = eager.parameters(), pg = graphed.parameters();
  for (size_t i = 0; i < pe.size(); ++i) {
    EXPECT_TRUE(allclose(pg[i].detach().cpu(), pe[i].detach().cpu(), 1e-4, 1e-5))
        << "parameter " << i;
  }
}
