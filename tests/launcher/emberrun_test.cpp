// End-to-end tests of emberrun: each test runs build/launcher/emberrun on the worker program
// build/launcher/test_workers/test_worker (tests/launcher/test_worker.cpp) and checks its exit
// status, output, files and that no worker process outlives it.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "emberrun_harness.h"

namespace {

using namespace emberrun_test;
namespace fs = std::filesystem;

class EnvTest : public ::testing::TestWithParam<int> {};

TEST_P(EnvTest, WorkersSeeTheirEnvironmentAndOutputIsPrefixed) {
  const int n = GetParam();
  TempDir d;
  Result r = run({"--nproc-per-node", std::to_string(n), "--master-port", "29613", worker(),
                  "env", d.path(), "a b", "--c"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const int threads = std::max(1, available_cpus() / n);
  for (int i = 0; i < n; ++i) {
    std::string env = read_file(d.path() + "/env_" + std::to_string(i) + ".txt");
    std::string ri = std::to_string(i), ns = std::to_string(n);
    for (const std::string& kv :
         {"RANK=" + ri, "LOCAL_RANK=" + ri, "WORLD_SIZE=" + ns, "LOCAL_WORLD_SIZE=" + ns,
          std::string("GROUP_RANK=0"), std::string("MASTER_ADDR=127.0.0.1"),
          std::string("MASTER_PORT=29613"), std::string("TORCHELASTIC_RESTART_COUNT=0"),
          std::string("EMBER_RESTART_COUNT=0"), "OMP_NUM_THREADS=" + std::to_string(threads),
          "EMBER_NUM_THREADS=" + std::to_string(threads), std::string("OMP_WAIT_POLICY=PASSIVE"),
          std::string("ARG=a b"),
          std::string("ARG=--c")}) {
      EXPECT_TRUE(contains(env, kv + "\n")) << "rank " << i << " lacks " << kv << ":\n" << env;
    }
    EXPECT_TRUE(contains(env, "/attempt_0/" + ri + "/error.json")) << env;
    EXPECT_TRUE(contains(r.out, "[rank " + ri + "]: hello from rank " + ri + "\n")) << describe(r);
    EXPECT_TRUE(contains(r.err, "[rank " + ri + "]: warning from rank " + ri + "\n"))
        << describe(r);
  }
}
INSTANTIATE_TEST_SUITE_P(Emberrun, EnvTest, ::testing::Values(1, 2, 4));

class DistTest : public ::testing::TestWithParam<int> {};

TEST_P(DistTest, InitProcessGroupRendezvousesThroughTheEnvironment) {
  const std::string dist_worker = build_dir() + "/launcher/test_workers/dist_worker";
  if (!fs::exists(dist_worker)) GTEST_SKIP() << dist_worker << " not built (no ember_distributed)";
  const int n = GetParam();
  TempDir d;
  Result r = run({"--standalone", "--nproc-per-node", std::to_string(n), dist_worker, d.path()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string want = std::to_string(n * (n + 1) / 2) + " " + std::to_string(n);
  for (int i = 0; i < n; ++i)  // allreduce of rank + 1: n(n+1)/2
    EXPECT_EQ(read_file(d.path() + "/sum_" + std::to_string(i)), want) << "rank " << i;
}
INSTANTIATE_TEST_SUITE_P(Emberrun, DistTest, ::testing::Values(2, 4));

// --store-max-stored-bytes reaches the store of the job (rank 0's, through the
// EMBER_STORE_MAX_STORED_BYTES emberrun exports): a worker's large key is refused with the
// store's quota error, which the same job without the option takes.
TEST(Emberrun, StoreQuotaOptionReachesTheJobsStore) {
  const std::string dist_worker = build_dir() + "/launcher/test_workers/dist_worker";
  if (!fs::exists(dist_worker)) GTEST_SKIP() << dist_worker << " not built (no ember_distributed)";
  TempDir d;
  Result r = run({"--standalone", "--nproc-per-node", "2", "--store-max-stored-bytes", "65536",
                  dist_worker, d.path()},
                 {"EMBER_TEST_SET_BYTES=100000"});
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.err, "the store is full: setting 'big' to 100000 bytes")) << describe(r);
  EXPECT_TRUE(contains(r.err, "past max_stored_bytes 65536")) << describe(r);
  EXPECT_FALSE(contains(r.out, "rank 0 stored")) << describe(r);

  TempDir d2;
  r = run({"--standalone", "--nproc-per-node", "2", dist_worker, d2.path()},
          {"EMBER_TEST_SET_BYTES=100000"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.out, "rank 0 stored 100000 bytes")) << describe(r);
}

// Rank 0 killed between creating its group's shared-memory segment and the other ranks mapping
// it (EMBER_TEST_KILL_AFTER_SHM_CREATE: where a Ctrl-C or kill -9 during group creation lands)
// never unlinks the name; emberrun, whose tag the name carries, removes it when the job ends.
TEST(Emberrun, ASharedMemoryNameAKilledRankLeftIsRemoved) {
  const std::string dist_worker = build_dir() + "/launcher/test_workers/dist_worker";
  if (!fs::exists(dist_worker)) GTEST_SKIP() << dist_worker << " not built (no ember_distributed)";
  TempDir d;
  Result r = run({"--standalone", "--nproc-per-node", "2", dist_worker, d.path()},
                 {"EMBER_TEST_KILL_AFTER_SHM_CREATE=1", "EMBER_PG_TIMEOUT=20"});
  EXPECT_NE(r.exit_code, 0) << describe(r);
  const std::string marker = "rank 0 created ";
  const auto at = r.err.find(marker);
  ASSERT_NE(at, std::string::npos) << describe(r);
  const std::string name = r.err.substr(at + marker.size(), r.err.find('\n', at) - at - marker.size());
  EXPECT_EQ(name.rfind("/ember-j", 0), 0u) << name << " carries no launcher tag";
  EXPECT_FALSE(fs::exists("/dev/shm" + name)) << name << " was left in /dev/shm\n" << describe(r);
}

// emberrun links the store library only: it never loads the tensor library, BLAS, oneDNN or
// CUDA (a regression to linking ember_distributed would bring them all back).
TEST(Emberrun, LoadsNoTensorLibrary) {
  std::string libs;
  {
    FILE* ldd = ::popen(("ldd " + emberrun() + " 2>&1").c_str(), "r");
    ASSERT_NE(ldd, nullptr);
    char buf[512];
    while (std::fgets(buf, sizeof buf, ldd) != nullptr) libs += buf;
    ASSERT_EQ(::pclose(ldd), 0) << libs;
  }
  EXPECT_TRUE(contains(libs, "libember_store")) << libs;
  for (const char* lib : {"libember_tensor", "libember_distributed", "libdnnl", "libopenblas",
                          "libcudart", "libgloo"}) {
    EXPECT_FALSE(contains(libs, lib)) << "emberrun loads " << lib << ":\n" << libs;
  }
}

TEST(Emberrun, UserThreadCountIsKept) {
  TempDir d;
  Result r = run({"--nproc-per-node", "2", worker(), "env", d.path()},
                 {"OMP_NUM_THREADS=3", "OMP_WAIT_POLICY=ACTIVE"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string env = read_file(d.file("env_1.txt"));
  EXPECT_TRUE(contains(env, "OMP_NUM_THREADS=3\n")) << env;
  EXPECT_TRUE(contains(env, "EMBER_NUM_THREADS=3\n")) << env;
  EXPECT_TRUE(contains(env, "OMP_WAIT_POLICY=ACTIVE\n")) << env;
}

TEST(Emberrun, EnvironmentSettingsAndCommandLineWins) {
  TempDir d;
  Result r = run({"--master-port", "4321", worker(), "env", d.path()},
                 {"EMBER_NPROC_PER_NODE=3", "EMBER_MASTER_PORT=1234", "EMBER_MASTER_ADDR=::1"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string env = read_file(d.file("env_2.txt"));
  EXPECT_TRUE(contains(env, "WORLD_SIZE=3\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_PORT=4321\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_ADDR=::1\n")) << env;
}

TEST(Emberrun, StandalonePicksAPort) {
  TempDir d;
  Result r = run({"--standalone", "--nproc-per-node", "2", worker(), "env", d.path()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string e0 = read_file(d.file("env_0.txt")), e1 = read_file(d.file("env_1.txt"));
  auto port = [](const std::string& env) {
    auto p = env.find("MASTER_PORT=");
    return env.substr(p + 12, env.find('\n', p) - p - 12);
  };
  EXPECT_EQ(port(e0), port(e1));
  int p = std::atoi(port(e0).c_str());
  EXPECT_GT(p, 0);
  EXPECT_LT(p, 65536);
}

// One node with a c10d --rdzv-endpoint (torchrun's way to stack jobs on one host): the
// workers get a port the agent picked (the OS's ephemeral range, so never the default 29500
// that every such job used to get), not the default.
TEST(Emberrun, OneNodeWithAnRdzvEndpointPicksAPort) {
  TempDir d;
  Result r = run({"--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29617",
                  "--nproc-per-node", "2", worker(), "env", d.path()});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string e0 = read_file(d.file("env_0.txt"));
  const auto at = e0.find("MASTER_PORT=");
  ASSERT_NE(at, std::string::npos) << e0;
  EXPECT_NE(e0.substr(at, e0.find('\n', at) - at), "MASTER_PORT=29500") << e0;
  Result bad = run({"--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:x", "--nproc-per-node",
                    "1", worker(), "env", d.path()});
  EXPECT_EQ(bad.exit_code, 2) << describe(bad);
}

// The log files go to a new folder <run-id>_XXXXXX under --log-dir, named on stderr (torchrun's
// layout): a second run with the same folder and run id leaves the first's files alone.
TEST(Emberrun, LogDirRedirectsAndFilter) {
  TempDir d, logs;
  const std::vector<std::string> args = {"--nproc-per-node",
                                         "2",
                                         "--log-dir",
                                         logs.path(),
                                         "--rdzv-id",
                                         "job7",
                                         "--redirects",
                                         "1",
                                         "--local-ranks-filter",
                                         "1",
                                         worker(),
                                         "env",
                                         d.path()};
  Result r = run(args);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "") << "stdout was redirected to the log files\n" << describe(r);
  EXPECT_FALSE(contains(r.err, "[rank 0]")) << "rank 0 was filtered out\n" << describe(r);
  EXPECT_TRUE(contains(r.err, "[rank 1]: warning from rank 1\n")) << describe(r);
  const std::string folder = log_folder(r.err);
  ASSERT_EQ(folder.rfind(logs.path() + "/job7_", 0), 0u) << describe(r);
  EXPECT_EQ(folder.size(), logs.path().size() + std::string("/job7_XXXXXX").size()) << folder;
  auto check = [](const std::string& folder) {
    for (int i = 0; i < 2; ++i) {
      const std::string dir = folder + "/attempt_0/" + std::to_string(i);
      EXPECT_EQ(read_file(dir + "/stdout.log"), "hello from rank " + std::to_string(i) + "\n")
          << dir;
      EXPECT_EQ(read_file(dir + "/stderr.log"), "warning from rank " + std::to_string(i) + "\n")
          << dir;
    }
  };
  check(folder);
  // The first run's files stay as they were: truncate the second's, and the first's still read
  // the same.
  Result again = run(args);
  ASSERT_EQ(again.exit_code, 0) << describe(again);
  const std::string second = log_folder(again.err);
  EXPECT_EQ(second.rfind(logs.path() + "/job7_", 0), 0u) << describe(again);
  EXPECT_NE(second, folder);
  check(second);
  std::ofstream(second + "/attempt_0/0/stdout.log", std::ios::trunc).flush();
  check(folder);
}

TEST(Emberrun, FailedWorkerIsNamedWithItsExitCode) {
  TempDir d;
  Result r = run({"--nproc-per-node", "3", worker(), "exit", d.path(), "1", "3"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "FAILED")) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank       : 1 (local_rank: 1)")) << describe(r);
  EXPECT_TRUE(contains(r.err, "exitcode   : 3")) << describe(r);
  EXPECT_TRUE(contains(r.err, "    rank 1 giving up\n")) << "log tail missing\n" << describe(r);
  EXPECT_FALSE(contains(r.err, "Other failures")) << "stopped ranks are not failures\n"
                                                  << describe(r);
}

TEST(Emberrun, ErrorFileIsTheRootCause) {
  TempDir d, logs;
  Result r = run({"--nproc-per-node", "2", "--log-dir", logs.path(), worker(), "error", d.path(),
                  "0"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "error      : ValueError: [train] loss is NaN at step 7"))
      << describe(r);
  EXPECT_TRUE(contains(r.err, "where      : test_worker.cpp:main")) << describe(r);
  const std::string folder = log_folder(r.err);
  EXPECT_EQ(folder.rfind(logs.path() + "/none_", 0), 0u) << describe(r);
  EXPECT_TRUE(contains(r.err, folder + "/attempt_0/0/error.json")) << describe(r);
  // The same log folder again, with a worker that writes no error file: the old one is not
  // shown as the root cause (the second run writes in a folder of its own).
  r = run(
      {"--nproc-per-node", "2", "--log-dir", logs.path(), worker(), "exit", d.path(), "0", "4"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "exitcode   : 4")) << describe(r);
  EXPECT_FALSE(contains(r.err, "loss is NaN")) << "stale error file shown\n" << describe(r);
}

TEST(Emberrun, KilledWorkerWithoutRestartsFailsTheGroup) {
  TempDir d;
  Emberrun e({"--nproc-per-node", "2", "--grace-period", "5", worker(), "block", d.path()});
  auto pids = wait_for_pids(e, d.path(), 2);
  ASSERT_EQ(pids.size(), 2u);
  kill(pids[1], SIGKILL);
  Result r = e.wait();
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank       : 1 (local_rank: 1)")) << describe(r);
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << describe(r);
  for (pid_t p : pids) EXPECT_FALSE(process_exists(p)) << "worker " << p << " outlived emberrun";
}

TEST(Emberrun, CheckpointedWorkerResumesAfterRestart) {
  TempDir d;
  Result r = run({"--nproc-per-node", "2", "--max-restarts", "2", worker(), "ckpt", d.path(),
                  "10", "4"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 1 was killed by SIGKILL; restarting the group (1/2)"))
      << describe(r);
  EXPECT_EQ(read_file(d.file("done_1")), "steps=10 restarts=1 resumed_from=4");
  EXPECT_TRUE(contains(read_file(d.file("done_0")), "steps=10 restarts=1"));
}

TEST(Emberrun, CheckpointedWorkerWithoutRestartsFails) {
  TempDir d;
  Result r = run({"--nproc-per-node", "2", worker(), "ckpt", d.path(), "10", "4"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << describe(r);
  EXPECT_EQ(read_file(d.file("ckpt_1")), "4");
  EXPECT_FALSE(fs::exists(d.file("done_1")));
}

TEST(Emberrun, WorkersDieWithAKilledEmberrun) {
  // SIGKILL gives emberrun no chance to stop them: PR_SET_PDEATHSIG is the backstop.
  TempDir d;  // also its TMPDIR: the killed emberrun cannot remove its temp folder
  Emberrun e({"--nproc-per-node", "2", worker(), "block", d.path()}, {"TMPDIR=" + d.path()});
  auto pids = wait_for_pids(e, d.path(), 2);
  ASSERT_EQ(pids.size(), 2u);
  kill(e.pid(), SIGKILL);
  Result r = e.wait();
  EXPECT_EQ(r.exit_code, -1) << describe(r);
  for (pid_t p : pids) EXPECT_TRUE(wait_until_gone(p)) << "worker " << p << " outlived emberrun";
}

struct SignalCase {
  int sig;
  bool ignore_term;
};
class SignalTest : public ::testing::TestWithParam<SignalCase> {};

TEST_P(SignalTest, SignalToEmberrunLeavesNoProcessBehind) {
  const auto [sig, ignore] = GetParam();
  TempDir d;
  std::vector<std::string> args{"--nproc-per-node", "3", "--grace-period", "0.3", worker(),
                                "block", d.path()};
  if (ignore) args.push_back("ignore");
  Emberrun e(args);
  auto pids = wait_for_pids(e, d.path(), 3);
  ASSERT_EQ(pids.size(), 3u);
  kill(e.pid(), sig);
  Result r = e.wait();
  EXPECT_EQ(r.exit_code, 128 + sig) << describe(r);
  EXPECT_TRUE(contains(r.err, std::string("received SIG") + sigabbrev_np(sig))) << describe(r);
  if (ignore) {
    EXPECT_TRUE(contains(r.err, "sent SIGKILL")) << describe(r);
  }
  for (pid_t p : pids) EXPECT_FALSE(process_exists(p)) << "worker " << p << " outlived emberrun";
}
INSTANTIATE_TEST_SUITE_P(Emberrun, SignalTest,
                         ::testing::Values(SignalCase{SIGTERM, false}, SignalCase{SIGINT, false},
                                           SignalCase{SIGHUP, false}, SignalCase{SIGQUIT, false},
                                           SignalCase{SIGTERM, true}));

TEST(Emberrun, BadOptionsAreUsageErrors) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  std::vector<Case> cases = {
      {{"--bogus", "prog"}, "--bogus"},
      {{"--nproc-per-node", "0", "prog"}, "--nproc-per-node"},
      {{"--nproc-per-node", "x", "prog"}, "'x'"},
      {{"--nnodes", "2", "--node-rank", "2", "prog"}, "--node-rank"},
      {{"--nnodes", "1:2", "--node-rank", "0", "prog"}, "needs a fixed --nnodes"},
      {{"--nnodes", "2", "--standalone", "prog"}, "--standalone"},
      {{"--nnodes", "2", "--rdzv-endpoint", ":29400", "prog"}, "--rdzv-endpoint"},
      {{"--nnodes", "2", "--rdzv-endpoint", "h:99999", "prog"}, "--rdzv-endpoint port"},
      {{"--rdzv-timeout", "0", "prog"}, "--rdzv-timeout"},
      {{"--nnodes", "3:1", "prog"}, "--nnodes"},
      {{"--redirects", "5", "prog"}, "--redirects"},
      {{"--tee", "0:1,7:2", "prog"}, "local rank 7"},
      {{"--max-restarts", "-1", "prog"}, "--max-restarts"},
      {{"--master-port", "70000", "prog"}, "--master-port"},
      {{"--monitor-interval", "0", "prog"}, "--monitor-interval"},
      {{"--local-ranks-filter", "5", "prog"}, "--local-ranks-filter"},
      {{"--nproc-per-node"}, "--nproc-per-node"},
      {{"--rdzv-conf", "join_timeout=1,foo=2", "prog"}, "--rdzv-conf: unknown key 'foo' (known: "},
      {{"--rdzv_conf", "join_timeout", "prog"}, "--rdzv-conf: malformed pair 'join_timeout'"},
      {{"-m", "train"}, "-m/--module is not supported: emberrun runs programs"},
      {{"--module", "train"}, "python3 -m MODULE"},
      {{"--run-path", "train.py"}, "python3 script.py"},
      {{"--start-method", "threads", "prog"}, "--start-method"},
      {{}, "missing PROGRAM"},
  };
  for (const auto& c : cases) {
    Result r = run(c.args);
    std::string cmd;
    for (auto& a : c.args) cmd += " " + a;
    EXPECT_EQ(r.exit_code, 2) << "emberrun" << cmd << "\n" << describe(r);
    EXPECT_TRUE(contains(r.err, c.expect)) << "emberrun" << cmd << "\n" << describe(r);
  }
  Result r = run({"--nproc-per-node", "x"}, {"EMBER_NPROC_PER_NODE=2"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  r = run({"prog"}, {"EMBER_MAX_RESTARTS=many"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "max-restarts")) << describe(r);
}

// torchrun's --role names the workers' role; --no-python and --start-method are accepted and
// said to do nothing, once.
TEST(Emberrun, RoleAndTorchrunPythonFlags) {
  Result r = run({"--role", "trainer", "--no-python", "--start_method", "spawn", "--nproc-per-node",
                  "2", "sh", "-c", "echo role=$ROLE_NAME rank=$ROLE_RANK of $ROLE_WORLD_SIZE"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (int i = 0; i < 2; ++i) {
    const std::string line =
        "[rank " + std::to_string(i) + "]: role=trainer rank=" + std::to_string(i) + " of 2\n";
    EXPECT_TRUE(contains(r.out, line)) << describe(r);
  }
  const std::string notice =
      "emberrun: --no-python has no effect: workers are always run as programs\n";
  EXPECT_EQ(r.err.find(notice), r.err.rfind(notice)) << describe(r);
  EXPECT_TRUE(contains(r.err, notice)) << describe(r);
  EXPECT_TRUE(contains(r.err, "emberrun: --start-method has no effect")) << describe(r);
  r = run({"sh", "-c", "echo role=$ROLE_NAME"});
  EXPECT_TRUE(contains(r.out, "[rank 0]: role=default\n")) << describe(r);
}

// Node 1 of 2 whose node 0 never comes: --rdzv-conf join_timeout bounds its wait (900 s by
// default, far beyond the harness's limit).
TEST(Emberrun, RdzvConfJoinTimeoutEndsTheWait) {
  Result r = run({"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                  "--master-port", "1", "--rdzv-conf", "join_timeout=0.5,read_timeout=2", "true"});
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "could not reach the rendezvous store at 127.0.0.1:1 within 0.5 s"))
      << describe(r);
}

// torchrun's PET_* variables set the options; EMBER_* ones and the command line beat them.
TEST(Emberrun, TorchrunVariablesAndCommandLineWins) {
  TempDir d;
  Result r = run({worker(), "env", d.path()}, {"PET_NPROC_PER_NODE=2", "PET_MASTER_PORT=29615"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string env = read_file(d.file("env_1.txt"));
  EXPECT_TRUE(contains(env, "WORLD_SIZE=2\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_PORT=29615\n")) << env;
  TempDir d2;
  r = run({"--nproc-per-node", "1", worker(), "env", d2.path()},
          {"PET_NPROC_PER_NODE=2", "PET_MASTER_PORT=29615", "EMBER_MASTER_PORT=29616"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  env = read_file(d2.file("env_0.txt"));
  EXPECT_TRUE(contains(env, "WORLD_SIZE=1\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_PORT=29616\n")) << env;
  EXPECT_FALSE(fs::exists(d2.file("env_1.txt")));
}

// The GPUs are counted by the driver as the workers will see them, so hidden devices do not
// count (a count of /dev/nvidia* would start a worker per GPU of the machine).
TEST(Emberrun, GpuCountHonoursCudaVisibleDevices) {
  Result r = run({"--nproc-per-node", "gpu", "prog"}, {"CUDA_VISIBLE_DEVICES="});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_TRUE(contains(r.err, "--nproc-per-node gpu: no GPU visible to this process"))
      << describe(r);
  EXPECT_TRUE(contains(r.err, "CUDA_VISIBLE_DEVICES=)")) << describe(r);
}

TEST(Emberrun, MissingProgramAndHelp) {
  Result r = run({"/nonexistent/emberrun_test_program"});
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_TRUE(contains(r.err, "/nonexistent/emberrun_test_program")) << describe(r);
  r = run({"--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.out, "--nproc-per-node")) << describe(r);
}

}  // namespace
