// Launching this test binary under mpirun from a test, shared by the MPI tests: the outer
// cases (run by ctest) start `mpirun -np N <this binary> --gtest_filter=<inner cases>` and check
// that every rank passed; the inner cases run only under mpirun.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace ember::test {

inline bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

#define SKIP_UNLESS_UNDER_MPIRUN() \
  if (!::ember::test::under_mpirun()) GTEST_SKIP() << "runs only under mpirun (the outer cases start it)"

inline std::string find_mpirun() {
  if (const char* p = std::getenv("EMBER_MPIRUN")) return p;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = dir + "/mpirun";
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

struct JobResult {
  int exit_code = -1;  // -1: killed by a signal, or hung and killed
  bool hung = false;
  double seconds = 0;
  std::string output;
};

/// Runs `mpirun -np np <this binary> --gtest_filter=filter`, restricted to loopback and shared
/// memory, with its own process group so a hang can be ended by killing the whole job.
inline JobResult run_job(const std::string& mpirun, int np, const std::string& filter,
                  std::chrono::seconds limit, const char* thread_level = nullptr) {
  char tmpl[] = "/tmp/ember_mpi_test_XXXXXX";
  const char* dir = mkdtemp(tmpl);
  EXPECT_NE(dir, nullptr) << "mkdtemp failed";
  const std::string log = std::string(dir ? dir : "/tmp") + "/output.txt";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();

  std::vector<std::string> args = {mpirun};
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,vader",
                        "--mca", "btl_vader_single_copy_mechanism", "none", "--mca",
                        "oob_tcp_if_include", "lo", "--mca", "pml", "ob1"}) {
    args.push_back(a);
  }
  if (thread_level) {
    args.push_back("-x");
    args.push_back(std::string("EMBER_MPI_THREAD_LEVEL=") + thread_level);
  }
  args.push_back("-np");
  args.push_back(std::to_string(np));
  args.push_back(self);
  args.push_back("--gtest_filter=" + filter);
  args.push_back("--gtest_color=no");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  JobResult result;
  EXPECT_GT(pid, 0) << "fork failed";
  if (pid <= 0) return result;
  setpgid(pid, pid);  // also from here, so the kill below cannot miss it

  // Wait for the child with a deadline: a pidfd becomes readable when the child exits.
  int status = 0;
  bool done = false;
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    done = poll(&p, 1, static_cast<int>(std::chrono::milliseconds(limit).count())) == 1;
    close(pidfd);
  } else {  // old kernel: check every 20 ms
    while (std::chrono::steady_clock::now() - start < limit) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        done = true;
        break;
      }
      usleep(20000);
    }
  }
  if (!done) {
    result.hung = true;
    kill(-pid, SIGKILL);
  }
  if (!(pidfd < 0 && done)) waitpid(pid, &status, 0);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!result.hung && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  result.output = ss.str();
  if (dir) std::filesystem::remove_all(dir);
  return result;
}

/// Runs `filter` under `mpirun -np np` and expects every rank to pass without skipping; skips
/// (saying why) when already under mpirun, without MPI or without mpirun.
inline void expect_mpi_job_passes(int np, const std::string& filter, std::chrono::seconds limit,
                                  bool mpi_built, const char* thread_level = nullptr) {
  if (under_mpirun()) GTEST_SKIP() << "already under mpirun";
  if (!mpi_built) GTEST_SKIP() << "built without MPI (EMBER_WITH_MPI=OFF)";
  const std::string mpirun = find_mpirun();
  if (mpirun.empty()) GTEST_SKIP() << "mpirun not found on PATH (set EMBER_MPIRUN)";
  JobResult r = run_job(mpirun, np, filter, limit, thread_level);
  // ctest reads "[  SKIPPED ]" anywhere in a case's output as the case skipping
  // (gtest_discover_tests' SKIP_REGULAR_EXPRESSION), so a rank's skip, shown as is, would turn a
  // failure below into a skip: the output is shown with it in lower case.
  std::string shown = r.output;
  for (size_t at; (at = shown.find("[  SKIPPED ]")) != std::string::npos;) {
    shown.replace(at, 12, "[  skipped ]");
  }
  EXPECT_FALSE(r.hung) << "mpirun -np " << np << " hung; killed after " << r.seconds
                       << " s. Output:\n"
                       << shown;
  EXPECT_EQ(r.exit_code, 0) << "mpirun -np " << np << " failed. Output:\n" << shown;
  EXPECT_NE(r.output.find("[  PASSED  ]"), std::string::npos) << shown;
  EXPECT_EQ(r.output.find("[  SKIPPED ]"), std::string::npos) << "a rank skipped its checks:\n"
                                                              << shown;
}

}  // namespace ember::test
