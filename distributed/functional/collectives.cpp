#include <ember/distributed/functional/collectives.h>

#include <numeric>
#include <vector>

#include <ember/autograd/function.h>
#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops.h>

namespace ember::dist::functional {

namespace {

using autograd::Context;
using autograd::TensorList;

std::shared_ptr<ProcessGroup> or_default(std::shared_ptr<ProcessGroup> group) {
  return group ? std::move(group) : default_group();
}

int64_t wrap_dim(const char* op, int64_t dim, const Tensor& t) {
  const int64_t n = t.dim();
  EMBER_CHECK(dim >= -n && dim < n, "[", op, "] dim ", dim, " is out of range for a tensor of ",
              n, " dims (shape ", t.shape(), ")");
  return dim < 0 ? dim + n : dim;
}

// The plain (not recorded) collectives the functions and their backward passes run.
Tensor gather_along(const Tensor& t, int64_t d, ProcessGroup& g) {
  Tensor front = t.movedim(d, 0).contiguous();
  std::vector<int64_t> shape = front.shape().vec();
  shape[0] *= g.size();
  Tensor out = empty(shape, t.options());
  g.allgather_into_tensor(out, front)->wait();
  return out.movedim(0, d).contiguous();
}

Tensor scatter_along(const Tensor& t, int64_t d, ReduceOp op, ProcessGroup& g) {
  EMBER_CHECK(t.size(d) % g.size() == 0, "[reduce_scatter] dim ", d, " of size ", t.size(d),
              " (shape ", t.shape(), ") is not divisible by the group's ", g.size(), " ranks");
  Tensor front = t.movedim(d, 0).contiguous();
  std::vector<int64_t> shape = front.shape().vec();
  shape[0] /= g.size();
  Tensor out = empty(shape, t.options());
  g.reduce_scatter_tensor(out, front, {.op = op, .timeout = {}})->wait();
  return out.movedim(0, d).contiguous();
}

Tensor exchange(const Tensor& t, int64_t split_dim, int64_t concat_dim, ProcessGroup& g) {
  EMBER_CHECK(t.size(split_dim) % g.size() == 0, "[all_to_all] split dim ", split_dim,
              " of size ", t.size(split_dim), " (shape ", t.shape(),
              ") is not divisible by the group's ", g.size(), " ranks");
  std::vector<Tensor> in;
  for (const Tensor& c : chunk(t, g.size(), split_dim)) in.push_back(c.contiguous());
  std::vector<Tensor> out;
  for (const Tensor& c : in) out.push_back(empty_like(c));
  g.alltoall(out, in)->wait();
  return cat(out, concat_dim);
}

Tensor reduced(const Tensor& t, ReduceOp op, ProcessGroup& g) {
  Tensor out = t.contiguous().clone();
  g.allreduce(out, {.op = op, .timeout = {}})->wait();
  return out;
}

struct GroupState {
  std::shared_ptr<ProcessGroup> group;
  ReduceOp op = ReduceOp::Sum;
  int64_t dim = 0;
  int64_t other_dim = 0;
  int src = 0;
};

void check_differentiable(const char* op, ReduceOp r) {
  EMBER_CHECK(r == ReduceOp::Sum || r == ReduceOp::Avg, "[", op, "] the gradient of a ",
              to_string(r), " reduction is not defined here: only sum and avg are differentiated");
}

struct AllReduceFn : autograd::Function<AllReduceFn> {
  static Tensor forward(Context* ctx, const Tensor& t, ReduceOp op,
                        std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>() = {g, op};
    return reduced(t, op, *g);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const GroupState& s = ctx->state<GroupState>();
    check_differentiable("all_reduce", s.op);
    return {all_reduce(grads[0], s.op, s.group)};
  }
};

struct AllGatherFn : autograd::Function<AllGatherFn> {
  static Tensor forward(Context* ctx, const Tensor& t, int64_t dim,
                        std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>() = {g, ReduceOp::Sum, dim};
    return gather_along(t, dim, *g);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const GroupState& s = ctx->state<GroupState>();
    return {reduce_scatter(grads[0], s.dim, ReduceOp::Sum, s.group)};
  }
};

struct ReduceScatterFn : autograd::Function<ReduceScatterFn> {
  static Tensor forward(Context* ctx, const Tensor& t, int64_t dim, ReduceOp op,
                        std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>() = {g, op, dim};
    return scatter_along(t, dim, op, *g);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const GroupState& s = ctx->state<GroupState>();
    check_differentiable("reduce_scatter", s.op);
    Tensor g = all_gather(grads[0], s.dim, s.group);
    if (s.op == ReduceOp::Avg) g = g / static_cast<double>(s.group->size());
    return {g};
  }
};

struct AllToAllFn : autograd::Function<AllToAllFn> {
  static Tensor forward(Context* ctx, const Tensor& t, int64_t split_dim, int64_t concat_dim,
                        std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>() = {g, ReduceOp::Sum, split_dim, concat_dim};
    return exchange(t, split_dim, concat_dim, *g);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const GroupState& s = ctx->state<GroupState>();
    return {all_to_all(grads[0], s.other_dim, s.dim, s.group)};
  }
};

struct BroadcastFn : autograd::Function<BroadcastFn> {
  static Tensor forward(Context* ctx, const Tensor& t, int src, std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>().group = g;
    ctx->state<GroupState>().src = src;
    Tensor out = t.contiguous().clone();
    g->broadcast(out, {.root = src, .timeout = {}})->wait();
    return out;
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const GroupState& s = ctx->state<GroupState>();
    Tensor sum = grads[0].contiguous().clone();
    s.group->reduce(sum, {.root = s.src, .op = ReduceOp::Sum, .timeout = {}})->wait();
    return {s.group->rank() == s.src ? sum : zeros_like(grads[0])};
  }
};

struct CopyToGroupFn : autograd::Function<CopyToGroupFn> {
  static Tensor forward(Context* ctx, const Tensor& t, std::shared_ptr<ProcessGroup> g) {
    ctx->state<GroupState>().group = g;
    return t;
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    return {all_reduce(grads[0], ReduceOp::Sum, ctx->state<GroupState>().group)};
  }
};

struct ReduceFromGroupFn : autograd::Function<ReduceFromGroupFn> {
  static Tensor forward(Context*, const Tensor& t, std::shared_ptr<ProcessGroup> g) {
    return reduced(t, ReduceOp::Sum, *g);
  }
  static TensorList backward(Context*, TensorList grads) { return {grads[0]}; }
};

}  // namespace

Tensor all_reduce(const Tensor& t, ReduceOp op, std::shared_ptr<ProcessGroup> group) {
  return AllReduceFn::apply(t, op, or_default(std::move(group)));
}

Tensor all_gather(const Tensor& t, int64_t dim, std::shared_ptr<ProcessGroup> group) {
  return AllGatherFn::apply(t, wrap_dim("all_gather", dim, t), or_default(std::move(group)));
}

Tensor reduce_scatter(const Tensor& t, int64_t dim, ReduceOp op,
                      std::shared_ptr<ProcessGroup> group) {
  return ReduceScatterFn::apply(t, wrap_dim("reduce_scatter", dim, t), op,
                                or_default(std::move(group)));
}

Tensor all_to_all(const Tensor& t, int64_t split_dim, int64_t concat_dim,
                  std::shared_ptr<ProcessGroup> group) {
  return AllToAllFn::apply(t, wrap_dim("all_to_all", split_dim, t),
                           wrap_dim("all_to_all", concat_dim, t), or_default(std::move(group)));
}

Tensor broadcast(const Tensor& t, int src, std::shared_ptr<ProcessGroup> group) {
  group = or_default(std::move(group));
  EMBER_CHECK(src >= 0 && src < group->size(), "[broadcast] src ", src,
              " is not a rank of the group of size ", group->size());
  return BroadcastFn::apply(t, src, std::move(group));
}

Tensor copy_to_group(const Tensor& t, std::shared_ptr<ProcessGroup> group) {
  return CopyToGroupFn::apply(t, or_default(std::move(group)));
}

Tensor reduce_from_group(const Tensor& t, std::shared_ptr<ProcessGroup> group) {
  return ReduceFromGroupFn::apply(t, or_default(std::move(group)));
}

}  // namespace ember::dist::functional
