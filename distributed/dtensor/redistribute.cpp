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

std::shared_ptr<ProcessGroup> unowned(ProcessGroup& g) {
  return std::shared_ptr<ProcessGroup>(&g, [](ProcessGroup*) {});
}

// All-gathers the shards of a dimension of `size`, unpadding the uneven ones (pieces are
// padded to ceil(size / n), so the padding is all at the end). Backward: reduce-scatter.
Tensor gather_shards(const Tensor& t, int64_t d, int64_t size, ProcessGroup& g) {
  const int64_t chunk = (size + g.size() - 1) / g.size();
  return functional::all_gather(pad_to(t, d, chunk), d, unowned(g)).narrow(d, 0, size);
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
    return {gather_shards(grads[0], s.dim, s.size, *s.group)};
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

Tensor check_and_sync(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      const Shape& global) {
  Tensor out = local;
  for (int i = 0; i < mesh.ndim(); ++i) {
    ProcessGroup& g = *mesh.get_group(i);
    const int64_t nd = local.dim();
    Tensor mine = zeros({nd}, TensorOptions(kInt64));
    for (int64_t d = 0; d < nd; ++d) mine.data<int64_t>()[d] = local.size(d);
    Tensor all = zeros({g.size() * nd}, TensorOptions(kInt64));
    g.allgather_into_tensor(all, mine)->wait();
    for (int j = 0; j < g.size(); ++j) {
      Shape want = local.shape();
      if (placements[i].is_shard()) {
        const int64_t d = placements[i].dim();
        want[d] = shard_length(global[d], g.size(), j);
      }
      for (int64_t d = 0; d < nd; ++d) {
        const int64_t got = all.data<int64_t>()[j * nd + d];
        EMBER_CHECK(got == want[d], "[DTensor.from_local] run_check: rank ", j, " of mesh ",
                    "dimension ", i, " has local size ", got, " in dim ", d, " but its part of ",
                    global, " placed ", to_string(placements), " has ", want[d]);
      }
    }
    if (placements[i].is_replicate()) out = functional::broadcast(out, 0, mesh.get_group(i));
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
    ProcessGroup& g = *mesh.get_group(i);
    const int64_t a = cur[i].dim();
    if (to[i].is_shard() && !sharded_elsewhere(i, to[i].dim()) &&
        even(shape_[a], g.size()) && even(shape_[to[i].dim()], g.size())) {
      t = functional::all_to_all(t, to[i].dim(), a, unowned(g));
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
      t = ToPartialFn::apply(t, mesh.get_local_rank(i) == 0, static_cast<bool>(partial[i]));
      partial[i] = false;
    }
    cur[i] = to[i];
  }
  return make(t, mesh_, to, shape_, partial);
}

}  // namespace ember::dist
