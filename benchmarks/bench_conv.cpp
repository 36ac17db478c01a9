// Convolution and pooling on the CPU (oneDNN / Ember's own pooling loops).
// Cases:
//   conv2d_fwd_b64_c32_64_k3_28     input [64, 32, 28, 28], weight [64, 32, 3, 3], padding 1, bias
//   conv2d_fwdbwd_b64_c32_64_k3_28  the same forward + backward_input + backward_weight + the bias
//                                   gradient (a sum over N, H, W)
//   maxpool2d_b64_c32_28            max_pool2d, kernel 2, on [64, 32, 28, 28]
//   maxpool2d_idx_b64_c32_28        the same, also returning indices
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include <ember/tensor/ops.h>

using namespace ember;

namespace {

Tensor lcg_tensor(IntList shape, uint64_t seed) {
  std::vector<float> v(Shape(shape).numel());
  uint64_t s = seed;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<float>((s >> 40) & 0xffff) / 32768.0f - 1.0f;
  }
  return from_vector(v, shape);
}

// grad_bias[o] = sum over n, h, w of grad_output[n, o, h, w].
Tensor bias_grad(const Tensor& go) {
  const int64_t n = go.size(0), o = go.size(1), hw = go.size(2) * go.size(3);
  Tensor gb = zeros({o});
  float* pb = gb.data<float>();
  const float* pg = go.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < o; ++c) {
      const float* row = pg + (i * o + c) * hw;
      float s = 0;
      for (int64_t j = 0; j < hw; ++j) s += row[j];
      pb[c] += s;
    }
  }
  return gb;
}

// A few outputs of the forward convolution against direct sums.
bool check_conv(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  const int64_t C = x.size(1), H = x.size(2), W = x.size(3), O = w.size(0);
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  const float* py = y.data<float>();
  for (int64_t t = 0; t < 16; ++t) {
    const int64_t n = (t * 13) % x.size(0), o = (t * 7) % O, oh = (t * 5) % H, ow = (t * 11) % W;
    double s = b.data<float>()[o];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 3; ++j) {
          const int64_t ih = oh - 1 + i, iw = ow - 1 + j;
          if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
          s += double(px[((n * C + c) * H + ih) * W + iw]) * pw[((o * C + c) * 3 + i) * 3 + j];
        }
    const float got = py[((n * O + o) * H + oh) * W + ow];
    if (std::fabs(s - got) > 1e-3 * (1 + std::fabs(s))) {
      std::fprintf(stderr, "conv2d mismatch at (%ld, %ld, %ld, %ld): got %f want %f\n", long(n),
                   long(o), long(oh), long(ow), got, s);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opts = bench::parse(argc, argv);
  Tensor x = lcg_tensor({64, 32, 28, 28}, 1);
  Tensor w = lcg_tensor({64, 32, 3, 3}, 2);
  Tensor b = lcg_tensor({64}, 3);
  Tensor gy = lcg_tensor({64, 64, 28, 28}, 4);
  Conv2dParams p;
  p.padding = {1, 1};
  const double conv_flops = 2.0 * 64 * 64 * 28 * 28 * 32 * 9;
  const double conv_bytes = 4.0 * (x.numel() + w.numel() + gy.numel());

  if (bench::selected(opts, "conv2d_fwd_b64_c32_64_k3_28")) {
    if (!check_conv(x, w, b, conv2d(x, w, b, p))) return 1;
    bench::run(
        opts, "conv2d_fwd_b64_c32_64_k3_28",
        [&] { bench::do_not_optimize(conv2d(x, w, b, p).data_ptr()); }, conv_flops, conv_bytes);
  }
  if (bench::selected(opts, "conv2d_fwdbwd_b64_c32_64_k3_28")) {
    bench::run(
        opts, "conv2d_fwdbwd_b64_c32_64_k3_28",
        [&] {
          Tensor y = conv2d(x, w, b, p);
          Tensor gx = conv2d_backward_input(gy, x.shape(), w, p);
          Tensor gw = conv2d_backward_weight(gy, x, w.shape(), p);
          Tensor gb = bias_grad(gy);
          bench::do_not_optimize(y.data_ptr());
          bench::do_not_optimize(gx.data_ptr());
          bench::do_not_optimize(gw.data_ptr());
          bench::do_not_optimize(gb.data_ptr());
        },
        3 * conv_flops, 3 * conv_bytes);
  }
  Pool2dParams pp;
  pp.kernel = {2, 2};
  const double pool_bytes = 4.0 * x.numel() * 1.25;
  if (bench::selected(opts, "maxpool2d_b64_c32_28")) {
    // Spot-check: the first output is the max of the first 2x2 window.
    Tensor y = max_pool2d(x, pp);
    const float* px = x.data<float>();
    const float want = std::max(std::max(px[0], px[1]), std::max(px[28], px[29]));
    if (y.data<float>()[0] != want) {
      std::fprintf(stderr, "max_pool2d mismatch: got %f want %f\n", y.data<float>()[0], want);
      return 1;
    }
    bench::run(
        opts, "maxpool2d_b64_c32_28", [&] { bench::do_not_optimize(max_pool2d(x, pp).data_ptr()); },
        0, pool_bytes);
  }
  if (bench::selected(opts, "maxpool2d_idx_b64_c32_28")) {
    bench::run(
        opts, "maxpool2d_idx_b64_c32_28",
        [&] { bench::do_not_optimize(max_pool2d_with_indices(x, pp).first.data_ptr()); }, 0,
        pool_bytes + 8.0 * x.numel() / 4);
  }
  return 0;
}
