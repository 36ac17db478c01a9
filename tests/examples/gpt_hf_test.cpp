// examples/gpt_hf.h: examples/gpt's model in GPT-2's Hugging Face layout. Without Python: the
// export reads back into the same model and the refusals are named. Where a Python with
// transformers and safetensors is found ($EMBER_HF_PYTHON, else python3; skipped with the
// reason elsewhere): Ember's export loads into transformers' GPT2LMHeadModel with the same
// logits, and a GPT2LMHeadModel's save_pretrained loads into Ember with the same logits and
// goes on training. EMBER_HF_GPT2_SHAPE=1 runs those two at GPT-2 124M's shape (12 layers, 768
// wide, 12 heads, context 1024, vocabulary 50257) instead of a small one.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <ember/tensor/grad_mode.h>
#include <ember/nn/functional.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/error.h>
#include <ember/tensor/ops/random.h>
#include "cmake/build_paths.h"
#include "examples/gpt_hf.h"
#include "tests/examples/example_test_util.h"

namespace ember::examples {
namespace {

using test::TempDir;

const GPTConfig kSmall{.layers = 2, .heads = 4, .dim = 64, .context = 32};

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return (a.to(kFloat64) - b.to(kFloat64)).abs().max().item<double>();
}

Tensor some_tokens(int64_t vocab) {
  manual_seed(3);
  return randint(0, vocab, {2, 16});
}

Tensor logits_of(GPT& model, const Tensor& tokens) {
  model.eval();
  NoGradGuard no_grad;
  return model(tokens);
}

TEST(GptHf, ExportReadsBackIntoTheSameModel) {
  manual_seed(1);
  GPT model(kSmall);
  TempDir d;
  export_gpt2(model, d.path(), {.max_shard_bytes = 100'000});
  EXPECT_TRUE(std::filesystem::exists(d.file("model.safetensors.index.json")));
  // GPT-2's names and Conv1D layouts on disk.
  const auto shard = nn::load_hf_checkpoint(d.path());
  bool found = false;
  for (const auto& [name, t] : shard.tensors) {
    if (name == "transformer.h.1.mlp.c_fc.weight") {
      found = true;
      EXPECT_EQ(t.size(0), 64);
      EXPECT_EQ(t.size(1), 256);
    }
  }
  EXPECT_TRUE(found);
  const auto config = nlohmann::json::parse(shard.config_json);
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_head"], 4);
  EXPECT_EQ(config["activation_function"], "gelu_new");

  auto back = import_gpt2(d.path());
  EXPECT_EQ(back->config.layers, 2);
  EXPECT_EQ(back->config.heads, 4);
  EXPECT_EQ(back->config.context, 32);
  const Tensor tokens = some_tokens(kSmall.vocab);
  EXPECT_EQ(max_abs_diff(logits_of(model, tokens), logits_of(*back, tokens)), 0.0);
}

TEST(GptHf, WhatTheModelCannotBeIsNamed) {
  auto config_error = [](nlohmann::json edit) {
    auto j = nlohmann::json::parse(gpt2_config_json(kSmall));
    j.update(edit);
    try {
      gpt_config_from_gpt2(j.dump());
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(config_error({{"activation_function", "relu"}}).find("\"activation_function\" is "
                                                                 "\"relu\""),
            std::string::npos);
  EXPECT_NE(config_error({{"n_inner", 100}}).find("\"n_inner\" is 100"), std::string::npos);
  EXPECT_NE(config_error({{"model_type", "llama"}}).find("\"model_type\""), std::string::npos);
  EXPECT_NE(config_error({{"tie_word_embeddings", false}}).find("tie_word_embeddings"),
            std::string::npos);
  EXPECT_NE(config_error({{"n_head", 3}}).find("must be a multiple of n_head (3)"),
            std::string::npos);
  EXPECT_EQ(config_error({{"activation_function", "gelu_pytorch_tanh"}, {"n_inner", 256}}),
            "(no error)");

  GPT model(kSmall);
  NamedTensors hf = to_gpt2_tensors(model.state_dict());
  hf.emplace_back("lm_head.weight", zeros({256, 64}));
  EXPECT_THROW(
      {
        try {
          from_gpt2_tensors(hf);
        } catch (const ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("lm_head.weight is not wte.weight"),
                    std::string::npos);
          throw;
        }
      },
      ValueError);
  hf.back() = {"transformer.h.0.attn.rotary", zeros({1})};
  EXPECT_THROW(from_gpt2_tensors(hf), ValueError);
  // The original OpenAI names (no "transformer." prefix) and the old mask buffers are read.
  NamedTensors openai;
  for (const auto& [name, t] : to_gpt2_tensors(model.state_dict())) {
    openai.emplace_back(name.substr(std::string("transformer.").size()), t);
  }
  openai.emplace_back("h.0.attn.bias", ones({1, 1, 32, 32}));
  EXPECT_EQ(from_gpt2_tensors(openai).size(), model.state_dict().size());
}

// ---- against transformers ----

GPTConfig interop_shape() {
  const char* full = std::getenv("EMBER_HF_GPT2_SHAPE");
  if (full && std::string(full) == "1") {
    return {.vocab = 50257, .layers = 12, .heads = 12, .dim = 768, .context = 1024};
  }
  return kSmall;
}

class GptHfTransformers : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("EMBER_HF_PYTHON");
    python_ = env && *env ? env : "python3";
    const auto r = test::run_command(python_ + " " + script_ + " check", 120);
    if (r.status == 3) {
      GTEST_SKIP() << python_ << " cannot import transformers and safetensors (" << r.output
                   << "); set EMBER_HF_PYTHON to a Python that can";
    }
  }
  // Runs hf_gpt2.py with `args`; fails the test with its output if it fails.
  void python(const std::string& args) {
    const auto r = test::run_command(python_ + " " + script_ + " " + args, 300);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  std::string python_;
  const std::string script_ = EMBER_SOURCE_DIR + "/tests/examples/hf_gpt2.py";
};

TEST_F(GptHfTransformers, EmbersExportGivesTheSameLogitsInTransformers) {
  manual_seed(5);
  GPT model(interop_shape());
  TempDir d;
  export_gpt2(model, d.file("hf"), {.max_shard_bytes = model.config.dim * model.config.dim * 20});
  const Tensor tokens = some_tokens(model.config.vocab);
  nn::save_safetensors(d.file("tokens.safetensors"), {{"tokens", tokens}});
  python("logits " + d.file("hf") + " " + d.file("tokens.safetensors") + " " +
         d.file("logits.safetensors"));
  const Tensor theirs = nn::load_safetensors(d.file("logits.safetensors")).at("logits");
  const Tensor ours = logits_of(model, tokens);
  ASSERT_EQ(theirs.sizes().vec(), ours.sizes().vec());
  const double diff = max_abs_diff(theirs, ours);
  std::printf("max |logit difference| = %.3g (over %lld logits)\n", diff,
              static_cast<long long>(ours.numel()));
  EXPECT_LE(diff, 1e-4);
}

TEST_F(GptHfTransformers, TransformersModelGivesTheSameLogitsInEmberAndTrainsOn) {
  TempDir d;
  const GPTConfig shape = interop_shape();
  std::ofstream(d.file("config.json")) << nlohmann::json{{"n_layer", shape.layers},
                                                     {"n_head", shape.heads},
                                                     {"n_embd", shape.dim},
                                                     {"n_positions", shape.context},
                                                     {"vocab_size", shape.vocab}}
                                          .dump();
  const Tensor tokens = some_tokens(shape.vocab);
  nn::save_safetensors(d.file("tokens.safetensors"), {{"tokens", tokens}});
  python("make " + d.file("hf") + " " + d.file("config.json") + " " + d.file("tokens.safetensors") +
         " " + d.file("logits.safetensors"));
  const Tensor theirs = nn::load_safetensors(d.file("logits.safetensors")).at("logits");
  EXPECT_GT(nn::load_hf_checkpoint(d.file("hf")).files.size(), 1u);  // sharded by transformers

  auto model = import_gpt2(d.file("hf"));
  const double diff = max_abs_diff(logits_of(*model, tokens), theirs);
  std::printf("max |logit difference| = %.3g\n", diff);
  EXPECT_LE(diff, 1e-4);

  // Training goes on from GPT-2's weights: next-token loss on a fixed batch falls.
  model->train();
  nn::optim::AdamW opt(model->parameters(), {.lr = 1e-3});
  const Tensor x = tokens.narrow(1, 0, 15), y = tokens.narrow(1, 1, 15);
  double first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    Tensor loss = nn::functional::cross_entropy((*model)(x).reshape({-1, shape.vocab}), y.reshape({-1}));
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first - 0.5) << "first " << first << ", last " << last;
}

}  // namespace
}  // namespace ember::examples
