// CPU reductions (Note [Reduction geometry], Note [Reduction functors] in
// detail/reduce_kernels.h).
//
// Note [CPU pairwise reduction]
// A dense run is reduced by `reduce_run`: runs longer than kPairwiseBlock are split in halves
// recursively; shorter ones are folded into kLanes independent accumulators (which the compiler
// keeps in SIMD registers) and the lanes are combined as a tree. Rounding error therefore grows
// like log(n) rather than n, at the speed of a plain vector loop. Outer reductions (reduced
// dims above a dense kept dim) do the same over rows: blocks of kRowBlock rows are accumulated
// into a tile of outputs and blocks are combined pairwise through per-level scratch tiles.
// Full reductions are split into fixed kChunk pieces reduced in parallel and combined as a tree,
// so the result does not depend on the number of threads.
// Like PyTorch's build (-fno-trapping-math): lets GCC turn the NaN-aware selects of max/min and
// exp into branch-free vector code. Must precede every include so inlined helpers match.
#pragma GCC optimize("no-trapping-math")

#include <algorithm>
#include <memory>
#include <vector>

#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

// Leaves this long amortise the lane set-up and fold (shorter ones make sums measurably
// slower); each lane still adds only 8192 / kLanes values sequentially.
constexpr int64_t kPairwiseBlock = 8192;
constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kColTile = 1024;
constexpr int64_t kRowBlock = 8;

// Independent accumulators per dense run: 128 bytes of float or double lanes (8 SSE or 4 AVX
// registers), 64 for bytes.
template <typename A>
constexpr int kLanes = sizeof(A) == 1 ? 64 : 128 / static_cast<int>(sizeof(A));

// Folds x[0..n) into the L lane accumulators acc[0..L) (Note [CPU pairwise reduction]). The
// lanes are only combined with each other at the very end, in reduce_run, so the per-block cost
// is a handful of vector ops.
template <typename Red, typename T>
EMBER_SIMD_CLONES void reduce_leaf(const T* x, int64_t n, const Red& r, typename Red::acc ctx,
                                   typename Red::acc* acc) {
  using A = typename Red::acc;
  constexpr int L = kLanes<A>;
  A a[L];
  for (int j = 0; j < L; ++j) a[j] = r.identity();
  int64_t i = 0;
  if constexpr (requires { Red::kSelect; }) {
    for (; i + L <= n; i += L) {
      // Not unrolled before vectorisation: the loop vectoriser turns the NaN-aware selects of
      // max/min into blends, where unrolled straight-line code would keep them as branches.
#pragma GCC unroll 1
      for (int j = 0; j < L; ++j) a[j] = r.combine(a[j], r.map(x[i + j], ctx));
    }
  } else {
    // Unrolled, so the lanes live in registers.
    for (; i + L <= n; i += L) {
      for (int j = 0; j < L; ++j) a[j] = r.combine(a[j], r.map(x[i + j], ctx));
    }
  }
  for (int j = 0; i + j < n; ++j) a[j] = r.combine(a[j], r.map(x[i + j], ctx));
  for (int j = 0; j < L; ++j) acc[j] = a[j];
}

// Folds x[0..n) into the L lane accumulators acc[0..L) (Note [CPU pairwise reduction]). The
// lanes are only combined with each other at the very end, in reduce_run, so the per-block cost
// is a handful of vector ops.
template <typename Red, typename T>
void reduce_lanes(const T* x, int64_t n, const Red& r, typename Red::acc ctx,
                  typename Red::acc* acc) {
  using A = typename Red::acc;
  constexpr int L = kLanes<A>;
  if (n > kPairwiseBlock) {
    const int64_t h = (n / 2 + L - 1) / L * L;
    A tmp[L];
    reduce_lanes(x, h, r, ctx, acc);
    reduce_lanes(x + h, n - h, r, ctx, tmp);
    for (int j = 0; j < L; ++j) acc[j] = r.combine(acc[j], tmp[j]);
    return;
  }
  reduce_leaf(x, n, r, ctx, acc);
}

template <typename Red, typename T>
typename Red::acc reduce_run(const T* x, int64_t n, const Red& r, typename Red::acc ctx) {
  using A = typename Red::acc;
  constexpr int L = kLanes<A>;
  A acc[L];
  reduce_lanes(x, n, r, ctx, acc);
  for (int w = L / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] = r.combine(acc[j], acc[j + w]);
  }
  return acc[0];
}

// Combines part[0..n) as a balanced tree into part[0].
template <typename Red, typename A>
A tree_combine(A* part, int64_t n, const Red& r) {
  for (int64_t w = 1; w < n; w *= 2) {
    for (int64_t c = 0; c + w < n; c += 2 * w) part[c] = r.combine(part[c], part[c + w]);
  }
  return part[0];
}

// Each output reduces one dense run.
template <typename Red, typename T, typename O>
void reduce_inner(const ReduceGeom& g, const T* in, O* out, const Red& r,
                  const typename Red::acc* ctx) {
  using A = typename Red::acc;
  const int64_t R = g.red_numel, M = g.num_out;
  if (M == 1 && R > kChunk) {
    const T* x = in + g.keep_offset(0);
    const A c0 = ctx ? ctx[0] : A{};
    const int64_t nchunks = (R + kChunk - 1) / kChunk;
    std::unique_ptr<A[]> part(new A[nchunks]);  // not vector: vector<bool> packs bits
    parallel_for(0, nchunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        part[c] = reduce_run(x + c * kChunk, std::min(kChunk, R - c * kChunk), r, c0);
      }
    });
    out[0] = r.template project<O>(tree_combine(part.get(), nchunks, r), c0);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(R, 1));
  parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const A c = ctx ? ctx[o] : A{};
      out[o] = r.template project<O>(reduce_run(in + g.keep_offset(o), R, r, c), c);
    }
  });
}

// acc[k] = rows[0][k] (+) rows[1][k] (+) ... in row order, four rows per sweep over acc.
template <bool kCtx, typename Red, typename T>
EMBER_SIMD_CLONES void accumulate_rows(const T* const* rows, int nrows, int64_t kn, const Red& r,
                                       const typename Red::acc* ctx, typename Red::acc* acc) {
  using A = typename Red::acc;
  for (int64_t k = 0; k < kn; ++k) acc[k] = r.identity();
  int i = 0;
  for (; i + 4 <= nrows; i += 4) {
    const T *x0 = rows[i], *x1 = rows[i + 1], *x2 = rows[i + 2], *x3 = rows[i + 3];
    for (int64_t k = 0; k < kn; ++k) {
      const A c = kCtx ? ctx[k] : A{};
      A a = r.combine(acc[k], r.map(x0[k], c));
      a = r.combine(a, r.map(x1[k], c));
      a = r.combine(a, r.map(x2[k], c));
      acc[k] = r.combine(a, r.map(x3[k], c));
    }
  }
  for (; i < nrows; ++i) {
    const T* x = rows[i];
    for (int64_t k = 0; k < kn; ++k) acc[k] = r.combine(acc[k], r.map(x[k], kCtx ? ctx[k] : A{}));
  }
}

// Rows [r0, r1) of the reduced dims, each a dense run of kn elements starting at
// base + red_offset(row), reduced into acc[0..kn) (Note [CPU pairwise reduction]).
template <typename Red, typename T>
void reduce_cols(const ReduceGeom& g, const T* base, int64_t r0, int64_t r1,
                 typename Red::acc* acc, typename Red::acc* scratch, int64_t kn, const Red& r,
                 const typename Red::acc* ctx) {
  if (r1 - r0 > kRowBlock) {
    const int64_t mid = r0 + (r1 - r0 + 1) / 2;
    reduce_cols(g, base, r0, mid, acc, scratch, kn, r, ctx);
    reduce_cols(g, base, mid, r1, scratch, scratch + kColTile, kn, r, ctx);
    for (int64_t k = 0; k < kn; ++k) acc[k] = r.combine(acc[k], scratch[k]);
    return;
  }
  const T* rows[kRowBlock];
  for (int64_t row = r0; row < r1; ++row) {
    rows[row - r0] = base + (g.nred == 1 ? row * g.red_strides[0] : g.red_offset(row));
  }
  if (ctx) {
    accumulate_rows<true>(rows, static_cast<int>(r1 - r0), kn, r, ctx, acc);
  } else {
    accumulate_rows<false>(rows, static_cast<int>(r1 - r0), kn, r, ctx, acc);
  }
}

// The innermost kept dim is dense: accumulate reduced rows into tiles of outputs.
template <typename Red, typename T, typename O>
void reduce_outer(const ReduceGeom& g, const T* in, O* out, const Red& r,
                  const typename Red::acc* ctx) {
  using A = typename Red::acc;
  const int64_t K = g.keep_sizes[g.nkeep - 1];
  const int64_t outer = g.num_out / K;
  const int64_t R = g.red_numel;
  const int64_t tiles = (K + kColTile - 1) / kColTile;
  ReduceGeom og = g;  // the kept dims above the dense one
  og.nkeep -= 1;
  int depth = 0;
  for (int64_t n = R; n > kRowBlock; n = (n + 1) / 2) ++depth;
  const int64_t grain =
      std::max<int64_t>(1, kGrainSize / std::max<int64_t>(R * std::min(K, kColTile), 1));
  parallel_for(0, outer * tiles, grain, [&](int64_t b, int64_t e) {
    std::unique_ptr<A[]> buf(new A[(depth + 2) * kColTile]);
    for (int64_t t = b; t < e; ++t) {
      const int64_t ob = t / tiles, k0 = (t % tiles) * kColTile;
      const int64_t kn = std::min(kColTile, K - k0);
      const T* base = in + og.keep_offset(ob) + k0;
      const A* c = ctx ? ctx + ob * K + k0 : nullptr;
      reduce_cols(g, base, 0, R, buf.get(), buf.get() + kColTile, kn, r, c);
      O* o = out + ob * K + k0;
      for (int64_t k = 0; k < kn; ++k) o[k] = r.template project<O>(buf[k], c ? c[k] : A{});
    }
  });
}

// Whether g reduces, per output, several dense runs of at least kMinRun elements: reduced dims
// on both sides of a kept one, as batch norm's statistics over N, H and W of [N, C, H, W].
constexpr int64_t kMinRun = 64;
bool runs_geometry(const ReduceGeom& g) {
  return g.num_out > 1 && g.nred >= 2 && g.red_strides[g.nred - 1] == 1 &&
         g.red_sizes[g.nred - 1] >= kMinRun;
}

// Every output reduces several dense runs (runs_geometry): each run as reduce_inner reduces
// one, the runs' results combined as a tree. Reads the input where it lies, where the permuted
// copy prepare_reduce would otherwise make costs a pass over the whole input.
template <typename Red, typename T, typename O>
void reduce_runs(const ReduceGeom& g, const T* in, O* out, const Red& r,
                 const typename Red::acc* ctx) {
  using A = typename Red::acc;
  const int64_t run = g.red_sizes[g.nred - 1];
  const int64_t runs = g.red_numel / run;
  ReduceGeom starts = g;  // the reduced dims above the run: where each run starts
  starts.nred -= 1;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(g.red_numel, 1));
  parallel_for(0, g.num_out, grain, [&](int64_t b, int64_t e) {
    std::unique_ptr<A[]> part(new A[runs]);  // not vector: vector<bool> packs bits
    for (int64_t o = b; o < e; ++o) {
      const T* base = in + g.keep_offset(o);
      const A c = ctx ? ctx[o] : A{};
      for (int64_t j = 0; j < runs; ++j) {
        part[j] = reduce_run(base + starts.red_offset(j), run, r, c);
      }
      out[o] = r.template project<O>(tree_combine(part.get(), runs, r), c);
    }
  });
}

template <typename Red, typename T, typename O>
void run_reduce(const ReduceGeom& g, const T* in, O* out, const Red& r,
                const typename Red::acc* ctx = nullptr) {
  if (g.num_out == 0) return;
  if (g.inner()) {
    reduce_inner(g, in, out, r, ctx);
  } else if (!g.outer() && runs_geometry(g)) {
    reduce_runs(g, in, out, r, ctx);
  } else {
    EMBER_INTERNAL_ASSERT(g.outer(), "reduction geometry is neither inner nor outer");
    reduce_outer(g, in, out, r, ctx);
  }
}

const char* kind_name(ReduceKind k) {
  switch (k) {
    case ReduceKind::Sum: return "sum";
    case ReduceKind::Prod: return "prod";
    case ReduceKind::Mean: return "mean";
    case ReduceKind::Max: return "max";
    case ReduceKind::Min: return "min";
    case ReduceKind::Any: return "any";
    case ReduceKind::All: return "all";
    case ReduceKind::Norm: return "norm";
    case ReduceKind::Var: return "var";
    case ReduceKind::LogSumExp: return "logsumexp";
  }
  return "reduce";
}

template <typename T>
using sum_out_t = std::conditional_t<std::is_integral_v<T>, int64_t, T>;

template <typename T>
void reduce_floating(ReduceKind kind, const Tensor& out, const ReduceGeom& g, const T* x,
                     const ReduceParams& params) {
  using A = acc_t<T>;
  T* o = out.data<T>();
  const int64_t M = g.num_out, R = g.red_numel;
  switch (kind) {
    case ReduceKind::Mean: {
      MeanOp<T> r;
      r.n = A(R);
      run_reduce(g, x, o, r);
      return;
    }
    case ReduceKind::Norm:
      with_norm_op<T>(params.p, [&](const auto& r) { run_reduce(g, x, o, r); });
      return;
    case ReduceKind::Var: {
      std::vector<A> mean(M);
      MeanOp<T> m;
      m.n = A(R);
      run_reduce(g, x, mean.data(), m);
      VarOp<T> v;
      v.divisor = A(std::max<int64_t>(0, R - params.correction));
      v.take_sqrt = params.take_sqrt;
      run_reduce(g, x, o, v, mean.data());
      return;
    }
    case ReduceKind::LogSumExp: {
      std::vector<A> m(M);
      run_reduce(g, x, m.data(), LseMaxOp<T>{});
      run_reduce(g, x, o, LseSumOp<T>{}, m.data());
      return;
    }
    default:
      EMBER_INTERNAL_ASSERT(false, "not a floating-only reduction");
  }
}

}  // namespace

void reduce_cpu(ReduceKind kind, const Tensor& out, const Tensor& in, uint32_t mask,
                const ReduceParams& params) {
  // Inner, outer and dense runs (reduce_runs) are read where they lie; other geometries are
  // copied into (kept, reduced) order first.
  ReduceInput p{in, make_reduce_geom(in, mask)};
  if (!p.g.inner() && !p.g.outer() && !runs_geometry(p.g)) p = prepare_reduce(in, mask);
  const ReduceGeom& g = p.g;
  EMBER_INTERNAL_ASSERT(out.is_contiguous() && out.numel() == g.num_out, "bad reduce output");
  const void* data = p.src.data_ptr();
  EMBER_DISPATCH_ALL(in.dtype(), kind_name(kind), [&]<typename T>() {
    const T* x = static_cast<const T*>(data);
    switch (kind) {
      case ReduceKind::Sum:
        run_reduce(g, x, out.data<sum_out_t<T>>(), SumOp<T>{});
        return;
      case ReduceKind::Prod:
        run_reduce(g, x, out.data<sum_out_t<T>>(), ProdOp<T>{});
        return;
      case ReduceKind::Max:
        run_reduce(g, x, out.data<T>(), MaxOp<T>{});
        return;
      case ReduceKind::Min:
        run_reduce(g, x, out.data<T>(), MinOp<T>{});
        return;
      case ReduceKind::Any:
        run_reduce(g, x, out.data<bool>(), AnyOp<T>{});
        return;
      case ReduceKind::All:
        run_reduce(g, x, out.data<bool>(), AllOp<T>{});
        return;
      default:
        if constexpr (std::is_floating_point_v<T> || is_reduced_float_v<T>) {
          reduce_floating(kind, out, g, x, params);
        } else {
          EMBER_INTERNAL_ASSERT(false, "floating-only reduction on ", in.dtype());
        }
    }
  });
}

// ---- argmax / argmin -------------------------------------------------------------------------

namespace {

template <bool kMax, typename T>
struct ArgResult {
  acc_t<T> v;
  int64_t i;
};

// Extreme of a dense run and the index of its first occurrence: a vectorised pass for the value,
// then a scan for where it first appears.
template <bool kMax, typename T>
ArgResult<kMax, T> arg_run(const T* x, int64_t n) {
  using A = acc_t<T>;
  A best;
  if constexpr (kMax) {
    best = reduce_run(x, n, MaxOp<T>{}, A{});
  } else {
    best = reduce_run(x, n, MinOp<T>{}, A{});
  }
  if (is_nan_v(best)) {
    for (int64_t i = 0; i < n; ++i) {
      if (is_nan_v(convert<A>(x[i]))) return {best, i};
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (convert<A>(x[i]) == best) return {best, i};
  }
  return {best, 0};  // unreachable for n > 0
}

template <bool kMax, typename T>
void arg_inner(const ReduceGeom& g, const T* in, T* values, int64_t* indices) {
  const int64_t R = g.red_numel, M = g.num_out;
  if (M == 1 && R > kChunk) {
    const T* x = in + g.keep_offset(0);
    const int64_t nchunks = (R + kChunk - 1) / kChunk;
    std::vector<ArgResult<kMax, T>> part(nchunks);
    parallel_for(0, nchunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        part[c] = arg_run<kMax>(x + c * kChunk, std::min(kChunk, R - c * kChunk));
        part[c].i += c * kChunk;
      }
    });
    ArgResult<kMax, T> best = part[0];
    for (int64_t c = 1; c < nchunks; ++c) {
      if (arg_better<kMax>(part[c].v, best.v)) best = part[c];
    }
    if (values) values[0] = convert<T>(best.v);
    indices[0] = best.i;
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainSize / R);
  parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      const ArgResult<kMax, T> res = arg_run<kMax>(in + g.keep_offset(o), R);
      if (values) values[o] = convert<T>(res.v);
      indices[o] = res.i;
    }
  });
}

// Best value and its row for each of kn columns of R rows (row stride rs).
template <bool kMax, typename T>
EMBER_SIMD_CLONES void arg_cols(const T* base, int64_t R, int64_t rs, int64_t kn, acc_t<T>* bv,
                                int64_t* bi) {
  using A = acc_t<T>;
  for (int64_t k = 0; k < kn; ++k) {
    bv[k] = convert<A>(base[k]);
    bi[k] = 0;
  }
  for (int64_t r = 1; r < R; ++r) {
    const T* x = base + r * rs;
    for (int64_t k = 0; k < kn; ++k) {
      const A v = convert<A>(x[k]);
      const bool better = arg_better<kMax>(v, bv[k]);
      bv[k] = better ? v : bv[k];
      bi[k] = better ? r : bi[k];
    }
  }
}

// The reduced dim lies above a dense kept dim: track the best value and index per column.
template <bool kMax, typename T>
void arg_outer(const ReduceGeom& g, const T* in, T* values, int64_t* indices) {
  using A = acc_t<T>;
  const int64_t K = g.keep_sizes[g.nkeep - 1];
  const int64_t outer = g.num_out / K;
  const int64_t R = g.red_numel;
  const int64_t rs = g.red_strides[0];
  const int64_t tiles = (K + kColTile - 1) / kColTile;
  ReduceGeom og = g;
  og.nkeep -= 1;
  const int64_t grain =
      std::max<int64_t>(1, kGrainSize / std::max<int64_t>(R * std::min(K, kColTile), 1));
  parallel_for(0, outer * tiles, grain, [&](int64_t b, int64_t e) {
    std::unique_ptr<A[]> bv(new A[kColTile]);
    std::unique_ptr<int64_t[]> bi(new int64_t[kColTile]);
    for (int64_t t = b; t < e; ++t) {
      const int64_t ob = t / tiles, k0 = (t % tiles) * kColTile;
      const int64_t kn = std::min(kColTile, K - k0);
      const T* base = in + og.keep_offset(ob) + k0;
      arg_cols<kMax>(base, R, rs, kn, bv.get(), bi.get());
      const int64_t o = ob * K + k0;
      for (int64_t k = 0; k < kn; ++k) {
        if (values) values[o + k] = convert<T>(bv[k]);
        indices[o + k] = bi[k];
      }
    }
  });
}

}  // namespace

void arg_reduce_cpu(const Tensor& values, const Tensor& indices, const Tensor& in, int64_t dim,
                    bool is_max) {
  const ReduceInput p = prepare_reduce(in, 1u << dim);
  const ReduceGeom& g = p.g;
  EMBER_INTERNAL_ASSERT(g.nred == 1 && g.red_numel > 0, "arg reduction over one non-empty dim");
  const void* data = p.src.data_ptr();
  EMBER_DISPATCH_ALL(in.dtype(), is_max ? "argmax" : "argmin", [&]<typename T>() {
    const T* x = static_cast<const T*>(data);
    T* v = values.defined() ? values.data<T>() : nullptr;
    int64_t* idx = indices.data<int64_t>();
    auto go = [&]<bool kMax>() {
      if (g.inner()) {
        arg_inner<kMax>(g, x, v, idx);
      } else {
        arg_outer<kMax>(g, x, v, idx);
      }
    };
    if (is_max) {
      go.template operator()<true>();
    } else {
      go.template operator()<false>();
    }
  });
}

// ---- topk ------------------------------------------------------------------------------------

// A partial sort of each row's positions by topk_before: n log k comparisons a row.
void topk_cpu(const Tensor& indices, const Tensor& in, int64_t k, bool largest) {
  const int64_t rows = in.size(0), n = in.size(1);
  EMBER_DISPATCH_ALL(in.dtype(), "topk", [&]<typename T>() {
    using A = acc_t<T>;
    const T* x = in.data<T>();
    int64_t* out = indices.data<int64_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(n, 1));
    parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t r = b; r < e; ++r) {
        const T* row = x + r * n;
        for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t i, int64_t j) {
          return topk_before(convert<A>(row[i]), i, convert<A>(row[j]), j, largest);
        });
        std::copy(order.begin(), order.begin() + k, out + r * k);
      }
    });
  });
}

}  // namespace ember::detail
