// Note [fused sequence-parallel linears]
// Under sequence parallelism a column-parallel Linear all-gathers its input on the sequence and
// a row-parallel one reduce-scatters its output (Megatron's g and its conjugate). Done as
// redistribute + linear, autograd keeps the gathered input for the weight's gradient: a whole
// [B, T, C] per column-parallel layer, which is what sequence parallelism set out to cut.
// Fused, the column-parallel layer keeps its shard and gathers it again in backward (Megatron
// does the same), and both layers can overlap their collective with the matmul next to it
// (PyTorch's async tensor parallelism, there on CUDA with symmetric memory; here over any
// backend): the batch is cut into `chunks` pieces, every piece's collective is issued at once
// (backends run them in issue order on their own threads), and piece i's matmul runs while the
// later pieces' collectives are in flight. Backward overlaps the same way: the input-gradient
// matmul of piece i with its reduce-scatter, the weight gradient with the re-gather.
#include <ember/distributed/tensor_parallel/detail/fused_linear.h>

#include <vector>

#include <ember/autograd/function.h>
#include <ember/nn/functional.h>
#include <ember/tensor/autocast.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops.h>

namespace ember::dist::detail {

namespace {

using autograd::Context;
using autograd::TensorList;

// A collective in flight and where its result lands (dimension d first).
struct Pending {
  WorkPtr work;
  Tensor out;
  int64_t dim;
  Tensor result() {
    work->wait();
    return out.movedim(0, dim).contiguous();
  }
};

Pending issue_gather(const Tensor& piece, int64_t d, ProcessGroup& g) {
  const Tensor in = piece.movedim(d, 0).contiguous();
  Shape s = in.shape();
  s[0] *= g.size();
  Pending p{nullptr, empty(s, in.options()), d};
  p.work = g.allgather_into_tensor(p.out, in);
  return p;
}

Pending issue_scatter(const Tensor& piece, int64_t d, ProcessGroup& g) {
  const Tensor in = piece.movedim(d, 0).contiguous();
  Shape s = in.shape();
  s[0] /= g.size();
  Pending p{nullptr, empty(s, in.options()), d};
  p.work = g.reduce_scatter_tensor(p.out, in);
  return p;
}

std::vector<Pending> issue_gathers(const std::vector<Tensor>& pieces, int64_t d, ProcessGroup& g) {
  std::vector<Pending> out;
  for (const Tensor& p : pieces) out.push_back(issue_gather(p, d, g));
  return out;
}

// [..., n] as rows [-1, n].
Tensor rows(const Tensor& t) { return t.reshape({-1, t.size(-1)}); }

struct State {
  std::shared_ptr<ProcessGroup> group;
  int64_t dim = 1;
  int64_t chunks = 1;
  bool has_bias = false;
  bool first = true;  // linear_reduce_scatter: this rank adds the bias
};

struct AllGatherLinearFn : autograd::Function<AllGatherLinearFn> {
  static Tensor forward(Context* ctx, const Tensor& x, const Tensor& w, const Tensor& b, State s) {
    ctx->save_for_backward({x, w});
    s.has_bias = b.defined();
    ctx->state<State>() = s;
    std::vector<Pending> gathers = issue_gathers(chunk(x, s.chunks, 0), s.dim, *s.group);
    std::vector<Tensor> ys;
    for (Pending& p : gathers) ys.push_back(nn::functional::linear(p.result(), w, b));
    return ys.size() == 1 ? ys[0] : cat(ys, 0);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const State& s = ctx->state<State>();
    const TensorList saved = ctx->saved();
    const Tensor &x = saved[0], &w = saved[1];
    // The input again, gathered piece by piece behind the input-gradient matmuls.
    std::vector<Pending> gathers = issue_gathers(chunk(x, s.chunks, 0), s.dim, *s.group);
    const std::vector<Tensor> gs = chunk(grads[0], s.chunks, 0);
    std::vector<Pending> scatters;
    Tensor gw = zeros_like(w);
    for (size_t i = 0; i < gs.size(); ++i) {
      scatters.push_back(issue_scatter(ember::matmul(gs[i], w), s.dim, *s.group));
      gw.add_(ember::matmul(rows(gs[i]).transpose(0, 1), rows(gathers[i].result())));
    }
    std::vector<Tensor> gx;
    for (Pending& p : scatters) gx.push_back(p.result());
    Tensor gb;
    if (s.has_bias) gb = rows(grads[0]).sum({0});
    return {gx.size() == 1 ? gx[0] : cat(gx, 0), gw, gb};
  }
};

struct LinearReduceScatterFn : autograd::Function<LinearReduceScatterFn> {
  static Tensor forward(Context* ctx, const Tensor& x, const Tensor& w, const Tensor& b, State s) {
    ctx->save_for_backward({x, w});
    s.has_bias = b.defined();
    ctx->state<State>() = s;
    std::vector<Pending> scatters;
    for (const Tensor& xi : chunk(x, s.chunks, 0)) {
      // The bias goes in once: on the first rank, before the parts are summed.
      scatters.push_back(
          issue_scatter(nn::functional::linear(xi, w, s.first ? b : Tensor()), s.dim, *s.group));
    }
    std::vector<Tensor> ys;
    for (Pending& p : scatters) ys.push_back(p.result());
    return ys.size() == 1 ? ys[0] : cat(ys, 0);
  }
  static TensorList backward(Context* ctx, TensorList grads) {
    const State& s = ctx->state<State>();
    const TensorList saved = ctx->saved();
    const Tensor &x = saved[0], &w = saved[1];
    std::vector<Pending> gathers = issue_gathers(chunk(grads[0], s.chunks, 0), s.dim, *s.group);
    const std::vector<Tensor> xs = chunk(x, s.chunks, 0);
    Tensor gw = zeros_like(w);
    Tensor gb = s.has_bias ? zeros({w.size(0)}, w.options()) : Tensor();
    std::vector<Tensor> gx;
    for (size_t i = 0; i < xs.size(); ++i) {
      const Tensor g = gathers[i].result();  // the whole sequence's gradient of this piece
      gx.push_back(ember::matmul(g, w));
      gw.add_(ember::matmul(rows(g).transpose(0, 1), rows(xs[i])));
      if (gb.defined()) gb.add_(rows(g).sum({0}));
    }
    return {gx.size() == 1 ? gx[0] : cat(gx, 0), gw, gb};
  }
};

void check(const char* op, const Tensor& x, int64_t dim, const ProcessGroup& g, int64_t chunks,
           bool gathers) {
  EMBER_CHECK(dim > 0 && dim < x.dim(), "[", op, "] the sequence dim ", dim,
              " must be a dim after the batch's of ", x.shape());
  EMBER_CHECK(chunks >= 1, "[", op, "] chunks must be >= 1, got ", chunks);
  if (!gathers) {
    EMBER_CHECK(x.size(dim) % g.size() == 0, "[", op, "] the sequence (", x.size(dim),
                ") must divide evenly over the group's ", g.size(), " ranks");
  }
}

}  // namespace

Tensor all_gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                         std::shared_ptr<ProcessGroup> group, int64_t dim, int64_t chunks) {
  check("all_gather_linear", x, dim, *group, chunks, true);
  // Under autocast the matmuls (and so the collectives) run in the low precision, as linear's.
  if (auto ac = ::ember::detail::autocast_inputs(AutocastPolicy::kLowPrecision, x, weight, bias)) {
    return all_gather_linear(ac[0], ac[1], ac[2], std::move(group), dim, chunks);
  }
  return AllGatherLinearFn::apply(x, weight, bias, State{group, dim, chunks});
}

Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             std::shared_ptr<ProcessGroup> group, int64_t dim, int64_t chunks) {
  check("linear_reduce_scatter", x, dim, *group, chunks, false);
  if (auto ac = ::ember::detail::autocast_inputs(AutocastPolicy::kLowPrecision, x, weight, bias)) {
    return linear_reduce_scatter(ac[0], ac[1], ac[2], std::move(group), dim, chunks);
  }
  State s{group, dim, chunks};
  s.first = group->rank() == 0;
  return LinearReduceScatterFn::apply(x, weight, bias, s);
}

}  // namespace ember::dist::detail
