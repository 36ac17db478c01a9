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

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
constexpr auto kTimeout = std::chrono::seconds(60);

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string build_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  return fs::path(buf).parent_path().parent_path().string();  // build/tests/x -> build
}
std::string emberrun() { return build_dir() + "/launcher/emberrun"; }
std::string worker() { return build_dir() + "/launcher/test_workers/test_worker"; }


// Whether pid is a live process (a zombie waiting for init to reap it counts as gone: a
// container's init may never reap it).
bool process_exists(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  if (stat.empty()) return false;
  auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

// Waits (bounded) until pid is gone; true if it is.
bool wait_until_gone(pid_t pid) {
  auto deadline = Clock::now() + kTimeout;
  while (process_exists(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// A unique temp folder, removed at the end even when the test fails.
struct TempDir {
  std::string path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "emberrun_test_XXXXXX").string();
    EXPECT_NE(mkdtemp(t.data()), nullptr) << std::strerror(errno);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Waits (with a deadline, checking every few ms) until `path` exists.
bool wait_for_file(const std::string& path, std::chrono::seconds limit = kTimeout) {
  auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (fs::exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

struct Result {
  int exit_code = -1;  // -1 when killed by a signal or timed out
  std::string out, err;
  bool timed_out = false;
};

// emberrun as a child process in its own process group, its stdout and stderr captured. The
// destructor kills it and every worker pid registered with track() and reaps emberrun, so a
// failing test leaves nothing behind.
class Emberrun {
 public:
  Emberrun(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    int out[2], err[2];
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(err, O_CLOEXEC), 0);
    std::vector<std::string> argv_s{emberrun()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      if (kv.rfind("EMBER_", 0) == 0 || kv.rfind("OMP_NUM_THREADS=", 0) == 0) continue;
      env_s.push_back(kv);
    }
    env_s.insert(env_s.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (auto& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      dup2(out[1], 1);
      dup2(err[1], 2);
      execve(argv[0], argv.data(), envp.data());
      _exit(126);
    }
    setpgid(pid_, pid_);
    close(out[1]);
    close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }
  ~Emberrun() {
    for (pid_t p : tracked_) kill(p, SIGKILL);
    if (pid_ > 0 && !reaped_) {
      kill(-pid_, SIGKILL);
      int st;
      waitpid(pid_, &st, 0);
    }
    for (int fd : fds_)
      if (fd >= 0) close(fd);
  }
  pid_t pid() const { return pid_; }
  void track(pid_t p) { tracked_.push_back(p); }

  // Reads its output until it exits (or kTimeout passes: then it is killed).
  Result wait() {
    Result r;
    std::string* bufs[2] = {&r.out, &r.err};
    auto deadline = Clock::now() + kTimeout;
    while (fds_[0] >= 0 || fds_[1] >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        r.timed_out = true;
        kill(-pid_, SIGKILL);
        break;
      }
      pollfd p[2] = {{fds_[0], POLLIN, 0}, {fds_[1], POLLIN, 0}};
      poll(p, 2, static_cast<int>(left.count()));
      for (int i = 0; i < 2; ++i) {
        if (fds_[i] < 0 || !p[i].revents) continue;
        char buf[4096];
        ssize_t n = read(fds_[i], buf, sizeof(buf));
        if (n > 0) {
          bufs[i]->append(buf, n);
        } else if (n == 0 || errno != EINTR) {
          close(fds_[i]);
          fds_[i] = -1;
        }
      }
    }
    int st = 0;
    // Both pipes closed: emberrun is exiting; a bounded wait for it.
    while (!reaped_) {
      pid_t w = waitpid(pid_, &st, WNOHANG);
      if (w == pid_) {
        reaped_ = true;
        break;
      }
      if (Clock::now() > deadline) {
        r.timed_out = true;
        kill(-pid_, SIGKILL);
        waitpid(pid_, &st, 0);
        reaped_ = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
    return r;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int fds_[2] = {-1, -1};
  std::vector<pid_t> tracked_;
};

Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  Emberrun e(args, env);
  return e.wait();
}

std::string describe(const Result& r) {
  return "exit " + std::to_string(r.exit_code) + (r.timed_out ? " (TIMED OUT)" : "") +
         "\n--- stdout ---\n" + r.out + "--- stderr ---\n" + r.err;
}

bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// Reads worker pids from DIR/pid_<rank> files as the workers start; registers them with `e`.
std::vector<pid_t> wait_for_pids(Emberrun& e, const std::string& dir, int n) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::string f = dir + "/pid_" + std::to_string(r);
    EXPECT_TRUE(wait_for_file(f)) << "worker " << r << " never wrote " << f;
    pid_t p = std::atoi(read_file(f).c_str());
    if (p > 0) {
      e.track(p);
      pids.push_back(p);
    }
  }
  return pids;
}

class EnvTest : public ::testing::TestWithParam<int> {};

TEST_P(EnvTest, WorkersSeeTheirEnvironmentAndOutputIsPrefixed) {
  const int n = GetParam();
  TempDir d;
  Result r = run({"--nproc-per-node", std::to_string(n), "--master-port", "29613", worker(),
                  "env", d.path, "a b", "--c"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const int threads = std::max(1, available_cpus() / n);
  for (int i = 0; i < n; ++i) {
    std::string env = read_file(d.path + "/env_" + std::to_string(i) + ".txt");
    std::string ri = std::to_string(i), ns = std::to_string(n);
    for (const std::string& kv :
         {"RANK=" + ri, "LOCAL_RANK=" + ri, "WORLD_SIZE=" + ns, "LOCAL_WORLD_SIZE=" + ns,
          std::string("GROUP_RANK=0"), std::string("MASTER_ADDR=127.0.0.1"),
          std::string("MASTER_PORT=29613"), std::string("TORCHELASTIC_RESTART_COUNT=0"),
          std::string("EMBER_RESTART_COUNT=0"), "OMP_NUM_THREADS=" + std::to_string(threads),
          "EMBER_NUM_THREADS=" + std::to_string(threads), std::string("ARG=a b"),
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
  Result r = run({"--standalone", "--nproc-per-node", std::to_string(n), dist_worker, d.path});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string want = std::to_string(n * (n + 1) / 2) + " " + std::to_string(n);
  for (int i = 0; i < n; ++i)  // allreduce of rank + 1: n(n+1)/2
    EXPECT_EQ(read_file(d.path + "/sum_" + std::to_string(i)), want) << "rank " << i;
}
INSTANTIATE_TEST_SUITE_P(Emberrun, DistTest, ::testing::Values(2, 4));

TEST(Emberrun, UserThreadCountIsKept) {
  TempDir d;
  Result r = run({"--nproc-per-node", "2", worker(), "env", d.path}, {"OMP_NUM_THREADS=3"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string env = read_file(d.path + "/env_1.txt");
  EXPECT_TRUE(contains(env, "OMP_NUM_THREADS=3\n")) << env;
  EXPECT_TRUE(contains(env, "EMBER_NUM_THREADS=3\n")) << env;
}

TEST(Emberrun, EnvironmentSettingsAndCommandLineWins) {
  TempDir d;
  Result r = run({"--master-port", "4321", worker(), "env", d.path},
                 {"EMBER_NPROC_PER_NODE=3", "EMBER_MASTER_PORT=1234", "EMBER_MASTER_ADDR=::1"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string env = read_file(d.path + "/env_2.txt");
  EXPECT_TRUE(contains(env, "WORLD_SIZE=3\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_PORT=4321\n")) << env;
  EXPECT_TRUE(contains(env, "MASTER_ADDR=::1\n")) << env;
}

TEST(Emberrun, StandalonePicksAPort) {
  TempDir d;
  Result r = run({"--standalone", "--nproc-per-node", "2", worker(), "env", d.path});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::string e0 = read_file(d.path + "/env_0.txt"), e1 = read_file(d.path + "/env_1.txt");
  auto port = [](const std::string& env) {
    auto p = env.find("MASTER_PORT=");
    return env.substr(p + 12, env.find('\n', p) - p - 12);
  };
  EXPECT_EQ(port(e0), port(e1));
  int p = std::atoi(port(e0).c_str());
  EXPECT_GT(p, 0);
  EXPECT_LT(p, 65536);
}

TEST(Emberrun, LogDirRedirectsAndFilter) {
  TempDir d, logs;
  Result r = run({"--nproc-per-node", "2", "--log-dir", logs.path, "--rdzv-id", "job7",
                  "--redirects", "1", "--local-ranks-filter", "1", worker(), "env", d.path});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "") << "stdout was redirected to the log files\n" << describe(r);
  EXPECT_FALSE(contains(r.err, "[rank 0]")) << "rank 0 was filtered out\n" << describe(r);
  EXPECT_TRUE(contains(r.err, "[rank 1]: warning from rank 1\n")) << describe(r);
  for (int i = 0; i < 2; ++i) {
    std::string dir = logs.path + "/job7/attempt_0/" + std::to_string(i);
    EXPECT_EQ(read_file(dir + "/stdout.log"), "hello from rank " + std::to_string(i) + "\n")
        << dir;
    EXPECT_EQ(read_file(dir + "/stderr.log"), "warning from rank " + std::to_string(i) + "\n")
        << dir;
  }
}

TEST(Emberrun, FailedWorkerIsNamedWithItsExitCode) {
  TempDir d;
  Result r = run({"--nproc-per-node", "3", worker(), "exit", d.path, "1", "3"});
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
  Result r = run({"--nproc-per-node", "2", "--log-dir", logs.path, worker(), "error", d.path,
                  "0"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "error      : ValueError: [train] loss is NaN at step 7"))
      << describe(r);
  EXPECT_TRUE(contains(r.err, "where      : test_worker.cpp:main")) << describe(r);
  EXPECT_TRUE(contains(r.err, logs.path + "/none/attempt_0/0/error.json")) << describe(r);
  // The same log folder again, with a worker that writes no error file: the old one is not
  // shown as the root cause.
  r = run({"--nproc-per-node", "2", "--log-dir", logs.path, worker(), "exit", d.path, "0", "4"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "exitcode   : 4")) << describe(r);
  EXPECT_FALSE(contains(r.err, "loss is NaN")) << "stale error file shown\n" << describe(r);
}

TEST(Emberrun, KilledWorkerWithoutRestartsFailsTheGroup) {
  TempDir d;
  Emberrun e({"--nproc-per-node", "2", "--grace-period", "5", worker(), "block", d.path});
  auto pids = wait_for_pids(e, d.path, 2);
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
  Result r = run({"--nproc-per-node", "2", "--max-restarts", "2", worker(), "ckpt", d.path,
                  "10", "4"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.err, "rank 1 was killed by SIGKILL; restarting the group (1/2)"))
      << describe(r);
  EXPECT_EQ(read_file(d.path + "/done_1"), "steps=10 restarts=1 resumed_from=4");
  EXPECT_TRUE(contains(read_file(d.path + "/done_0"), "steps=10 restarts=1"));
}

TEST(Emberrun, CheckpointedWorkerWithoutRestartsFails) {
  TempDir d;
  Result r = run({"--nproc-per-node", "2", worker(), "ckpt", d.path, "10", "4"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_TRUE(contains(r.err, "SIGKILL")) << describe(r);
  EXPECT_EQ(read_file(d.path + "/ckpt_1"), "4");
  EXPECT_FALSE(fs::exists(d.path + "/done_1"));
}

TEST(Emberrun, WorkersDieWithAKilledEmberrun) {
  // SIGKILL gives emberrun no chance to stop them: PR_SET_PDEATHSIG is the backstop.
  TempDir d;  // also its TMPDIR: the killed emberrun cannot remove its temp folder
  Emberrun e({"--nproc-per-node", "2", worker(), "block", d.path}, {"TMPDIR=" + d.path});
  auto pids = wait_for_pids(e, d.path, 2);
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
                                "block", d.path};
  if (ignore) args.push_back("ignore");
  Emberrun e(args);
  auto pids = wait_for_pids(e, d.path, 3);
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
      {{"--nnodes", "2", "prog"}, "--nnodes 2"},
      {{"--nnodes", "3:1", "prog"}, "--nnodes"},
      {{"--redirects", "5", "prog"}, "--redirects"},
      {{"--tee", "0:1,7:2", "prog"}, "local rank 7"},
      {{"--max-restarts", "-1", "prog"}, "--max-restarts"},
      {{"--master-port", "70000", "prog"}, "--master-port"},
      {{"--monitor-interval", "0", "prog"}, "--monitor-interval"},
      {{"--local-ranks-filter", "5", "prog"}, "--local-ranks-filter"},
      {{"--nproc-per-node"}, "--nproc-per-node"},
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

TEST(Emberrun, MissingProgramAndHelp) {
  Result r = run({"/nonexistent/emberrun_test_program"});
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_TRUE(contains(r.err, "/nonexistent/emberrun_test_program")) << describe(r);
  r = run({"--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(contains(r.out, "--nproc-per-node")) << describe(r);
}

}  // namespace
