#include <ember/distributed/sharding/zero.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include <ember/distributed/errors.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sharding/detail/byte_exchange.h>
#include <ember/distributed/sharding/detail/zero_overlap.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>

namespace ember::dist {
namespace {

using nn::optim::OptimizerState;
using nn::optim::ParamGroup;
using Json = nlohmann::json;

constexpr const char* kOp = "[ZeroRedundancyOptimizer]";

// Note [ZeRO partition]: as torch's ZeroRedundancyOptimizer, group by group, the parameters in
// decreasing size (stable, so every rank gets the same order) each go to the rank holding the
// fewest bytes so far (the lowest such rank on a tie). Deterministic from the shapes alone, so
// every rank computes the same partition without communicating. A group added later continues
// from the loads the earlier groups left, so the earlier parameters keep their ranks.
void partition(const std::vector<size_t>& group, const std::vector<Tensor>& params,
               std::vector<int64_t>& load, std::vector<int>& owner) {
  std::vector<size_t> order = group;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params[a].nbytes() > params[b].nbytes(); });
  owner.resize(params.size(), 0);
  for (size_t i : order) {
    const auto r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = static_cast<int>(r);
    load[r] += params[i].nbytes();
  }
}

// "state.<index>.<key>" -> (index, key).
std::pair<size_t, std::string> split_state_name(const std::string& name) {
  const size_t a = name.find('.'), b = name.find('.', a + 1);
  EMBER_CHECK(name.compare(0, a, "state") == 0 && b != std::string::npos, kOp,
              " expected state names \"state.<index>.<key>\", got '", name, "'");
  size_t index = 0;
  try {
    index = std::stoul(name.substr(a + 1, b - a - 1));
  } catch (const std::exception&) {
    EMBER_CHECK(false, kOp, " expected state names \"state.<index>.<key>\", got '", name, "'");
  }
  return {index, name.substr(b + 1)};
}

std::string state_name(size_t index, const std::string& key) {
  return "state." + std::to_string(index) + "." + key;
}

// A rank's state entries as bytes: the count, then per entry its global index, key, dtype,
// shape and data (host, contiguous).
std::string pack_state(const nn::NamedTensors& entries) {
  std::ostringstream os;
  os << entries.size() << '\n';
  std::string data;
  for (const auto& [name, t] : entries) {
    const Tensor host = t.detach().to(kCPU).contiguous();
    os << name << ' ' << static_cast<int>(host.dtype()) << ' ' << host.dim();
    for (int64_t d : host.shape()) os << ' ' << d;
    os << ' ' << host.nbytes() << '\n';
    data.append(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(host.nbytes()));
  }
  return os.str() + data;
}

nn::NamedTensors unpack_state(const std::string& bytes) {
  std::istringstream is(bytes);
  size_t count = 0;
  is >> count;
  struct Entry {
    std::string name;
    Dtype dtype;
    std::vector<int64_t> shape;
    int64_t nbytes;
  };
  std::vector<Entry> entries;
  for (size_t i = 0; i < count; ++i) {
    Entry e;
    int dtype = 0, dim = 0;
    is >> e.name >> dtype >> dim;
    e.dtype = static_cast<Dtype>(dtype);
    e.shape.resize(static_cast<size_t>(dim));
    for (auto& d : e.shape) is >> d;
    is >> e.nbytes;
    entries.push_back(std::move(e));
  }
  is.get();  // the newline before the data
  auto at = static_cast<size_t>(is.tellg());
  nn::NamedTensors out;
  for (const Entry& e : entries) {
    Tensor t = empty(Shape(e.shape), e.dtype);
    EMBER_CHECK(t.nbytes() == e.nbytes && at + static_cast<size_t>(e.nbytes) <= bytes.size(), kOp,
                " consolidate_state_dict: a rank's state entry '", e.name, "' is malformed");
    std::memcpy(t.data_ptr(), bytes.data() + at, static_cast<size_t>(e.nbytes));
    at += static_cast<size_t>(e.nbytes);
    out.emplace_back(e.name, t);
  }
  return out;
}

}  // namespace

// One dtype and device's parameters: each rank packs its own into `mine` (as long as the
// longest rank's share), the all-gather fills `all`, and every rank copies the others' out.
struct ZeroRedundancyOptimizer::Flat {
  std::vector<std::vector<size_t>> by_rank;  // parameter indices, per owner, ascending
  int64_t longest = 0;                       // elements of the largest share
  int64_t chunk = 0;                         // elements of a share gathered per all-gather
  Tensor mine, all;                          // [chunk], [world * chunk]
};

namespace {

// The all-gather of the updated parameters runs in windows of each rank's share of at most this
// many bytes, so its buffers stay small beside the model (whole-share buffers would hold a full
// extra copy of the model: more than the optimizer state ZeRO saves at 2 ranks).
constexpr int64_t kGatherChunkBytes = int64_t{8} << 20;

// Calls f(param index, offset in the parameter, offset in the window, length) for the parts of
// a share (its parameters flattened back to back) that fall in the window [lo, hi).
template <typename F>
void for_window(const std::vector<size_t>& share, const std::vector<Tensor>& params, int64_t lo,
                int64_t hi, F&& f) {
  int64_t at = 0;
  for (size_t i : share) {
    const int64_t n = params[i].numel();
    const int64_t b = std::max(lo, at), e = std::min(hi, at + n);
    if (b < e) f(i, b - at, b - lo, e - b);
    at += n;
    if (at >= hi) break;
  }
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<ParamGroup> groups,
                                                 OptimizerFactory factory,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 ZeroOptions options)
    : group_(group ? std::move(group) : default_group()),
      options_(options),
      load_(static_cast<size_t>(group_->size()), 0),
      gather_chunk_bytes_(kGatherChunkBytes) {
  EMBER_CHECK(factory != nullptr, kOp, " expected an optimizer factory, got null");
  const int world = group_->size(), me = group_->rank();
  std::vector<std::vector<size_t>> members;
  for (size_t g = 0; g < groups.size(); ++g) members.push_back(take_params(groups[g], g));
  EMBER_CHECK(!params_.empty(), kOp, " got no parameters");
  for (const auto& m : members) partition(m, params_, load_, owner_);
  std::vector<int64_t> held(static_cast<size_t>(world), 0);
  for (int o : owner_) ++held[static_cast<size_t>(o)];
  for (int r = 0; r < world; ++r) {
    EMBER_CHECK(held[static_cast<size_t>(r)] > 0, kOp, " ", params_.size(),
                " parameters cannot give each of ", world,
                " ranks a share: rank ", r, " would get none (use fewer ranks, or DDP's "
                "optimizer on every rank)");
  }
  std::vector<ParamGroup> local_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup lg({}, groups[g].options);
    for (size_t i : members[g]) {
      if (owner_[i] == me) lg.params.push_back(params_[i]);
    }
    local_groups.push_back(std::move(lg));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owner_[i] == me) local_.push_back(i);
  }
  local_opt_ = factory(std::move(local_groups));
  EMBER_CHECK(local_opt_ != nullptr, kOp, " the optimizer factory returned null");
  if (options_.overlap_with_ddp) {
    // The hook sends each bucket's updates itself: no gather buffers.
    overlap_ = std::make_shared<dist::detail::ZeroOverlap>(*this);
  } else {
    build_flats();
  }
}

std::vector<size_t> ZeroRedundancyOptimizer::take_params(const ParamGroup& group, size_t g) {
  std::set<const TensorImpl*> seen;
  for (const Tensor& p : params_) seen.insert(p.impl());
  std::vector<size_t> members;
  for (const Tensor& p : group.params) {
    // What the wrapped optimizer checks too, but of every parameter here: it sees only this
    // rank's, and a rank must not throw where its peers go on.
    EMBER_CHECK(p.defined() && p.requires_grad() && p.is_leaf() && p.is_floating_point(), kOp,
                " parameter ", params_.size(), " (group ", g,
                ") must be a floating-point leaf tensor that requires grad");
    EMBER_CHECK(seen.insert(p.impl()).second, kOp, " parameter ", params_.size(), " (group ", g,
                ") appears twice");
    members.push_back(params_.size());
    params_.push_back(p);
    group_of_.push_back(g);
  }
  return members;
}

// Flat buffers per (dtype, device), in the order the parameters first show them.
void ZeroRedundancyOptimizer::build_flats() {
  const int world = group_->size();
  flats_.clear();
  std::map<std::pair<int, std::string>, size_t> flat_of;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto key = std::make_pair(static_cast<int>(params_[i].dtype()), params_[i].device().str());
    auto [it, added] = flat_of.emplace(key, flats_.size());
    if (added) {
      flats_.emplace_back();
      flats_.back().by_rank.resize(static_cast<size_t>(world));
    }
    flats_[it->second].by_rank[static_cast<size_t>(owner_[i])].push_back(i);
  }
  for (Flat& f : flats_) {
    for (const auto& share : f.by_rank) {
      int64_t n = 0;
      for (size_t i : share) n += params_[i].numel();
      f.longest = std::max(f.longest, n);
    }
  }
  set_gather_chunk_bytes(gather_chunk_bytes_);
}

void ZeroRedundancyOptimizer::add_param_group(ParamGroup group) {
  EMBER_CHECK(!overlap_, kOp,
              " add_param_group: not with overlap_with_ddp (the communication "
              "hook's buckets hold the parameters the optimizer was built with)");
  EMBER_CHECK(!group.params.empty(), kOp, " add_param_group: the group has no parameters");
  const int me = group_->rank();
  const size_t first = params_.size();
  std::vector<int64_t> load = load_;
  std::vector<int> owner = owner_;
  std::vector<size_t> mine;
  try {  // nothing changes unless every check passes, the wrapped optimizer's included
    const std::vector<size_t> members = take_params(group, local_opt_->param_groups().size());
    partition(members, params_, load, owner);
    ParamGroup local({}, group.options);
    for (size_t i : members) {
      if (owner[i] != me) continue;
      local.params.push_back(params_[i]);
      mine.push_back(i);
    }
    local_opt_->add_param_group(std::move(local));
  } catch (...) {
    params_.resize(first);
    group_of_.resize(first);
    throw;
  }
  load_ = std::move(load);
  owner_ = std::move(owner);
  local_.insert(local_.end(), mine.begin(), mine.end());
  build_flats();
  consolidated_.reset();
}

void ZeroRedundancyOptimizer::set_gather_chunk_bytes(int64_t bytes) {
  EMBER_CHECK(bytes > 0, kOp, " set_gather_chunk_bytes: expected a positive size, got ", bytes);
  const int world = group_->size();
  gather_chunk_bytes_ = bytes;
  for (Flat& f : flats_) {
    size_t any = 0;
    for (const auto& share : f.by_rank) {
      if (!share.empty()) any = share.front();
    }
    const TensorOptions o = params_[any].options();
    f.chunk = std::min(f.longest, std::max<int64_t>(1, bytes / itemsize(params_[any].dtype())));
    f.mine = empty({f.chunk}, o);
    f.all = empty({f.chunk * world}, o);
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  if (overlap_) overlap_->detach();
}

void ZeroRedundancyOptimizer::step() {
  if (overlap_) return overlap_->check_step();
  local_opt_->step();
  ++steps_;
  NoGradGuard no_grad;
  const int world = group_->size(), me = group_->rank();
  for (Flat& f : flats_) {
    for (int64_t lo = 0; lo < f.longest; lo += f.chunk) {
      const int64_t hi = std::min(lo + f.chunk, f.longest), len = hi - lo;
      for_window(f.by_rank[static_cast<size_t>(me)], params_, lo, hi,
                 [&](size_t i, int64_t from, int64_t to, int64_t n) {
                   f.mine.narrow(0, to, n).copy_(params_[i].detach().reshape({-1}).narrow(0, from, n));
                 });
      Tensor mine = f.mine.narrow(0, 0, len), all = f.all.narrow(0, 0, len * world);
      group_->allgather_into_tensor(all, mine)->wait();
      for (int r = 0; r < world; ++r) {
        if (r == me) continue;
        for_window(f.by_rank[static_cast<size_t>(r)], params_, lo, hi,
                   [&](size_t i, int64_t from, int64_t to, int64_t n) {
                     params_[i].detach().view({-1}).narrow(0, from, n)
                         .copy_(all.narrow(0, r * len + to, n));
                   });
      }
    }
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (Tensor& p : params_) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      Tensor g = p.grad().detach();
      g.zero_();
      p.set_grad(g);
    }
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  EMBER_CHECK(to >= 0 && to < group_->size(), kOp, " consolidate_state_dict: rank ", to,
              " is not in this group of size ", group_->size());
  const OptimizerState local = local_opt_->state_dict();
  nn::NamedTensors global;  // this rank's entries, renamed to global indices
  for (const auto& [name, t] : local.state) {
    const auto [k, key] = split_state_name(name);
    EMBER_CHECK(k < local_.size(), kOp, " the wrapped optimizer's state names parameter ", k,
                " but this rank holds ", local_.size());
    global.emplace_back(state_name(local_[k], key), t);
  }
  const std::vector<std::string> all = detail::exchange_bytes(*group_, pack_state(global), to);
  consolidated_.reset();
  if (group_->rank() != to) return;
  std::vector<std::pair<size_t, std::pair<std::string, Tensor>>> entries;
  for (const std::string& bytes : all) {
    for (auto& [name, t] : unpack_state(bytes)) {
      entries.push_back({split_state_name(name).first, {name, t}});
    }
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  OptimizerState full;
  full.type = local.type;
  for (auto& e : entries) full.state.push_back(std::move(e.second));
  Json groups = Json::parse(local.param_groups);
  for (auto& g : groups) g["params"] = Json::array();
  for (size_t i = 0; i < params_.size(); ++i) groups[group_of_[i]]["params"].push_back(i);
  full.param_groups = groups.dump();
  consolidated_ = std::move(full);
  consolidated_at_ = steps_;
}

OptimizerState ZeroRedundancyOptimizer::state_dict() const {
  EMBER_CHECK(consolidated_.has_value(), kOp, " state_dict() on rank ", group_->rank(),
              ": call consolidate_state_dict(to) on every rank first; only rank `to` gets the "
              "full state");
  EMBER_CHECK(consolidated_at_ == steps_, kOp, " state_dict() on rank ", group_->rank(), ": ",
              steps_ - consolidated_at_,
              " step(s) ran since consolidate_state_dict; consolidate again");
  return *consolidated_;
}

void ZeroRedundancyOptimizer::load_state_dict(const OptimizerState& full) {
  Json groups;
  try {
    groups = Json::parse(full.param_groups);
  } catch (const Json::exception& e) {
    EMBER_CHECK(false, kOp, " load_state_dict: param_groups is not valid JSON: ", e.what());
  }
  EMBER_CHECK(groups.is_array() && groups.size() == local_opt_->param_groups().size(), kOp,
              " load_state_dict: the state has ", groups.is_array() ? groups.size() : 0,
              " parameter groups, this optimizer ", local_opt_->param_groups().size());
  std::vector<size_t> want(groups.size(), 0), got(groups.size(), 0);
  for (size_t g : group_of_) ++want[g];
  for (size_t g = 0; g < groups.size(); ++g) got[g] = groups[g].value("params", Json::array()).size();
  EMBER_CHECK(want == got, kOp, " load_state_dict: the state's groups hold ",
              Json(got).dump(), " parameters, this optimizer's ", Json(want).dump());
  std::map<size_t, size_t> local_index;  // global -> local
  for (size_t k = 0; k < local_.size(); ++k) local_index[local_[k]] = k;
  Json local_groups = groups;
  for (auto& g : local_groups) g["params"] = Json::array();
  for (size_t k = 0; k < local_.size(); ++k) local_groups[group_of_[local_[k]]]["params"].push_back(k);
  OptimizerState local;
  local.type = full.type;
  local.param_groups = local_groups.dump();
  for (const auto& [name, t] : full.state) {
    const auto [i, key] = split_state_name(name);
    EMBER_CHECK(i < params_.size(), kOp, " load_state_dict: state entry '", name,
                "' names parameter ", i, " of ", params_.size());
    if (auto it = local_index.find(i); it != local_index.end()) {
      local.state.emplace_back(state_name(it->second, key), t);
    }
  }
  local_opt_->load_state_dict(local);
}

}  // namespace ember::dist
