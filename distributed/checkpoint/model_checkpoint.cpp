#include <ember/distributed/checkpoint/model_checkpoint.h>

#include <set>
#include <unordered_map>

#include <ember/distributed/checkpoint/checkpoint.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/nn/io/checkpoint.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {
namespace {

constexpr const char* kOptimizerKey = "optimizer";
constexpr const char* kGroupsKey = "param_groups";

// A tensor this rank holds, and where its elements sit in the whole parameter: the block of it
// this rank's tensor-parallel part is (whole when no style laid the parameter out), and the
// flat range of that block the tensor is (fully_shard's piece; all of it otherwise).
struct Owned {
  std::string name;
  Shape shape;        // of the whole parameter
  Box box;            // this rank's tensor-parallel block of it
  int64_t begin = 0;  // of this tensor's elements in the block
};

// The whole parameter's shape and the block `param` (a module's parameter handle, whole or
// tensor-parallel) is of it, from its DTensor record. The record's global shape is the view the
// block is taken in (a fused projection's [3, C, C] blocks); the whole's shape is that view
// folded to the parameter's dimensions ([3C, C]), as a single process holds it.
std::pair<Shape, Box> whole_of(const std::string& name, const Tensor& param, const char* op) {
  const std::optional<DTensor> d = as_dtensor(param);
  if (!d) return {param.shape(), {}};
  std::vector<int64_t> view;
  for (int64_t k = 0; k < d->dim(); ++k) view.push_back(d->size(k));
  Box box{view, std::vector<int64_t>(view.size(), 0), view};
  const DeviceMesh& mesh = *d->device_mesh();
  for (size_t i = 0; i < d->placements().size(); ++i) {
    const Placement& p = d->placements()[i];
    EMBER_CHECK(!p.is_partial(), "[", op, "] parameter '", name, "' is ", to_string(d->placements()),
                ": a pending reduction cannot be saved");
    if (!p.is_shard()) continue;
    const auto dim = static_cast<size_t>(p.dim() < 0 ? p.dim() + d->dim() : p.dim());
    const int64_t n = mesh.size(static_cast<int>(i));
    const int c = mesh.get_coordinate()[i];
    box.offset[dim] = shard_offset(view[dim], n, c);
    box.shape[dim] = shard_length(view[dim], n, c);
  }
  const int64_t extra = d->dim() - param.dim();
  int64_t in_box = 1;
  for (int64_t x : box.shape) in_box *= x;
  EMBER_CHECK(extra >= 0 && (extra == 0 || param.dim() > 0) && in_box == param.numel(), "[", op,
              "] parameter '", name, "' of shape ", param.shape(), " is not the part ",
              d->str(), " gives this rank");
  std::vector<int64_t> whole(view.begin() + extra, view.end());
  for (int64_t k = 0; k < extra; ++k) whole[0] *= view[static_cast<size_t>(k)];
  if (extra == 0) box.view.clear();
  return {Shape(whole), box};
}

// root's sharded layout, taken once per save or load: this rank's pieces, and the storages of
// the sharded parameters (their gather arenas), which every state_dict() view of a sharded
// parameter shares, a tied second name's included.
struct Layout {
  std::vector<LocalShard> shards;
  std::set<const Storage*> arenas;

  explicit Layout(const nn::Module& root) : shards(local_shards(root)) {
    std::set<std::string> names;
    for (const LocalShard& s : shards) names.insert(s.name);
    for (const auto& [name, p] : root.named_parameters()) {
      if (names.count(name) != 0) arenas.insert(p.storage().get());
    }
  }
  bool sharded(const Tensor& t) const { return arenas.count(t.storage().get()) != 0; }
};

// The parameter handles of root (which DTensor records are kept by) for the tensors of its
// state_dict() (detached: other handles of the same elements), a tied second name's included.
class Handles {
 public:
  explicit Handles(const nn::Module& root) {
    for (const auto& [name, p] : root.named_parameters()) {
      by_place_[{p.storage().get(), p.storage_offset()}] = p;
    }
  }
  /// The parameter `t` is a handle of, or t itself (a buffer).
  const Tensor& of(const Tensor& t) const {
    auto it = by_place_.find({t.storage().get(), t.storage_offset()});
    return it != by_place_.end() && it->second.shape() == t.shape() ? it->second : t;
  }

 private:
  std::map<std::pair<const Storage*, int64_t>, Tensor> by_place_;
};

// Every tensor root's training steps on this rank: fully_shard's pieces and the parameters it
// does not hold in pieces.
std::unordered_map<const TensorImpl*, Owned> owned_tensors(const nn::Module& root,
                                                           const Layout& layout, const char* op) {
  std::unordered_map<const TensorImpl*, Owned> out;
  const nn::NamedTensors params = root.named_parameters();
  std::map<std::string, Tensor> by_name(params.begin(), params.end());
  for (const LocalShard& s : layout.shards) {
    if (!s.data.defined()) continue;
    auto [whole, box] = whole_of(s.name, by_name.at(s.name), op);
    out[s.data.impl()] = {s.name, whole, box, s.begin};
  }
  for (const auto& [name, p] : params) {
    if (layout.sharded(p)) continue;
    auto [whole, box] = whole_of(name, p, op);
    out[p.impl()] = {name, whole, box, 0};
  }
  return out;
}

// The optimizer's parameters in its state's index order (across groups).
std::vector<Tensor> optimizer_params(const nn::optim::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& g : opt.param_groups()) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

// "state.<i>.<key>" -> (i, key).
std::pair<size_t, std::string> split_state_name(const std::string& n) {
  const size_t dot = n.find('.', 6);
  return {std::stoul(n.substr(6, dot - 6)), n.substr(dot + 1)};
}

const Owned& owner_of(const std::unordered_map<const TensorImpl*, Owned>& owned, const Tensor& p,
                      const char* op) {
  auto it = owned.find(p.impl());
  EMBER_CHECK(it != owned.end(), "[", op, "] the optimizer steps a tensor of shape ", p.shape(),
              " that is neither a piece of a sharded parameter nor a parameter of the model "
              "(build it over the model's parameters, or fsdp_parameters(model))");
  return it->second;
}

}  // namespace


}  // namespace ember::dist

namespace ember::dist::detail {

checkpoint::SavedState model_state(const nn::Module& root) {
  constexpr const char* kOp = "checkpoint::model";
  const Layout layout(root);
  const auto owned = owned_tensors(root, layout, kOp);
  checkpoint::SavedState out;
  // Every part this rank holds, as a replicated piece: where other ranks hold the same part,
  // save_sharded has one of them write it.
  auto add = [&](const std::string& name, const Owned& o, const Tensor& t) {
    out.tensors.push_back({name, o.shape.vec(), o.begin, t.detach().reshape({-1}), o.box, true});
  };
  for (const LocalShard& s : layout.shards) {
    if (s.data.defined()) add(s.name, owned.at(s.data.impl()), s.data);
  }
  // Everything else in the state dict (parameters fully_shard does not hold, buffers; not the
  // tied second names of sharded parameters).
  const Handles handles(root);
  for (const auto& [name, t] : root.state_dict()) {
    if (layout.sharded(t)) continue;
    auto [whole, box] = whole_of(name, handles.of(t), kOp);
    add(name, Owned{name, whole, box, 0}, t);
  }
  return out;
}

checkpoint::SavedState optimizer_state(const nn::Module& root, const nn::optim::Optimizer& opt) {
  constexpr const char* kOp = "checkpoint::optimizer";
  const Layout layout(root);
  const auto owned = owned_tensors(root, layout, kOp);
  checkpoint::SavedState out;
  const std::vector<Tensor> params = optimizer_params(opt);
  const nn::optim::OptimizerState st = opt.state_dict();
  out.values[kOptimizerKey] = st.type;
  out.values[kGroupsKey] = st.param_groups;
  out.values[nn::kStateKeysKey] = nn::kStateKeysByName;
  for (const auto& [sname, t] : st.state) {
    const auto [i, key] = split_state_name(sname);
    const Owned& o = owner_of(owned, params.at(i), kOp);
    const std::string name = o.name + "." + key;
    if (t.numel() == params[i].numel() && t.dim() > 0) {
      out.tensors.push_back({name, o.shape.vec(), o.begin, t.detach().reshape({-1}), o.box, true});
    } else {
      // A per-parameter scalar (Adam's step): the same on every rank holding a part.
      out.tensors.push_back({name, t.shape().vec(), 0, t.detach().reshape({-1}), {}, true});
    }
  }
  return out;
}

void load_model_state(const checkpoint::StateReader& r, const nn::Module& root) {
  constexpr const char* kOp = "checkpoint::model";
  const std::string& dir = r.checkpoint().dir();
  auto require = [&](const std::string& name, const Shape& shape) {
    EMBER_CHECK(r.contains(name), "[", kOp, "] ", dir, " has no tensor '", name, "'",
                r.object().empty() ? "" : " in '" + r.object() + "'");
    EMBER_CHECK(Shape(r.shape(name)) == shape, "[", kOp, "] ", dir, ": '", name, "' has shape ",
                Shape(r.shape(name)), ", the model's is ", shape);
  };
  const Layout layout(root);
  const auto owned = owned_tensors(root, layout, kOp);
  NoGradGuard no_grad;
  // fully_shard's pieces are checked on every rank, also where this rank's piece is empty.
  const nn::NamedTensors params = root.named_parameters();
  const std::map<std::string, Tensor> by_name(params.begin(), params.end());
  for (const LocalShard& s : layout.shards) {
    require(s.name, whole_of(s.name, by_name.at(s.name), kOp).first);
    if (!s.data.defined()) continue;
    const Owned& o = owned.at(s.data.impl());
    Tensor out = s.data.detach();
    r.read_into(s.name, o.begin, out, o.box);
  }
  const Handles handles(root);
  for (const auto& [name, t] : root.state_dict()) {
    if (layout.sharded(t)) continue;  // above (tied second names included)
    auto [whole, box] = whole_of(name, handles.of(t), kOp);
    require(name, whole);
    if (t.is_contiguous() && t.is_cpu() && t.dtype() == r.dtype(name)) {
      Tensor flat = t.detach().reshape({-1});  // a view: the bytes land in place
      r.read_into(name, 0, flat, box);
    } else {
      Tensor(t).copy_(r.read(name, 0, t.numel(), box).reshape(t.shape()));
    }
  }
}

void load_optimizer_state(const checkpoint::StateReader& r, const nn::Module& root,
                          nn::optim::Optimizer& opt) {
  constexpr const char* kOp = "checkpoint::optimizer";
  const std::string& dir = r.checkpoint().dir();
  const std::optional<std::string> type = r.find_value(kOptimizerKey);
  EMBER_CHECK(type.has_value(), "[", kOp, "] ", dir, " holds no optimizer state",
              r.object().empty() ? "" : " in '" + r.object() + "'");
  const Layout layout(root);
  const auto owned = owned_tensors(root, layout, kOp);
  // The state's tensors by parameter: "<parameter>.<key>" -> keys[parameter] (parameter names
  // hold dots; keys do not).
  std::map<std::string, std::vector<std::string>> keys;
  for (const std::string& name : r.tensor_names()) {
    const size_t last = name.rfind('.');
    if (last != std::string::npos && last > 0) keys[name.substr(0, last)].push_back(name.substr(last + 1));
  }
  const std::vector<Tensor> opt_params = optimizer_params(opt);
  nn::optim::OptimizerState st = opt.state_dict();
  EMBER_CHECK(*type == st.type, "[", kOp, "] ", dir, " holds ", *type, " state; the optimizer is ",
              st.type);
  if (auto g = r.find_value(kGroupsKey)) st.param_groups = nn::merge_param_groups(*g, st.param_groups, kOp);
  st.state.clear();
  for (size_t i = 0; i < opt_params.size(); ++i) {
    const Owned& o = owner_of(owned, opt_params[i], kOp);
    auto k = keys.find(o.name);
    if (k == keys.end()) continue;  // no state saved for it (never stepped)
    for (const std::string& key : k->second) {
      const std::string name = o.name + "." + key;
      const Shape full(r.shape(name));
      Tensor t = full == o.shape ? r.read(name, o.begin, opt_params[i].numel(), o.box)
                                       .reshape(opt_params[i].shape())
                                 : r.read_full(name);
      st.state.emplace_back("state." + std::to_string(i) + "." + key, t);
    }
  }
  opt.load_state_dict(st, /*copy=*/false);  // the tensors were read for it
}

}  // namespace ember::dist::detail

namespace ember::dist {

// The layout these functions have always written: the model's tensors under their own names,
// the optimizer's under "optim.", its values as "optim.*" metadata.
void save_model_checkpoint(const std::string& dir, const nn::Module& root,
                           const nn::optim::Optimizer* optimizer, ProcessGroup& pg,
                           const std::map<std::string, std::string>& metadata) {
  constexpr const char* kOp = "save_model_checkpoint";
  checkpoint::SavedState all = detail::model_state(root);
  std::map<std::string, std::string> meta = metadata;
  for (const auto& [k, v] : metadata) {
    EMBER_CHECK(k.rfind("optim.", 0) != 0, "[", kOp, "] metadata key '", k,
                "' is reserved (keys starting with 'optim.')");
  }
  if (optimizer != nullptr) {
    checkpoint::SavedState o = detail::optimizer_state(root, *optimizer);
    for (ShardPiece& p : o.tensors) {
      p.name = "optim." + p.name;
      all.tensors.push_back(std::move(p));
    }
    for (const auto& [k, v] : o.values) meta["optim." + k] = v;
  }
  save_sharded(dir, all.tensors, pg, meta);
}

std::map<std::string, std::string> load_model_checkpoint(const std::string& dir,
                                                         const nn::Module& root,
                                                         nn::optim::Optimizer* optimizer) {
  const ShardedCheckpoint ck(dir);
  detail::load_model_state(checkpoint::StateReader(ck, "", 0), root);
  if (optimizer != nullptr) {
    detail::load_optimizer_state(checkpoint::StateReader(ck, "optim", 0), root, *optimizer);
  }
  std::map<std::string, std::string> meta = ck.metadata();
  for (auto mit = meta.begin(); mit != meta.end();) {
    mit = mit->first.rfind("optim.", 0) == 0 ? meta.erase(mit) : std::next(mit);
  }
  return meta;
}

}  // namespace ember::dist
