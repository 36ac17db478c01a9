// FSDP's state outside a step: the parameters an optimizer steps, gradient sync, clipping,
// state dicts and the local pieces of each parameter (fsdp.h). The unit itself: fsdp.cpp.
#include <ember/distributed/sharding/fsdp.h>

#include <cmath>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <ember/distributed/sharding/detail/fsdp_unit.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

using detail::FlatGroup;
using detail::FsdpUnit;

namespace {

// Where a sharded parameter lives: its unit, group and index there.
struct Place {
  std::shared_ptr<FsdpUnit> unit;
  FlatGroup* group = nullptr;
  size_t index = 0;
};

// Keyed by storage and offset: state_dict() hands out detached views, not the parameters' own
// handles, and a sharded parameter is the only tensor at its offset of its group's storage.
using PlaceKey = std::pair<const Storage*, int64_t>;
struct PlaceHash {
  size_t operator()(const PlaceKey& k) const {
    return std::hash<const void*>()(k.first) ^ (std::hash<int64_t>()(k.second) * 31);
  }
};
using Places = std::unordered_map<PlaceKey, Place, PlaceHash>;

PlaceKey key_of(const Tensor& t) { return {t.storage().get(), t.storage_offset()}; }

Places places_under(const nn::Module& root) {
  Places out;
  for (const auto& u : detail::units_under(root)) {
    for (FlatGroup& g : u->groups) {
      for (size_t i = 0; i < g.params.size(); ++i) out[key_of(g.params[i])] = {u, &g, i};
    }
  }
  return out;
}

std::vector<std::shared_ptr<FsdpUnit>> require_units(const nn::Module& root, const char* op) {
  auto units = detail::units_under(root);
  EMBER_CHECK(!units.empty(), "[", op, "] nothing under ", root.name(),
              " is sharded: call fully_shard on it or its submodules first");
  return units;
}

// root's parameters that no unit holds.
std::vector<Tensor> replicated_params(const nn::Module& root) {
  std::vector<Tensor> out;
  for (const Tensor& p : root.parameters()) {
    if (detail::unit_holding(p) == nullptr) out.push_back(p);
  }
  return out;
}

}  // namespace

namespace {
// Records `p`, a parameter outside every unit, as one whose gradient each backward averages
// over the ranks (finish_backward), once.
void register_replicated(detail::FsdpContext& ctx, const Tensor& p) {
  const bool known = std::any_of(ctx.replicated.begin(), ctx.replicated.end(),
                                 [&](const Tensor& r) { return r.is_same(p); });
  if (!known) ctx.replicated.push_back(p);
}
}  // namespace

std::vector<Tensor> fsdp_parameters(const nn::Module& root) {
  auto units = require_units(root, "fsdp_parameters");
  const Places places = places_under(root);
  auto& ctx = *units.front()->ctx;
  std::vector<Tensor> out;
  for (const auto& [name, p] : root.named_parameters()) {
    auto it = places.find(key_of(p));
    if (it != places.end()) {
      const Tensor& piece = it->second.group->pieces[it->second.index];
      if (piece.defined() && piece.requires_grad()) out.push_back(piece);
      continue;
    }
    if (!p.requires_grad()) continue;
    out.push_back(p);
    register_replicated(ctx, p);
  }
  return out;
}

void set_requires_gradient_sync(const nn::Module& root, bool sync) {
  for (const auto& u : require_units(root, "set_requires_gradient_sync")) u->ctx->sync = sync;
}

Tensor clip_grad_norm_(const nn::Module& root, double max_norm, double norm_type) {
  constexpr const char* kOp = "clip_grad_norm_";
  EMBER_CHECK(max_norm >= 0, "[", kOp, "] expected max_norm >= 0, got ", max_norm);
  EMBER_CHECK(norm_type > 0, "[", kOp, "] expected norm_type > 0, got ", norm_type);
  auto units = require_units(root, kOp);
  const bool inf = std::isinf(norm_type);
  NoGradGuard no_grad;
  std::vector<Tensor> grads, replicated;
  for (const auto& u : units) {
    for (const FlatGroup& g : u->groups) {
      for (const Tensor& piece : g.pieces) {
        if (piece.defined() && piece.grad().defined()) grads.push_back(piece.grad());
      }
    }
  }
  for (const Tensor& p : replicated_params(root)) {
    if (p.grad().defined()) replicated.push_back(p.grad());
  }
  // |g|^p summed (or the largest |g|): over the shards on every rank, then across ranks; the
  // replicated gradients are equal on every rank and count once.
  auto accumulate = [&](const std::vector<Tensor>& gs) {
    double acc = 0;
    for (const Tensor& g : gs) {
      const double n = norm(g, norm_type).item<double>();
      acc = inf ? std::max(acc, n) : acc + std::pow(n, norm_type);
    }
    return acc;
  };
  // On the shards' device: the group may work on that device only (NCCL).
  const Device dev = units.front()->groups.front().device;
  Tensor local = full({1}, accumulate(grads), TensorOptions(kFloat64).device(dev));
  units.front()->group->allreduce(local, {.op = inf ? ReduceOp::Max : ReduceOp::Sum})->wait();
  const double rep = accumulate(replicated);
  const double sharded = local.item<double>();
  const double total = inf ? std::max(sharded, rep) : std::pow(sharded + rep, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    for (Tensor& g : grads) g.mul_(coef);
    for (Tensor& g : replicated) g.mul_(coef);
  }
  // A total past float32's range is inf there, as PyTorch's float32 norm is.
  return full({}, static_cast<double>(static_cast<float>(total)), TensorOptions(kFloat32));
}

std::vector<LocalShard> local_shards(const nn::Module& root) {
  const Places places = places_under(root);
  // The parameters outside every unit are averaged as fsdp_parameters() arranges: a user who
  // builds the optimizer from these pieces and the root's own parameters (weight-decay groups)
  // never calls it.
  const auto units = detail::units_under(root);
  std::vector<LocalShard> out;
  for (const auto& [name, t] : root.named_parameters()) {
    auto it = places.find(key_of(t));
    if (it == places.end()) {
      if (!units.empty() && t.requires_grad()) register_replicated(*units.front()->ctx, t);
      continue;
    }
    const FlatGroup& g = *it->second.group;
    const size_t i = it->second.index;
    const Tensor& piece = g.pieces[i];
    const int64_t begin = g.piece_begin[i];
    out.push_back({name, t.shape(), begin, begin + (piece.defined() ? piece.numel() : 0), piece});
  }
  return out;
}

nn::NamedTensors full_state_dict(const nn::Module& root) {
  auto units = require_units(root, "full_state_dict");
  NoGradGuard no_grad;
  // Every group's full flat parameters, gathered in the units' order (the same on every rank).
  std::map<const FlatGroup*, Tensor> gathered;
  for (const auto& u : units) {
    for (FlatGroup& g : u->groups) {
      Tensor all =
          empty({g.shard_size * u->group->size()}, TensorOptions(g.dtype).device(g.device));
      u->group->allgather_into_tensor(all, g.shard.detach())->wait();
      gathered[&g] = all;
    }
  }
  const auto places = places_under(root);
  nn::NamedTensors out;
  for (const auto& [name, t] : root.state_dict()) {
    auto it = places.find(key_of(t));
    if (it == places.end()) {
      out.emplace_back(name, t.detach().clone());
      continue;
    }
    const Place& pl = it->second;
    const Tensor& all = gathered.at(pl.group);
    const Tensor flat = all.narrow(0, pl.group->offsets[pl.index], t.numel());
    out.emplace_back(name, flat.reshape(t.shape()).clone());
  }
  return out;
}

void load_full_state_dict(const nn::Module& root, const nn::NamedTensors& state) {
  constexpr const char* kOp = "load_full_state_dict";
  require_units(root, kOp);
  std::map<std::string, Tensor> given(state.begin(), state.end());
  const nn::NamedTensors mine = root.state_dict();
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> names;
  for (const auto& [name, t] : mine) {
    names.insert(name);
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
    } else if (it->second.shape() != t.shape()) {
      mismatched.push_back(name + " (expected " + dist::detail::str_cat(t.shape()) + ", got " +
                           dist::detail::str_cat(it->second.shape()) + ")");
    }
  }
  for (const auto& [name, t] : state) {
    if (names.count(name) == 0) unexpected.push_back(name);
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s.empty() ? std::string("none") : s;
  };
  EMBER_CHECK(missing.empty() && unexpected.empty() && mismatched.empty(), "[", kOp, "] ",
              root.name(), ": missing keys: ", join(missing), "; unexpected keys: ",
              join(unexpected), "; shape mismatches: ", join(mismatched));
  const auto places = places_under(root);
  NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    const Tensor& value = given.at(name);
    auto it = places.find(key_of(t));
    if (it == places.end()) {
      Tensor(t).copy_(value);
      continue;
    }
    const FlatGroup& g = *it->second.group;
    const size_t i = it->second.index;
    if (!g.pieces[i].defined()) continue;  // this rank holds none of it
    const int64_t n = g.pieces[i].numel();
    g.pieces[i].detach().copy_(value.reshape({-1}).narrow(0, g.piece_begin[i], n));
  }
}

}  // namespace ember::dist
