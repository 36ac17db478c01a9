// Indexing, joining and random-number benchmarks (CPU). bytes = bytes read + written per call.
//   index_select_rows_1Mx64_f32: 65536 random rows of a [65536, 64] float32 table (16 MiB read,
//                                16 MiB written, plus the 512 KiB int64 index)
//   embedding_b64x128_d256:      8192 ids ([64, 128]) into a [32768, 256] float32 table
//   cat_2x8M_f32:                two float32 vectors of 8M elements along dim 0
//   randn_16M_f32 / rand_16M_f32: 16M float32 values (64 MiB written)
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench_util.h"
#include <ember/tensor/ops.h>

using namespace ember;

namespace {

// Deterministic row ids (a 64-bit LCG), independent of Ember's random module.
Tensor row_ids(int64_t n, int64_t bound, IntList shape) {
  std::vector<int64_t> v(n);
  uint64_t s = 12345;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(bound));
  }
  return from_vector(v, shape);
}

bool check(bool ok, const char* name) {
  if (!ok) std::fprintf(stderr, "CHECK FAILED: %s\n", name);
  return ok;
}

// Spot-checks rows of a gather: out[i, :] == table[ids[i], :].
bool rows_match(const Tensor& out, const Tensor& table, const Tensor& ids) {
  const int64_t d = table.size(1);
  const float* o = out.data<float>();
  const float* t = table.data<float>();
  const int64_t* id = ids.data<int64_t>();
  for (int64_t i = 0; i < ids.numel(); i += 997) {
    for (int64_t j = 0; j < d; ++j) {
      if (o[i * d + j] != t[id[i] * d + j]) return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opts = bench::parse(argc, argv);
  bool ok = true;

  if (bench::selected(opts, "index_select_rows_1Mx64_f32")) {
    const int64_t rows = 65536, d = 64, n = 65536;
    const Tensor table = arange(0.0, static_cast<double>(rows * d), 1.0).view({rows, d});
    const Tensor ids = row_ids(n, rows, {n});
    ok &= check(rows_match(index_select(table, 0, ids), table, ids), "index_select");
    bench::run(opts, "index_select_rows_1Mx64_f32",
               [&] { bench::do_not_optimize(index_select(table, 0, ids)); }, 0,
               2.0 * n * d * 4 + n * 8);
  }
  if (bench::selected(opts, "embedding_b64x128_d256")) {
    const int64_t vocab = 32768, d = 256;
    const Tensor weight = arange(0.0, static_cast<double>(vocab * d), 1.0).view({vocab, d});
    const Tensor ids = row_ids(64 * 128, vocab, {64, 128});
    ok &= check(rows_match(embedding(weight, ids).view({-1, d}), weight, ids.view({-1})),
                "embedding");
    bench::run(opts, "embedding_b64x128_d256",
               [&] { bench::do_not_optimize(embedding(weight, ids)); }, 0,
               2.0 * 64 * 128 * d * 4 + 64 * 128 * 8);
  }
  if (bench::selected(opts, "cat_2x8M_f32")) {
    const int64_t n = 8 << 20;
    const Tensor a = full({n}, 1.0f), b = full({n}, 2.0f);
    const Tensor c = cat({a, b});
    const float* p = c.data<float>();
    ok &= check(c.numel() == 2 * n && p[0] == 1.0f && p[n - 1] == 1.0f && p[n] == 2.0f &&
                    p[2 * n - 1] == 2.0f,
                "cat");
    bench::run(opts, "cat_2x8M_f32", [&] { bench::do_not_optimize(cat({a, b})); }, 0,
               2.0 * 2 * n * 4);
  }
  const int64_t n16 = 16 << 20;
  if (bench::selected(opts, "randn_16M_f32")) {
    Generator g(1);
    const Tensor t = randn({n16}, kFloat32, &g);
    double s = 0, s2 = 0;
    for (float x : t.to_vector<float>()) {
      s += x;
      s2 += static_cast<double>(x) * x;
    }
    ok &= check(std::abs(s / n16) < 1e-3 && std::abs(s2 / n16 - 1) < 2e-3, "randn moments");
    bench::run(opts, "randn_16M_f32", [&] { bench::do_not_optimize(randn({n16}, kFloat32, &g)); },
               0, n16 * 4.0);
  }
  if (bench::selected(opts, "rand_16M_f32")) {
    Generator g(2);
    const Tensor t = rand({n16}, kFloat32, &g);
    double s = 0;
    for (float x : t.to_vector<float>()) s += x;
    ok &= check(std::abs(s / n16 - 0.5) < 1e-3, "rand mean");
    bench::run(opts, "rand_16M_f32", [&] { bench::do_not_optimize(rand({n16}, kFloat32, &g)); },
               0, n16 * 4.0);
  }
  return ok ? 0 : 1;
}
