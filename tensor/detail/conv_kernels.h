// Backend kernels behind tensor/ops/conv.h (internal). The front end (tensor/ops/conv.cpp)
// validates, computes output sizes, makes operands contiguous NCHW and allocates; these only
// compute.
//
// The pooling math is written once here as __host__ __device__ functions of one output (or,
// for the backward passes, one input) element: cpu/pool.cpp and cuda/pool.cu both call them,
// so the CPU tests check what the GPU computes. The backward passes gather (each input element
// sums the outputs whose windows contain it) instead of scattering: no atomics, deterministic.
#pragma once

#include <cstdint>
#include <limits>

#include <ember/tensor/half.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

/// Resolved geometry of one 2-d convolution.
struct ConvGeom {
  int64_t n = 0, c = 0, h = 0, w = 0;  ///< input [n, c, h, w]
  int64_t o = 0, kh = 0, kw = 0;       ///< weight [o, c / groups, kh, kw]
  int64_t oh = 0, ow = 0;              ///< output [n, o, oh, ow]
  int64_t sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1, groups = 1;
};

// All tensors contiguous, one floating dtype, one device; bias undefined or [o].
void conv2d_cpu(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                const ConvGeom& g);
void conv2d_backward_input_cpu(const Tensor& grad_input, const Tensor& grad_output,
                               const Tensor& weight, const ConvGeom& g);
void conv2d_backward_weight_cpu(const Tensor& grad_weight, const Tensor& grad_output,
                                const Tensor& input, const ConvGeom& g);
void conv2d_cuda(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                 const ConvGeom& g);
void conv2d_backward_input_cuda(const Tensor& grad_input, const Tensor& grad_output,
                                const Tensor& weight, const ConvGeom& g);
void conv2d_backward_weight_cuda(const Tensor& grad_weight, const Tensor& grad_output,
                                 const Tensor& input, const ConvGeom& g);
/// out[n, o, :, :] += bias[o] on CUDA (out contiguous NCHW).
void add_channel_bias_cuda(const Tensor& out, const Tensor& bias);

/// Resolved geometry of one 2-d pooling over `planes` = N * C planes of h x w.
struct PoolGeom {
  int64_t planes = 0, h = 0, w = 0, oh = 0, ow = 0;
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  bool count_include_pad = true;
};

// Inputs and outputs contiguous [planes, h, w] / [planes, oh, ow]; indices int64; one floating
// dtype. `indices` may be undefined for max pooling without indices.
void max_pool2d_cpu(const Tensor& out, const Tensor& indices, const Tensor& input,
                    const PoolGeom& g);
void max_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                             const Tensor& indices, const PoolGeom& g);
void avg_pool2d_cpu(const Tensor& out, const Tensor& input, const PoolGeom& g);
void avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                             const PoolGeom& g);
/// Adaptive pooling uses only planes, h, w, oh, ow of g.
void adaptive_avg_pool2d_cpu(const Tensor& out, const Tensor& input, const PoolGeom& g);
void adaptive_avg_pool2d_backward_cpu(const Tensor& grad_input, const Tensor& grad_output,
                                      const PoolGeom& g);
void max_pool2d_cuda(const Tensor& out, const Tensor& indices, const Tensor& input,
                     const PoolGeom& g);
void max_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                              const Tensor& indices, const PoolGeom& g);
void avg_pool2d_cuda(const Tensor& out, const Tensor& input, const PoolGeom& g);
void avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                              const PoolGeom& g);
void adaptive_avg_pool2d_cuda(const Tensor& out, const Tensor& input, const PoolGeom& g);
void adaptive_avg_pool2d_backward_cuda(const Tensor& grad_input, const Tensor& grad_output,
                                       const PoolGeom& g);

// ---- the pooling math, one element at a time (host and device) ----------------------------

namespace pool {

EMBER_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
EMBER_HD inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/// Max over the (dilated) window of output (oh, ow) of one plane; writes the value and its
/// flat index ih * w + iw. Matches PyTorch's CPU kernel: NaN wins, the first maximum is kept,
/// and a window of padding only gives -inf at its first in-bounds position.
template <typename T>
EMBER_HD inline void max_at(const T* plane, const PoolGeom& g, int64_t oh, int64_t ow, T* out,
                            int64_t* index) {
  using A = acc_t<T>;
  int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
  const int64_t h1 = min64(h0 + (g.kh - 1) * g.dh + 1, g.h);
  const int64_t w1 = min64(w0 + (g.kw - 1) * g.dw + 1, g.w);
  while (h0 < 0) h0 += g.dh;
  while (w0 < 0) w0 += g.dw;
  A best = -std::numeric_limits<A>::infinity();
  int64_t best_i = h0 * g.w + w0;
  for (int64_t ih = h0; ih < h1; ih += g.dh) {
    for (int64_t iw = w0; iw < w1; iw += g.dw) {
      const int64_t i = ih * g.w + iw;
      const A v = static_cast<A>(plane[i]);
      if (v > best || v != v) {
        best = v;
        best_i = i;
      }
    }
  }
  *out = T(best);
  if (index) *index = best_i;
}

/// Gradient of max pooling at input (ih, iw): the sum of the output gradients whose recorded
/// index is this position.
template <typename T>
EMBER_HD inline T max_backward_at(const T* grad_plane, const int64_t* index_plane,
                                  const PoolGeom& g, int64_t ih, int64_t iw) {
  using A = acc_t<T>;
  // Outputs whose window span [o * s - p, o * s - p + (k - 1) * d] contains the position.
  const int64_t eh = ih + g.ph - (g.kh - 1) * g.dh, ew = iw + g.pw - (g.kw - 1) * g.dw;
  const int64_t oh0 = eh <= 0 ? 0 : (eh + g.sh - 1) / g.sh;
  const int64_t ow0 = ew <= 0 ? 0 : (ew + g.sw - 1) / g.sw;
  const int64_t oh1 = min64((ih + g.ph) / g.sh + 1, g.oh);
  const int64_t ow1 = min64((iw + g.pw) / g.sw + 1, g.ow);
  const int64_t me = ih * g.w + iw;
  A sum = 0;
  for (int64_t oh = oh0; oh < oh1; ++oh) {
    for (int64_t ow = ow0; ow < ow1; ++ow) {
      const int64_t o = oh * g.ow + ow;
      if (index_plane[o] == me) sum += static_cast<A>(grad_plane[o]);
    }
  }
  return T(sum);
}

/// Window of average-pooling output (oh, ow), clipped to the input, and its divisor.
struct AvgWindow {
  int64_t h0, h1, w0, w1, divisor;
};
EMBER_HD inline AvgWindow avg_window(const PoolGeom& g, int64_t oh, int64_t ow) {
  int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
  int64_t h1 = min64(h0 + g.kh, g.h + g.ph), w1 = min64(w0 + g.kw, g.w + g.pw);
  const int64_t pool_size = (h1 - h0) * (w1 - w0);
  h0 = max64(h0, 0);
  w0 = max64(w0, 0);
  h1 = min64(h1, g.h);
  w1 = min64(w1, g.w);
  const int64_t divisor = g.count_include_pad ? pool_size : (h1 - h0) * (w1 - w0);
  return {h0, h1, w0, w1, divisor};
}

template <typename T>
EMBER_HD inline T avg_at(const T* plane, const PoolGeom& g, int64_t oh, int64_t ow) {
  using A = acc_t<T>;
  const AvgWindow win = avg_window(g, oh, ow);
  if (win.h0 >= win.h1 || win.w0 >= win.w1) return T(A(0));
  A sum = 0;
  for (int64_t ih = win.h0; ih < win.h1; ++ih) {
    for (int64_t iw = win.w0; iw < win.w1; ++iw) sum += static_cast<A>(plane[ih * g.w + iw]);
  }
  return T(sum / static_cast<A>(win.divisor));
}

template <typename T>
EMBER_HD inline T avg_backward_at(const T* grad_plane, const PoolGeom& g, int64_t ih, int64_t iw) {
  using A = acc_t<T>;
  // Outputs whose window [o * s - p, o * s - p + k) contains the position.
  const int64_t eh = ih + g.ph - g.kh, ew = iw + g.pw - g.kw;
  const int64_t oh0 = eh < 0 ? 0 : eh / g.sh + 1;
  const int64_t ow0 = ew < 0 ? 0 : ew / g.sw + 1;
  const int64_t oh1 = min64((ih + g.ph) / g.sh + 1, g.oh);
  const int64_t ow1 = min64((iw + g.pw) / g.sw + 1, g.ow);
  A sum = 0;
  for (int64_t oh = oh0; oh < oh1; ++oh) {
    for (int64_t ow = ow0; ow < ow1; ++ow) {
      const AvgWindow win = avg_window(g, oh, ow);
      sum += static_cast<A>(grad_plane[oh * g.ow + ow]) / static_cast<A>(win.divisor);
    }
  }
  return T(sum);
}

/// Adaptive pooling: output o of `out` covers inputs [floor(o * in / out), ceil((o + 1) * in /
/// out)).
EMBER_HD inline int64_t adaptive_start(int64_t o, int64_t out, int64_t in) { return o * in / out; }
EMBER_HD inline int64_t adaptive_end(int64_t o, int64_t out, int64_t in) {
  return ((o + 1) * in + out - 1) / out;
}

template <typename T>
EMBER_HD inline T adaptive_avg_at(const T* plane, const PoolGeom& g, int64_t oh, int64_t ow) {
  using A = acc_t<T>;
  const int64_t h0 = adaptive_start(oh, g.oh, g.h), h1 = adaptive_end(oh, g.oh, g.h);
  const int64_t w0 = adaptive_start(ow, g.ow, g.w), w1 = adaptive_end(ow, g.ow, g.w);
  A sum = 0;
  for (int64_t ih = h0; ih < h1; ++ih) {
    for (int64_t iw = w0; iw < w1; ++iw) sum += static_cast<A>(plane[ih * g.w + iw]);
  }
  return T(sum / static_cast<A>((h1 - h0) * (w1 - w0)));
}

template <typename T>
EMBER_HD inline T adaptive_avg_backward_at(const T* grad_plane, const PoolGeom& g, int64_t ih,
                                           int64_t iw) {
  using A = acc_t<T>;
  // Candidates: outputs o with floor(ih * out / in) <= o < ceil((ih + 1) * out / in).
  const int64_t oh0 = ih * g.oh / g.h, oh1 = min64(((ih + 1) * g.oh + g.h - 1) / g.h, g.oh);
  const int64_t ow0 = iw * g.ow / g.w, ow1 = min64(((iw + 1) * g.ow + g.w - 1) / g.w, g.ow);
  A sum = 0;
  for (int64_t oh = oh0; oh < oh1; ++oh) {
    const int64_t h0 = adaptive_start(oh, g.oh, g.h), h1 = adaptive_end(oh, g.oh, g.h);
    if (ih < h0 || ih >= h1) continue;
    for (int64_t ow = ow0; ow < ow1; ++ow) {
      const int64_t w0 = adaptive_start(ow, g.ow, g.w), w1 = adaptive_end(ow, g.ow, g.w);
      if (iw < w0 || iw >= w1) continue;
      sum += static_cast<A>(grad_plane[oh * g.ow + ow]) / static_cast<A>((h1 - h0) * (w1 - w0));
    }
  }
  return T(sum);
}

}  // namespace pool

}  // namespace ember::detail
