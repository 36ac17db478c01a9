// CPU fused attention (Note [Fused attention] in tensor/detail/attention_kernels.h).
// Tiles of kBr query rows by kBc keys: the tile products go to oneDNN's sgemm (float32) or
// OpenBLAS (float64), single-threaded inside Ember's parallel loops; the per-row softmax work
// runs in vector loops. Forward splits the work over (batch, query tile); backward over the
// batch, so that each thread owns the dQ, dK and dV rows it accumulates into and no reduction
// across threads is needed.
// Like PyTorch's build (-fno-trapping-math): lets GCC turn the selects of max and exp into
// branch-free vector code. Must precede every include so inlined helpers match.
#pragma GCC optimize("no-trapping-math")

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ember/tensor/cpu/matmul_dnnl.h>
#include <ember/tensor/detail/attention_dropout.h>
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/detail/fast_exp.h>
#include <ember/tensor/detail/lane_sum.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

constexpr int64_t kBr = 64;  // query rows per tile
constexpr int64_t kBc = 64;  // keys per tile (small tiles skip more of the causal triangle)

// C = alpha * op(A) op(B) + beta * C, row-major.
void gemm(bool ta, bool tb, int64_t n, int64_t m, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  dnnl_gemm_f32(ta, tb, n, m, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void gemm(bool ta, bool tb, int64_t n, int64_t m, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), alpha, a,
              static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

// The largest element (NaNs ignored), in kSumLanes running maxima so that the loop vectorises
// (one select per element in one chain does not); a maximum is exact in any order.
template <typename T>
EMBER_WIDE_CLONES T row_max(const T* x, int64_t n) {
  T mx[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) mx[j] = -std::numeric_limits<T>::infinity();
  int64_t c = 0;
  for (; c + kSumLanes <= n; c += kSumLanes) {
#pragma GCC unroll 1  // a loop over the lanes vectorises; GCC's fully unrolled selects do not
    for (int j = 0; j < kSumLanes; ++j) mx[j] = x[c + j] > mx[j] ? x[c + j] : mx[j];
  }
  for (int j = 0; c + j < n; ++j) mx[j] = x[c + j] > mx[j] ? x[c + j] : mx[j];
  T m = mx[0];
  for (int j = 1; j < kSumLanes; ++j) m = mx[j] > m ? mx[j] : m;
  return m;
}

// x = exp(x - m) in place.
template <typename T>
EMBER_WIDE_CLONES void exp_sub(T* x, int64_t n, T m) {
  for (int64_t c = 0; c < n; ++c) x[c] = exp_shifted<T>(x[c] - m);
}

// x = exp(x - m) in place; returns the sum (lane_sum's order).
template <typename T>
EMBER_WIDE_CLONES T exp_sub_sum(T* x, int64_t n, T m) {
  for (int64_t c = 0; c < n; ++c) x[c] = exp_shifted<T>(x[c] - m);
  return lane_sum(x, n);
}

// ds = p * (dp - d) in place in dp.
template <typename T>
EMBER_WIDE_CLONES void softmax_grad_row(const T* p, T* dp, int64_t n, T d) {
  for (int64_t c = 0; c < n; ++c) dp[c] = p[c] * (dp[c] - d);
}

template <typename T>
EMBER_WIDE_CLONES T dot(const T* a, const T* b, int64_t n) {
  return lane_sum<T>(n, [a, b](int64_t c) { return a[c] * b[c]; });
}

// dst[c, r] = src[r, c] for a tile of `rows` rows of `cols` (src rows ld apart), dst rows kBc
// apart. oneDNN's sgemm runs a 64 x 64 x 32 tile product faster with its right operand laid out
// this way (NN) than transposed in the call (NT), by more than the copy costs: so q k^T, and dO
// v^T in the backward, take their key and value tiles as copies transposed once per tile.
template <typename T>
void transpose_tile(const T* src, int64_t ld, int64_t rows, int64_t cols, T* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * ld;
    for (int64_t c = 0; c < cols; ++c) dst[c * kBc + r] = row[c];
  }
}

// The inputs of one call, as typed pointers with their layouts (Note [Attention operand
// layouts]).
template <typename T>
struct Operands {
  const T* q;
  const T* k;
  const T* v;
  const T* mask;  // null when there is none
  AttentionRows ql, kl, vl;
  const AttentionParams& p;
  T scale;

  Operands(const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& tmask,
           const AttentionParams& params)
      : q(tq.data<T>()),
        k(tk.data<T>()),
        v(tv.data<T>()),
        mask(tmask.defined() ? tmask.data<T>() : nullptr),
        ql(attention_rows(tq)),
        kl(attention_rows(tk)),
        vl(attention_rows(tv)),
        p(params),
        scale(static_cast<T>(params.scale)) {}

  // Last key (exclusive) that query rows [i0, i0 + br) may see.
  int64_t key_end(int64_t i0, int64_t br) const { return p.causal ? std::min(p.S, i0 + br) : p.S; }

  // The score tile sc[br, bc] (row stride kBc) = scale * q_i k_j^T + mask, with -inf above the
  // causal diagonal; kt holds k_j^T (transpose_tile, row stride kBc).
  void scores(T* sc, const T* kt, int64_t b, int64_t i0, int64_t br, int64_t j0, int64_t bc) const {
    gemm(false, false, br, bc, p.E, scale, ql.row(q, b, i0), ql.row_stride, kt, kBc, T(0), sc, kBc);
    if (mask != nullptr) {
      const T* mb = mask + p.mask.batch_offset(b);
      for (int64_t r = 0; r < br; ++r) {
        const T* mr = mb + (i0 + r) * p.mask.row_stride + j0 * p.mask.col_stride;
        T* row = sc + r * kBc;
        const int64_t cs = p.mask.col_stride;
        for (int64_t c = 0; c < bc; ++c) row[c] += mr[c * cs];
      }
    }
    if (p.causal && j0 + bc - 1 > i0) {
      for (int64_t r = 0; r < br; ++r) {
        const int64_t first = std::max<int64_t>(0, i0 + r + 1 - j0);  // first masked column
        std::fill(sc + r * kBc + std::min(first, bc), sc + r * kBc + bc,
                  -std::numeric_limits<T>::infinity());
      }
    }
  }

  // Multiplies row i of the tile (keys j0..j0+n) by the dropout keep / (1 - p).
  void dropout_row(T* x, int64_t b, int64_t i, int64_t j0, int64_t n) const {
    const float pf = static_cast<float>(p.dropout_p);
    const T keep_scale = static_cast<T>(1.0 / (1.0 - p.dropout_p));
    const uint64_t e0 = static_cast<uint64_t>((b * p.L + i) * p.S + j0);
    uint64_t blk_id = e0 / 4;
    Philox4 blk = philox_block(p.seed, p.offset + blk_id);
    for (int64_t c = 0; c < n; ++c) {
      const uint64_t e = e0 + static_cast<uint64_t>(c);
      if (e / 4 != blk_id) {
        blk_id = e / 4;
        blk = philox_block(p.seed, p.offset + blk_id);
      }
      x[c] = attention_keep(blk.v[e % 4], pf) ? x[c] * keep_scale : T(0);
    }
  }
};

// One query tile: online softmax over the key tiles, then out = acc / l, lse = m + log(l).
template <typename T>
void forward_tile(const Operands<T>& o, T* out, const AttentionRows& ol, T* lse, int64_t b,
                  int64_t i0, T* sc, T* kt, T* acc, T* m, T* l) {
  const AttentionParams& p = o.p;
  const int64_t br = std::min(kBr, p.L - i0), Ev = p.Ev;
  const T ninf = -std::numeric_limits<T>::infinity();
  std::fill(m, m + br, ninf);
  std::fill(l, l + br, T(0));
  std::fill(acc, acc + br * Ev, T(0));
  const int64_t j_end = o.key_end(i0, br);
  for (int64_t j0 = 0; j0 < j_end; j0 += kBc) {
    const int64_t bc = std::min(kBc, j_end - j0);
    // Each query tile transposes the key tiles it sees: the tasks are (batch, query tile), and
    // keeping a whole head's k^T per thread would cost E x S floats where a tile costs E x kBc.
    transpose_tile(o.kl.row(o.k, b, j0), o.kl.row_stride, bc, p.E, kt);
    o.scores(sc, kt, b, i0, br, j0, bc);
    for (int64_t r = 0; r < br; ++r) {
      T* row = sc + r * kBc;
      const T mnew = std::max(m[r], row_max(row, bc));
      if (mnew == ninf) {  // every key so far masked: nothing to add yet
        std::fill(row, row + bc, T(0));
        continue;
      }
      const T alpha = exp_shifted<T>(m[r] - mnew);
      l[r] = l[r] * alpha + exp_sub_sum(row, bc, mnew);
      m[r] = mnew;
      if (alpha != T(1)) {
        T* a = acc + r * Ev;
        for (int64_t c = 0; c < Ev; ++c) a[c] *= alpha;
      }
      if (p.dropout_p > 0) o.dropout_row(row, b, i0 + r, j0, bc);
    }
    gemm(false, false, br, Ev, bc, T(1), sc, kBc, o.vl.row(o.v, b, j0), o.vl.row_stride, T(1), acc,
         Ev);
  }
  for (int64_t r = 0; r < br; ++r) {
    const T inv = T(1) / l[r];  // 0 for a fully masked row: 0 * inf = NaN, as the math path
    T* dst = ol.row(out, b, i0 + r);
    for (int64_t c = 0; c < Ev; ++c) dst[c] = acc[r * Ev + c] * inv;
    lse[b * p.L + i0 + r] = m[r] + std::log(l[r]);
  }
}

template <typename T>
void forward_typed(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, const Tensor& mask, const AttentionParams& p) {
  const Operands<T> o(q, k, v, mask, p);
  T* out_p = out.data<T>();
  const AttentionRows ol = attention_rows(out);
  T* lse_p = lse.data<T>();
  const int64_t tiles = (p.L + kBr - 1) / kBr;
  parallel_for(0, p.batch * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(kBr * kBc + p.E * kBc + kBr * p.Ev + 2 * kBr);
    T* sc = buf.data();
    T* kt = sc + kBr * kBc;
    T* acc = kt + p.E * kBc;
    T* m = acc + kBr * p.Ev;
    T* l = m + kBr;
    for (int64_t t = begin; t < end; ++t) {
      forward_tile(o, out_p, ol, lse_p, t / tiles, (t % tiles) * kBr, sc, kt, acc, m, l);
    }
  });
}

// The gradients' and dout's pointers and layouts (any AttentionRows layout; the autograd node
// allocates dq, dk and dv densely in their input's dim order).
template <typename T>
struct Grads {
  T* dq;
  T* dk;
  T* dv;
  const T* dout;
  const T* out;
  AttentionRows dql, dkl, dvl, dol, ol;
};

// Gradients of one batch entry (Note [Fused attention]); dq, dk, dv start at zero.
template <typename T>
void backward_batch(const Operands<T>& o, const Grads<T>& g, const T* lse, int64_t b, T* sc, T* dp,
                    T* pd, T* kt, T* vt, T* d) {
  const AttentionParams& p = o.p;
  const int64_t L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  for (int64_t i = 0; i < L; ++i) d[i] = dot(g.dol.row(g.dout, b, i), g.ol.row(g.out, b, i), Ev);
  for (int64_t j0 = 0; j0 < S; j0 += kBc) {
    const int64_t bc = std::min(kBc, S - j0);
    const T* kj = o.kl.row(o.k, b, j0);
    const T* vj = o.vl.row(o.v, b, j0);
    T* dkj = g.dkl.row(g.dk, b, j0);
    T* dvj = g.dvl.row(g.dv, b, j0);
    transpose_tile(kj, o.kl.row_stride, bc, E, kt);
    transpose_tile(vj, o.vl.row_stride, bc, Ev, vt);
    // Causal: query tiles ending before key j0 see none of this key tile.
    for (int64_t i0 = p.causal ? j0 / kBr * kBr : 0; i0 < L; i0 += kBr) {
      const int64_t br = std::min(kBr, L - i0);
      const T* qi = o.ql.row(o.q, b, i0);
      const T* doi = g.dol.row(g.dout, b, i0);
      o.scores(sc, kt, b, i0, br, j0, bc);
      for (int64_t r = 0; r < br; ++r) exp_sub(sc + r * kBc, bc, lse[b * L + i0 + r]);  // P
      const T* pdrop = sc;
      if (p.dropout_p > 0) {
        for (int64_t r = 0; r < br; ++r) {
          std::copy(sc + r * kBc, sc + r * kBc + bc, pd + r * kBc);
          o.dropout_row(pd + r * kBc, b, i0 + r, j0, bc);
        }
        pdrop = pd;
      }
      // dV += Pd^T dO
      gemm(true, false, bc, Ev, br, T(1), pdrop, kBc, doi, g.dol.row_stride, T(1), dvj,
           g.dvl.row_stride);
      // dP = dO V^T
      gemm(false, false, br, bc, Ev, T(1), doi, g.dol.row_stride, vt, kBc, T(0), dp, kBc);
      for (int64_t r = 0; r < br; ++r) {
        T* dpr = dp + r * kBc;
        if (p.dropout_p > 0) o.dropout_row(dpr, b, i0 + r, j0, bc);
        if (p.bool_mask && lse[b * L + i0 + r] == -std::numeric_limits<T>::infinity()) {
          std::fill(dpr, dpr + bc, T(0));  // Note [Fused attention]: masked_fill's gradient
        } else {
          softmax_grad_row(sc + r * kBc, dpr, bc, d[i0 + r]);  // dS = P (dP - D)
        }
      }
      gemm(false, false, br, E, bc, o.scale, dp, kBc, kj, o.kl.row_stride, T(1),
           g.dql.row(g.dq, b, i0), g.dql.row_stride);
      gemm(true, false, bc, E, br, o.scale, dp, kBc, qi, o.ql.row_stride, T(1), dkj,
           g.dkl.row_stride);
    }
  }
}

template <typename T>
void backward_typed(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, const Tensor& mask, const AttentionParams& p) {
  const Operands<T> o(q, k, v, mask, p);
  const Grads<T> g{dq.data<T>(),          dk.data<T>(),        dv.data<T>(),
                   dout.data<T>(),        out.data<T>(),       attention_rows(dq),
                   attention_rows(dk),    attention_rows(dv),  attention_rows(dout),
                   attention_rows(out)};
  const T* lse_p = lse.data<T>();
  auto zero_rows = [&](T* base, const AttentionRows& rows, int64_t b, int64_t n, int64_t cols) {
    for (int64_t i = 0; i < n; ++i) std::fill_n(rows.row(base, b, i), cols, T(0));
  };
  parallel_for(0, p.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(3 * kBr * kBc + (p.E + p.Ev) * kBc + p.L);
    T* sc = buf.data();
    T* dp = sc + kBr * kBc;
    T* pd = dp + kBr * kBc;
    T* kt = pd + kBr * kBc;
    T* vt = kt + p.E * kBc;
    T* d = vt + p.Ev * kBc;
    for (int64_t b = begin; b < end; ++b) {
      zero_rows(g.dq, g.dql, b, p.L, p.E);
      zero_rows(g.dk, g.dkl, b, p.S, p.E);
      zero_rows(g.dv, g.dvl, b, p.S, p.Ev);
      backward_batch(o, g, lse_p, b, sc, dp, pd, kt, vt, d);
    }
  });
}

}  // namespace

void attention_forward_cpu(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& mask, const AttentionParams& p) {
  for (const Tensor* t : {&q, &k, &v, &out}) {
    EMBER_INTERNAL_ASSERT(attention_rows_ok(*t), "attention_forward_cpu: operand of shape ",
                          t->shape(), " and strides ", t->strides(), " has no row layout");
  }
  if (q.dtype() == kFloat64) {
    forward_typed<double>(out, lse, q, k, v, mask, p);
  } else {
    EMBER_INTERNAL_ASSERT(q.dtype() == kFloat32, "attention_forward_cpu: dtype ", q.dtype());
    forward_typed<float>(out, lse, q, k, v, mask, p);
  }
}

void attention_backward_cpu(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor& mask,
                            const AttentionParams& p) {
  for (const Tensor* t : {&dq, &dk, &dv, &dout, &q, &k, &v, &out}) {
    EMBER_INTERNAL_ASSERT(attention_rows_ok(*t), "attention_backward_cpu: operand of shape ",
                          t->shape(), " and strides ", t->strides(), " has no row layout");
  }
  if (q.dtype() == kFloat64) {
    backward_typed<double>(dq, dk, dv, dout, q, k, v, out, lse, mask, p);
  } else {
    EMBER_INTERNAL_ASSERT(q.dtype() == kFloat32, "attention_backward_cpu: dtype ", q.dtype());
    backward_typed<float>(dq, dk, dv, dout, q, k, v, out, lse, mask, p);
  }
}

}  // namespace ember::detail
