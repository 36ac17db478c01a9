// Tiny harness shared by the tensor benchmarks and the libtorch reference (ref_libtorch.cpp), so
// both print the same lines and benchmarks/run_tensor_bench.py can interleave them:
//   BENCH name=<case> sec=<median seconds per call> flops=<per call> bytes=<per call>
// Usage: bench_x [--filter SUBSTRING] [--samples N] [--min-time SECONDS] [--list]
// Each case is checked by the caller before timing; here it is warmed up, then timed in
// `samples` batches of enough calls to last `min_time`, and the median batch is reported.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace bench {

struct Options {
  std::string filter;
  int samples = 5;
  double min_time = 0.2;
  bool list = false;
};

/// Parses the options above; --help prints them and exits 0, a bad option exits 2 naming it.
inline Options parse(int argc, char** argv) {
  Options o;
  CLI::App app{"Ember benchmark: prints BENCH lines (see benchmarks/run_tensor_bench.py)"};
  app.add_option("--filter", o.filter, "run only the cases whose name contains this");
  app.add_option("--samples", o.samples, "timed batches per case; the median is reported")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--min-time", o.min_time, "seconds each timed batch lasts at least")
      ->check(CLI::Range(0.001, 3600.0));
  app.add_flag("--list", o.list, "print the case names and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  return o;
}

inline bool selected(const Options& o, const std::string& name) {
  if (o.list) {
    std::printf("%s\n", name.c_str());
    return false;
  }
  return o.filter.empty() || name.find(o.filter) != std::string::npos;
}

/// Times fn (one call = one op) and prints a BENCH line. `sync` runs after each batch (e.g. a
/// CUDA synchronize) and is inside the timed region.
inline double run(const Options& o, const std::string& name, const std::function<void()>& fn,
                  double flops = 0, double bytes = 0, const std::function<void()>& sync = {}) {
  using clock = std::chrono::steady_clock;
  fn();  // warm up (allocator caches, lazy init)
  if (sync) sync();
  // Calibrate the batch size to last about min_time.
  int64_t calls = 1;
  for (;;) {
    auto t0 = clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    if (sync) sync();
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (dt >= o.min_time / 4 || calls >= (int64_t{1} << 30)) {
      calls = std::max<int64_t>(1, static_cast<int64_t>(calls * o.min_time / std::max(dt, 1e-9)));
      break;
    }
    calls *= 4;
  }
  std::vector<double> per_call;
  for (int s = 0; s < o.samples; ++s) {
    auto t0 = clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    if (sync) sync();
    per_call.push_back(std::chrono::duration<double>(clock::now() - t0).count() / calls);
  }
  std::sort(per_call.begin(), per_call.end());
  const double med = per_call[per_call.size() / 2];
  std::printf("BENCH name=%s sec=%.9g flops=%.6g bytes=%.6g\n", name.c_str(), med, flops, bytes);
  std::fflush(stdout);
  return med;
}

/// "<python> <source dir>/<script>" for a benchmark's PyTorch side: $EMBER_PYTHON (default
/// Debian's /usr/bin/python3) and $EMBER_SOURCE_DIR (default the tree this was built from), so a
/// build carried to another machine finds that machine's torch and its copy of the scripts.
inline std::string python_script(const std::string& built_source_dir, const std::string& script) {
  const char* py = std::getenv("EMBER_PYTHON");
  const char* src = std::getenv("EMBER_SOURCE_DIR");
  return std::string(py && *py ? py : "/usr/bin/python3") + " " +
         (src && *src ? std::string(src) : built_source_dir) + "/" + script;
}

/// Keeps the compiler from discarding a computed value.
template <typename T>
inline void do_not_optimize(const T& v) {
  asm volatile("" : : "r,m"(v) : "memory");
}

}  // namespace bench
