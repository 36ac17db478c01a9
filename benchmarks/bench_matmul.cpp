// Matrix multiplication throughput: square float32 matmul (OpenBLAS on the CPU).
// Cases: matmul_<n>_f32, flops = 2 n^3.
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include "tensor/ops.h"

using namespace ember;

namespace {

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
bool check(const Tensor& a, const Tensor& b, const Tensor& c) {
  const int64_t n = a.size(0), k = a.size(1), m = b.size(1);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* pc = c.data<float>();
  for (int64_t t = 0; t < 16; ++t) {
    const int64_t i = (t * 7919) % n, j = (t * 104729) % m;
    double s = 0;
    for (int64_t p = 0; p < k; ++p) s += double(pa[i * k + p]) * pb[p * m + j];
    if (std::fabs(s - pc[i * m + j]) > 1e-3 * (1 + std::fabs(s))) {
      std::fprintf(stderr, "matmul mismatch at (%ld, %ld): got %f want %f\n", long(i), long(j),
                   pc[i * m + j], s);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opts = bench::parse(argc, argv);
  for (int64_t n : {512, 1024, 2048}) {
    const std::string name = "matmul_" + std::to_string(n) + "_f32";
    if (!bench::selected(opts, name)) continue;
    Tensor a = lcg_tensor(n, n, 1), b = lcg_tensor(n, n, 2);
    if (!check(a, b, matmul(a, b))) return 1;
    bench::run(
        opts, name, [&] { bench::do_not_optimize(matmul(a, b).data_ptr()); },
        2.0 * n * n * n, 3.0 * n * n * 4);
  }
  return 0;
}
