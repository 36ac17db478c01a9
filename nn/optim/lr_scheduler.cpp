#include <ember/nn/optim/lr_scheduler.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

namespace ember::nn::optim {

using Json = nlohmann::ordered_json;

namespace {
constexpr double kPi = 3.14159265358979323846;  // Python's math.pi, the same double

Json parse_state(const std::string& op, const std::string& text) {
  try {
    Json j = Json::parse(text);
    EMBER_CHECK(j.is_object(), op, "the state must be a JSON object, got ", j.type_name());
    return j;
  } catch (const nlohmann::json::exception& e) {
    EMBER_CHECK(false, op, "the state is not valid JSON: ", e.what());
  }
  return {};
}

const Json& field(const std::string& op, const Json& j, const char* key) {
  EMBER_CHECK(j.contains(key), op, "the state has no '", key, "' field");
  return j[key];
}

int64_t int_field(const std::string& op, const Json& j, const char* key) {
  const Json& v = field(op, j, key);
  EMBER_CHECK(v.is_number_integer(), op, "'", key, "' must be an integer, got ", v.dump());
  return v.get<int64_t>();
}

std::vector<double> doubles_field(const std::string& op, const Json& j, const char* key,
                                  size_t n) {
  const Json& v = field(op, j, key);
  EMBER_CHECK(v.is_array() && v.size() == n, op, "'", key, "' must be an array of ", n,
              " numbers (one per parameter group), got ", v.dump());
  std::vector<double> out;
  for (const Json& x : v) {
    EMBER_CHECK(x.is_number(), op, "'", key, "' must hold numbers, got ", x.dump());
    out.push_back(x.get<double>());
  }
  return out;
}
}  // namespace

// ---- LRScheduler ------------------------------------------------------------------------------

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {}

void LRScheduler::start(int64_t last_epoch) {
  EMBER_CHECK(last_epoch >= -1, "[", name(), "] expected last_epoch >= -1, got ", last_epoch);
  auto& groups = optimizer_.param_groups();
  base_lrs_.clear();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (last_epoch == -1) {
      groups[i].options.emplace("initial_lr", groups[i].lr());
    } else {
      EMBER_CHECK(groups[i].has("initial_lr"), "[", name(), "] param 'initial_lr' is not ",
                  "specified in param_groups[", i, "] when resuming an optimizer (last_epoch=",
                  last_epoch, "); load the optimizer's state first");
    }
    base_lrs_.push_back(groups[i].get("initial_lr"));
  }
  last_epoch_ = last_epoch;
  initial_step();
}

void LRScheduler::initial_step() {
  step_count_ = 0;
  step();
}

void LRScheduler::step() {
  ++step_count_;
  ++last_epoch_;
  apply(get_lr());
}

void LRScheduler::step_to(int64_t epoch) {
  ++step_count_;
  last_epoch_ = epoch;
  apply(closed_form_lr());
}

void LRScheduler::apply(const std::vector<double>& lrs) {
  auto& groups = optimizer_.param_groups();
  // As PyTorch's zip: groups added after the scheduler was made keep their lr.
  const size_t n = std::min(lrs.size(), groups.size());
  for (size_t i = 0; i < n; ++i) groups[i].set_lr(lrs[i]);
  last_lr_ = group_lrs();
}

std::vector<double> LRScheduler::group_lrs() const {
  std::vector<double> lrs;
  for (const ParamGroup& g : optimizer_.param_groups()) lrs.push_back(g.lr());
  return lrs;
}

std::vector<double> LRScheduler::per_group(const std::vector<double>& values,
                                           const char* what) const {
  const size_t n = optimizer_.param_groups().size();
  if (values.size() == 1) return std::vector<double>(n, values[0]);
  EMBER_CHECK(values.size() == n, "[", name(), "] expected ", n, " values for ", what,
              " (one per parameter group) or 1, got ", values.size());
  return values;
}

std::string LRScheduler::state_dict() const {
  Json j = Json::object();
  j["scheduler"] = name();
  j["last_epoch"] = last_epoch_;
  j["step_count"] = step_count_;
  j["base_lrs"] = base_lrs_;
  j["last_lr"] = last_lr_;
  return j.dump();
}

void LRScheduler::load_state_dict(const std::string& state) {
  const std::string op = detail::str_cat("[", name(), "::load_state_dict] ");
  const Json j = parse_state(op, state);
  const Json& type = field(op, j, "scheduler");
  EMBER_CHECK(type.is_string() && type.get<std::string>() == name(), op,
              "the state is from scheduler ", type.dump(), ", not ", name());
  const int64_t last_epoch = int_field(op, j, "last_epoch");
  const int64_t step_count = int_field(op, j, "step_count");
  auto base_lrs = doubles_field(op, j, "base_lrs", base_lrs_.size());
  auto last_lr = doubles_field(op, j, "last_lr", last_lr_.size());
  last_epoch_ = last_epoch;
  step_count_ = step_count;
  base_lrs_ = std::move(base_lrs);
  last_lr_ = std::move(last_lr);
}

// ---- LambdaLR ---------------------------------------------------------------------------------

LambdaLR::LambdaLR(Optimizer& optimizer, Lambda lr_lambda, int64_t last_epoch)
    : LambdaLR(optimizer, std::vector<Lambda>(optimizer.param_groups().size(), lr_lambda),
               last_epoch) {}

LambdaLR::LambdaLR(Optimizer& optimizer, std::vector<Lambda> lr_lambdas, int64_t last_epoch)
    : LRScheduler(optimizer), lambdas_(std::move(lr_lambdas)) {
  EMBER_CHECK(lambdas_.size() == optimizer.param_groups().size(), "[LambdaLR] expected ",
              optimizer.param_groups().size(), " lr_lambdas (one per parameter group), got ",
              lambdas_.size());
  for (size_t i = 0; i < lambdas_.size(); ++i) {
    EMBER_CHECK(static_cast<bool>(lambdas_[i]), "[LambdaLR] lr_lambda ", i, " is empty");
  }
  start(last_epoch);
}

std::vector<double> LambdaLR::get_lr() {
  std::vector<double> lrs;
  for (size_t i = 0; i < std::min(base_lrs_.size(), lambdas_.size()); ++i) {
    lrs.push_back(base_lrs_[i] * lambdas_[i](last_epoch_));
  }
  return lrs;
}

// ---- StepLR, MultiStepLR, ExponentialLR -------------------------------------------------------

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma, int64_t last_epoch)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  EMBER_CHECK(step_size > 0, "[StepLR] expected step_size > 0, got ", step_size);
  start(last_epoch);
}

std::vector<double> StepLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0 || last_epoch_ % step_size_ != 0) return lrs;
  for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

std::vector<double> StepLR::closed_form_lr() {
  std::vector<double> lrs;
  // Python's // floors; last_epoch >= 0 here, so C++'s truncation agrees.
  for (double b : base_lrs_) {
    lrs.push_back(b * std::pow(gamma_, static_cast<double>(last_epoch_ / step_size_)));
  }
  return lrs;
}

MultiStepLR::MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma,
                         int64_t last_epoch)
    : LRScheduler(optimizer), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
  start(last_epoch);
}

std::vector<double> MultiStepLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  const auto n = std::count(milestones_.begin(), milestones_.end(), last_epoch_);
  if (n == 0) return lrs;
  for (double& lr : lrs) lr *= std::pow(gamma_, static_cast<double>(n));
  return lrs;
}

std::vector<double> MultiStepLR::closed_form_lr() {
  const auto passed =
      std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  std::vector<double> lrs;
  for (double b : base_lrs_) lrs.push_back(b * std::pow(gamma_, static_cast<double>(passed)));
  return lrs;
}

ExponentialLR::ExponentialLR(Optimizer& optimizer, double gamma, int64_t last_epoch)
    : LRScheduler(optimizer), gamma_(gamma) {
  start(last_epoch);
}

std::vector<double> ExponentialLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0) return lrs;
  for (double& lr : lrs) lr *= gamma_;
  return lrs;
}

std::vector<double> ExponentialLR::closed_form_lr() {
  std::vector<double> lrs;
  for (double b : base_lrs_) lrs.push_back(b * std::pow(gamma_, static_cast<double>(last_epoch_)));
  return lrs;
}

// ---- CosineAnnealingLR ------------------------------------------------------------------------

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t T_max, double eta_min,
                                     int64_t last_epoch)
    : LRScheduler(optimizer), t_max_(T_max), eta_min_(eta_min) {
  EMBER_CHECK(T_max > 0, "[CosineAnnealingLR] expected T_max > 0, got ", T_max);
  start(last_epoch);
}

// PyTorch 1.13's chainable form, branch for branch: epoch 0 keeps the lr; the first step of a
// resumed scheduler uses the closed form; the step after each minimum (epoch - 1 - T_max a
// multiple of 2 T_max) adds the increment that turns the curve back up (the ratio below would
// divide by 1 + cos(pi) = 0); every other step scales the distance to eta_min by a ratio.
std::vector<double> CosineAnnealingLR::get_lr() {
  const auto& groups = optimizer_.param_groups();
  const double t = static_cast<double>(last_epoch_), T = static_cast<double>(t_max_);
  const size_t n = std::min(base_lrs_.size(), groups.size());
  std::vector<double> lrs;
  if (last_epoch_ == 0) return group_lrs();
  if (step_count_ == 1 && last_epoch_ > 0) {
    for (size_t i = 0; i < n; ++i) {
      lrs.push_back(eta_min_ + (base_lrs_[i] - eta_min_) * (1 + std::cos(t * kPi / T)) / 2);
    }
    return lrs;
  }
  // Python's % of a negative left operand is non-negative; (t - 1 - T) can be negative here.
  const int64_t period = 2 * t_max_;
  const int64_t phase = ((last_epoch_ - 1 - t_max_) % period + period) % period;
  if (phase == 0) {
    for (size_t i = 0; i < n; ++i) {
      lrs.push_back(groups[i].lr() + (base_lrs_[i] - eta_min_) * (1 - std::cos(kPi / T)) / 2);
    }
    return lrs;
  }
  for (const ParamGroup& g : groups) {
    lrs.push_back((1 + std::cos(kPi * t / T)) / (1 + std::cos(kPi * (t - 1) / T)) *
                      (g.lr() - eta_min_) +
                  eta_min_);
  }
  return lrs;
}

std::vector<double> CosineAnnealingLR::closed_form_lr() {
  const double t = static_cast<double>(last_epoch_), T = static_cast<double>(t_max_);
  std::vector<double> lrs;
  for (double b : base_lrs_) {
    lrs.push_back(eta_min_ + (b - eta_min_) * (1 + std::cos(kPi * t / T)) / 2);
  }
  return lrs;
}

// ---- LinearLR ---------------------------------------------------------------------------------

LinearLR::LinearLR(Optimizer& optimizer, double start_factor, double end_factor,
                   int64_t total_iters, int64_t last_epoch)
    : LRScheduler(optimizer),
      start_factor_(start_factor),
      end_factor_(end_factor),
      total_iters_(total_iters) {
  EMBER_CHECK(start_factor > 0 && start_factor <= 1, "[LinearLR] expected 0 < start_factor <= 1, ",
              "got ", start_factor);
  EMBER_CHECK(end_factor >= 0 && end_factor <= 1, "[LinearLR] expected 0 <= end_factor <= 1, got ",
              end_factor);
  EMBER_CHECK(total_iters > 0, "[LinearLR] expected total_iters > 0, got ", total_iters);
  start(last_epoch);
}

std::vector<double> LinearLR::get_lr() {
  std::vector<double> lrs = group_lrs();
  if (last_epoch_ == 0) {
    for (double& lr : lrs) lr *= start_factor_;
    return lrs;
  }
  if (last_epoch_ > total_iters_) return lrs;
  const double d = end_factor_ - start_factor_;
  const double factor =
      1. + d / (static_cast<double>(total_iters_) * start_factor_ +
                static_cast<double>(last_epoch_ - 1) * d);
  for (double& lr : lrs) lr *= factor;
  return lrs;
}

std::vector<double> LinearLR::closed_form_lr() {
  std::vector<double> lrs;
  const double e = static_cast<double>(std::min(total_iters_, last_epoch_));
  for (double b : base_lrs_) {
    lrs.push_back(b * (start_factor_ +
                       (end_factor_ - start_factor_) * e / static_cast<double>(total_iters_)));
  }
  return lrs;
}

// ---- SequentialLR -----------------------------------------------------------------------------

SequentialLR::SequentialLR(Optimizer& optimizer,
                           std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones, int64_t last_epoch)
    : LRScheduler(optimizer), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  EMBER_CHECK(!schedulers_.empty(), "[SequentialLR] expected at least one scheduler");
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    EMBER_CHECK(schedulers_[i] != nullptr, "[SequentialLR] scheduler ", i, " is null");
    EMBER_CHECK(&schedulers_[i]->optimizer_ == &optimizer, "[SequentialLR] expects all schedulers ",
                "to belong to the optimizer passed in, but scheduler ", i, " (",
                schedulers_[i]->name(), ") belongs to another");
  }
  EMBER_CHECK(milestones_.size() + 1 == schedulers_.size(), "[SequentialLR] expects the number of ",
              "schedulers to be one more than the number of milestones, but got ",
              schedulers_.size(), " schedulers and ", milestones_.size(), " milestones");
  // PyTorch's SequentialLR.__init__: undo the construction step of every scheduler, restore
  // the initial lrs, and redo the first scheduler's initial step.
  last_epoch_ = last_epoch + 1;
  auto& groups = optimizer.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    EMBER_CHECK(groups[i].has("initial_lr"), "[SequentialLR] param_groups[", i,
                "] has no 'initial_lr'; construct the schedulers on this optimizer first");
    groups[i].set_lr(groups[i].get("initial_lr"));
  }
  for (auto& s : schedulers_) --s->last_epoch_;
  schedulers_[0]->initial_step();
  base_lrs_ = schedulers_[0]->base_lrs_;
  last_lr_ = schedulers_[0]->get_last_lr();
}

std::vector<double> SequentialLR::get_lr() { return group_lrs(); }

void SequentialLR::step() {
  ++last_epoch_;
  const size_t idx =
      std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin();
  LRScheduler& s = *schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == last_epoch_) {
    s.step_to(0);
  } else {
    s.step();
  }
  last_lr_ = s.get_last_lr();
}

std::string SequentialLR::state_dict() const {
  Json j = Json::parse(LRScheduler::state_dict());
  Json subs = Json::array();
  for (const auto& s : schedulers_) subs.push_back(Json::parse(s->state_dict()));
  j["schedulers"] = std::move(subs);
  return j.dump();
}

void SequentialLR::load_state_dict(const std::string& state) {
  const std::string op = "[SequentialLR::load_state_dict] ";
  const Json j = parse_state(op, state);
  const Json& subs = field(op, j, "schedulers");
  EMBER_CHECK(subs.is_array() && subs.size() == schedulers_.size(), op, "expected ",
              schedulers_.size(), " scheduler states, got ",
              subs.is_array() ? std::to_string(subs.size()) : subs.type_name());
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const Json& sub = subs[i];
    EMBER_CHECK(sub.is_object() && sub.contains("scheduler") &&
                    sub["scheduler"] == schedulers_[i]->name(),
                op, "scheduler state ", i, " is not from a ", schedulers_[i]->name());
  }
  // All or nothing: each load checks before it writes, but a later part may still refuse after
  // an earlier one was taken, so every part goes back to what it was.
  const std::string before = state_dict();
  Json self = j;
  self.erase("schedulers");
  try {
    LRScheduler::load_state_dict(self.dump());
    for (size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(subs[i].dump());
  } catch (...) {
    const Json old = Json::parse(before);
    Json old_self = old;
    old_self.erase("schedulers");
    LRScheduler::load_state_dict(old_self.dump());
    for (size_t i = 0; i < schedulers_.size(); ++i) {
      schedulers_[i]->load_state_dict(old["schedulers"][i].dump());
    }
    throw;
  }
}

// ---- OneCycleLR -------------------------------------------------------------------------------

OneCycleLR::OneCycleLR(Optimizer& optimizer, const OneCycleLROptions& o, int64_t last_epoch)
    : LRScheduler(optimizer) {
  if (o.total_steps != 0) {
    EMBER_CHECK(o.total_steps > 0, "[OneCycleLR] expected a positive total_steps, got ",
                o.total_steps);
    total_steps_ = o.total_steps;
  } else {
    EMBER_CHECK(o.epochs != 0 || o.steps_per_epoch != 0, "[OneCycleLR] you must define either ",
                "total_steps OR (epochs AND steps_per_epoch)");
    EMBER_CHECK(o.epochs > 0, "[OneCycleLR] expected a positive epochs, got ", o.epochs);
    EMBER_CHECK(o.steps_per_epoch > 0, "[OneCycleLR] expected a positive steps_per_epoch, got ",
                o.steps_per_epoch);
    total_steps_ = o.epochs * o.steps_per_epoch;
  }
  EMBER_CHECK(o.pct_start >= 0 && o.pct_start <= 1, "[OneCycleLR] expected pct_start between ",
              "0 and 1, got ", o.pct_start);
  EMBER_CHECK(o.anneal_strategy == "cos" || o.anneal_strategy == "linear",
              "[OneCycleLR] anneal_strategy must be 'cos' or 'linear', got '", o.anneal_strategy,
              "'");
  EMBER_CHECK(!o.max_lr.empty(), "[OneCycleLR] max_lr is required");
  EMBER_CHECK(o.div_factor > 0, "[OneCycleLR] expected div_factor > 0, got ", o.div_factor);
  EMBER_CHECK(o.final_div_factor > 0, "[OneCycleLR] expected final_div_factor > 0, got ",
              o.final_div_factor);
  cos_ = o.anneal_strategy == "cos";
  const double total = static_cast<double>(total_steps_);
  if (o.three_phase) {
    phases_ = {
        {o.pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
        {2 * o.pct_start * total - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"},
        {total - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"},
    };
  } else {
    phases_ = {
        {o.pct_start * total - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"},
        {total - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"},
    };
  }

  auto& groups = optimizer.param_groups();
  const std::vector<double> max_lrs = per_group(o.max_lr, "max_lr");
  if (last_epoch == -1) {
    for (size_t i = 0; i < groups.size(); ++i) {
      const double initial = max_lrs[i] / o.div_factor;
      groups[i].set("initial_lr", initial);
      groups[i].set("max_lr", max_lrs[i]);
      groups[i].set("min_lr", initial / o.final_div_factor);
    }
  }
  cycle_momentum_ = o.cycle_momentum;
  if (cycle_momentum_) {
    const GroupOptions& d = optimizer.defaults();
    EMBER_CHECK(d.count("momentum") || d.count("beta1"), "[OneCycleLR] optimizer ",
                optimizer.name(), " must support momentum with the cycle_momentum option enabled");
    momentum_key_ = d.count("beta1") ? "beta1" : "momentum";
    const auto max_m = per_group(o.max_momentum, "max_momentum");
    const auto base_m = per_group(o.base_momentum, "base_momentum");
    if (last_epoch == -1) {
      for (size_t i = 0; i < groups.size(); ++i) {
        groups[i].set(momentum_key_, max_m[i]);
        groups[i].set("max_momentum", max_m[i]);
        groups[i].set("base_momentum", base_m[i]);
      }
    }
  }
  start(last_epoch);
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (cos_) {
    const double cos_out = std::cos(kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

std::vector<double> OneCycleLR::get_lr() {
  const int64_t step_num = last_epoch_;
  EMBER_CHECK(step_num <= total_steps_, "[OneCycleLR] tried to step ", step_num + 1,
              " times; the specified number of total steps is ", total_steps_);
  std::vector<double> lrs;
  for (ParamGroup& g : optimizer_.param_groups()) {
    double start_step = 0, lr = 0, momentum = 0;
    for (size_t i = 0; i < phases_.size(); ++i) {
      const Phase& ph = phases_[i];
      if (static_cast<double>(step_num) <= ph.end_step || i + 1 == phases_.size()) {
        const double pct = (static_cast<double>(step_num) - start_step) / (ph.end_step - start_step);
        lr = anneal(g.get(ph.start_lr), g.get(ph.end_lr), pct);
        if (cycle_momentum_) momentum = anneal(g.get(ph.start_momentum), g.get(ph.end_momentum), pct);
        break;
      }
      start_step = ph.end_step;
    }
    lrs.push_back(lr);
    if (cycle_momentum_) g.set(momentum_key_, momentum);
  }
  return lrs;
}

}  // namespace ember::nn::optim
