// The kernel thread count: default_thread_count's rules for each launcher (emberrun's variable,
// an affinity mask, ranks of mpirun or srun sharing a node, Slurm's CPUs per task), Slurm's
// tasks-per-node lists, set_num_threads, and the count a process really starts with under
// taskset (this binary run again as a child).
#include <ember/tensor/threading.h>

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include <ember/tensor/detail/thread_count.h>
#include <ember/tensor/error.h>
#include <ember/tensor/ops.h>
#include "tests/examples/example_test_util.h"

namespace ember {
namespace {

using detail::default_thread_count;
using detail::slurm_tasks_on_node;
using Env = std::map<std::string, std::string>;

TEST(ThreadCount, EmberThenOmpVariableWins) {
  auto t = default_thread_count(Env{{"EMBER_NUM_THREADS", "3"}, {"OMP_NUM_THREADS", "5"}}, 8, 8);
  EXPECT_EQ(t.threads, 3);
  EXPECT_EQ(t.reason, "EMBER_NUM_THREADS=3");
  // A variable wins over the mask, the local ranks and Slurm's limit alike.
  t = default_thread_count(Env{{"OMP_NUM_THREADS", "5"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                               {"SLURM_CPUS_PER_TASK", "2"}},
                           1, 8);
  EXPECT_EQ(t.threads, 5);
  EXPECT_EQ(t.reason, "OMP_NUM_THREADS=5");
}

TEST(ThreadCount, ValueThatIsNotAPositiveIntegerIsSkippedAndSaid) {
  auto t = default_thread_count(Env{{"EMBER_NUM_THREADS", "four"}, {"OMP_NUM_THREADS", "2"}}, 8, 8);
  EXPECT_EQ(t.threads, 2);
  EXPECT_EQ(t.reason,
            "EMBER_NUM_THREADS='four' is not a positive integer, skipped; OMP_NUM_THREADS=2");
  t = default_thread_count(Env{{"EMBER_NUM_THREADS", "0"}, {"OMP_NUM_THREADS", "4,2"}}, 6, 6);
  EXPECT_EQ(t.threads, 6);
  EXPECT_NE(t.reason.find("EMBER_NUM_THREADS='0' is not a positive integer"), std::string::npos)
      << t.reason;
  EXPECT_NE(t.reason.find("OMP_NUM_THREADS='4,2' is not a positive integer"), std::string::npos)
      << t.reason;
  EXPECT_NE(t.reason.find("6 CPUs in the affinity mask"), std::string::npos) << t.reason;
  for (const char* bad : {"", "-3", "2x", " 2", "99999999999"}) {
    EXPECT_EQ(default_thread_count(Env{{"EMBER_NUM_THREADS", bad}}, 3, 4).threads, 3) << bad;
  }
}

TEST(ThreadCount, AffinityMaskWithoutLauncher) {
  auto t = default_thread_count(Env{}, 16, 16);
  EXPECT_EQ(t.threads, 16);
  EXPECT_EQ(t.reason, "16 CPUs in the affinity mask");
  // taskset -c 0, or srun binding a task to one CPU.
  t = default_thread_count(Env{}, 1, 16);
  EXPECT_EQ(t.threads, 1);
  EXPECT_EQ(t.reason, "1 CPU in the affinity mask");
  EXPECT_EQ(default_thread_count(Env{}, 0, 16).threads, 1);  // never below one
}

TEST(ThreadCount, RanksSharingAWholeMachineMaskDivideIt) {
  EXPECT_EQ(default_thread_count(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}, 16, 16).threads, 4);
  EXPECT_EQ(default_thread_count(Env{{"MPI_LOCALNRANKS", "3"}}, 16, 16).threads, 5);
  EXPECT_EQ(default_thread_count(Env{{"LOCAL_WORLD_SIZE", "2"}}, 16, 16).threads, 8);
  const auto t = default_thread_count(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}, 16, 16);
  EXPECT_EQ(t.reason, "16 CPUs in the affinity mask shared by OMPI_COMM_WORLD_LOCAL_SIZE=4 ranks");
  // More ranks than cores: one thread each.
  EXPECT_EQ(default_thread_count(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}, 2, 2).threads, 1);
  // torchrun's variable comes first, then Open MPI's.
  EXPECT_EQ(default_thread_count(
                Env{{"LOCAL_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}, 16, 16)
                .threads,
            8);
  // A bad local size is no local size.
  EXPECT_EQ(default_thread_count(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "x"}}, 16, 16).threads, 16);
}

TEST(ThreadCount, ANarrowerMaskIsThisRanksOwn) {
  // mpirun --bind-to or srun's task binding gave this rank 4 of the 16 CPUs: all 4 are its own.
  const auto t = default_thread_count(Env{{"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}, 4, 16);
  EXPECT_EQ(t.threads, 4);
  EXPECT_EQ(t.reason, "4 CPUs in the affinity mask");
}

TEST(ThreadCount, SrunTasksShareTheNodeOnlyInAStep) {
  const Env step{{"SLURM_STEP_ID", "0"},
                 {"SLURM_NODEID", "1"},
                 {"SLURM_STEP_TASKS_PER_NODE", "4(x2),2"},
                 {"SLURM_TASKS_PER_NODE", "8(x3)"}};
  auto t = default_thread_count(step, 32, 32);
  EXPECT_EQ(t.threads, 8);
  EXPECT_EQ(
      t.reason,
      "32 CPUs in the affinity mask shared by SLURM_STEP_TASKS_PER_NODE=4(x2),2 (node 1) ranks");
  Env last = step;
  last["SLURM_NODEID"] = "2";
  EXPECT_EQ(default_thread_count(last, 32, 32).threads, 16);
  // Without the step's list, the job's; without either, --ntasks-per-node's.
  Env job = step;
  job.erase("SLURM_STEP_TASKS_PER_NODE");
  EXPECT_EQ(default_thread_count(job, 32, 32).threads, 4);
  Env requested{{"SLURM_STEP_ID", "3"}, {"SLURM_NTASKS_PER_NODE", "2"}};
  EXPECT_EQ(default_thread_count(requested, 32, 32).threads, 16);
  // The batch script (no SLURM_STEP_ID) is one process, whatever the job's layout says.
  Env batch = step;
  batch.erase("SLURM_STEP_ID");
  batch["SLURM_NTASKS_PER_NODE"] = "4";
  t = default_thread_count(batch, 32, 32);
  EXPECT_EQ(t.threads, 32);
  EXPECT_EQ(t.reason, "32 CPUs in the affinity mask");
  // A node id past the list, or not a number, gives no local size.
  Env past = step;
  past["SLURM_NODEID"] = "7";
  past.erase("SLURM_TASKS_PER_NODE");
  EXPECT_EQ(default_thread_count(past, 32, 32).threads, 32);
  past["SLURM_NODEID"] = "one";
  EXPECT_EQ(default_thread_count(past, 32, 32).threads, 32);
}

TEST(ThreadCount, SlurmCpusPerTaskIsAnUpperBound) {
  auto t = default_thread_count(Env{{"SLURM_CPUS_PER_TASK", "6"}}, 64, 64);
  EXPECT_EQ(t.threads, 6);
  EXPECT_EQ(t.reason, "64 CPUs in the affinity mask, at most SLURM_CPUS_PER_TASK=6");
  // Never raises the count: 4 ranks on 16 cores get 4 each even with 6 per task asked for.
  t = default_thread_count(
      Env{{"SLURM_CPUS_PER_TASK", "6"}, {"SLURM_STEP_ID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "4"}},
      16, 16);
  EXPECT_EQ(t.threads, 4);
  EXPECT_EQ(default_thread_count(Env{{"SLURM_CPUS_PER_TASK", "8"}}, 2, 64).threads, 2);
  EXPECT_EQ(default_thread_count(Env{{"SLURM_CPUS_PER_TASK", "zero"}}, 8, 8).threads, 8);
}

TEST(ThreadCount, SlurmTasksPerNodeLists) {
  EXPECT_EQ(slurm_tasks_on_node("4", 0), 4);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(slurm_tasks_on_node("2(x3),1", 4), 0);
  EXPECT_EQ(slurm_tasks_on_node("1,3,2(x2)", 1), 3);
  EXPECT_EQ(slurm_tasks_on_node("1,3,2(x2)", 3), 2);
  for (const char* bad : {"", "x", "2(x)", "2(3)", "2(x3", "0", "2,,1", "2,", "-1"}) {
    EXPECT_EQ(slurm_tasks_on_node(bad, 0), 0) << bad;
  }
}

TEST(Threading, SetNumThreadsChangesTheCountAndRefusesZero) {
  const int saved = get_num_threads();
  set_num_threads(3);
  EXPECT_EQ(get_num_threads(), 3);
  EXPECT_THROW(set_num_threads(0), ValueError);
  EXPECT_EQ(get_num_threads(), 3);
  set_num_threads(saved);
}

// Run by StartsWithTheCountOfItsAffinityMask in a child of its own environment; skipped when
// this binary runs on its own.
TEST(Threading, ChildReportsItsThreadCount) {
  if (std::getenv("EMBER_THREADING_TEST_CHILD") == nullptr) {
    GTEST_SKIP() << "run as a child by Threading.StartsWithTheCountOfItsAffinityMask";
  }
  std::printf("kernel threads: %d\n", get_num_threads());
}

std::string child(const std::string& prefix) {
  // The launcher variables of the test's own environment must not decide the child's count.
  const std::string cmd =
      "env -u EMBER_NUM_THREADS -u OMP_NUM_THREADS -u LOCAL_WORLD_SIZE -u "
      "OMPI_COMM_WORLD_LOCAL_SIZE -u MPI_LOCALNRANKS -u SLURM_STEP_ID -u SLURM_CPUS_PER_TASK "
      "EMBER_THREADING_TEST_CHILD=1 " +
      prefix + " /proc/" + std::to_string(getpid()) +
      "/exe --gtest_filter=Threading.ChildReportsItsThreadCount";
  const test::CommandResult r = test::run_command(cmd, 60);
  EXPECT_EQ(r.status, 0) << cmd << "\n" << r.output;
  const size_t at = r.output.find("kernel threads: ");
  if (at == std::string::npos) {
    ADD_FAILURE() << cmd << " printed no count:\n" << r.output;
    return "";
  }
  return r.output.substr(at, r.output.find('\n', at) - at);
}

// Run by ThreadLimitBelowTheCountLeavesNoWorkUndone in a child under OMP_THREAD_LIMIT=2.
TEST(Threading, ChildComputesAtEightThreads) {
  if (std::getenv("EMBER_THREADING_TEST_CHILD") == nullptr) {
    GTEST_SKIP() << "run as a child by Threading.ThreadLimitBelowTheCountLeavesNoWorkUndone";
  }
  set_num_threads(8);
  const Tensor x = ones({1 << 20});
  std::printf("sum %.1f\n", x.sum().item<double>());
  std::printf("doubled %.1f\n", (x * 2.0).sum().item<double>());
  std::printf("softmax rows %.1f\n", softmax(ones({4096, 64}), 1).sum().item<double>());
}

// OpenMP may give a parallel region fewer threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC on a
// loaded machine): parallel_for cut the range for the count asked, so the chunks of threads that
// never started were skipped (a sum of 2^20 ones came out of uninitialised partials).
TEST(Threading, ThreadLimitBelowTheCountLeavesNoWorkUndone) {
  const std::string cmd =
      "env -u EMBER_NUM_THREADS -u OMP_NUM_THREADS OMP_THREAD_LIMIT=2 "
      "EMBER_THREADING_TEST_CHILD=1 /proc/" +
      std::to_string(getpid()) + "/exe --gtest_filter=Threading.ChildComputesAtEightThreads";
  const test::CommandResult r = test::run_command(cmd, 60);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("sum 1048576.0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("doubled 2097152.0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("softmax rows 4096.0\n"), std::string::npos) << r.output;
}

TEST(Threading, StartsWithTheCountOfItsAffinityMask) {
  EXPECT_EQ(child("taskset -c 0"), "kernel threads: 1");
  // Two ranks of mpirun on this process's CPUs, unbound: each takes half of them.
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int mine = CPU_COUNT(&set);
  const int online = static_cast<int>(std::thread::hardware_concurrency());
  if (mine == online) {
    EXPECT_EQ(child("OMPI_COMM_WORLD_LOCAL_SIZE=2"),
              "kernel threads: " + std::to_string(std::max(1, mine / 2)));
  }
  EXPECT_EQ(child("EMBER_NUM_THREADS=3 taskset -c 0"), "kernel threads: 3");
}

}  // namespace
}  // namespace ember
