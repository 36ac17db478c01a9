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

// Rows [offset, offset + size) of dim 0 for each rank, from a list of sizes.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), off.begin() + 1);
  return off;
}

// The exchange behind all_to_all_single: a send and a receive per peer with rows to move, all
// issued before any is waited for (batch_isend_irecv), and this rank's own rows copied.
Tensor exchange_rows(const Tensor& t, const std::vector<int64_t>& out_sizes,
                     const std::vector<int64_t>& in_sizes, ProcessGroup& g) {
  const Tensor in = t.contiguous();
  std::vector<int64_t> shape = in.shape().vec();
  const std::vector<int64_t> in_off = offsets_of(in_sizes), out_off = offsets_of(out_sizes);
  shape[0] = out_off.back();
  Tensor out = empty(shape, in.options());
  std::vector<P2POp> ops;
  for (int r = 0; r < g.size(); ++r) {
    if (r == g.rank()) continue;
    if (in_sizes[r] > 0) ops.push_back(P2POp::isend(in.narrow(0, in_off[r], in_sizes[r]), r));
    if (out_sizes[r] > 0) ops.push_back(P2POp::irecv(out.narrow(0, out_off[r], out_sizes[r]), r));
  }
  std::vector<WorkPtr> works;
  if (!ops.empty()) works = g.batch_isend_irecv(ops);
  const int me = g.rank();
  if (in_sizes[me] > 0) {
    out.narrow(0, out_off[me], out_sizes[me]).copy_(in.narrow(0, in_off[me], in_sizes[me]));
  }
  for (const WorkPtr& w : works) w->wait();
  return out;
}

struct SplitState {
  std::shared_ptr<ProcessGroup> group;
  std::vector<int64_t> out_sizes, in_sizes;
};

struct AllToAllSingleFn : autograd::Function<AllToAllSingleFn> {
  static Tensor forward(Context* ctx, const Tensor& t, std::vector<int64_t> out_sizes,
                        std::vector<int64_t> in_sizes, std::shared_ptr<ProcessGroup> g) {
    Tensor out = exchange_rows(t, out_sizes, in_sizes, *g);
    ctx->state<SplitState>() = {std::move(g), std::move(out_sizes), std::move(in_sizes)};
    return out;
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const SplitState& s = ctx->state<SplitState>();
    return {all_to_all_single(grads[0], s.in_sizes, s.out_sizes, s.group)};
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

Tensor all_to_all_single(const Tensor& t, std::vector<int64_t> output_split_sizes,
                         std::vector<int64_t> input_split_sizes,
                         std::shared_ptr<ProcessGroup> group) {
  group = or_default(std::move(group));
  const int64_t n = group->size();
  EMBER_CHECK(t.dim() >= 1, "[all_to_all_single] expected a tensor of at least one dim, got ",
              "shape ", t.shape());
  auto check_sizes = [&](std::vector<int64_t>& sizes, const char* which, int64_t rows) {
    if (sizes.empty()) {
      EMBER_CHECK(rows % n == 0, "[all_to_all_single] without ", which, " dim 0 of size ", rows,
                  " must divide into the group's ", n, " ranks");
      sizes.assign(static_cast<size_t>(n), rows / n);
      return;
    }
    EMBER_CHECK(static_cast<int64_t>(sizes.size()) == n, "[all_to_all_single] expected ", n, " ",
                which, " (one per rank of the group), got ", sizes.size());
    for (int64_t v : sizes) {
      EMBER_CHECK(v >= 0, "[all_to_all_single] expected non-negative ", which, ", got ", v);
    }
  };
  check_sizes(input_split_sizes, "input_split_sizes", t.size(0));
  const int64_t sent =
      std::accumulate(input_split_sizes.begin(), input_split_sizes.end(), int64_t{0});
  EMBER_CHECK(sent == t.size(0), "[all_to_all_single] input_split_sizes add up to ", sent,
              " rows, but the input has ", t.size(0), " (shape ", t.shape(), ")");
  check_sizes(output_split_sizes, "output_split_sizes", t.size(0));
  const int me = group->rank();
  EMBER_CHECK(output_split_sizes[me] == input_split_sizes[me], "[all_to_all_single] rank ", me,
              " sends itself ", input_split_sizes[me], " rows but expects to receive ",
              output_split_sizes[me]);
  return AllToAllSingleFn::apply(t, std::move(output_split_sizes), std::move(input_split_sizes),
                                 std::move(group));
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
