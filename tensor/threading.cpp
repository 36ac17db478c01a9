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

std::string detail::affinity_mask() {
  const int size = std::max(static_cast<int>(std::thread::hardware_concurrency()), CPU_SETSIZE);
  cpu_set_t* set = CPU_ALLOC(size);
  if (set == nullptr) return {};
  const size_t bytes = CPU_ALLOC_SIZE(size);
  std::string mask;
  if (sched_getaffinity(0, bytes, set) == 0) {
    mask.assign(static_cast<size_t>(size), '0');
    for (int c = 0; c < size; ++c) {
      if (CPU_ISSET_S(c, bytes, set)) mask[static_cast<size_t>(c)] = '1';
    }
  }
  CPU_FREE(set);
  return mask;
}

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

// The CPUs this process may run on (all `online` ones when the kernel does not say).
int affinity_cpus(int online) {
  const std::string mask = detail::affinity_mask();
  const auto n = static_cast<int>(std::count(mask.begin(), mask.end(), '1'));
  return std::max(1, mask.empty() ? online : n);
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
    // The team OpenMP gave, which may be smaller than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC):
    // chunks counted from `nt` would leave the range past the team's last chunk undone.
    const int team = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    const int64_t chunk = (n + team - 1) / team;
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
