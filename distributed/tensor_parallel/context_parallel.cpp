#include <ember/distributed/tensor_parallel/context_parallel.h>

#include <numeric>
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

// One chunk of queries' attention over the key blocks it has seen so far, in float32 (float64
// for float64 operands): each block's fused output weighted by its logsumexp's share.
struct Running {
  Tensor out, lse;

  void add(const AttentionForward& f, Dtype acc) {
    const Tensor o = f.out.to(acc), l = f.lse.to(acc);
    if (!out.defined()) {
      out = o;
      lse = l;
      return;
    }
    // Every row sees at least its own key first, so both logsumexps are finite.
    const Tensor m = maximum(lse, l);
    const Tensor merged = m + log(exp(lse - m) + exp(l - m));
    out = out * exp(lse - merged).unsqueeze(-1) + o * exp(l - merged).unsqueeze(-1);
    lse = merged;
  }
};

Dtype accumulation_dtype(const Tensor& q) { return q.dtype() == kFloat64 ? kFloat64 : kFloat32; }

// A part of the local queries that one set of rules covers: a chunk (causal), or all of them.
struct QueryPiece {
  int64_t chunk, at, length;
};

std::vector<QueryPiece> query_pieces(const std::vector<int64_t>& chunks, int64_t tc, bool causal) {
  if (!causal) return {{0, 0, tc * static_cast<int64_t>(chunks.size())}};
  std::vector<QueryPiece> out;
  for (size_t i = 0; i < chunks.size(); ++i)
    out.push_back({chunks[i], static_cast<int64_t>(i) * tc, tc});
  return out;
}

// The keys of a block (holding the global chunks `kchunks`, in its local order: the whole
// sequence, or a rotated rank's part) a piece of queries sees: an earlier chunk whole, its own
// chunk causally, a later one not at all; neighbouring whole chunks in one call.
std::vector<KeyBlock> visible(const QueryPiece& p, const std::vector<int64_t>& kchunks, int64_t tc,
                              bool causal) {
  const int64_t n = static_cast<int64_t>(kchunks.size());
  if (!causal) return {{0, n * tc, false}};
  std::vector<KeyBlock> out;
  for (int64_t i = 0; i < n; ++i) {
    if (kchunks[i] > p.chunk) continue;
    const bool diagonal = kchunks[i] == p.chunk;
    if (!diagonal && !out.empty() && !out.back().causal &&
        out.back().begin + out.back().length == i * tc) {
      out.back().length += tc;
      continue;
    }
    out.push_back({i * tc, tc, diagonal});
  }
  return out;
}

// What the local queries attend over in one block of keys and values (their global chunks
// `kchunks`), through the fused kernels, for forward and backward alike.
struct BlockAttention {
  const Tensor& q;
  const std::vector<QueryPiece>& pieces;
  int64_t tc;
  bool causal;
  std::optional<double> scale;
  Dtype acc;

  // Adds the block's visible keys to each piece's running attention.
  void forward(const Tensor& k, const Tensor& v, const std::vector<int64_t>& kchunks,
               std::vector<Running>& running) const {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Tensor qp = q.narrow(-2, pieces[i].at, pieces[i].length);
      for (const KeyBlock& b : visible(pieces[i], kchunks, tc, causal))
        running[i].add(
            scaled_dot_product_attention_forward(qp, k.narrow(-2, b.begin, b.length),
                                                 v.narrow(-2, b.begin, b.length), b.causal, scale),
            acc);
    }
  }

  // The block's exact share of the gradients, given the combined output and logsumexp (Note
  // [Fused attention]): added to each piece's dq and to the block's dk and dv (in `acc`).
  void backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& k,
                const Tensor& v, const std::vector<int64_t>& kchunks, std::vector<Tensor>& dq,
                Tensor& dk, Tensor& dv) const {
    for (size_t i = 0; i < pieces.size(); ++i) {
      const QueryPiece& p = pieces[i];
      const Tensor qp = q.narrow(-2, p.at, p.length), dp = dout.narrow(-2, p.at, p.length);
      const Tensor op = out.narrow(-2, p.at, p.length), lp = lse.narrow(-1, p.at, p.length);
      for (const KeyBlock& b : visible(p, kchunks, tc, causal)) {
        const AttentionGrads gr = scaled_dot_product_attention_backward(
            dp, qp, k.narrow(-2, b.begin, b.length), v.narrow(-2, b.begin, b.length), op, lp,
            b.causal, scale);
        const Tensor g_q = gr.dq.to(acc);
        dq[i] = dq[i].defined() ? dq[i] + g_q : g_q;
        dk.narrow(-2, b.begin, b.length).add_(gr.dk.to(acc));
        dv.narrow(-2, b.begin, b.length).add_(gr.dv.to(acc));
      }
    }
  }
};

// The pieces' combined output [..., L, Ev] and logsumexp [..., L], in local order.
std::pair<Tensor, Tensor> combined(const std::vector<Running>& running) {
  std::vector<Tensor> outs, lses;
  for (const Running& r : running) {
    outs.push_back(r.out);
    lses.push_back(r.lse);
  }
  if (outs.size() == 1) return {outs[0], lses[0]};
  return {cat(outs, -2), cat(lses, -1)};
}

Tensor cat_pieces(const std::vector<Tensor>& parts) {
  return parts.size() == 1 ? parts[0] : cat(parts, -2);
}

// Attention of the local query chunks over the whole sequence's keys and values (in sequence
// order), with no communication: each chunk's blocks through the fused forward, combined by
// their logsumexps; backward runs each block's fused backward with the combined output and
// logsumexp.
struct ChunkAttention : autograd::Function<ChunkAttention> {
  struct State {
    std::vector<int64_t> chunks;
    int64_t tc = 0;
    bool causal = true;
    std::optional<double> scale;
  };

  // The global chunks of the whole sequence, in order.
  static std::vector<int64_t> all_chunks(const Tensor& k, int64_t tc) {
    std::vector<int64_t> c(static_cast<size_t>(k.size(-2) / tc));
    std::iota(c.begin(), c.end(), int64_t{0});
    return c;
  }

  static Tensor forward(autograd::Context* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& chunks, int64_t tc, bool causal,
                        std::optional<double> scale) {
    // Combined in float32 (float64 operands in float64): the blocks' outputs may be float16.
    const std::vector<QueryPiece> pieces = query_pieces(chunks, tc, causal);
    std::vector<Running> running(pieces.size());
    BlockAttention{q, pieces, tc, causal, scale, accumulation_dtype(q)}.forward(
        k, v, all_chunks(k, tc), running);
    const auto [out, lse] = combined(running);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->state<State>() = {chunks, tc, causal, scale};
    return out.to(q.dtype());
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const autograd::TensorList s = ctx->saved();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const State& st = ctx->state<State>();
    // Summed over the blocks in float32 (float64 for float64), rounded once.
    const Dtype acc = accumulation_dtype(q);
    const std::vector<QueryPiece> pieces = query_pieces(st.chunks, st.tc, st.causal);
    Tensor dk = zeros(k.shape(), TensorOptions(acc).device(k.device()));
    Tensor dv = zeros(v.shape(), TensorOptions(acc).device(v.device()));
    std::vector<Tensor> dq(pieces.size());
    BlockAttention{q, pieces, st.tc, st.causal, st.scale, acc}.backward(
        g[0], out, lse, k, v, all_chunks(k, st.tc), dq, dk, dv);
    return {cat_pieces(dq).to(q.dtype()), dk.to(k.dtype()), dv.to(v.dtype())};
  }
};

// Ring attention (Liu et al.; PyTorch's "alltoall" rotate method): the key and value blocks go
// round the ring, each rank attending its queries over the block it holds while the next one
// arrives; backward sends them round again, each block's key and value gradients travelling
// with it and arriving home complete after the last hop. No rank ever holds more than two
// ranks' blocks (and saves only its own), against the whole sequence's keys and values for the
// all-gather.
struct RingAttention : autograd::Function<RingAttention> {
  struct State {
    std::shared_ptr<ProcessGroup> group;
    bool balanced = true, causal = true;
    std::optional<double> scale;
  };

  // The sends of this rank's block on (to rank + 1) and the receives of the next one (from
  // rank - 1), tags apart from the gradients'.
  static std::vector<WorkPtr> rotate(ProcessGroup& g, const std::vector<Tensor>& send,
                                     std::vector<Tensor>& recv, int first_tag) {
    const int next = (g.rank() + 1) % g.size(), prev = (g.rank() + g.size() - 1) % g.size();
    std::vector<P2POp> ops;
    for (size_t i = 0; i < send.size(); ++i) {
      recv.push_back(empty_like(send[i]));
      ops.push_back(P2POp::isend(send[i], next, first_tag + static_cast<int>(i)));
      ops.push_back(P2POp::irecv(recv[i], prev, first_tag + static_cast<int>(i)));
    }
    return g.batch_isend_irecv(ops);
  }

  static void wait_all(std::vector<WorkPtr>& works) {
    for (auto& w : works) w->wait();
    works.clear();
  }

  static Tensor forward(autograd::Context* ctx, const Tensor& q, const Tensor& k_in,
                        const Tensor& v_in, std::shared_ptr<ProcessGroup> group, bool balanced,
                        bool causal, std::optional<double> scale) {
    // Sent as they are: a head split leaves them strided, which gloo and MPI do not send.
    const Tensor k = k_in.contiguous(), v = v_in.contiguous();
    const int n = group->size(), rank = group->rank();
    const int64_t per = balanced ? 2 : 1, tc = q.size(-2) / per;
    const std::vector<QueryPiece> pieces = query_pieces(chunks_of(rank, n, balanced), tc, causal);
    const BlockAttention attend{q, pieces, tc, causal, scale, accumulation_dtype(q)};
    std::vector<Running> running(pieces.size());
    std::vector<Tensor> block = {k, v};
    for (int step = 0; step < n; ++step) {
      std::vector<Tensor> next;
      std::vector<WorkPtr> works;
      if (step + 1 < n) works = rotate(*group, block, next, 0);
      attend.forward(block[0], block[1], chunks_of((rank - step + n) % n, n, balanced), running);
      wait_all(works);
      block = std::move(next);
    }
    const auto [out, lse] = combined(running);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->state<State>() = {std::move(group), balanced, causal, scale};
    return out.to(q.dtype());
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList g) {
    const autograd::TensorList s = ctx->saved();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const State& st = ctx->state<State>();
    ProcessGroup& group = *st.group;
    const int n = group.size(), rank = group.rank();
    const int64_t per = st.balanced ? 2 : 1, tc = q.size(-2) / per;
    const Dtype acc = accumulation_dtype(q);
    const std::vector<QueryPiece> pieces =
        query_pieces(chunks_of(rank, n, st.balanced), tc, st.causal);
    const BlockAttention attend{q, pieces, tc, st.causal, st.scale, acc};
    std::vector<Tensor> dq(pieces.size());
    std::vector<Tensor> block = {k, v};
    // The gradients of the block in hand, summed over the ranks it has visited; they move on
    // after this rank's share is added, so their sends and the next block's receives overlap
    // the next block's computation.
    std::vector<Tensor> incoming;
    std::vector<WorkPtr> grad_works, grad_sends;
    std::vector<Tensor> grad_sent;
    for (int step = 0; step < n; ++step) {
      std::vector<Tensor> next;
      std::vector<WorkPtr> works;
      if (step + 1 < n) works = rotate(group, block, next, 0);
      Tensor dk = zeros(k.shape(), TensorOptions(acc).device(k.device()));
      Tensor dv = zeros(v.shape(), TensorOptions(acc).device(v.device()));
      attend.backward(g[0], out, lse, block[0], block[1],
                      chunks_of((rank - step + n) % n, n, st.balanced), dq, dk, dv);
      if (step > 0) {
        wait_all(grad_works);
        dk.add_(incoming[0]);
        dv.add_(incoming[1]);
        incoming.clear();  // before the next ones' buffers are made
      }
      // The previous block's gradients left during this block's computation.
      wait_all(grad_sends);
      grad_sent.clear();
      std::vector<Tensor> arrived;
      std::vector<WorkPtr> both = rotate(group, {dk, dv}, arrived, 2);
      // Sends and receives alternate in `both`: the receives are waited for at the next step
      // (or after the loop), the sends before this step's tensors are released.
      grad_sends = {both[0], both[2]};
      grad_works = {both[1], both[3]};
      grad_sent = {dk, dv};
      incoming = std::move(arrived);
      wait_all(works);
      block = std::move(next);
    }
    // After n hops each block's gradients are back with their owner, complete.
    wait_all(grad_works);
    wait_all(grad_sends);
    return {cat_pieces(dq).to(q.dtype()), incoming[0].to(k.dtype()), incoming[1].to(v.dtype())};
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
  const int size = group->size();
  if (o.rotate == ContextParallelRotate::Ring && size > 1)
    return RingAttention::apply(q, k, v, group, o.load_balance, o.is_causal, o.scale);
  // Keys and values in an all-gather each: gathered side by side in one, each block of them
  // would be read at twice its row stride, which cost the CPU kernels more than the second
  // collective saves (docs/benchmarks.md, "Context parallelism").
  const int64_t d = q.dim() - 2;
  const Tensor kg = context_parallel_unshard(k, d, group, o.load_balance);
  const Tensor vg = context_parallel_unshard(v, d, group, o.load_balance);
  return ChunkAttention::apply(q, kg, vg, chunks_of(group->rank(), size, o.load_balance),
                               q.size(-2) / per, o.is_causal, o.scale);
}

}  // namespace ember::dist
