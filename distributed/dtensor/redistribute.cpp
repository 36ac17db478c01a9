// DTensor::redistribute, one mesh dimension at a time, and the autograd functions it and the
// DTensor ops are made of (Note [gradient conventions] in dtensor.cpp).
#include <ember/distributed/dtensor/detail/dtensor_impl.h>

#include <ember/autograd/function.h>
#include <ember/distributed/functional/collectives.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

using autograd::Context;
using autograd::TensorList;

struct DimState {
  std::shared_ptr<ProcessGroup> group;
  int64_t dim = 0;   // tensor dimension
  int64_t size = 0;  // its global size
  int index = 0;     // this rank's index along the mesh dimension
};

// `t` padded with zeros along `d` to `length`.
Tensor pad_to(const Tensor& t, int64_t d, int64_t length) {
  if (t.size(d) == length) return t;
  Shape s = t.shape();
  s[d] = length - t.size(d);
  return cat({t, zeros(s, t.options())}, d);
}

// All-gathers the shards of a dimension of `size`, unpadding the uneven ones (pieces are
// padded to ceil(size / n), so the padding is all at the end). Backward: reduce-scatter.
// `g` is owned: the backward that the autograd graph keeps may run after every mesh that named
// the group is gone.
Tensor gather_shards(const Tensor& t, int64_t d, int64_t size,
                     const std::shared_ptr<ProcessGroup>& g) {
  const int64_t chunk = (size + g->size() - 1) / g->size();
  return functional::all_gather(pad_to(t, d, chunk), d, g).narrow(d, 0, size);
}

// Replicate (whole gradient) -> this rank's shard. Backward all-gathers the shards' gradients,
// so every rank's Replicate input gets the whole gradient.
struct ScatterFn : autograd::Function<ScatterFn> {
  static Tensor forward(Context* ctx, const Tensor& t, DimState s) {
    ctx->state<DimState>() = s;
    const int64_t n = s.group->size();
    return t.narrow(s.dim, shard_offset(s.size, n, s.index), shard_length(s.size, n, s.index))
        .contiguous();
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const DimState& s = ctx->state<DimState>();
    return {gather_shards(grads[0], s.dim, s.size, s.group)};
  }
};

struct KeepFirstGradFn : autograd::Function<KeepFirstGradFn> {
  static Tensor forward(Context* ctx, const Tensor& t, bool first) {
    ctx->state<bool>() = first;
    return t;
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    return {ctx->state<bool>() ? grads[0] : zeros_like(grads[0])};
  }
};

// Replicate -> Partial: the first rank keeps the value, the others hold zeros, so the parts sum
// to it exactly. Backward: the Partial's gradient is the whole one; a whole-gradient input takes
// it on every rank, a partial_grad input only at the first rank (as the forward).
struct ToPartialFn : autograd::Function<ToPartialFn> {
  struct State {
    bool first = false;
    bool input_partial_grad = false;
  };
  static Tensor forward(Context* ctx, const Tensor& t, bool first, bool input_partial_grad) {
    ctx->state<State>() = {first, input_partial_grad};
    return first ? t : zeros_like(t);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const State& s = ctx->state<State>();
    return {s.first || !s.input_partial_grad ? grads[0] : zeros_like(grads[0])};
  }
};

bool even(int64_t size, int64_t n) { return size % n == 0; }

}  // namespace

namespace detail {

void check_partition(const char* op, ReduceOp reduce, int mesh_dim) {
  EMBER_CHECK(reduce != ReduceOp::Product, "[", op, "] Replicate -> Partial(", to_string(reduce),
              ") on mesh dimension ", mesh_dim, " is not supported (as in ",
              "PyTorch): a replicated value splits into parts for sum, avg, max and min only");
}

Tensor keep_first_grad(const Tensor& t, const DeviceMesh& mesh, int dim) {
  return KeepFirstGradFn::apply(t, mesh.get_local_rank(dim) == 0);
}

Tensor copy_to_mesh_dim(const Tensor& t, const DeviceMesh& mesh, int dim) {
  return functional::copy_to_group(t, mesh.get_group(dim));
}

Tensor local_for(const DTensor& a, const Placements& out) {
  Tensor t = a.local();
  const DeviceMesh& mesh = *a.device_mesh();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!a.placements()[i].is_replicate()) continue;
    if (!out[i].is_replicate() && !a.partial_grad(i)) t = copy_to_mesh_dim(t, mesh, i);
    if (out[i].is_replicate() && a.partial_grad(i)) t = keep_first_grad(t, mesh, i);
  }
  return t;
}

// A broadcast that autograd sees as the identity: from_local's run_check only repairs data that
// should already agree, so a Replicate's gradient stays the whole one on every rank (PyTorch's
// run_check broadcasts outside autograd).
struct SyncReplicaFn : autograd::Function<SyncReplicaFn> {
  static Tensor forward(Context*, const Tensor& t, std::shared_ptr<ProcessGroup> g) {
    Tensor out = t.contiguous().clone();
    g->broadcast(out)->wait();
    return out;
  }
  static TensorList backward(Context*, TensorList grads) { return {grads[0]}; }
};

Tensor check_and_sync(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const Shape& global) {
  constexpr const char* kWhere = "[DTensor.from_local] run_check:";
  // The exchange rides on the mesh's device (NCCL takes no host tensors). Every rank gathers
  // every peer's dims and claimed global shape and applies the same checks to all of them, so a
  // disagreement throws on every rank alike and none is left waiting in the next collective.
  const TensorOptions ints = TensorOptions(kInt64).device(mesh.device());
  auto gathered = [&](ProcessGroup& g, const std::vector<int64_t>& mine) {
    const int64_t k = static_cast<int64_t>(mine.size());
    Tensor in = zeros({k}, TensorOptions(kInt64));
    std::copy(mine.begin(), mine.end(), in.data<int64_t>());
    in = in.to(mesh.device());
    Tensor all = zeros({g.size() * k}, ints);
    g.allgather_into_tensor(all, in)->wait();
    return all.to(kCPU).contiguous();
  };
  const int64_t nd = local.dim();
  Tensor out = local;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const auto gp = mesh.get_group(i);
    ProcessGroup& g = *gp;
    // First the ranks (dims), which sizes the second exchange.
    const Tensor ranks = gathered(g, {nd, static_cast<int64_t>(global.size())});
    // Every rank compares every rank with the first, so all name the same one.
    const int64_t* first = ranks.data<int64_t>();
    for (int j = 0; j < g.size(); ++j) {
      const int64_t* r = ranks.data<int64_t>() + 2 * j;
      EMBER_CHECK(r[0] == first[0] && r[1] == first[1] && r[0] == r[1], kWhere,
                  " on mesh dimension ", i, " rank ", j, " has a local tensor of ", r[0],
                  " dims and a shape of ", r[1], " dims where rank 0 has ", first[0], " and ",
                  first[1]);
    }
    std::vector<int64_t> mine(local.shape().begin(), local.shape().end());
    mine.insert(mine.end(), global.begin(), global.end());
    const Tensor all = gathered(g, mine);
    const int64_t* first_global = all.data<int64_t>() + nd;
    Shape agreed = global;
    for (int64_t d = 0; d < nd; ++d) agreed[d] = first_global[d];
    for (int j = 0; j < g.size(); ++j) {
      const int64_t* sizes = all.data<int64_t>() + j * 2 * nd;
      Shape claimed = global;
      for (int64_t d = 0; d < nd; ++d) claimed[d] = sizes[nd + d];
      EMBER_CHECK(claimed == agreed, kWhere, " on mesh dimension ", i, " rank ", j,
                  " gives the global shape ", claimed, " but rank 0 gives ", agreed);
    }
    // A peer along this mesh dimension shares this rank's coordinates on the others.
    const Shape here = local_shape(agreed, mesh, placements);
    for (int j = 0; j < g.size(); ++j) {
      const int64_t* sizes = all.data<int64_t>() + j * 2 * nd;
      for (int64_t d = 0; d < nd; ++d) {
        const int64_t want =
            placements[i].is_shard(d) ? shard_length(agreed[d], g.size(), j) : here[d];
        EMBER_CHECK(sizes[d] == want, kWhere, " rank ", j, " of mesh dimension ", i,
                    " has local size ", sizes[d], " in dim ", d, " but its part of ", agreed,
                    " placed ", to_string(placements), " has ", want);
      }
    }
    if (placements[i].is_replicate()) out = SyncReplicaFn::apply(out, gp);
  }
  return out;
}

}  // namespace detail

DTensor DTensor::redistribute(const Placements& target) const {
  EMBER_CHECK(defined(), "[DTensor.redistribute] the DTensor is undefined");
  EMBER_CHECK(target.size() == placements_.size(), "[DTensor.redistribute] expected one placement ",
              "per mesh dimension (", placements_.size(), "), got ", target.size(), ": ",
              to_string(target));
  const Placements to = detail::normalized("DTensor.redistribute", target, *mesh_, dim());
  Tensor t = local_;
  Placements cur = placements_;
  std::vector<bool> partial = partial_grad_;
  const DeviceMesh& mesh = *mesh_;
  auto state = [&](int i, int64_t d) {
    return DimState{mesh.get_group(i), d, shape_[d], mesh.get_local_rank(i)};
  };
  auto sharded_elsewhere = [&](int i, int64_t d) {
    for (int j = 0; j < static_cast<int>(cur.size()); ++j) {
      if (j != i && cur[j].is_shard(d)) return true;
    }
    return false;
  };
  // First every Shard that changes leaves its dimension (an all-to-all when even, else an
  // all-gather), so that no step shards a tensor dimension another mesh dimension still shards.
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!cur[i].is_shard() || cur[i] == to[i]) continue;
    const auto g = mesh.get_group(i);
    const int64_t a = cur[i].dim();
    if (to[i].is_shard() && !sharded_elsewhere(i, to[i].dim()) && even(shape_[a], g->size()) &&
        even(shape_[to[i].dim()], g->size())) {
      t = functional::all_to_all(t, to[i].dim(), a, g);
      cur[i] = to[i];
    } else {
      t = gather_shards(t, a, shape_[a], g);
      cur[i] = Replicate();
      partial[i] = true;
    }
  }
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (cur[i] == to[i]) continue;
    ProcessGroup& g = *mesh.get_group(i);
    const auto gp = mesh.get_group(i);
    if (cur[i].is_partial()) {
      const ReduceOp op = cur[i].op();
      EMBER_CHECK(!to[i].is_partial(), "[DTensor.redistribute] Partial(", to_string(op),
                  ") -> ", to[i].str(), " on mesh dimension ", i, " is not supported");
      if (to[i].is_replicate()) {
        if (op == ReduceOp::Sum) {
          t = functional::reduce_from_group(t, gp);
        } else if (op == ReduceOp::Avg) {
          t = functional::reduce_from_group(t, gp) / static_cast<double>(g.size());
        } else {
          t = functional::all_reduce(t, op, gp);
        }
      } else {  // Shard(d)
        const int64_t d = to[i].dim();
        const int64_t n = g.size(), chunk = (shape_[d] + n - 1) / n;
        if (op == ReduceOp::Sum || op == ReduceOp::Avg) {
          t = functional::reduce_scatter(pad_to(t, d, chunk * n), d, op, gp)
                  .narrow(d, 0, shard_length(shape_[d], n, mesh.get_local_rank(i)));
        } else {
          t = ScatterFn::apply(functional::all_reduce(t, op, gp), state(i, d));
        }
      }
      partial[i] = false;
    } else if (to[i].is_shard()) {  // from Replicate
      const DimState s = state(i, to[i].dim());
      const int64_t n = g.size();
      t = partial[i] ? t.narrow(s.dim, shard_offset(s.size, n, s.index),
                                shard_length(s.size, n, s.index))
                     : ScatterFn::apply(t, s);
      partial[i] = false;
    } else {  // Replicate -> Partial
      const ReduceOp op = to[i].op();
      detail::check_partition("DTensor.redistribute", op, i);
      if (op == ReduceOp::Sum) {
        t = ToPartialFn::apply(t, mesh.get_local_rank(i) == 0, static_cast<bool>(partial[i]));
      } else if (!partial[i]) {
        // Every rank keeps the value, which avg, max and min reduce back to. Each rank's part
        // gets its own gradient, so the whole-gradient Replicate sums them (f).
        t = detail::copy_to_mesh_dim(t, mesh, i);
      }
      partial[i] = false;
    }
    cur[i] = to[i];
  }
  return make(t, mesh_, to, shape_, partial);
}

}  // namespace ember::dist
