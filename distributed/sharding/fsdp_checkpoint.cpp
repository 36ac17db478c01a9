#include <ember/distributed/sharding/fsdp_checkpoint.h>

#include <set>
#include <unordered_map>

#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/sharding/sharded_checkpoint.h>
#include <ember/nn/checkpoint.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {
namespace {

constexpr const char* kOptimizerKey = "optim.optimizer";
constexpr const char* kGroupsKey = "optim.param_groups";

// A tensor the optimizer steps, and where its elements sit in the whole parameter.
struct Owned {
  std::string name;
  Shape shape;        // of the whole parameter
  int64_t begin = 0;  // of this tensor's elements in it
  bool sharded = false;
};

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

// Every tensor root's sharded training steps: the local pieces and the replicated parameters.
std::unordered_map<const TensorImpl*, Owned> owned_tensors(const nn::Module& root,
                                                           const Layout& layout) {
  std::unordered_map<const TensorImpl*, Owned> out;
  for (const LocalShard& s : layout.shards) {
    if (s.data.defined()) out[s.data.impl()] = {s.name, s.shape, s.begin, true};
  }
  for (const auto& [name, p] : root.named_parameters()) {
    if (!layout.sharded(p)) out[p.impl()] = {name, p.shape(), 0, false};
  }
  return out;
}

// The checkpoint's optimizer tensors by parameter: "optim.<parameter>.<key>" -> keys[parameter].
// (Parameter names hold dots; keys do not.)
std::map<std::string, std::vector<std::string>> optimizer_keys(const ShardedCheckpoint& ck) {
  std::map<std::string, std::vector<std::string>> out;
  for (const std::string& name : ck.names()) {
    const size_t last = name.rfind('.');
    if (name.rfind("optim.", 0) != 0 || last <= 6) continue;
    out[name.substr(6, last - 6)].push_back(name.substr(last + 1));
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
              "(build it over fsdp_parameters(model))");
  return it->second;
}

}  // namespace

void save_fsdp_checkpoint(const std::string& dir, const nn::Module& root,
                          const nn::optim::Optimizer* optimizer, ProcessGroup& pg,
                          const std::map<std::string, std::string>& metadata) {
  constexpr const char* kOp = "save_fsdp_checkpoint";
  const Layout layout(root);
  std::vector<ShardPiece> pieces;
  for (const LocalShard& s : layout.shards) {
    if (s.data.defined()) pieces.push_back({s.name, s.shape.vec(), s.begin, s.data.detach()});
  }
  // Everything else in the state dict (replicated parameters, buffers; not the tied second
  // names of sharded parameters) is the same on every rank: rank 0 writes it.
  if (pg.rank() == 0) {
    for (const auto& [name, t] : root.state_dict()) {
      if (!layout.sharded(t)) pieces.push_back({name, t.shape().vec(), 0, t.reshape({-1})});
    }
  }
  std::map<std::string, std::string> meta = metadata;
  for (const auto& [k, v] : metadata) {
    EMBER_CHECK(k.rfind("optim.", 0) != 0, "[", kOp, "] metadata key '", k,
                "' is reserved (keys starting with 'optim.')");
  }
  if (optimizer != nullptr) {
    const auto owned = owned_tensors(root, layout);
    const std::vector<Tensor> params = optimizer_params(*optimizer);
    const nn::optim::OptimizerState st = optimizer->state_dict();
    meta[kOptimizerKey] = st.type;
    meta[kGroupsKey] = st.param_groups;
    meta[std::string("optim.") + nn::kStateKeysKey] = nn::kStateKeysByName;
    for (const auto& [sname, t] : st.state) {
      const auto [i, key] = split_state_name(sname);
      const Owned& o = owner_of(owned, params.at(i), kOp);
      const std::string name = "optim." + o.name + "." + key;
      if (t.numel() == params[i].numel() && t.dim() > 0) {
        if (o.sharded || pg.rank() == 0) {
          pieces.push_back({name, o.shape.vec(), o.begin, t.reshape({-1})});
        }
      } else if (o.begin == 0 && (o.sharded || pg.rank() == 0)) {
        // A per-parameter scalar (Adam's step): written once, by the rank holding element 0.
        pieces.push_back({name, t.shape().vec(), 0, t.reshape({-1})});
      }
    }
  }
  save_sharded(dir, pieces, pg, meta);
}

std::map<std::string, std::string> load_fsdp_checkpoint(const std::string& dir,
                                                        const nn::Module& root,
                                                        nn::optim::Optimizer* optimizer) {
  constexpr const char* kOp = "load_fsdp_checkpoint";
  const ShardedCheckpoint ck(dir);
  auto require = [&](const std::string& name, const Shape& shape) {
    EMBER_CHECK(ck.contains(name), "[", kOp, "] ", dir, " has no tensor '", name, "'");
    EMBER_CHECK(Shape(ck.shape(name)) == shape, "[", kOp, "] ", dir, ": '", name, "' has shape ",
                Shape(ck.shape(name)), ", the model's is ", shape);
  };
  const Layout layout(root);
  NoGradGuard no_grad;
  for (const LocalShard& s : layout.shards) {
    require(s.name, s.shape);
    if (!s.data.defined()) continue;
    Tensor out = s.data.detach();
    ck.read_into(s.name, s.begin, out);
  }
  for (const auto& [name, t] : root.state_dict()) {
    if (layout.sharded(t)) continue;  // above (tied second names included)
    require(name, t.shape());
    Tensor(t).copy_(ck.read_full(name));
  }
  std::map<std::string, std::string> meta = ck.metadata();
  if (optimizer != nullptr) {
    auto it = meta.find(kOptimizerKey);
    EMBER_CHECK(it != meta.end(), "[", kOp, "] ", dir, " holds no optimizer state");
    const auto owned = owned_tensors(root, layout);
    const auto keys = optimizer_keys(ck);
    const std::vector<Tensor> params = optimizer_params(*optimizer);
    nn::optim::OptimizerState st = optimizer->state_dict();
    EMBER_CHECK(it->second == st.type, "[", kOp, "] ", dir, " holds ", it->second,
                " state; the optimizer is ", st.type);
    if (auto g = meta.find(kGroupsKey); g != meta.end()) {
      st.param_groups = nn::merge_param_groups(g->second, st.param_groups, kOp);
    }
    st.state.clear();
    for (size_t i = 0; i < params.size(); ++i) {
      const Owned& o = owner_of(owned, params[i], kOp);
      auto k = keys.find(o.name);
      if (k == keys.end()) continue;  // no state saved for it (never stepped)
      for (const std::string& key : k->second) {
        const std::string name = "optim." + o.name + "." + key;
        const Shape full(ck.shape(name));
        Tensor t = full == o.shape
                       ? ck.read(name, o.begin, params[i].numel()).reshape(params[i].shape())
                       : ck.read_full(name);
        st.state.emplace_back("state." + std::to_string(i) + "." + key, t);
      }
    }
    optimizer->load_state_dict(st);
  }
  for (auto mit = meta.begin(); mit != meta.end();) {
    mit = mit->first.rfind("optim.", 0) == 0 ? meta.erase(mit) : std::next(mit);
  }
  return meta;
}

}  // namespace ember::dist
