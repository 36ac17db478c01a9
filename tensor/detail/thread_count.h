// How many CPU threads Ember's kernels start with, decided from the environment and the CPUs the
// process may run on (tensor/threading.cpp applies it when the library loads). A pure function
// of its inputs, so each launcher's case is testable without starting one; and the affinity
// mask it is given the count of.
#pragma once

#include <map>
#include <string>

namespace ember::detail {

/// A thread count and the reason for it, e.g. {4, "EMBER_NUM_THREADS=4"} or
/// {8, "32 CPUs in the affinity mask shared by OMPI_COMM_WORLD_LOCAL_SIZE=4 ranks"}.
struct ThreadCount {
  int threads = 1;
  std::string reason;
};

/// The default thread count of a process whose environment is `env`, that may run on
/// `affinity_cpus` CPUs (sched_getaffinity: what taskset, srun --cpus-per-task with task
/// binding, and cgroup cpusets give) of the machine's `online_cpus`:
/// 1. EMBER_NUM_THREADS, else OMP_NUM_THREADS, when it is a positive integer (emberrun sets
///    both to its share of the cores; a value that is not a positive integer is skipped, and
///    the reason says so, since this runs when the library loads and cannot throw);
/// 2. else `affinity_cpus`, divided among the ranks of this node when the mask is the whole
///    machine (nothing bound the ranks to cores of their own) and a launcher other than
///    emberrun started several: LOCAL_WORLD_SIZE, else OMPI_COMM_WORLD_LOCAL_SIZE, else
///    MPI_LOCALNRANKS, else in an srun step (SLURM_STEP_ID set; a batch script is one process
///    whatever SLURM_NTASKS says) this node's entry of SLURM_STEP_TASKS_PER_NODE, else of
///    SLURM_TASKS_PER_NODE ("2(x3),1" form, indexed by SLURM_NODEID), else
///    SLURM_NTASKS_PER_NODE;
/// 3. then at most SLURM_CPUS_PER_TASK when it is set.
/// Always at least 1.
ThreadCount default_thread_count(const std::map<std::string, std::string>& env, int affinity_cpus,
                                 int online_cpus);

/// The CPUs the calling thread may run on (sched_getaffinity) as one '0' or '1' per CPU, the
/// mask sized for the machine (a fixed cpu_set_t stops at 1024 CPUs and sched_getaffinity fails
/// beyond); empty when the kernel does not say.
std::string affinity_mask();

/// This node's task count from a Slurm tasks-per-node list such as "2(x3),1" (nodes 0-2 run 2
/// tasks, node 3 runs 1) for node `node_id`; 0 when the list is malformed or too short.
int slurm_tasks_on_node(const std::string& tasks_per_node, int node_id);

}  // namespace ember::detail
