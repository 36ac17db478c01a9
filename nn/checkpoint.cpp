#include <ember/nn/checkpoint.h>

#include <optional>

#include <ember/nn/serialize.h>
#include <ember/tensor/trace.h>

namespace ember::nn {

namespace {
constexpr const char* kOptimPrefix = "optim.";
constexpr const char* kExtraPrefix = "extra.";

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }
}  // namespace

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
  if (optimizer != nullptr) ost = optim::OptimizerState::from(std::move(optim_state), optim_meta);
  model.load_state_dict(model_state);
  if (optimizer != nullptr) optimizer->load_state_dict(*ost);
  if (extra != nullptr) *extra = std::move(extra_state);
  return user;
}

}  // namespace ember::nn
