// bench_codecs: the compressing hooks' wire encodings (compression_hooks.h, namespace codec) on
// one bucket-sized float32 vector, one thread, beside memcpy of the same vector in the same run:
// the codecs are memory-bound loops, so memcpy's time is the floor a pass over the data can
// reach. Also the fp16 hook's and the float16 reductions' loops (distributed/detail/
// half_kernels.h) beside the scalar Half conversions they replace ("_scalar"), and top-k's choice
// (codec::topk_indices) beside the plain definition, a partial sort of every index. Prints BENCH
// lines (benchmarks/bench_util.h) and then each case's time over memcpy's.
//
//   build/benchmarks/ddp/bench_codecs [--elements N] [--samples 5] [--min-time 0.2]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ember/distributed/ddp/compression_hooks.h>
#include <ember/distributed/detail/half_kernels.h>
#include <ember/tensor/half.h>
#include "benchmarks/bench_util.h"

namespace codec = ember::dist::codec;
int main(int argc, char** argv) {
  bench::Options o;
  int64_t n = 4 << 20;  // a 16 MiB float32 bucket, past the last-level cache
  CLI::App app{"bench_codecs: int8 and sign encode/decode and top-k's choice beside memcpy"};
  app.add_option("--elements", n, "float32 elements per call")->check(CLI::Range(1, 1 << 28));
  app.add_option("--samples", o.samples, "timed batches per case; the median is reported")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--min-time", o.min_time, "seconds each timed batch lasts at least")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option("--filter", o.filter, "run only the cases whose name contains this");
  CLI11_PARSE(app, argc, argv);

  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> x(static_cast<size_t>(n)), y(x.size()), residual(x.size());
  for (float& v : x) v = normal(rng);
  const int64_t channel = 512;
  std::vector<uint8_t> q8(static_cast<size_t>(codec::int8_bytes(n, channel)));
  std::vector<uint8_t> q1(static_cast<size_t>(codec::sign_bytes(n, channel)));
  codec::int8_encode(x.data(), n, channel, q8.data());
  codec::sign_encode(x.data(), n, channel, q1.data());

  const double fbytes = 4.0 * static_cast<double>(n);
  std::map<std::string, double> sec;
  auto time = [&](const std::string& name, double bytes, const std::function<void()>& fn) {
    if (bench::selected(o, name)) sec[name] = bench::run(o, name, fn, 0, bytes);
  };
  time("memcpy_f32", 2 * fbytes, [&] { std::memcpy(y.data(), x.data(), x.size() * 4); });
  time("int8_encode", fbytes + n, [&] { codec::int8_encode(x.data(), n, channel, q8.data()); });
  time("int8_encode_residual", 2 * fbytes + n,
       [&] { codec::int8_encode(x.data(), n, channel, q8.data(), residual.data()); });
  time("int8_decode_add", 2 * fbytes + n,
       [&] { codec::int8_decode_add(q8.data(), n, channel, y.data()); });
  // Straight into a bucket (the two-phase hooks' last step), a range starting off a byte.
  time("int8_decode_range", fbytes + n,
       [&] { codec::int8_decode_range(q8.data(), n, channel, 3, n - 3, y.data()); });
  time("sign_encode_residual", 2 * fbytes + n / 8.0,
       [&] { codec::sign_encode(x.data(), n, channel, q1.data(), residual.data()); });
  time("sign_decode_add", 2 * fbytes + n / 8.0,
       [&] { codec::sign_decode_add(q1.data(), n, channel, y.data()); });
  time("sign_decode_range", fbytes + n / 8.0,
       [&] { codec::sign_decode_range(q1.data(), n, channel, 3, n - 3, y.data()); });

  // Top-k's choice at 1% and 10%, beside the plain definition (an nth_element over all n
  // indices by magnitude, ties to the lower index, then a sort of the k chosen).
  std::vector<int32_t> all_indices(static_cast<size_t>(n));
  for (const double ratio : {0.01, 0.1}) {
    const auto k = std::max<int64_t>(1, static_cast<int64_t>(ratio * static_cast<double>(n)));
    const std::string pct = std::to_string(static_cast<int>(ratio * 100)) + "pct";
    time("topk_indices_" + pct, fbytes, [&] { (void)codec::topk_indices(x.data(), n, k); });
    time("topk_nth_element_sort_" + pct, fbytes, [&] {
      std::iota(all_indices.begin(), all_indices.end(), 0);
      auto larger = [&](int32_t a, int32_t b) {
        const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
        return fa > fb || (fa == fb && a < b);
      };
      std::nth_element(all_indices.begin(), all_indices.begin() + (k - 1), all_indices.end(),
                       larger);
      std::sort(all_indices.begin(), all_indices.begin() + k);
    });
  }

  namespace half = ember::dist::detail;
  using ember::detail::f16_bits_to_f32;
  using ember::detail::f32_to_f16_bits;
  const auto un = static_cast<size_t>(n);
  std::vector<uint16_t> h(un), h2(un);
  half::float_to_half_divided(x.data(), h2.data(), un, 1.0f);
  time("fp16_cast_divide", fbytes + 2.0 * n,
       [&] { half::float_to_half_divided(x.data(), h.data(), un, 4.0f); });
  time("fp16_cast_divide_scalar", fbytes + 2.0 * n, [&] {
    for (size_t i = 0; i < un; ++i) {
      h[i] = f32_to_f16_bits(f16_bits_to_f32(f32_to_f16_bits(x[i])) / 4.0f);
    }
  });
  time("fp16_sum", 6.0 * n, [&] { half::half_sum(h.data(), h2.data(), h2.data(), un); });
  time("fp16_sum_scalar", 6.0 * n, [&] {
    for (size_t i = 0; i < un; ++i) {
      h[i] = f32_to_f16_bits(f16_bits_to_f32(h2[i]) + f16_bits_to_f32(h2[i]));
    }
  });
  time("fp16_to_f32", 2.0 * n + fbytes, [&] { half::half_to_float(h2.data(), y.data(), un); });
  time("fp16_to_f32_scalar", 2.0 * n + fbytes, [&] {
    for (size_t i = 0; i < un; ++i) y[i] = f16_bits_to_f32(h2[i]);
  });

  if (sec.count("memcpy_f32") != 0) {
    std::printf("\n%lld elements, one thread; time / memcpy's time (memcpy %.3f ms, %.2f GB/s)\n",
                static_cast<long long>(n), sec["memcpy_f32"] * 1e3,
                2 * fbytes / sec["memcpy_f32"] / 1e9);
    for (const auto& [name, s] : sec) {
      std::printf("%-22s %9.3f ms  %6.2fx memcpy\n", name.c_str(), s * 1e3,
                  s / sec["memcpy_f32"]);
    }
  }
  return 0;
}
