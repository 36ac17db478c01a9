// Pooling on the CPU: the per-element math of detail/conv_kernels.h, run over rows of the output
// (or of the input, for the gathering backward passes) on the thread pool.
#include <algorithm>
#include <type_traits>

#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

// Runs fn(plane, row) for every row of `rows_per_plane` rows in every plane, in parallel chunks
// of about kGrainSize units of work (a row costs `row_cost`).
template <typename Fn>
void for_each_row(int64_t planes, int64_t rows_per_plane, int64_t row_cost, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(row_cost, 1));
  parallel_for(0, planes * rows_per_plane, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r / rows_per_plane, r % rows_per_plane);
  });
}

// dst[p][r][c] = at(p, r, c) over a dense [planes, rows, cols] destination, rows in parallel
// (each element costs about `cost`).
template <typename T, typename At>
void fill_rows(T* dst, int64_t planes, int64_t rows, int64_t cols, int64_t cost, At&& at) {
  for_each_row(planes, rows, cols * cost, [&](int64_t p, int64_t r) {
    T* row = dst + (p * rows + r) * cols;
    for (int64_t c = 0; c < cols; ++c) row[c] = at(p, r, c);
  });
}

// One output row of 2x2 / stride 2 max pooling, written with selects instead of branches so it
// vectorises: same comparisons in the same order as pool::max_at (NaN wins, first max kept).
template <typename T, bool kIndices>
void max_pool_2x2_row(const T* r0, int64_t w, int64_t ow_n, int64_t base, T* out, int64_t* idx) {
  using A = acc_t<T>;
  const T* r1 = r0 + w;
  const int32_t w32 = static_cast<int32_t>(w);  // the caller keeps w below 2^31
  for (int64_t ow = 0; ow < ow_n; ++ow) {
    const A a = static_cast<A>(r0[2 * ow]), b = static_cast<A>(r0[2 * ow + 1]);
    const A c = static_cast<A>(r1[2 * ow]), d = static_cast<A>(r1[2 * ow + 1]);
    bool t = b > a || b != b;
    A m = t ? b : a;
    int32_t k = t ? 1 : 0;  // 32-bit like the float compares, so the selects vectorise
    t = c > m || c != c;
    m = t ? c : m;
    k = t ? w32 : k;
    t = d > m || d != d;
    m = t ? d : m;
    k = t ? w32 + 1 : k;
    out[ow] = T(m);
    if constexpr (kIndices) idx[ow] = base + 2 * ow + k;
  }
}

template <typename T>
void max_pool_typed(const Tensor& out, const Tensor& indices, const Tensor& input,
                    const PoolGeom& g) {
  const T* in = input.data<T>();
  T* o = out.data<T>();
  int64_t* idx = indices.defined() ? indices.data<int64_t>() : nullptr;
  const int64_t in_plane = g.h * g.w, out_plane = g.oh * g.ow;
  // The common case (2x2 windows, stride 2, no padding or dilation, every window inside the
  // input) gets a branch-light loop.
  const bool fast = g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2 && g.ph == 0 && g.pw == 0 &&
                    g.dh == 1 && g.dw == 1 && 2 * g.oh <= g.h && 2 * g.ow <= g.w &&
                    g.w < (int64_t{1} << 30);
  for_each_row(g.planes, g.oh, g.ow * g.kh * g.kw, [&](int64_t p, int64_t oh) {
    const T* plane = in + p * in_plane;
    T* orow = o + p * out_plane + oh * g.ow;
    int64_t* irow = idx ? idx + p * out_plane + oh * g.ow : nullptr;
    if (fast) {
      if (irow) {
        max_pool_2x2_row<T, true>(plane + 2 * oh * g.w, g.w, g.ow, 2 * oh * g.w, orow, irow);
      } else {
        max_pool_2x2_row<T, false>(plane + 2 * oh * g.w, g.w, g.ow, 2 * oh * g.w, orow, irow);
      }
      return;
    }
    for (int64_t ow = 0; ow < g.ow; ++ow) {
      pool::max_at(plane, g, oh, ow, orow + ow, irow ? irow + ow : nullptr);
    }
  });
}

}  // namespace

void max_pool2d_cpu(const Tensor& out, const Tensor& indices, const Tensor& input,
                    const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(input.dtype(), "max_pool2d", [&]<typename T>() {
    max_pool_typed<T>(out, indices, input, g);
  });
}

void max_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                             const Tensor& indices, const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(grad_output.dtype(), "max_pool2d_backward", [&]<typename T>() {
    const T* go = grad_output.data<T>();
    const int64_t* idx = indices.data<int64_t>();
    const int64_t out_plane = g.oh * g.ow, in_plane = g.h * g.w;
    T* gi = grad_input.data<T>();
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      // Scatter, one plane per task: zero the plane, then add each output's gradient at its
      // argmax. One pass over the output, no per-element window search (which costs four
      // integer divisions per input element); planes never share elements, so no races.
      // Sums follow output order, as the gather below does.
      const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(in_plane, 1));
      parallel_for(0, g.planes, grain, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          T* plane = gi + p * in_plane;
          std::fill(plane, plane + in_plane, T(0));
          const T* gp = go + p * out_plane;
          const int64_t* ip = idx + p * out_plane;
          for (int64_t o = 0; o < out_plane; ++o) {
            // The indices may be a caller's, not max_pool2d's: a bad one must not write
            // outside the plane.
            EMBER_CHECK_TYPE(IndexError, ip[o] >= 0 && ip[o] < in_plane,
                             "[max_pool2d_backward] index ", ip[o], " at output ", o, " of plane ",
                             p, " is outside the input plane of ", in_plane, " elements");
            plane[ip[o]] += gp[o];
          }
        }
      });
    } else {
      // float16 / bfloat16: gather, summing each input's contributions in float32 before one
      // rounding (the GPU kernel does the same).
      fill_rows(gi, g.planes, g.h, g.w, 4, [&](int64_t p, int64_t ih, int64_t iw) {
        return pool::max_backward_at(go + p * out_plane, idx + p * out_plane, g, ih, iw);
      });
    }
  });
}

void avg_pool2d_cpu(const Tensor& out, const Tensor& input, const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(input.dtype(), "avg_pool2d", [&]<typename T>() {
    const T* in = input.data<T>();
    const int64_t in_plane = g.h * g.w;
    fill_rows(out.data<T>(), g.planes, g.oh, g.ow, g.kh * g.kw,
              [&](int64_t p, int64_t oh, int64_t ow) {
                return pool::avg_at(in + p * in_plane, g, oh, ow);
              });
  });
}

void avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                             const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(grad_output.dtype(), "avg_pool2d_backward", [&]<typename T>() {
    const T* go = grad_output.data<T>();
    const int64_t out_plane = g.oh * g.ow;
    fill_rows(grad_input.data<T>(), g.planes, g.h, g.w, 4, [&](int64_t p, int64_t ih, int64_t iw) {
      return pool::avg_backward_at(go + p * out_plane, g, ih, iw);
    });
  });
}

void adaptive_avg_pool2d_cpu(const Tensor& out, const Tensor& input, const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(input.dtype(), "adaptive_avg_pool2d", [&]<typename T>() {
    const T* in = input.data<T>();
    const int64_t in_plane = g.h * g.w;
    const int64_t window = ((g.h + g.oh - 1) / g.oh + 1) * ((g.w + g.ow - 1) / g.ow + 1);
    fill_rows(out.data<T>(), g.planes, g.oh, g.ow, window, [&](int64_t p, int64_t oh, int64_t ow) {
      return pool::adaptive_avg_at(in + p * in_plane, g, oh, ow);
    });
  });
}

void adaptive_avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                                      const PoolGeom& g) {
  EMBER_DISPATCH_FLOATING(grad_output.dtype(), "adaptive_avg_pool2d_backward", [&]<typename T>() {
    const T* go = grad_output.data<T>();
    const int64_t out_plane = g.oh * g.ow;
    fill_rows(grad_input.data<T>(), g.planes, g.h, g.w, 4, [&](int64_t p, int64_t ih, int64_t iw) {
      return pool::adaptive_avg_backward_at(go + p * out_plane, g, ih, iw);
    });
  });
}

}  // namespace ember::detail
