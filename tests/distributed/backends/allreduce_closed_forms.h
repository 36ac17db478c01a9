// The allreduce inputs and results the collective tests of every backend check against:
// rank r's input at index i is r + 1 + i % 2, so every ReduceOp has a closed form.
#pragma once

#include <cmath>
#include <cstdint>

#include <ember/distributed/process_group.h>

namespace ember::test {

inline double input(int r, int64_t i) { return r + 1 + static_cast<double>(i % 2); }

/// The reduction over n ranks of input(r, i) with `op`, as dtype d holds it.
inline double expected(dist::ReduceOp op, int n, int64_t i, Dtype d) {
  const double k = static_cast<double>(i % 2);
  switch (op) {
    case dist::ReduceOp::Sum:
      return n * (n + 1) / 2.0 + n * k;
    case dist::ReduceOp::Avg: {
      const double s = n * (n + 1) / 2.0 + n * k;
      return is_floating(d) ? s / n : std::floor(s / n);  // integers: truncating division
    }
    case dist::ReduceOp::Product: {
      double p = 1;
      for (int r = 0; r < n; ++r) p *= r + 1 + k;
      return p;
    }
    case dist::ReduceOp::Min:
      return 1 + k;
    case dist::ReduceOp::Max:
      return n + k;
  }
  return 0;
}

}  // namespace ember::test
