// Matrix multiplication throughput on the CPU: square matmul in float32 and bfloat16, and
// float32 operands under bf16 autocast (the casts included), plus the GPT example's MLP shape
// (16 x 128 tokens, 128 -> 512). Cases: matmul_<n>_{f32,bf16,autocast_bf16} with flops = 2 n^3,
// and linear_2048x128x512_{f32,bf16,autocast_bf16}.
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include <ember/tensor/autocast.h>
#include <ember/tensor/ops.h>

using namespace ember;

namespace {

enum class Mode { kF32, kBf16, kAutocast };
constexpr const char* kModeNames[] = {"f32", "bf16", "autocast_bf16"};

Tensor lcg_tensor(int64_t n, int64_t m, uint64_t seed) {
  std::vector<float> v(n * m);
  uint64_t s = seed;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<float>((s >> 40) & 0xffff) / 32768.0f - 1.0f;
  }
  return from_vector(v, {n, m});
}

// Spot-checks a few entries of c = a @ b against dot products in double.
// bfloat16 operands and results are compared in float32 with a looser tolerance (the products
// are exact in float32, so only the rounding of the result and of the sum's order remains).
bool check(const Tensor& a_in, const Tensor& b_in, const Tensor& c_in) {
  const bool low = c_in.dtype() != kFloat32;
  const Tensor a = a_in.to(kFloat32), b = b_in.to(kFloat32), c = c_in.to(kFloat32);
  const double tol = low ? 1e-2 : 1e-3;
  const int64_t n = a.size(0), k = a.size(1), m = b.size(1);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* pc = c.data<float>();
  for (int64_t t = 0; t < 16; ++t) {
    const int64_t i = (t * 7919) % n, j = (t * 104729) % m;
    double s = 0;
    for (int64_t p = 0; p < k; ++p) s += double(pa[i * k + p]) * pb[p * m + j];
    if (std::fabs(s - pc[i * m + j]) > tol * (std::sqrt(double(k)) + std::fabs(s))) {
      std::fprintf(stderr, "matmul mismatch at (%ld, %ld): got %f want %f\n", long(i), long(j),
                   pc[i * m + j], s);
      return false;
    }
  }
  return true;
}

// Times a @ b (n x k times k x m) in one mode; false if the result is wrong.
bool run_case(const bench::Options& opts, const std::string& name, int64_t n, int64_t k, int64_t m,
              Mode mode) {
  if (!bench::selected(opts, name)) return true;
  Tensor a = lcg_tensor(n, k, 1), b = lcg_tensor(k, m, 2);
  if (mode == Mode::kBf16) {
    a = a.to(kBFloat16);
    b = b.to(kBFloat16);
  }
  auto product = [&] {
    AutocastGuard amp(kCPU, kBFloat16, mode == Mode::kAutocast);
    return matmul(a, b);
  };
  if (!check(a, b, product())) return false;
  const double elem = mode == Mode::kBf16 ? 2 : 4;
  bench::run(
      opts, name, [&] { bench::do_not_optimize(product().data_ptr()); }, 2.0 * n * k * m,
      (n * k + k * m + n * m) * elem);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opts = bench::parse(argc, argv);
  for (Mode mode : {Mode::kF32, Mode::kBf16, Mode::kAutocast}) {
    const std::string suffix = kModeNames[static_cast<int>(mode)];
    for (int64_t n : {512, 1024, 2048}) {
      if (!run_case(opts, "matmul_" + std::to_string(n) + "_" + suffix, n, n, n, mode)) return 1;
    }
    if (!run_case(opts, "linear_2048x128x512_" + suffix, 2048, 128, 512, mode)) return 1;
  }
  return 0;
}
