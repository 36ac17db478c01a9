// Element-wise ops: memory-bound throughput on 16M floats (into an existing tensor and with a
// fresh result) and per-op overhead on one-element tensors, the cases PyTorch is compared on in
// benchmarks/run_tensor_bench.py and ref_libtorch.cpp.
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>

#include "bench_util.h"
#include <ember/tensor/ops.h>

using namespace ember;

namespace {
int fail(const char* name) {
  std::fprintf(stderr, "%s: wrong result\n", name);
  return 1;
}
// Whether any case in names would run (so big inputs are only made when needed).
bool any_selected(const bench::Options& o, std::initializer_list<const char*> names) {
  if (o.list || o.filter.empty()) return true;
  for (const char* n : names) {
    if (std::string(n).find(o.filter) != std::string::npos) return true;
  }
  return false;
}
bool near(float got, float want) { return std::fabs(got - want) <= 1e-6f * std::fabs(want) + 1e-7f; }
}  // namespace

int main(int argc, char** argv) {
  bench::Options o = bench::parse(argc, argv);
  const int64_t M16 = int64_t{16} << 20;
  if (any_selected(o, {"add_16M_f32_out", "add_16M_f32_fresh", "mul_scalar_16M_f32_out",
                       "exp_16M_f32_fresh"})) {
    Tensor a = rand({M16}), b = rand({M16}), c = empty({M16});
    const float a7 = a[7].item<float>(), b7 = b[7].item<float>();
    if (bench::selected(o, "add_16M_f32_out")) {
      add_out(c, a, b);
      if (!near(c[7].item<float>(), a7 + b7)) return fail("add_16M_f32_out");
      bench::run(o, "add_16M_f32_out", [&] { add_out(c, a, b); }, 0, 12.0 * M16);
    }
    if (bench::selected(o, "add_16M_f32_fresh")) {
      if (!near((a + b)[7].item<float>(), a7 + b7)) return fail("add_16M_f32_fresh");
      bench::run(o, "add_16M_f32_fresh", [&] {
        Tensor r = a + b;
        bench::do_not_optimize(r.data_ptr());
      }, 0, 12.0 * M16);
    }
    if (bench::selected(o, "mul_scalar_16M_f32_out")) {
      mul_out(c, a, scalar_tensor(2.5f, kFloat32));
      if (!near(c[7].item<float>(), a7 * 2.5f)) return fail("mul_scalar_16M_f32_out");
      bench::run(o, "mul_scalar_16M_f32_out", [&] { mul_out(c, a, scalar_tensor(2.5f, kFloat32)); },
                 0, 8.0 * M16);
    }
    if (bench::selected(o, "exp_16M_f32_fresh")) {
      if (!near(exp(a)[7].item<float>(), std::exp(a7))) return fail("exp_16M_f32_fresh");
      bench::run(o, "exp_16M_f32_fresh", [&] {
        Tensor r = exp(a);
        bench::do_not_optimize(r.data_ptr());
      }, 0, 8.0 * M16);
    }
  }
  {
    Tensor a = rand({1}), b = rand({1});
    if (bench::selected(o, "add_1_f32")) {
      if (!near((a + b).item<float>(), a.item<float>() + b.item<float>())) return fail("add_1_f32");
      bench::run(o, "add_1_f32", [&] {
        Tensor r = a + b;
        bench::do_not_optimize(r.data_ptr());
      });
    }
    if (bench::selected(o, "add_1_f32_inplace")) {
      const float want = a.item<float>() + b.item<float>();
      a.add_(b);
      if (!near(a.item<float>(), want)) return fail("add_1_f32_inplace");
      bench::run(o, "add_1_f32_inplace", [&] { a.add_(b); });
    }
  }
  return 0;
}
