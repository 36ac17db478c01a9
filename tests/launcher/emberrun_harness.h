// The harness of the end-to-end launcher tests: emberrun (or any command) as a child process
// with its output captured and its processes cleaned up, plus small file helpers. Shared by
// emberrun_test.cpp and multinode_test.cpp.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
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

#include "tests/temp_dir.h"

namespace emberrun_test {

namespace fs = std::filesystem;
using ember::test::TempDir;
using Clock = std::chrono::steady_clock;
inline constexpr auto kTimeout = std::chrono::seconds(60);

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string build_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  buf[n > 0 ? n : 0] = 0;
  return fs::path(buf).parent_path().parent_path().string();  // build/tests/x -> build
}
inline std::string emberrun() { return build_dir() + "/launcher/emberrun"; }
inline std::string worker() { return build_dir() + "/launcher/test_workers/test_worker"; }
// tests/launcher/step_worker.cpp: an elastic job's worker, one collective per step (built only
// with ember_distributed; tests skip without it).
inline std::string step_worker() { return build_dir() + "/launcher/test_workers/step_worker"; }

// Whether pid is a live process (a zombie waiting for init to reap it counts as gone: a
// container's init may never reap it).
inline bool process_exists(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  if (stat.empty()) return false;
  auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

// Waits (bounded) until pid is gone; true if it is.
inline bool wait_until_gone(pid_t pid) {
  auto deadline = Clock::now() + kTimeout;
  while (process_exists(pid)) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

inline int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Waits (with a deadline, checking every few ms) until `path` exists.
inline bool wait_for_file(const std::string& path, std::chrono::seconds limit = kTimeout) {
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
  /// Runs `prefix... emberrun args...` (prefix: e.g. {"ip", "netns", "exec", NS}), or, with
  /// raw, `args...` as given (args[0] looked up in PATH). `env` is added to this process's
  /// environment without its EMBER_* and OMP_NUM_THREADS variables.
  Emberrun(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
           const std::vector<std::string>& prefix = {}, bool raw = false) {
    int out[2], err[2];
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(err, O_CLOEXEC), 0);
    std::vector<std::string> argv_s = prefix;
    if (!raw) argv_s.push_back(emberrun());
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
      execvpe(argv[0], argv.data(), envp.data());
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

inline Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  Emberrun e(args, env);
  return e.wait();
}

inline std::string describe(const Result& r) {
  return "exit " + std::to_string(r.exit_code) + (r.timed_out ? " (TIMED OUT)" : "") +
         "\n--- stdout ---\n" + r.out + "--- stderr ---\n" + r.err;
}

// a followed by b (command lines built from parts).
inline std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline bool contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// The run's log folder, from emberrun's "log files under D/<run-id>_XXXXXX" line on stderr; ""
// if there is none.
inline std::string log_folder(const std::string& err) {
  const std::string key = "emberrun: log files under ";
  const size_t at = err.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return err.substr(from, err.find('\n', from) - from);
}

// Reads worker pids from DIR/pid_<rank> files as the workers start; registers them with `e`.
inline std::vector<pid_t> wait_for_pids(Emberrun& e, const std::string& dir, int n) {
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

}  // namespace emberrun_test
