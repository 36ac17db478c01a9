// Convolution and pooling (tensor/ops/conv.h) against naive loops written here: direct convolution,
// its transpose (backward input) and weight gradient, finite differences, max pooling with index
// tracking, average pooling (ceil mode, padding, count_include_pad), adaptive average pooling,
// error messages, CUDA vs CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cudnn.h>
#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/ops.h>
#include "test_util.h"

using ember::test::expect_close;
using ember::test::expect_error;
using ember::test::lcg_values;
using ember::test::rand_t;

using namespace ember;

namespace {

double tol_for(Dtype t) {
  switch (t) {
    case kFloat64:
      return 1e-11;
    case kFloat32:
      return 1e-4;
    default:
      return 3e-2;
  }
}

// ---- naive convolution -------------------------------------------------------------------

struct Case {
  int64_t n, c, h, w, o, kh, kw;
  Conv2dParams p;
};

struct Dims {
  int64_t oh, ow, cg, og;
};
Dims dims(const Case& k) {
  const int64_t oh =
      (k.h + 2 * k.p.padding[0] - k.p.dilation[0] * (k.kh - 1) - 1) / k.p.stride[0] + 1;
  const int64_t ow =
      (k.w + 2 * k.p.padding[1] - k.p.dilation[1] * (k.kw - 1) - 1) / k.p.stride[1] + 1;
  return {oh, ow, k.c / k.p.groups, k.o / k.p.groups};
}

// Calls f(n, o, oh, ow, c, i, j, input_index, weight_index) for every product term of the
// direct convolution whose input position is inside the image.
template <typename F>
void for_each_term(const Case& k, F&& f) {
  const Dims d = dims(k);
  for (int64_t n = 0; n < k.n; ++n)
    for (int64_t o = 0; o < k.o; ++o) {
      const int64_t g = o / d.og;
      for (int64_t oh = 0; oh < d.oh; ++oh)
        for (int64_t ow = 0; ow < d.ow; ++ow)
          for (int64_t cc = 0; cc < d.cg; ++cc)
            for (int64_t i = 0; i < k.kh; ++i)
              for (int64_t j = 0; j < k.kw; ++j) {
                const int64_t ih = oh * k.p.stride[0] - k.p.padding[0] + i * k.p.dilation[0];
                const int64_t iw = ow * k.p.stride[1] - k.p.padding[1] + j * k.p.dilation[1];
                if (ih < 0 || ih >= k.h || iw < 0 || iw >= k.w) continue;
                const int64_t c = g * d.cg + cc;
                const int64_t out_i = ((n * k.o + o) * d.oh + oh) * d.ow + ow;
                const int64_t in_i = ((n * k.c + c) * k.h + ih) * k.w + iw;
                const int64_t w_i = ((o * d.cg + cc) * k.kh + i) * k.kw + j;
                f(out_i, in_i, w_i);
              }
    }
}

std::vector<double> naive_conv(const Case& k, const std::vector<double>& x,
                               const std::vector<double>& w, const std::vector<double>* bias) {
  const Dims d = dims(k);
  std::vector<double> y(k.n * k.o * d.oh * d.ow, 0.0);
  if (bias) {
    for (size_t i = 0; i < y.size(); ++i) y[i] = (*bias)[(i / (d.oh * d.ow)) % k.o];
  }
  for_each_term(k, [&](int64_t o, int64_t i, int64_t wi) { y[o] += x[i] * w[wi]; });
  return y;
}

// The transposed convolution: each output gradient flows back along every term that used it.
std::vector<double> naive_conv_backward_input(const Case& k, const std::vector<double>& gy,
                                              const std::vector<double>& w) {
  std::vector<double> gx(k.n * k.c * k.h * k.w, 0.0);
  for_each_term(k, [&](int64_t o, int64_t i, int64_t wi) { gx[i] += gy[o] * w[wi]; });
  return gx;
}

std::vector<double> naive_conv_backward_weight(const Case& k, const std::vector<double>& gy,
                                               const std::vector<double>& x) {
  std::vector<double> gw(k.o * (k.c / k.p.groups) * k.kh * k.kw, 0.0);
  for_each_term(k, [&](int64_t o, int64_t i, int64_t wi) { gw[wi] += gy[o] * x[i]; });
  return gw;
}

Conv2dParams params(Pair stride, Pair padding, Pair dilation, int64_t groups) {
  Conv2dParams p;
  p.stride = stride;
  p.padding = padding;
  p.dilation = dilation;
  p.groups = groups;
  return p;
}

std::vector<Case> conv_cases() {
  return {
      {2, 3, 7, 6, 4, 3, 3, params({1, 1}, {1, 1}, {1, 1}, 1)},
      {1, 4, 9, 8, 6, 3, 3, params({2, 2}, {0, 0}, {2, 2}, 2)},
      {3, 4, 6, 7, 4, 3, 3, params({1, 2}, {1, 1}, {1, 1}, 4)},      // depthwise
      {2, 2, 8, 7, 3, 3, 2, params({2, 1}, {1, 0}, {1, 2}, 1)},      // asymmetric
      {2, 16, 10, 10, 16, 3, 3, params({1, 1}, {1, 1}, {1, 1}, 1)},  // blocked oneDNN layouts
      {1, 8, 5, 5, 8, 1, 1, params({1, 1}, {0, 0}, {1, 1}, 1)},      // 1x1
      {2, 3, 5, 5, 2, 5, 5, params({3, 3}, {2, 2}, {1, 1}, 1)},      // kernel as large as input
  };
}

std::string case_name(const Case& k, Dtype dt) {
  return detail::str_cat("conv [", k.n, ", ", k.c, ", ", k.h, ", ", k.w, "] w [", k.o, ", ",
                         k.c / k.p.groups, ", ", k.kh, ", ", k.kw, "] groups ", k.p.groups, " ",
                         dt);
}

}  // namespace

TEST(Conv2d, ForwardMatchesNaive) {
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
    for (const Case& k : conv_cases()) {
      Tensor x = rand_t({k.n, k.c, k.h, k.w}, dt, 1);
      Tensor w = rand_t({k.o, k.c / k.p.groups, k.kh, k.kw}, dt, 2);
      Tensor b = rand_t({k.o}, dt, 3);
      auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
      Tensor y = conv2d(x, w, b, k.p);
      const Dims d = dims(k);
      ASSERT_EQ(y.shape(), Shape({k.n, k.o, d.oh, d.ow})) << case_name(k, dt);
      EXPECT_EQ(y.dtype(), dt);
      expect_close(y, naive_conv(k, xv, wv, &bv), tol_for(dt) * 10, case_name(k, dt));
      expect_close(conv2d(x, w, Tensor(), k.p), naive_conv(k, xv, wv, nullptr), tol_for(dt) * 10,
                   case_name(k, dt) + " no bias");
    }
  }
}

TEST(Conv2d, NonContiguousOperands) {
  for (Dtype dt : {kFloat32, kFloat64}) {
    Case k{2, 3, 6, 5, 4, 3, 3, params({1, 1}, {1, 1}, {1, 1}, 1)};
    // An NHWC buffer seen as NCHW, and a weight stored transposed in its spatial dims.
    Tensor x = rand_t({2, 6, 5, 3}, dt, 1).permute({0, 3, 1, 2});
    Tensor w = rand_t({4, 3, 3, 3}, dt, 2).transpose(2, 3);
    ASSERT_FALSE(x.is_contiguous());
    auto want = naive_conv(k, x.to_vector<double>(), w.to_vector<double>(), nullptr);
    expect_close(conv2d(x, w, Tensor(), k.p), want, tol_for(dt) * 10, "non-contiguous");
  }
}

TEST(Conv2d, BackwardMatchesTransposedConvolution) {
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16}) {
    for (const Case& k : conv_cases()) {
      const Dims d = dims(k);
      Tensor x = rand_t({k.n, k.c, k.h, k.w}, dt, 1);
      Tensor w = rand_t({k.o, k.c / k.p.groups, k.kh, k.kw}, dt, 2);
      Tensor gy = rand_t({k.n, k.o, d.oh, d.ow}, dt, 4);
      auto gyv = gy.to_vector<double>();
      Tensor gx = conv2d_backward_input(gy, x.shape(), w, k.p);
      ASSERT_EQ(gx.shape(), x.shape());
      expect_close(gx, naive_conv_backward_input(k, gyv, w.to_vector<double>()), tol_for(dt) * 10,
                   case_name(k, dt) + " backward_input");
      Tensor gw = conv2d_backward_weight(gy, x, w.shape(), k.p);
      ASSERT_EQ(gw.shape(), w.shape());
      expect_close(gw, naive_conv_backward_weight(k, gyv, x.to_vector<double>()), tol_for(dt) * 30,
                   case_name(k, dt) + " backward_weight");
    }
  }
}

TEST(Conv2d, BackwardMatchesFiniteDifferences) {
  // L(x, w) = sum(conv2d(x, w) * gy) is bilinear, so central differences are exact up to
  // rounding: dL/dx[i] = (L(x + e_i) - L(x - e_i)) / 2.
  Case k{2, 4, 5, 6, 4, 3, 2, params({2, 1}, {1, 1}, {1, 2}, 2)};
  const Dims d = dims(k);
  Tensor x = rand_t({k.n, k.c, k.h, k.w}, kFloat64, 1);
  Tensor w = rand_t({k.o, k.c / 2, k.kh, k.kw}, kFloat64, 2);
  Tensor gy = rand_t({k.n, k.o, d.oh, d.ow}, kFloat64, 3);
  auto loss = [&](const Tensor& xx, const Tensor& ww) {
    auto y = conv2d(xx, ww, Tensor(), k.p).to_vector<double>();
    auto g = gy.to_vector<double>();
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * g[i];
    return s;
  };
  auto gx = conv2d_backward_input(gy, x.shape(), w, k.p).to_vector<double>();
  auto gw = conv2d_backward_weight(gy, x, w.shape(), k.p).to_vector<double>();
  auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  for (int64_t i = 0; i < x.numel(); i += 7) {
    auto xp = xv, xm = xv;
    xp[i] += 0.5;
    xm[i] -= 0.5;
    const double fd =
        loss(from_vector(xp).reshape(x.shape()), w) - loss(from_vector(xm).reshape(x.shape()), w);
    EXPECT_NEAR(gx[i], fd, 1e-9) << "input index " << i;
  }
  for (int64_t i = 0; i < w.numel(); i += 3) {
    auto wp = wv, wm = wv;
    wp[i] += 0.5;
    wm[i] -= 0.5;
    const double fd =
        loss(x, from_vector(wp).reshape(w.shape())) - loss(x, from_vector(wm).reshape(w.shape()));
    EXPECT_NEAR(gw[i], fd, 1e-9) << "weight index " << i;
  }
}

TEST(Conv2d, ZeroSizedTensors) {
  for (Dtype dt : {kFloat32, kFloat64}) {
    Tensor w = rand_t({4, 3, 3, 3}, dt, 1);
    Tensor y = conv2d(empty({0, 3, 5, 5}, dt), w, Tensor(), params({1, 1}, {1, 1}, {1, 1}, 1));
    EXPECT_EQ(y.shape(), Shape({0, 4, 5, 5}));
    // No input channels: the sum is empty, so the output is the bias.
    Tensor b = rand_t({4}, dt, 2);
    Tensor y0 = conv2d(empty({2, 0, 4, 4}, dt), empty({4, 0, 3, 3}, dt), b);
    ASSERT_EQ(y0.shape(), Shape({2, 4, 2, 2}));
    auto bv = b.to_vector<double>();
    std::vector<double> want(y0.numel());
    for (size_t i = 0; i < want.size(); ++i) want[i] = bv[(i / 4) % 4];
    expect_close(y0, want, 0, "no channels");
    Tensor gw = conv2d_backward_weight(empty({0, 4, 5, 5}, dt), empty({0, 3, 5, 5}, dt),
                                       {4, 3, 3, 3}, params({1, 1}, {1, 1}, {1, 1}, 1));
    expect_close(gw, std::vector<double>(4 * 27, 0.0), 0, "empty batch weight grad");
    EXPECT_EQ(conv2d_backward_input(empty({0, 4, 5, 5}, dt), {0, 3, 5, 5}, w,
                                    params({1, 1}, {1, 1}, {1, 1}, 1))
                  .shape(),
              Shape({0, 3, 5, 5}));
  }
}

TEST(Conv2d, ErrorsFollowPyTorch) {
  Tensor x = zeros({1, 3, 28, 28});
  expect_error(
      [&] {
        conv2d(x, zeros({8, 4, 3, 3}));
      },
      {"[conv2d]", "expected input[1, 3, 28, 28] to have 4 channels", "got 3 channels",
       "[8, 4, 3, 3]"});
  expect_error(
      [&] {
        conv2d(zeros({3, 28, 28}), zeros({8, 3, 3, 3}));
      },
      {"[conv2d]", "4-d", "[3, 28, 28]"});
  expect_error([&] { conv2d(x, zeros({8, 3, 3})); }, {"[conv2d]", "weight", "[8, 3, 3]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 4, 8, 8}), zeros({3, 2, 3, 3}), Tensor(),
               params({1, 1}, {0, 0}, {1, 1}, 2));
      },
      {"[conv2d]", "groups=2", "divisible by 2", "[3, 2, 3, 3]"});
  expect_error(
      [&] {
        conv2d(zeros({1, 3, 2, 2}), zeros({8, 3, 3, 3}));
      },
      {"[conv2d]", "Kernel size", "(2 x 2)", "(3 x 3)"});
  expect_error(
      [&] {
        conv2d(x, zeros({8, 3, 3, 3}), zeros({4}));
      },
      {"[conv2d]", "bias", "8 elements", "[4]"});
  expect_error(
      [&] {
        conv2d(x, zeros({8, 3, 3, 3}), Tensor(), params({0, 1}, {0, 0}, {1, 1}, 1));
      },
      {"[conv2d]", "stride", "[0, 1]"});
  expect_error(
      [&] {
        conv2d(x, zeros({8, 3, 3, 3}), Tensor(), params({1, 1}, {-1, 0}, {1, 1}, 1));
      },
      {"[conv2d]", "padding", "[-1, 0]"});
  expect_error(
      [&] {
        conv2d(x, zeros({8, 3, 3, 3}), Tensor(), params({1, 1}, {0, 0}, {1, 1}, 0));
      },
      {"[conv2d]", "groups", "0"});
  EXPECT_THROW(conv2d(x, zeros({8, 3, 3, 3}, kFloat64)), TypeError);
  expect_error(
      [&] {
        conv2d(x, zeros({8, 3, 3, 3}, kFloat64));
      },
      {"[conv2d]", "float32", "float64"});
  EXPECT_THROW(conv2d(zeros({1, 3, 4, 4}, kInt64), zeros({8, 3, 3, 3}, kInt64)), TypeError);
  expect_error(
      [&] {
        conv2d_backward_input(zeros({1, 8, 25, 25}), {1, 3, 28, 28}, zeros({8, 3, 3, 3}));
      },
      {"[conv2d_backward_input]", "[1, 8, 26, 26]", "[1, 8, 25, 25]"});
  expect_error(
      [&] {
        conv2d_backward_weight(zeros({1, 8, 26, 26}), x, {8, 4, 3, 3});
      },
      {"[conv2d_backward_weight]", "4 channels"});
  expect_error([&] { conv2d(Tensor(), zeros({8, 3, 3, 3})); }, {"[conv2d]", "'input'"});
}

// ---- pooling -----------------------------------------------------------------------------

namespace {

Pool2dParams pool_params(Pair kernel, std::optional<Pair> stride, Pair padding, Pair dilation,
                         bool ceil_mode, bool count_include_pad = true) {
  Pool2dParams p;
  p.kernel = kernel;
  p.stride = stride;
  p.padding = padding;
  p.dilation = dilation;
  p.ceil_mode = ceil_mode;
  p.count_include_pad = count_include_pad;
  return p;
}

int64_t naive_out_size(int64_t in, int64_t k, int64_t pad, int64_t s, int64_t d, bool ceil) {
  const int64_t span = in + 2 * pad - d * (k - 1) - 1;
  int64_t out = (ceil ? (span + s - 1) / s : span / s) + 1;
  if (ceil && (out - 1) * s >= in + pad) --out;
  return out;
}

struct PoolRef {
  int64_t oh, ow;
  std::vector<double> out;
  std::vector<int64_t> idx;
};

// Plain max over each window in row-major order; the first strict maximum wins.
PoolRef naive_max_pool(const std::vector<double>& x, int64_t planes, int64_t h, int64_t w,
                       const Pool2dParams& p) {
  const Pair s = p.stride.value_or(p.kernel);
  PoolRef r;
  r.oh = naive_out_size(h, p.kernel[0], p.padding[0], s[0], p.dilation[0], p.ceil_mode);
  r.ow = naive_out_size(w, p.kernel[1], p.padding[1], s[1], p.dilation[1], p.ceil_mode);
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t oh = 0; oh < r.oh; ++oh)
      for (int64_t ow = 0; ow < r.ow; ++ow) {
        double best = -std::numeric_limits<double>::infinity();
        int64_t bi = -1;
        for (int64_t i = 0; i < p.kernel[0]; ++i)
          for (int64_t j = 0; j < p.kernel[1]; ++j) {
            const int64_t ih = oh * s[0] - p.padding[0] + i * p.dilation[0];
            const int64_t iw = ow * s[1] - p.padding[1] + j * p.dilation[1];
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            const double v = x[(pl * h + ih) * w + iw];
            if (bi < 0 || v > best) best = v, bi = ih * w + iw;
          }
        r.out.push_back(best);
        r.idx.push_back(bi);
      }
  return r;
}

PoolRef naive_avg_pool(const std::vector<double>& x, int64_t planes, int64_t h, int64_t w,
                       const Pool2dParams& p) {
  const Pair s = p.stride.value_or(p.kernel);
  PoolRef r;
  r.oh = naive_out_size(h, p.kernel[0], p.padding[0], s[0], 1, p.ceil_mode);
  r.ow = naive_out_size(w, p.kernel[1], p.padding[1], s[1], 1, p.ceil_mode);
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t oh = 0; oh < r.oh; ++oh)
      for (int64_t ow = 0; ow < r.ow; ++ow) {
        double sum = 0;
        int64_t inside = 0, padded = 0;
        for (int64_t i = 0; i < p.kernel[0]; ++i)
          for (int64_t j = 0; j < p.kernel[1]; ++j) {
            const int64_t ih = oh * s[0] - p.padding[0] + i, iw = ow * s[1] - p.padding[1] + j;
            // Positions in the padding count (with count_include_pad); positions past it, which
            // ceil mode can create, never do.
            if (ih < h + p.padding[0] && iw < w + p.padding[1]) ++padded;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            sum += x[(pl * h + ih) * w + iw];
            ++inside;
          }
        r.out.push_back(sum / (p.count_include_pad ? padded : inside));
      }
  return r;
}

}  // namespace

TEST(MaxPool2d, MatchesNaiveWithIndices) {
  const Pool2dParams cases[] = {
      pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, false),  // the fast path
      pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, true),   // odd sizes, ceil mode
      pool_params({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true),
      pool_params({3, 2}, Pair{1, 2}, {1, 0}, {2, 1}, false),  // dilation, asymmetric
      pool_params({2, 3}, Pair{3, 1}, {1, 1}, {2, 2}, true),
  };
  for (Dtype dt : {kFloat32, kFloat64, kBFloat16}) {
    for (const auto& p : cases) {
      SCOPED_TRACE(detail::str_cat(dt, " kernel [", p.kernel[0], ", ", p.kernel[1], "] padding [",
                                   p.padding[0], ", ", p.padding[1], "] dilation [", p.dilation[0],
                                   ", ", p.dilation[1], "] ceil ", p.ceil_mode));
      Tensor x = rand_t({2, 3, 7, 9}, dt, 5);
      auto ref = naive_max_pool(x.to_vector<double>(), 6, 7, 9, p);
      auto [y, idx] = max_pool2d_with_indices(x, p);
      ASSERT_EQ(y.shape(), Shape({2, 3, ref.oh, ref.ow}));
      EXPECT_EQ(idx.dtype(), kInt64);
      expect_close(y, ref.out, 0, "max_pool2d values");
      EXPECT_EQ(idx.to_vector<int64_t>(), ref.idx);
      expect_close(max_pool2d(x, p), ref.out, 0, "max_pool2d without indices");
      // Backward: each output gradient goes to its argmax (summed where windows overlap).
      Tensor gy = rand_t(y.shape(), dt, 6);
      auto gyv = gy.to_vector<double>();
      std::vector<double> gx(x.numel(), 0.0);
      for (size_t i = 0; i < gyv.size(); ++i) {
        gx[(i / (ref.oh * ref.ow)) * 63 + ref.idx[i]] += gyv[i];
      }
      expect_close(max_pool2d_backward(gy, x, idx, p), gx, tol_for(dt), "max_pool2d_backward");
    }
  }
}

TEST(MaxPool2d, NonContiguousInputAndNaN) {
  Tensor x = rand_t({2, 6, 6, 3}, kFloat32, 1).permute({0, 3, 1, 2});
  auto p = pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, false);
  auto ref = naive_max_pool(x.to_vector<double>(), 6, 6, 6, p);
  expect_close(max_pool2d(x, p), ref.out, 0, "permuted input");
  // NaN propagates and is where the index points, as in PyTorch.
  std::vector<float> v = {1, 2, 3, 4, std::nanf(""), 0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  Tensor t = from_vector(v).reshape({1, 1, 4, 4});
  auto [y, idx] = max_pool2d_with_indices(t, p);
  auto yv = y.to_vector<float>();
  EXPECT_TRUE(std::isnan(yv[0]));
  EXPECT_EQ(idx.to_vector<int64_t>()[0], 4);
  EXPECT_EQ(yv[1], 6.0f);
}

TEST(AvgPool2d, MatchesNaive) {
  const Pool2dParams cases[] = {
      pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, false),
      pool_params({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, true),
      pool_params({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, false),
      pool_params({3, 2}, Pair{2, 1}, {1, 1}, {1, 1}, false, false),
      pool_params({2, 2}, Pair{3, 3}, {1, 0}, {1, 1}, true, true),
  };
  for (Dtype dt : {kFloat32, kFloat64, kFloat16}) {
    for (const auto& p : cases) {
      Tensor x = rand_t({2, 2, 7, 8}, dt, 7);
      auto ref = naive_avg_pool(x.to_vector<double>(), 4, 7, 8, p);
      Tensor y = avg_pool2d(x, p);
      ASSERT_EQ(y.shape(), Shape({2, 2, ref.oh, ref.ow}));
      expect_close(y, ref.out, tol_for(dt), "avg_pool2d");
      // Backward, naively: L = sum(avg_pool(x) * gy) is linear in x; its gradient at x[i] is
      // L(e_i), computed one basis vector at a time through the naive forward.
      Tensor gy = rand_t(y.shape(), dt, 8);
      auto gyv = gy.to_vector<double>();
      std::vector<double> gx(x.numel(), 0.0);
      for (int64_t i = 0; i < x.numel(); ++i) {
        std::vector<double> e(x.numel(), 0.0);
        e[i] = 1.0;
        auto r = naive_avg_pool(e, 4, 7, 8, p);
        for (size_t o = 0; o < r.out.size(); ++o) gx[i] += r.out[o] * gyv[o];
      }
      expect_close(avg_pool2d_backward(gy, x, p), gx, tol_for(dt), "avg_pool2d_backward");
    }
  }
}

TEST(AdaptiveAvgPool2d, MatchesNaive) {
  const std::pair<Pair, Pair> cases[] = {
      {{7, 9}, {3, 4}}, {{5, 5}, {5, 5}}, {{4, 6}, {1, 1}}, {{3, 4}, {5, 7}}, {{10, 10}, {4, 3}}};
  for (Dtype dt : {kFloat32, kFloat64}) {
    for (const auto& [in, out] : cases) {
      Tensor x = rand_t({2, 3, in[0], in[1]}, dt, 9);
      auto xv = x.to_vector<double>();
      std::vector<double> want;
      std::vector<double> gx(x.numel(), 0.0);
      Tensor gy = rand_t({2, 3, out[0], out[1]}, dt, 10);
      auto gyv = gy.to_vector<double>();
      for (int64_t pl = 0; pl < 6; ++pl)
        for (int64_t oh = 0; oh < out[0]; ++oh)
          for (int64_t ow = 0; ow < out[1]; ++ow) {
            const int64_t h0 = oh * in[0] / out[0];
            const int64_t h1 = static_cast<int64_t>(std::ceil(double((oh + 1) * in[0]) / out[0]));
            const int64_t w0 = ow * in[1] / out[1];
            const int64_t w1 = static_cast<int64_t>(std::ceil(double((ow + 1) * in[1]) / out[1]));
            const double cnt = double((h1 - h0) * (w1 - w0));
            double s = 0;
            for (int64_t ih = h0; ih < h1; ++ih)
              for (int64_t iw = w0; iw < w1; ++iw) {
                s += xv[(pl * in[0] + ih) * in[1] + iw];
                gx[(pl * in[0] + ih) * in[1] + iw] += gyv[(pl * out[0] + oh) * out[1] + ow] / cnt;
              }
            want.push_back(s / cnt);
          }
      Tensor y = adaptive_avg_pool2d(x, out);
      ASSERT_EQ(y.shape(), Shape({2, 3, out[0], out[1]}));
      expect_close(y, want, tol_for(dt), "adaptive_avg_pool2d");
      expect_close(adaptive_avg_pool2d_backward(gy, x), gx, tol_for(dt),
                   "adaptive_avg_pool2d_backward");
    }
  }
}

TEST(Pool2d, ZeroSizedBatchAndErrors) {
  auto p = pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, false);
  EXPECT_EQ(max_pool2d(empty({0, 3, 4, 4}), p).shape(), Shape({0, 3, 2, 2}));
  EXPECT_EQ(avg_pool2d(empty({2, 0, 4, 4}), p).shape(), Shape({2, 0, 2, 2}));
  EXPECT_EQ(adaptive_avg_pool2d(empty({0, 3, 4, 4}), {2, 2}).shape(), Shape({0, 3, 2, 2}));

  expect_error(
      [&] {
        max_pool2d(zeros({3, 4, 4}), p);
      },
      {"[max_pool2d]", "4-d", "[3, 4, 4]"});
  expect_error(
      [&] {
        max_pool2d(zeros({1, 1, 4, 4}), pool_params({2, 2}, std::nullopt, {2, 0}, {1, 1}, false));
      },
      {"[max_pool2d]", "pad", "half"});
  expect_error(
      [&] {
        avg_pool2d(zeros({1, 1, 1, 1}), p);
      },
      {"[avg_pool2d]", "too small", "[1, 1, 1, 1]"});
  expect_error(
      [&] {
        max_pool2d(zeros({1, 1, 4, 4}), pool_params({2, 2}, Pair{0, 1}, {0, 0}, {1, 1}, false));
      },
      {"[max_pool2d]", "stride"});
  EXPECT_THROW(max_pool2d(zeros({1, 1, 4, 4}, kInt64), p), TypeError);
  Tensor x = zeros({1, 1, 4, 4});
  auto [y, idx] = max_pool2d_with_indices(x, p);
  expect_error(
      [&] {
        max_pool2d_backward(zeros({1, 1, 3, 3}), x, idx, p);
      },
      {"[max_pool2d_backward]", "[1, 1, 2, 2]", "[1, 1, 3, 3]"});
  expect_error([&] { max_pool2d_backward(y, x, idx.to(kInt32), p); },
                        {"[max_pool2d_backward]", "int64", "int32"});
  // Indices a caller made: one outside the input plane is refused, not written through.
  for (int64_t bad : {int64_t{16}, int64_t{1000000}, int64_t{-1}}) {
    expect_error<IndexError>([&] { max_pool2d_backward(y, x, full_like(idx, bad), p); },
                             {"[max_pool2d_backward]", std::to_string(bad), "16 elements"});
  }
  expect_error(
      [&] {
        adaptive_avg_pool2d(x, {0, 2});
      },
      {"[adaptive_avg_pool2d]", "[0, 2]"});
}

// ---- CUDA vs CPU -------------------------------------------------------------------------

// cuDNN is optional in a CUDA build: the library says whether this one has it, as configured.
TEST(ConvCuda, CudnnIsAvailableAsConfigured) {
  EXPECT_EQ(cuda::cudnn_is_available(), EMBER_TEST_HAVE_CUDNN != 0);
  if (!cuda::is_built()) {
    EXPECT_FALSE(cuda::cudnn_is_available());
  }
}

// Without cuDNN, convolution on CUDA tensors says what the build lacks and how to get it;
// pooling still runs. The kernels' entry points are called directly first, so that a build
// without cuDNN checks its messages on a machine without a GPU too.
TEST(ConvCuda, WithoutCudnnConvolutionSaysHowToGetIt) {
  if (cuda::cudnn_is_available()) GTEST_SKIP() << "this build has cuDNN";
  if (!cuda::is_built()) GTEST_SKIP() << "a build without CUDA: CUDA tensors say that instead";
  const std::initializer_list<std::string_view> how = {
      "needs cuDNN", "EMBER_WITH_CUDNN=OFF", "libcudnn9-dev-cuda-13", "scripts/install-cuda.sh"};
  const Tensor none;
  const detail::ConvGeom g{};
  expect_error<NotImplementedError>([&] { detail::conv2d_cuda(none, none, none, none, g); }, how);
  expect_error<NotImplementedError>(
      [&] { detail::conv2d_backward_input_cuda(none, none, none, g); }, how);
  expect_error<NotImplementedError>(
      [&] { detail::conv2d_backward_weight_cuda(none, none, none, g); }, how);
  if (!cuda::is_available()) return;  // the rest needs CUDA tensors
  const Tensor x = zeros({1, 2, 5, 5}).cuda(), w = zeros({3, 2, 3, 3}).cuda();
  const Tensor gy = zeros({1, 3, 3, 3}).cuda();
  expect_error<NotImplementedError>([&] { conv2d(x, w); }, {"[conv2d]", "needs cuDNN"});
  expect_error<NotImplementedError>([&] { conv2d_backward_input(gy, x.shape(), w); },
                                    {"[conv2d_backward_input]", "needs cuDNN"});
  expect_error<NotImplementedError>([&] { conv2d_backward_weight(gy, x, w.shape()); },
                                    {"[conv2d_backward_weight]", "needs cuDNN"});
  EXPECT_EQ(max_pool2d(x, Pool2dParams{}).cpu().to_vector<float>(), std::vector<float>(8, 0.0f));  // [1, 2, 2, 2]
}

TEST(ConvCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  if (!cuda::cudnn_is_available()) GTEST_SKIP() << "this build has no cuDNN";
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    // float32 may run on TF32 tensor cores (as PyTorch allows): compare loosely.
    const double tol = dt == kFloat64 ? 1e-10 : 3e-2;
    for (const Case& k : conv_cases()) {
      const Dims d = dims(k);
      Tensor x = rand_t({k.n, k.c, k.h, k.w}, dt, 1);
      Tensor w = rand_t({k.o, k.c / k.p.groups, k.kh, k.kw}, dt, 2);
      Tensor b = rand_t({k.o}, dt, 3);
      Tensor gy = rand_t({k.n, k.o, d.oh, d.ow}, dt, 4);
      expect_close(conv2d(x.cuda(), w.cuda(), b.cuda(), k.p).cpu(),
                   conv2d(x, w, b, k.p).to_vector<double>(), tol, case_name(k, dt) + " cuda fwd");
      expect_close(conv2d_backward_input(gy.cuda(), x.shape(), w.cuda(), k.p).cpu(),
                   conv2d_backward_input(gy, x.shape(), w, k.p).to_vector<double>(), tol,
                   case_name(k, dt) + " cuda bwd input");
      expect_close(conv2d_backward_weight(gy.cuda(), x.cuda(), w.shape(), k.p).cpu(),
                   conv2d_backward_weight(gy, x, w.shape(), k.p).to_vector<double>(), tol,
                   case_name(k, dt) + " cuda bwd weight");
    }
  }
  expect_error(
      [&] {
        conv2d(zeros({1, 3, 8, 8}), zeros({4, 3, 3, 3}).cuda());
      },
      {"[conv2d]", "cpu", "cuda:0"});
}

TEST(PoolCuda, MatchesCpu) {
  if (!ember::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: " << ember::cuda::unavailable_reason();
  const Pool2dParams cases[] = {
      pool_params({2, 2}, std::nullopt, {0, 0}, {1, 1}, false),
      pool_params({3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true, false),
      pool_params({3, 2}, Pair{1, 2}, {1, 0}, {2, 1}, true),
  };
  for (Dtype dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    for (const auto& p : cases) {
      Tensor x = rand_t({2, 3, 9, 8}, dt, 5);
      auto [y, idx] = max_pool2d_with_indices(x, p);
      auto [yc, idxc] = max_pool2d_with_indices(x.cuda(), p);
      expect_close(yc.cpu(), y.to_vector<double>(), 0, "cuda max_pool2d");
      EXPECT_EQ(idxc.cpu().to_vector<int64_t>(), idx.to_vector<int64_t>());
      Tensor gy = rand_t(y.shape(), dt, 6);
      expect_close(max_pool2d_backward(gy.cuda(), x.cuda(), idxc, p).cpu(),
                   max_pool2d_backward(gy, x, idx, p).to_vector<double>(), 1e-6,
                   "cuda max_pool2d_backward");
      Tensor ya = avg_pool2d(x, p);
      expect_close(avg_pool2d(x.cuda(), p).cpu(), ya.to_vector<double>(), 1e-6, "cuda avg_pool2d");
      Tensor gya = rand_t(ya.shape(), dt, 7);
      expect_close(avg_pool2d_backward(gya.cuda(), x.cuda(), p).cpu(),
                   avg_pool2d_backward(gya, x, p).to_vector<double>(), 1e-6,
                   "cuda avg_pool2d_backward");
    }
    Tensor x = rand_t({2, 3, 10, 7}, dt, 8);
    expect_close(adaptive_avg_pool2d(x.cuda(), {3, 4}).cpu(),
                 adaptive_avg_pool2d(x, {3, 4}).to_vector<double>(), 1e-6, "cuda adaptive");
    Tensor gy = rand_t({2, 3, 3, 4}, dt, 9);
    expect_close(adaptive_avg_pool2d_backward(gy.cuda(), x.cuda()).cpu(),
                 adaptive_avg_pool2d_backward(gy, x).to_vector<double>(), 1e-6,
                 "cuda adaptive backward");
  }
}
