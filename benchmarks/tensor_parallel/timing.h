// Timing helpers of the model-parallel benchmarks (bench_context_parallel, bench_expert_parallel).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace ember::bench {

using Clock = std::chrono::steady_clock;

inline double since_ms(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// The middle value (the upper of the two middle ones for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace ember::bench
