#include <ember/tensor/threading.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include <ember/tensor/error.h>

extern "C" void openblas_set_num_threads(int);

namespace ember {

namespace {

int threads_from_env() {
  for (const char* name : {"EMBER_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n >= 1) return static_cast<int>(n);
    }
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::atomic<int>& num_threads() {
  static std::atomic<int> n{[] {
    int v = threads_from_env();
    openblas_set_num_threads(v);
    omp_set_num_threads(v);
    return v;
  }()};
  return n;
}

// Apply the setting when the library loads, before OpenBLAS's own threads get a chance to run.
const int kInit = num_threads().load();

}  // namespace

void set_num_threads(int n) {
  EMBER_CHECK(n >= 1, "[set_num_threads] expected a thread count >= 1, got ", n);
  num_threads().store(n);
  openblas_set_num_threads(n);
  omp_set_num_threads(n);
}

int get_num_threads() { return num_threads().load(std::memory_order_relaxed); }

namespace detail {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  const int nt = static_cast<int>(std::min<int64_t>(get_num_threads(), (n + grain - 1) / grain));
  if (nt <= 1 || omp_in_parallel()) {
    fn(begin, end);
    return;
  }
  // Exceptions must not cross the OpenMP region: keep the first and rethrow after it.
  std::exception_ptr error;
  std::atomic<bool> failed{false};
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t b = begin + tid * chunk;
    const int64_t e = std::min(end, b + chunk);
    if (b < e) {
      try {
        fn(b, e);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace detail
}  // namespace ember
