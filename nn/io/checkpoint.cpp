#include <ember/nn/io/checkpoint.h>

#include <optional>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include <ember/nn/io/serialize.h>
#include <ember/tensor/observe/trace.h>

namespace ember::nn {

namespace {
constexpr const char* kOptimPrefix = "optim.";
constexpr const char* kExtraPrefix = "extra.";

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Optimizer state keyed "<parameter name>.<key>" renamed "state.<i>.<key>", i being the
// parameter's index in `opt` (across groups): the optimizer's parameters are found in `model`
// by identity. Parameter names hold dots; keys do not.
NamedTensors state_by_index(NamedTensors by_name, const Module& model,
                            const optim::Optimizer& opt, const std::string& path) {
  std::unordered_map<const TensorImpl*, std::string> names;
  for (const auto& [name, p] : model.named_parameters()) names.emplace(p.impl(), name);
  std::map<std::string, size_t> index;
  for (const auto& g : opt.param_groups()) {
    for (const Tensor& p : g.params) {
      auto it = names.find(p.impl());
      EMBER_CHECK(it != names.end(), "[load_checkpoint] ", path, " keys the optimizer's state "
                  "by parameter name, but the optimizer steps a tensor of shape ", p.shape(),
                  " that is not a parameter of the model");
      index.emplace(it->second, index.size());
    }
  }
  NamedTensors out;
  for (auto& [name, t] : by_name) {
    const size_t dot = name.rfind('.');
    auto it = dot == std::string::npos ? index.end() : index.find(name.substr(0, dot));
    EMBER_CHECK(it != index.end(), "[load_checkpoint] ", path, " holds optimizer state 'optim.",
                name, "', which belongs to no parameter the optimizer steps");
    out.emplace_back("state." + std::to_string(it->second) + name.substr(dot), std::move(t));
  }
  return out;
}
}  // namespace

std::string merge_param_groups(const std::string& saved, const std::string& mine, const char* op) {
  // The saved value comes from a file: anything malformed is named, not passed on as a JSON
  // library's exception.
  const nlohmann::json s0 = nlohmann::json::parse(saved, nullptr, false);
  EMBER_CHECK(s0.is_array(), "[", op,
              "] the checkpoint's optimizer param_groups is not a JSON "
              "array of objects: '",
              saved.substr(0, 200), "'");
  for (const auto& g : s0) {
    EMBER_CHECK(g.is_object(), "[", op, "] the checkpoint's optimizer param_groups holds ",
                g.dump(), " where a parameter group (a JSON object) was expected");
  }
  nlohmann::json s = s0, m = nlohmann::json::parse(mine);
  EMBER_CHECK(m.is_array() && s.size() == m.size(), "[", op,
              "] the checkpoint's "
              "optimizer has ",
              s.size(), " parameter groups; this one has ", m.size());
  for (size_t g = 0; g < s.size(); ++g) s[g]["params"] = m[g]["params"];
  return s.dump();
}

void save_checkpoint(const std::string& path, const Module& model,
                     const optim::Optimizer* optimizer,
                     const std::map<std::string, std::string>& metadata,
                     const NamedTensors& extra) {
  trace::Span span("save checkpoint", "checkpoint");
  NamedTensors tensors = model.state_dict();
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : metadata) {
    EMBER_CHECK(!starts_with(k, kOptimPrefix), "[save_checkpoint] metadata key '", k,
                "' is reserved (keys starting with 'optim.' hold the optimizer's settings)");
    meta[k] = v;
  }
  for (const auto& [name, t] : tensors) {
    EMBER_CHECK(!starts_with(name, kOptimPrefix), "[save_checkpoint] the model has a tensor "
                "named '", name, "', which clashes with the optimizer's 'optim.' prefix");
    EMBER_CHECK(!starts_with(name, kExtraPrefix), "[save_checkpoint] the model has a tensor "
                "named '", name, "', which clashes with the 'extra.' prefix of extra tensors");
  }
  for (const auto& [name, t] : extra) tensors.emplace_back(kExtraPrefix + name, t);
  if (optimizer != nullptr) {
    const optim::OptimizerState st = optimizer->state_dict();
    for (const auto& [name, t] : st.state) tensors.emplace_back(kOptimPrefix + name, t);
    for (const auto& [k, v] : st.metadata()) meta[kOptimPrefix + k] = v;
  }
  save_safetensors(path, tensors, meta);
}

std::map<std::string, std::string> load_checkpoint(const std::string& path, Module& model,
                                                   optim::Optimizer* optimizer,
                                                   NamedTensors* extra) {
  const SafetensorsFile file = load_safetensors(path);
  NamedTensors model_state, optim_state, extra_state;
  for (const auto& [name, t] : file.tensors()) {
    if (starts_with(name, kExtraPrefix)) {
      extra_state.emplace_back(name.substr(std::char_traits<char>::length(kExtraPrefix)), t);
    } else if (starts_with(name, kOptimPrefix)) {
      optim_state.emplace_back(name.substr(std::char_traits<char>::length(kOptimPrefix)), t);
    } else {
      model_state.emplace_back(name, t);
    }
  }
  std::map<std::string, std::string> user, optim_meta;
  for (const auto& [k, v] : file.metadata()) {
    if (starts_with(k, kOptimPrefix)) {
      optim_meta[k.substr(std::char_traits<char>::length(kOptimPrefix))] = v;
    } else {
      user[k] = v;
    }
  }
  if (optimizer != nullptr) {
    EMBER_CHECK(!optim_meta.empty(), "[load_checkpoint] ", path, " holds no optimizer state "
                "(it was saved without an optimizer); load it with optimizer = nullptr");
  }
  // Parse the optimizer's state before touching the model. Each load_state_dict validates
  // everything before it changes anything, but if the optimizer's fails, the model is loaded.
  std::optional<optim::OptimizerState> ost;
  if (optimizer != nullptr) {
    auto layout = optim_meta.find(kStateKeysKey);
    const bool by_name = layout != optim_meta.end() && layout->second == kStateKeysByName;
    if (by_name) {
      optim_state = state_by_index(std::move(optim_state), model, *optimizer, path);
      auto groups = optim_meta.find("param_groups");
      if (groups != optim_meta.end()) {
        groups->second = merge_param_groups(groups->second, optimizer->state_dict().param_groups,
                                            "load_checkpoint");
      }
    }
    ost = optim::OptimizerState::from(std::move(optim_state), optim_meta);
  }
  model.load_state_dict(model_state);
  if (optimizer != nullptr) optimizer->load_state_dict(*ost);
  if (extra != nullptr) *extra = std::move(extra_state);
  return user;
}

}  // namespace ember::nn
