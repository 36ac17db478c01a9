#include <ember/nn/optim/optimizer.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace ember::nn::optim {

using Json = nlohmann::ordered_json;

namespace {

std::string join_keys(const GroupOptions& options) {
  std::string s;
  for (const auto& [k, v] : options) {
    if (!s.empty()) s += ", ";
    s += k;
  }
  return s.empty() ? "none" : s;
}

// "state.<index>.<key>" -> (index, key); false if the name has another form.
bool parse_state_name(const std::string& name, int64_t& index, std::string& key) {
  const std::string prefix = "state.";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size() || dot + 1 == name.size()) return false;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + dot;
  auto [ptr, ec] = std::from_chars(first, last, index);
  if (ec != std::errc() || ptr != last || index < 0) return false;
  key = name.substr(dot + 1);
  return true;
}

}  // namespace

// ---- ParamGroup, OptimizerState ---------------------------------------------------------------

double ParamGroup::get(const std::string& key) const {
  auto it = options.find(key);
  EMBER_CHECK(it != options.end(), "[ParamGroup] has no option '", key, "'; it has ",
              join_keys(options));
  return it->second;
}

std::map<std::string, std::string> OptimizerState::metadata() const {
  return {{"optimizer", type}, {"param_groups", param_groups}};
}

OptimizerState OptimizerState::from(NamedTensors state,
                                    const std::map<std::string, std::string>& meta) {
  OptimizerState s;
  for (const char* key : {"optimizer", "param_groups"}) {
    EMBER_CHECK(meta.count(key), "[OptimizerState::from] metadata has no '", key,
                "' entry (expected 'optimizer' and 'param_groups')");
  }
  s.type = meta.at("optimizer");
  s.param_groups = meta.at("param_groups");
  s.state = std::move(state);
  return s;
}

// ---- Optimizer --------------------------------------------------------------------------------

Optimizer::Optimizer(GroupOptions defaults, std::vector<std::string> flags)
    : defaults_(std::move(defaults)), flags_(std::move(flags)) {}

void Optimizer::add_param_groups(std::vector<ParamGroup> groups) {
  size_t n = 0;
  for (const ParamGroup& g : groups) n += g.params.size();
  EMBER_CHECK(n > 0, "[", name(), "] got an empty parameter list");
  for (ParamGroup& g : groups) add_param_group(std::move(g));
}

void Optimizer::add_param_group(ParamGroup group) {
  const std::string op = detail::str_cat("[", name(), "] ");
  const size_t gi = groups_.size();
  // Keys a group may set: the optimizer's own and any a scheduler already added to the others
  // ("initial_lr", "max_lr", ...), so a group added mid-schedule can carry them too.
  std::set<std::string> known = {"lr"};  // may lack a default (SGD) but is always an option
  for (const auto& [k, v] : defaults_) known.insert(k);
  for (const ParamGroup& g : groups_) {
    for (const auto& [k, v] : g.options) known.insert(k);
  }
  for (const auto& [k, v] : group.options) {
    if (known.count(k)) continue;
    std::string list;
    for (const std::string& s : known) {
      if (!list.empty()) list += ", ";
      list += s;
    }
    EMBER_CHECK(false, op, "parameter group ", gi, " has unknown option '", k, "'; known: ", list);
  }
  for (const auto& [k, v] : defaults_) group.options.emplace(k, v);
  EMBER_CHECK(group.options.count("lr"), op, "parameter group ", gi,
              " did not specify lr, and the optimizer has no default lr");
  check_options(group.options, gi);

  for (size_t i = 0; i < group.params.size(); ++i) {
    const Tensor& p = group.params[i];
    EMBER_CHECK(p.defined(), op, "parameter ", i, " of group ", gi, " is an undefined tensor");
    EMBER_CHECK_TYPE(TypeError, p.is_floating_point(), op, "parameter ", i, " of group ", gi,
                     " has dtype ", p.dtype(), "; only floating-point tensors can be optimized");
    EMBER_CHECK(p.is_leaf(), op, "parameter ", i, " of group ", gi, " (shape ", p.shape(),
                ") is not a leaf tensor; can't optimize a non-leaf Tensor (detach() it, or "
                "optimize the leaves it was computed from)");
    // A parameter that does not require grad (a frozen layer) is accepted, as in PyTorch: it
    // never gets a gradient, so step() leaves it alone.
    for (size_t j = 0; j < i; ++j) {
      EMBER_CHECK(!group.params[j].is_same(p), op, "parameter ", i, " of group ", gi,
                  " is the same tensor as parameter ", j, " of that group (shape ", p.shape(),
                  "); list each parameter once");
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (const Tensor& q : groups_[g].params) {
        EMBER_CHECK(!q.is_same(p), op, "parameter ", i, " of group ", gi, " (shape ", p.shape(),
                    ") is already in parameter group ", g,
                    "; some parameters appear in more than one parameter group");
      }
    }
  }
  groups_.push_back(std::move(group));
}

Tensor Optimizer::step(const std::function<Tensor()>& closure) {
  Tensor loss;
  {
    EnableGradGuard grad_on;
    loss = closure();
  }
  step();
  return loss;
}

void Optimizer::step_unless(const Tensor& found_inf) {
  check_found_inf(found_inf);
  if (found_inf.item<float>() == 0.0f) step();
}

void Optimizer::check_found_inf(const Tensor& found_inf) const {
  EMBER_CHECK(found_inf.defined(), "[", name(),
              ".step_unless] expected found_inf to be a float32 tensor of one element, got an "
              "undefined tensor");
  EMBER_CHECK(found_inf.dtype() == kFloat32 && found_inf.numel() == 1, "[", name(),
              ".step_unless] expected found_inf to be a float32 tensor of one element, got ",
              found_inf.dtype(), " of shape ", found_inf.shape());
}

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (ParamGroup& g : groups_) {
    for (Tensor& p : g.params) {
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        p.set_grad(Tensor());
      } else {
        // A grad built with create_graph has history; zeroing it in place must not record.
        if (grad.requires_grad()) grad.detach_();
        grad.zero_();
      }
    }
  }
}

const NamedTensors& Optimizer::state(const Tensor& param) const {
  static const NamedTensors kEmpty;
  auto it = state_.find(param.impl());
  return it == state_.end() ? kEmpty : it->second;
}

Tensor* Optimizer::find(NamedTensors& state, const std::string& key) {
  for (auto& [k, t] : state) {
    if (k == key) return &t;
  }
  return nullptr;
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState out;
  out.type = name();
  Json groups = Json::array();
  int64_t index = 0;
  for (const ParamGroup& g : groups_) {
    Json j = Json::object();
    for (const auto& [k, v] : g.options) {
      if (std::find(flags_.begin(), flags_.end(), k) != flags_.end()) {
        j[k] = v != 0.0;
      } else {
        j[k] = v;
      }
    }
    Json params = Json::array();
    for (const Tensor& p : g.params) {
      auto it = state_.find(p.impl());
      if (it != state_.end()) {
        for (const auto& [key, t] : it->second) {
          out.state.emplace_back("state." + std::to_string(index) + "." + key, t);
        }
      }
      params.push_back(index++);
    }
    j["params"] = std::move(params);
    groups.push_back(std::move(j));
  }
  out.param_groups = groups.dump();
  return out;
}

namespace {

// load_state_dict's first part: the saved param_groups (JSON) read against this optimizer's
// groups. Fills `ids` (saved parameter index -> this optimizer's parameter, pairing both
// groups' lists in order) and returns each group's options; a malformed file throws, a group
// whose options do not fit goes to `errors`.
std::vector<GroupOptions> read_param_groups(
    const std::string& op, const std::string& json, const std::vector<ParamGroup>& mine,
    const GroupOptions& defaults,
    const std::function<void(const GroupOptions&, size_t)>& check_options,
    std::unordered_map<int64_t, Tensor>& ids, std::vector<std::string>& errors) {
  Json groups;
  try {
    groups = Json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    EMBER_CHECK(false, op, "param_groups is not valid JSON: ", e.what());
  }
  EMBER_CHECK(groups.is_array(), op, "param_groups must be a JSON array, got ",
              groups.type_name());
  EMBER_CHECK(groups.size() == mine.size(), op, "the state has ", groups.size(),
              " parameter groups but the optimizer has ", mine.size());
  std::vector<GroupOptions> options(groups.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Json& g = groups[gi];
    EMBER_CHECK(g.is_object(), op, "param_groups[", gi, "] must be a JSON object, got ",
                g.type_name());
    EMBER_CHECK(g.contains("params") && g["params"].is_array(), op, "param_groups[", gi,
                "] has no 'params' array");
    const Json& params = g["params"];
    EMBER_CHECK(params.size() == mine[gi].params.size(), op, "param_groups[", gi, "] has ",
                params.size(), " parameters but the optimizer's group ", gi, " has ",
                mine[gi].params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EMBER_CHECK(params[i].is_number_integer() && params[i].get<int64_t>() >= 0, op,
                  "param_groups[", gi, "].params[", i, "] must be a non-negative integer, got ",
                  params[i].dump());
      const int64_t id = params[i].get<int64_t>();
      EMBER_CHECK(!ids.count(id), op, "parameter index ", id, " appears twice in param_groups");
      ids.emplace(id, mine[gi].params[i]);
    }
    for (const auto& [k, v] : g.items()) {
      if (k == "params") continue;
      if (v.is_boolean()) {
        options[gi][k] = v.get<bool>() ? 1.0 : 0.0;
      } else {
        EMBER_CHECK(v.is_number(), op, "param_groups[", gi, "].", k,
                    " must be a number or boolean, got ", v.dump());
        options[gi][k] = v.get<double>();
      }
    }
    // Options this version knows but the file lacks keep their defaults (PyTorch's setdefault).
    for (const auto& [k, v] : defaults) options[gi].emplace(k, v);
    if (!options[gi].count("lr")) {
      errors.push_back("param_groups[" + std::to_string(gi) + "] has no lr");
      continue;
    }
    try {
      check_options(options[gi], gi);
    } catch (const ValueError& e) {
      errors.push_back(e.what());
    }
  }
  return options;
}

// load_state_dict's second part: saved state tensor `name` = `t` for parameter `p` (index
// `id`), as the optimizer keeps it: a parameter-shaped copy on p's device and dtype, the step
// count as a host float, anything else cloned. Undefined, with the reason in `errors`, when it
// does not fit.
Tensor state_value(const std::string& name, const std::string& key, const Tensor& t, int64_t id,
                   const Tensor& p, bool param_shaped, bool copy, std::vector<std::string>& errors) {
  if (!t.defined()) {
    errors.push_back("'" + name + "' is an undefined tensor");
    return {};
  }
  if (param_shaped) {
    if (t.shape() != p.shape()) {
      std::ostringstream os;
      os << "'" << name << "' has shape " << t.shape() << " but parameter " << id
         << " has shape " << p.shape();
      errors.push_back(os.str());
      return {};
    }
    return t.to(p.device(), p.dtype(), /*non_blocking=*/false, copy || !t.is_contiguous());
  }
  if (key == "step") {
    if (t.numel() != 1) {
      std::ostringstream os;
      os << "'" << name << "' must hold one number, got shape " << t.shape();
      errors.push_back(os.str());
      return {};
    }
    // The step count lives on the host (as PyTorch's non-capturable optimizers keep it).
    return t.reshape({}).to(kCPU, kFloat32, false, /*copy=*/true);
  }
  return t.clone();
}

}  // namespace

void Optimizer::load_state_dict(const OptimizerState& saved, bool copy) {
  const std::string op = detail::str_cat("[", name(), "::load_state_dict] ");
  EMBER_CHECK(saved.type == name(), op, "the state is from a ", saved.type, " optimizer, not ",
              name());
  std::unordered_map<int64_t, Tensor> ids;
  std::vector<std::string> errors;
  std::vector<GroupOptions> options = read_param_groups(
      op, saved.param_groups, groups_, defaults_,
      [this](const GroupOptions& o, size_t gi) { check_options(o, gi); }, ids, errors);

  std::unordered_map<const TensorImpl*, NamedTensors> state;
  for (const auto& [tname, t] : saved.state) {
    int64_t id = 0;
    std::string key;
    if (!parse_state_name(tname, id, key)) {
      errors.push_back("'" + tname + "' is not named state.<param index>.<key>");
      continue;
    }
    auto it = ids.find(id);
    if (it == ids.end()) {
      errors.push_back("'" + tname + "' refers to parameter " + std::to_string(id) +
                       ", which no group lists");
      continue;
    }
    const Tensor& p = it->second;
    Tensor value = state_value(tname, key, t, id, p, is_param_shaped(key), copy, errors);
    if (value.defined()) state[p.impl()].emplace_back(key, value);
  }
  if (!errors.empty()) {
    std::string msg = op + "the state does not fit this optimizer:";
    for (const std::string& e : errors) msg += "\n  " + e;
    throw ValueError(msg);
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) groups_[gi].options = std::move(options[gi]);
  state_ = std::move(state);
}

}  // namespace ember::nn::optim
