// The machine's memory bandwidth, the yardstick for memory-bound ops: one core copying 64 MiB
// with memcpy (bytes counted as read + written), and the same through Ember's copy_.
#include <cstring>
#include <vector>

#include "bench_util.h"
#include <ember/tensor/ops.h>

int main(int argc, char** argv) {
  bench::Options o = bench::parse(argc, argv);
  const size_t n = size_t{64} << 20;
  if (bench::selected(o, "memcpy_64MB")) {
    std::vector<char> a(n, 1), b(n, 2);
    bench::run(o, "memcpy_64MB", [&] {
      std::memcpy(b.data(), a.data(), n);
      bench::do_not_optimize(b[n / 2]);
    }, 0, 2.0 * n);
  }
  if (bench::selected(o, "copy_16M_f32")) {
    ember::Tensor a = ember::ones({16 << 20}), b = ember::zeros({16 << 20});
    b.copy_(a);
    if (b[123].item<float>() != 1.0f) return 1;
    bench::run(o, "copy_16M_f32", [&] { b.copy_(a); }, 0, 2.0 * n);
  }
  return 0;
}
