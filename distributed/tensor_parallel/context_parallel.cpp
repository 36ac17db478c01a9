#include <ember/distributed/tensor_parallel/context_parallel.h>

#include <string>
#include <vector>

#include <ember/autograd/function.h>
#include <ember/distributed/functional/collectives.h>
#include <ember/tensor/ops/attention_parts.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/ops/indexing.h>

namespace ember::dist {

namespace {

// The sequence's chunks: 2 x size (load-balanced) or size.
int64_t chunk_count(int size, bool balanced) { return balanced ? 2 * int64_t{size} : size; }

// The global chunks `rank` holds, in its local order.
std::vector<int64_t> chunks_of(int rank, int size, bool balanced) {
  if (!balanced) return {rank};
  return {rank, 2 * int64_t{size} - 1 - rank};
}

int64_t wrap_dim(const char* op, const Tensor& t, int64_t dim) {
  const int64_t n = t.dim();
  EMBER_CHECK(dim >= -n && dim < n, "[", op, "] dim ", dim, " is out of range for a tensor of ", n,
              " dims");
  return dim < 0 ? dim + n : dim;
}

// One block of keys a chunk of queries attends over: [begin, begin + length), causally (the
// diagonal block, top-left aligned) or whole.
struct KeyBlock {
  int64_t begin, length;
  bool causal;
};

// Query chunk c (of `tc` positions) sees every key before it whole and its own chunk causally,
// or, without causality, every key.
std::vector<KeyBlock> blocks_of(int64_t c, int64_t tc, int64_t total, bool causal) {
  if (!causal) return {{0, total, false}};
  std::vector<KeyBlock> out;
  if (c > 0) out.push_back({0, c * tc, false});
  out.push_back({c * tc, tc, true});
  return out;
}

// Attention of the local query chunks over the whole sequence's keys and values (in sequence
// order), with no communication: each chunk's blocks through the fused forward, combined by
// their logsumexps; backward runs each block's fused backward with the combined output and
// logsumexp, which gives its exact share (Note [Fused attention]).
struct ChunkAttention : autograd::Function<ChunkAttention> {
  struct State {
    std::vector<int64_t> chunks;
    int64_t tc = 0;
    bool causal = true;
    std::optional<double> scale;
  };

  static Tensor forward(autograd::Context* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& chunks, int64_t tc, bool causal,
                        std::optional<double> scale) {
    // Combined in float32 (float64 operands in float64): the blocks' outputs may be float16.
    const Dtype acc = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
    const int64_t total = k.size(-2);
    std::vector<Tensor> outs, lses;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const Tensor qc = q.narrow(-2, static_cast<int64_t>(i) * tc, tc);
      Tensor out, lse;
      for (const KeyBlock& b : blocks_of(chunks[i], tc, total, causal)) {
        const AttentionForward f = scaled_dot_product_attention_forward(
            qc, k.narrow(-2, b.begin, b.length), v.narrow(-2, b.begin, b.length), b.causal, scale);
        const Tensor o = f.out.to(acc), l = f.lse.to(acc);
        if (!out.defined()) {
          out = o;
          lse = l;
          continue;
        }
        // Every row sees at least its own key, so both logsumexps are finite.
        const Tensor m = maximum(lse, l);
        const Tensor merged = m + log(exp(lse - m) + exp(l - m));
        out = out * exp(lse - merged).unsqueeze(-1) + o * exp(l - merged).unsqueeze(-1);
        lse = merged;
      }
      outs.push_back(out);
      lses.push_back(lse);
    }
    const Tensor out = cat(outs, -2), lse = cat(lses, -1);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->state<State>() = {chunks, tc, causal, scale};
    return out.to(q.dtype());
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const autograd::TensorList s = ctx->saved();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const State& st = ctx->state<State>();
    const int64_t total = k.size(-2), tc = st.tc;
    // Summed over the blocks in float32 (float64 for float64), rounded once.
    const Dtype acc = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
    Tensor dk = zeros(k.shape(), TensorOptions(acc).device(k.device()));
    Tensor dv = zeros(v.shape(), TensorOptions(acc).device(v.device()));
    std::vector<Tensor> dqs;
    for (size_t i = 0; i < st.chunks.size(); ++i) {
      const int64_t at = static_cast<int64_t>(i) * tc;
      const Tensor qc = q.narrow(-2, at, tc), dout = g[0].narrow(-2, at, tc);
      const Tensor oc = out.narrow(-2, at, tc), lc = lse.narrow(-1, at, tc);
      Tensor dq;
      for (const KeyBlock& b : blocks_of(st.chunks[i], tc, total, st.causal)) {
        const AttentionGrads gr = scaled_dot_product_attention_backward(
            dout, qc, k.narrow(-2, b.begin, b.length), v.narrow(-2, b.begin, b.length), oc, lc,
            b.causal, st.scale);
        const Tensor g_q = gr.dq.to(acc);
        dq = dq.defined() ? dq + g_q : g_q;
        dk.narrow(-2, b.begin, b.length).add_(gr.dk.to(acc));
        dv.narrow(-2, b.begin, b.length).add_(gr.dv.to(acc));
      }
      dqs.push_back(dq);
    }
    return {cat(dqs, -2).to(q.dtype()), dk.to(k.dtype()), dv.to(v.dtype())};
  }
};

}  // namespace

Tensor context_parallel_shard(const Tensor& t, int64_t dim, int rank, int size, bool load_balance) {
  constexpr const char* kOp = "context_parallel_shard";
  EMBER_CHECK(t.defined(), "[", kOp, "] expected a tensor, got an undefined one");
  EMBER_CHECK(size >= 1 && rank >= 0 && rank < size, "[", kOp, "] expected a rank in [0, ", size,
              "), got ", rank);
  const int64_t d = wrap_dim(kOp, t, dim), n = chunk_count(size, load_balance);
  EMBER_CHECK(t.size(d) % n == 0, "[", kOp, "] dim ", dim, " of size ", t.size(d),
              " does not divide into ", n, " chunks (", size, " ranks",
              load_balance ? ", two chunks each for the load balance" : "", ")");
  const int64_t tc = t.size(d) / n;
  std::vector<Tensor> parts;
  for (int64_t c : chunks_of(rank, size, load_balance)) parts.push_back(t.narrow(d, c * tc, tc));
  return parts.size() == 1 ? parts[0] : cat(parts, d);
}

Tensor context_parallel_unshard(const Tensor& local, int64_t dim,
                                std::shared_ptr<ProcessGroup> group, bool load_balance) {
  constexpr const char* kOp = "context_parallel_unshard";
  EMBER_CHECK(group != nullptr, "[", kOp, "] expected a process group, got null");
  EMBER_CHECK(local.defined(), "[", kOp, "] expected a tensor, got an undefined one");
  const int size = group->size();
  const int64_t d = wrap_dim(kOp, local, dim), per = load_balance ? 2 : 1;
  EMBER_CHECK(local.size(d) % per == 0, "[", kOp, "] dim ", dim, " of size ", local.size(d),
              " does not hold the two chunks of a load-balanced part");
  const int64_t tc = local.size(d) / per;
  // The ranks' parts in rank order, then the chunks in sequence order.
  const Tensor parts = functional::all_gather(local, d, group);
  std::vector<Tensor> chunks;
  for (int64_t c = 0; c < chunk_count(size, load_balance); ++c) {
    const int64_t owner = c < size ? c : 2 * int64_t{size} - 1 - c, slot = c < size ? 0 : 1;
    chunks.push_back(parts.narrow(d, (owner * per + slot) * tc, tc));
  }
  return cat(chunks, d);
}

Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                  std::shared_ptr<ProcessGroup> group,
                                  const ContextParallelOptions& o) {
  constexpr const char* kOp = "context_parallel_attention";
  EMBER_CHECK(group != nullptr, "[", kOp, "] expected a process group, got null");
  EMBER_CHECK(q.defined() && k.defined() && v.defined(), "[", kOp,
              "] expected query, key and value, got an undefined tensor");
  EMBER_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim() &&
                  k.size(-2) == q.size(-2) && v.size(-2) == q.size(-2),
              "[", kOp,
              "] expected query, key and value of one rank >= 2 holding this rank's part of one "
              "sequence (the same length along dim -2), got ",
              q.shape(), ", ", k.shape(), " and ", v.shape());
  const int64_t per = o.load_balance ? 2 : 1;
  EMBER_CHECK(q.size(-2) % per == 0 && q.size(-2) > 0, "[", kOp, "] this rank's part of ",
              q.size(-2), " positions ",
              o.load_balance ? "does not hold the two equal chunks of a load-balanced part "
                               "(context_parallel_shard with load_balance)"
                             : "is empty");
  // Keys and values in an all-gather each: gathered side by side in one, each block of them
  // would be read at twice its row stride, which cost the CPU kernels more than the second
  // collective saves (docs/benchmarks.md, "Context parallelism").
  const int64_t d = q.dim() - 2;
  const Tensor kg = context_parallel_unshard(k, d, group, o.load_balance);
  const Tensor vg = context_parallel_unshard(v, d, group, o.load_balance);
  return ChunkAttention::apply(q, kg, vg, chunks_of(group->rank(), group->size(), o.load_balance),
                               q.size(-2) / per, o.is_causal, o.scale);
}

}  // namespace ember::dist
