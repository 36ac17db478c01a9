// Helpers for the store tests: temp dirs, child processes, raw sockets.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/store/store.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/temp_dir.h"
#include "tests/tensor/test_util.h"

namespace ember::test {

using dist::Bytes;

inline Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

/// Throws std::runtime_error(what) unless cond: the child processes' assertion.
inline void require(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error(what);
}

/// What f() throws (its what()), or "" if it returns.
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// Number of threads in this process (from /proc/self/task).
inline int thread_count() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

/// Threads the process had before any test ran: libraries start some at load time (OpenBLAS's
/// pool), idle ones that the children never use (OpenBLAS even stops its pool at the first
/// fork, so later there may be fewer).
inline const int kThreadsAtStart = thread_count();

/// Child processes for the multi-process tests. They are forked in the constructor, before the
/// test starts any thread of its own (checked), so a child may use anything; each then waits for
/// go(), runs body(index, message) and reports "" or the exception's text through a pipe. The
/// destructor SIGKILLs and reaps any child still running, so a failing test leaves nothing
/// behind.
class Children {
 public:
  Children(int n, std::function<void(int index, const std::string& message)> body) {
#ifdef __SANITIZE_THREAD__
    constexpr int kRuntimeThreads = 1;  // TSan's background thread, started lazily
#else
    constexpr int kRuntimeThreads = 0;
#endif
    // A thread the case before joined can still be listed in /proc/self/task for a moment: the
    // kernel wakes pthread_join when it clears the thread's tid, before it reaps the task, and
    // under TSan that window is long enough to be seen. No event says when the entry goes, so
    // the guard looks again for up to 10 s before it calls the threads the test's own.
    const int allowed = kThreadsAtStart + kRuntimeThreads;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    int found = thread_count();
    while (found > allowed && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      found = thread_count();
    }
    if (found > allowed) {
      throw std::runtime_error("Children: fork before the test starts threads: found " +
                               std::to_string(found) + " threads, " +
                               std::to_string(kThreadsAtStart) + " at start");
    }
    for (int i = 0; i < n; ++i) {
      int to_child[2], from_child[2];
      if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) throw std::runtime_error("pipe");
      const pid_t pid = ::fork();
      if (pid < 0) throw std::runtime_error("fork failed");
      if (pid == 0) {
        ::close(to_child[1]);
        ::close(from_child[0]);
        for (const auto& c : kids_) {  // siblings' pipe ends
          ::close(c.to);
          ::close(c.from);
        }
        std::string message, result;
        if (!read_all(to_child[0], &message, 300000) || message.empty() || message[0] != 'G') {
          ::_exit(3);  // the parent went away or never said go
        }
        try {
          body(i, message.substr(1));
        } catch (const std::exception& e) {
          result = "child " + std::to_string(i) + ": " + e.what();
        } catch (...) {
          result = "child " + std::to_string(i) + ": unknown exception";
        }
        const std::string out = "R" + result;
        (void)!::write(from_child[1], out.data(), out.size());
        ::_exit(0);  // no atexit handlers, no flushing of the parent's stdio buffers
      }
      ::close(to_child[0]);
      ::close(from_child[1]);
      kids_.push_back({pid, to_child[1], from_child[0]});
    }
  }

  ~Children() {
    for (auto& c : kids_) {
      if (c.pid > 0) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
      }
      if (c.to >= 0) ::close(c.to);
      if (c.from >= 0) ::close(c.from);
    }
  }
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;

  /// Lets every child start, passing it message.
  void go(const std::string& message) {
    for (auto& c : kids_) {
      const std::string m = "G" + message;
      (void)!::write(c.to, m.data(), m.size());
      ::close(c.to);
      c.to = -1;
    }
  }

  /// The pid of child i.
  pid_t pid(int i) const { return kids_[i].pid; }

  /// Kills child i now (SIGKILL) and reaps it.
  void kill(int i) {
    auto& c = kids_[i];
    if (c.pid <= 0) return;
    ::kill(c.pid, SIGKILL);
    ::waitpid(c.pid, nullptr, 0);
    c.pid = -1;
  }

  /// Waits for every remaining child to report and exit; returns one line per failed child
  /// (empty: all passed). A child that does not report within timeout_ms is killed.
  std::vector<std::string> join(int timeout_ms = 300000) {
    std::vector<std::string> errors;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (size_t i = 0; i < kids_.size(); ++i) {
      auto& c = kids_[i];
      if (c.pid <= 0) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      std::string report;
      const bool got = read_all(c.from, &report, std::max<int64_t>(left, 1));
      if (!got) {
        ::kill(c.pid, SIGKILL);
        errors.push_back("child " + std::to_string(i) + ": no report within " +
                         std::to_string(timeout_ms) + " ms (killed)");
      }
      int status = 0;
      ::waitpid(c.pid, &status, 0);
      c.pid = -1;
      if (!got) continue;
      if (report.empty() || report[0] != 'R') {
        errors.push_back("child " + std::to_string(i) + ": died without a report (status " +
                         std::to_string(status) + ")");
      } else if (report.size() > 1) {
        errors.push_back(report.substr(1));
      }
    }
    return errors;
  }

 private:
  struct Kid {
    pid_t pid;
    int to;
    int from;
  };

  // Reads fd until EOF; false if timeout_ms passes first.
  static bool read_all(int fd, std::string* out, int64_t timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    char buf[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return false;
      pollfd p{fd, POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(left));
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) return false;
      const ssize_t k = ::read(fd, buf, sizeof(buf));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return true;
      out->append(buf, static_cast<size_t>(k));
    }
  }

  std::vector<Kid> kids_;
};

/// "" when children forked by Children can use a CUDA device, else why not. Asked once, in a
/// child of its own, so that this process never initialises CUDA: the driver's threads would trip
/// Children's fork check, and a process forked after its parent initialised CUDA cannot use it.
inline std::string cuda_unusable_in_children() {
  static const std::string why = [] {
    Children probe(1, [](int, const std::string&) {
      if (!cuda::is_available()) throw std::runtime_error(cuda::unavailable_reason());
    });
    probe.go("");
    const std::vector<std::string> errors = probe.join(120000);
    return errors.empty() ? std::string() : errors[0];
  }();
  return why;
}

/// Expects no child errors, printing each.
inline void expect_children_ok(const std::vector<std::string>& errors) {
  for (const auto& e : errors) ADD_FAILURE() << e;
}

/// A port the OS picked and that nothing listens on right now (bound, read, closed). Another
/// process could take it before the test uses it; on a test machine that is vanishingly rare.
inline uint16_t unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("unused_port: bind failed");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Polls cond() until it holds or timeout_ms passes (for observing another thread's or
/// process's progress; never as a substitute for a real wait in the code under test).
inline bool eventually(const std::function<bool()>& cond, int timeout_ms = 60000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace ember::test
