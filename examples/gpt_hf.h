// examples/gpt's model in Hugging Face's GPT-2 layout (transformers' GPT2LMHeadModel): the same
// architecture (pre-LayerNorm blocks, tanh GELU, learned positions, the head tied to the token
// embedding, biases everywhere, LayerNorm eps 1e-5), so only the names and the projections'
// layout differ. GPT-2's projections are Conv1D, whose weight is [in, out], the transpose of a
// Linear's [out, in]:
//
//   examples/gpt                 GPT-2 (transformers)
//   wte.weight, wpe.weight       transformer.wte.weight, transformer.wpe.weight
//   blocks.<i>.ln1.*             transformer.h.<i>.ln_1.*
//   blocks.<i>.qkv.weight        transformer.h.<i>.attn.c_attn.weight    (transposed)
//   blocks.<i>.proj.weight       transformer.h.<i>.attn.c_proj.weight    (transposed)
//   blocks.<i>.ln2.*             transformer.h.<i>.ln_2.*
//   blocks.<i>.fc.weight         transformer.h.<i>.mlp.c_fc.weight       (transposed)
//   blocks.<i>.fc_proj.weight    transformer.h.<i>.mlp.c_proj.weight     (transposed)
//   ln_f.*                       transformer.ln_f.*
//
// Biases keep their shapes. Header-only, like gpt_model.h.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <ember/nn/io/hf_checkpoint.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/error.h>

#include "examples/gpt_model.h"

namespace ember::examples {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// config.json of transformers' GPT2LMHeadModel of `c`'s shape (its dropout as all three of
/// GPT-2's).
inline std::string gpt2_config_json(const GPTConfig& c) {
  const nlohmann::ordered_json j = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", c.vocab},
      {"n_positions", c.context},
      {"n_embd", c.dim},
      {"n_layer", c.layers},
      {"n_head", c.heads},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"resid_pdrop", c.dropout},
      {"embd_pdrop", c.dropout},
      {"attn_pdrop", c.dropout},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"tie_word_embeddings", true},
      {"dtype", "float32"}};
  return j.dump(2);
}

/// The GPTConfig of a transformers GPT-2 config.json (dropout and activation checkpointing are
/// the caller's). Throws ValueError naming a field whose value examples/gpt's model does not
/// have (another model type, activation, MLP width, LayerNorm eps, an untied head, ...).
inline GPTConfig gpt_config_from_gpt2(const std::string& config_json) {
  const auto j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  EMBER_CHECK(j.is_object(), "[gpt2 config] expected a JSON object");
  auto want = [&](const char* key, auto expected, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      EMBER_CHECK(!required, "[gpt2 config] has no \"", key, "\"");
      return;
    }
    using T = decltype(expected);
    bool same = false;
    if constexpr (std::is_same_v<T, double>) {
      same = j[key].is_number() && std::abs(j[key].template get<double>() - expected) < 1e-12;
    } else {
      same = j[key] == nlohmann::json(expected);
    }
    EMBER_CHECK(same, "[gpt2 config] \"", key, "\" is ", j[key].dump(), "; examples/gpt's model has ",
                nlohmann::json(expected).dump());
  };
  auto count = [&](const char* key) {
    EMBER_CHECK(j.contains(key) && j[key].is_number_integer() && j[key].get<int64_t>() > 0,
                "[gpt2 config] \"", key, "\" must be a positive integer, got ",
                j.contains(key) ? j[key].dump() : std::string("nothing"));
    return j[key].get<int64_t>();
  };
  want("model_type", std::string("gpt2"), true);
  if (j.contains("activation_function") && j["activation_function"] == "gelu_pytorch_tanh") {
    // the same function as gelu_new
  } else {
    want("activation_function", std::string("gelu_new"), false);
  }
  want("layer_norm_epsilon", 1e-5, false);
  want("tie_word_embeddings", true, false);
  want("scale_attn_weights", true, false);
  want("scale_attn_by_inverse_layer_idx", false, false);
  want("add_cross_attention", false, false);
  GPTConfig c;
  c.vocab = count("vocab_size");
  c.context = count("n_positions");
  c.dim = count("n_embd");
  c.layers = count("n_layer");
  c.heads = count("n_head");
  if (j.contains("n_inner")) want("n_inner", 4 * c.dim, false);
  EMBER_CHECK(c.dim % c.heads == 0, "[gpt2 config] n_embd (", c.dim,
              ") must be a multiple of n_head (", c.heads, ")");
  return c;
}

namespace gpt2_detail {
struct Rename {
  const char* ember;  // after "blocks.<i>." for block tensors
  const char* hf;     // after "transformer.h.<i>."
  bool transposed;
};
inline constexpr Rename kBlock[] = {
    {"ln1.weight", "ln_1.weight", false},          {"ln1.bias", "ln_1.bias", false},
    {"qkv.weight", "attn.c_attn.weight", true},    {"qkv.bias", "attn.c_attn.bias", false},
    {"proj.weight", "attn.c_proj.weight", true},   {"proj.bias", "attn.c_proj.bias", false},
    {"ln2.weight", "ln_2.weight", false},          {"ln2.bias", "ln_2.bias", false},
    {"fc.weight", "mlp.c_fc.weight", true},        {"fc.bias", "mlp.c_fc.bias", false},
    {"fc_proj.weight", "mlp.c_proj.weight", true}, {"fc_proj.bias", "mlp.c_proj.bias", false},
};
inline constexpr Rename kTop[] = {{"wte.weight", "wte.weight", false},
                                  {"wpe.weight", "wpe.weight", false},
                                  {"ln_f.weight", "ln_f.weight", false},
                                  {"ln_f.bias", "ln_f.bias", false}};
}  // namespace gpt2_detail

/// examples/gpt's state dict (any order; a name it does not know is an error) -> GPT-2's names
/// and layouts, in transformers' order. The tensors are views: nothing is copied.
inline NamedTensors to_gpt2_tensors(const NamedTensors& state) {
  using namespace gpt2_detail;
  static const std::regex block(R"(blocks\.(\d+)\.(.+))");
  NamedTensors out;
  for (const auto& [name, t] : state) {
    std::smatch m;
    const Rename* r = nullptr;
    std::string prefix = "transformer.", rest = name;
    if (std::regex_match(name, m, block)) {
      prefix += "h." + m[1].str() + ".";
      rest = m[2].str();
      for (const auto& b : kBlock) r = rest == b.ember ? &b : r;
    } else {
      for (const auto& b : kTop) r = rest == b.ember ? &b : r;
    }
    EMBER_CHECK(r != nullptr, "[to_gpt2_tensors] '", name,
                "' is not a tensor of examples/gpt's model");
    out.emplace_back(prefix + r->hf, r->transposed ? t.t() : t);
  }
  return out;
}

/// GPT-2's tensors (transformers' names, with or without the "transformer." prefix, as the
/// original OpenAI files have them) -> examples/gpt's state dict, float32. The attention's
/// causal-mask buffers older files carry (attn.bias, attn.masked_bias) are skipped; an
/// lm_head.weight must equal wte.weight (the head is tied). Throws ValueError naming an
/// unknown tensor or an untied head.
inline NamedTensors from_gpt2_tensors(const NamedTensors& hf) {
  using namespace gpt2_detail;
  static const std::regex block(R"((?:transformer\.)?h\.(\d+)\.(.+))");
  static const std::regex top(R"((?:transformer\.)?(.+))");
  NamedTensors out;
  const Tensor* head = nullptr;
  for (const auto& [name, t] : hf) {
    std::smatch m;
    if (name == "lm_head.weight") {
      head = &t;
      continue;
    }
    const Rename* r = nullptr;
    std::string prefix;
    if (std::regex_match(name, m, block)) {
      const std::string rest = m[2].str();
      if (rest == "attn.bias" || rest == "attn.masked_bias") continue;
      prefix = "blocks." + m[1].str() + ".";
      for (const auto& b : kBlock) r = rest == b.hf ? &b : r;
    } else if (std::regex_match(name, m, top)) {
      for (const auto& b : kTop) r = m[1].str() == b.hf ? &b : r;
    }
    EMBER_CHECK(r != nullptr, "[from_gpt2_tensors] '", name,
                "' is not a tensor of a GPT-2 model (GPT2LMHeadModel)");
    const Tensor f = t.to(kFloat32);
    out.emplace_back(prefix + r->ember, r->transposed ? f.t().contiguous() : f);
  }
  if (head != nullptr) {
    const Tensor* wte = nullptr;
    for (const auto& [name, t] : out) wte = name == "wte.weight" ? &t : wte;
    EMBER_CHECK(wte != nullptr && equal(head->to(kFloat32), *wte),
                "[from_gpt2_tensors] lm_head.weight is not wte.weight: examples/gpt's head is tied "
                "to the token embedding (tie_word_embeddings)");
  }
  return out;
}

/// Writes `model` (a whole model, not a shard) into `dir` in GPT-2's Hugging Face layout.
inline void export_gpt2(const GPT& model, const std::string& dir,
                        const nn::HFSaveOptions& options = {}) {
  nn::save_hf_checkpoint(dir, to_gpt2_tensors(model.state_dict()), gpt2_config_json(model.config),
                         options);
}

/// A model of a GPT-2 Hugging Face directory's shape, with its weights. `base` gives what the
/// config does not (dropout, activation checkpointing).
inline std::shared_ptr<GPT> import_gpt2(const std::string& dir, const GPTConfig& base = {}) {
  const nn::HFCheckpoint ck = nn::load_hf_checkpoint(dir);
  GPTConfig c = gpt_config_from_gpt2(ck.config_json);
  c.dropout = base.dropout;
  c.checkpoint_activations = base.checkpoint_activations;
  auto model = std::make_shared<GPT>(c);
  model->load_state_dict(from_gpt2_tensors(ck.tensors));
  return model;
}

}  // namespace ember::examples
