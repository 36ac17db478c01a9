#include <ember/tensor/threading.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include <ember/tensor/detail/thread_count.h>
#include <ember/tensor/error.h>

extern "C" void openblas_set_num_threads(int);

namespace ember {

namespace {

// The variables default_thread_count reads, snapshotted when the library loads.
std::map<std::string, std::string> thread_environment() {
  std::map<std::string, std::string> env;
  for (const char* name :
       {"EMBER_NUM_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS", "SLURM_STEP_ID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK"}) {
    if (const char* v = std::getenv(name)) env[name] = v;
  }
  return env;
}

// The CPUs this process may run on; the mask is sized for the machine, since a fixed cpu_set_t
// stops at 1024 CPUs and sched_getaffinity fails beyond.
int affinity_cpus(int online) {
  const int size = std::max(online, CPU_SETSIZE);
  cpu_set_t* set = CPU_ALLOC(size);
  const size_t bytes = CPU_ALLOC_SIZE(size);
  int n = online;
  if (set != nullptr && sched_getaffinity(0, bytes, set) == 0) n = CPU_COUNT_S(bytes, set);
  CPU_FREE(set);
  return std::max(1, n);
}

int threads_from_env() {
  const int online = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return detail::default_thread_count(thread_environment(), affinity_cpus(online), online).threads;
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
