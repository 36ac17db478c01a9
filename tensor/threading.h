// One thread setting for everything Ember runs on the CPU: its own kernels, OpenBLAS and oneDNN.
// It starts from EMBER_NUM_THREADS, else OMP_NUM_THREADS, else this rank's share of the CPUs
// it may run on (detail/thread_count.h), applied at start-up, so the libraries underneath never
// spawn threads that fight Ember's over the cores (as OpenBLAS does under Debian's PyTorch).
#pragma once

#include <cstdint>
#include <functional>

namespace ember {

/// Sets the number of CPU threads for Ember's kernels, OpenBLAS and oneDNN (n >= 1).
void set_num_threads(int n);
int get_num_threads();

namespace detail {
/// Splits [begin, end) into chunks of at least `grain` elements and runs fn(chunk_begin,
/// chunk_end) on the thread pool; runs inline when the range is small or one thread is set.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);
/// Elements below which element-wise kernels stay on one thread.
inline constexpr int64_t kGrainSize = 32768;
}  // namespace detail

}  // namespace ember
