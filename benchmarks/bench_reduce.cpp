// Reduction benchmarks (CPU): full sum, sums over either dim of a matrix, softmax, argmax.
// Case names and byte counts match benchmarks/ref_libtorch.cpp and run_tensor_bench.py.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "benchmarks/bench_util.h"
#include <ember/tensor/ops.h>

using namespace ember;

namespace {

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "bench_reduce: wrong result in %s\n", what);
    std::exit(1);
  }
}

// Deterministic values in [-1, 1) without depending on the random-number family.
Tensor pattern(int64_t rows, int64_t cols) {
  std::vector<float> v(rows * cols);
  uint32_t s = 12345;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / static_cast<float>(1 << 23) - 1.0f;
  }
  return from_vector(v, {rows, cols});
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options o = bench::parse(argc, argv);
  const int64_t M16 = 16 * 1024 * 1024;

  if (bench::selected(o, "sum_16M_f32")) {
    Tensor a = full({M16}, 0.5f);
    expect(sum(a).item<float>() == 0.5f * M16, "sum_16M_f32");
    bench::run(o, "sum_16M_f32", [&] { bench::do_not_optimize(sum(a)); }, 0, 4.0 * M16);
  }
  const bool need_m = bench::selected(o, "sum_dim0_4096x4096_f32") ||
                      bench::selected(o, "sum_dim1_4096x4096_f32");
  if (need_m || o.list) {
    Tensor m = full({4096, 4096}, 1.0f);
    if (bench::selected(o, "sum_dim0_4096x4096_f32")) {
      auto v = sum(m, {0}).to_vector<float>();
      expect(v.size() == 4096 && v[0] == 4096.0f && v[4095] == 4096.0f, "sum_dim0");
      bench::run(o, "sum_dim0_4096x4096_f32", [&] { bench::do_not_optimize(sum(m, {0})); }, 0,
                 4.0 * 4096 * 4096);
    }
    if (bench::selected(o, "sum_dim1_4096x4096_f32")) {
      auto v = sum(m, {1}).to_vector<float>();
      expect(v.size() == 4096 && v[0] == 4096.0f && v[4095] == 4096.0f, "sum_dim1");
      bench::run(o, "sum_dim1_4096x4096_f32", [&] { bench::do_not_optimize(sum(m, {1})); }, 0,
                 4.0 * 4096 * 4096);
    }
  }
  const bool need_s = bench::selected(o, "softmax_4096x1024_f32") ||
                      bench::selected(o, "argmax_4096x1024_f32");
  if (need_s || o.list) {
    Tensor s = pattern(4096, 1024);
    if (bench::selected(o, "softmax_4096x1024_f32")) {
      Tensor y = softmax(s, 1);
      auto row = sum(y, {1}).to_vector<float>();
      expect(std::fabs(row[0] - 1.0f) < 1e-5f && std::fabs(row[4095] - 1.0f) < 1e-5f, "softmax");
      bench::run(o, "softmax_4096x1024_f32", [&] { bench::do_not_optimize(softmax(s, 1)); }, 0,
                 8.0 * 4096 * 1024);
    }
    if (bench::selected(o, "argmax_4096x1024_f32")) {
      auto idx = argmax(s, 1).to_vector<int64_t>();
      auto sv = s.to_vector<float>();
      int64_t best = 0;
      for (int64_t j = 1; j < 1024; ++j) {
        if (sv[j] > sv[best]) best = j;
      }
      expect(idx[0] == best, "argmax");
      bench::run(o, "argmax_4096x1024_f32", [&] { bench::do_not_optimize(argmax(s, 1)); }, 0,
                 4.0 * 4096 * 1024);
    }
  }
  return 0;
}
