#include "launcher/agent.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launcher/rendezvous.h"

extern char** environ;

namespace ember::launcher {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kTailLines = 20;        // lines of a failed worker's output in the summary
constexpr size_t kMaxLine = 64 * 1024;   // a longer line without '\n' is cut
constexpr auto kDrainLimit = std::chrono::seconds(2);  // output left after the group ended

// Self-pipe for signals: the handler only writes the signal number; the loop reads it.
int g_signal_pipe[2] = {-1, -1};
void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

std::string now_string() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // console gone (EPIPE, SIGPIPE ignored): drop the output
    off += static_cast<size_t>(n);
  }
}

void log_line(const std::string& s) { write_all(STDERR_FILENO, "emberrun: " + s + "\n"); }

// PROGRAM resolved as execvp would, so a missing program is reported before any spawn.
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) {
    return access(program.c_str(), X_OK) == 0 ? program : "";
  }
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string p = (dir.empty() ? "." : dir) + "/" + program;
    struct stat st{};
    if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0) {
      return p;
    }
  }
  return "";
}

// One of a worker's output streams: a pipe read by the agent, split into lines.
struct Stream {
  int fd = -1;          // read end, non-blocking; -1 after EOF
  int console_fd = -1;  // where prefixed lines go, -1 = not shown
  int log_fd = -1;      // the rank's log file, -1 = none
  std::string partial;
};

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool reaped = false;
  int status = 0;
  Clock::time_point reaped_at;
  Stream streams[2];  // stdout, stderr
  std::deque<std::string> tail;
  std::string error_file;
};

// Where this node's workers sit in the job: from the command line on one node, from the
// rendezvous across nodes.
struct GroupSpec {
  int node_rank = 0;
  int nnodes = 1;
  int rank_base = 0;   // global rank of local rank 0
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
};

class Group {
 public:
  Group(const LaunchConfig& c, std::string program_path, std::string run_dir, bool keep_logs)
      : c_(c), program_path_(std::move(program_path)), run_dir_(std::move(run_dir)),
        keep_logs_(keep_logs) {}
  ~Group() { kill_all_groups(); close_all(); }

  // Spawns every worker of attempt `attempt`. Returns "" or an error message.
  std::string spawn(int attempt, const GroupSpec& spec);
  enum class Outcome { kSucceeded, kFailed, kInterrupted, kPeer };
  // Pumps output and reaps workers until all succeeded, one failed, a signal arrived, or
  // `peer_check` (called at most once per monitor interval) returned true.
  Outcome monitor(const std::function<bool()>& peer_check = nullptr);
  // SIGTERM (or `sig`) to every worker's group, SIGKILL after the grace period; reaps all.
  void stop(int sig);
  // Drains output left in pipes (bounded) and closes everything; kills leftover groups.
  void finish();
  const std::vector<WorkerFailure>& failures() const { return failures_; }
  int interrupt_signal() const { return interrupt_signal_; }

 private:
  void pump(int timeout_ms, bool* got_signal);
  void read_stream(Worker& w, int which);
  void emit(Worker& w, int which, const std::string& line);
  void reap(bool blocking);
  void record_failure(Worker& w);
  void kill_all_groups();
  void close_all();
  bool pipes_open() const;

  const LaunchConfig& c_;
  std::string program_path_;
  std::string run_dir_;
  bool keep_logs_;
  std::vector<Worker> workers_;
  std::vector<WorkerFailure> failures_;
  int interrupt_signal_ = 0;
};

std::string Group::spawn(int attempt, const GroupSpec& spec) {
  close_all();
  workers_.clear();
  failures_.clear();
  const int n = c_.nproc_per_node;
  const std::string attempt_dir = run_dir_ + "/attempt_" + std::to_string(attempt);

  // Environment shared by every rank: the caller's, plus the thread count.
  std::map<std::string, std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  {
    auto omp = base.find("OMP_NUM_THREADS"), emb = base.find("EMBER_NUM_THREADS");
    std::string threads;
    if (emb != base.end()) threads = emb->second;
    else if (omp != base.end()) threads = omp->second;
    else threads = std::to_string(std::max(1, available_cpus() / n));
    base.emplace("OMP_NUM_THREADS", threads);  // emplace: keeps a value the user set
    base.emplace("EMBER_NUM_THREADS", threads);
    // OpenMP threads that finish a parallel region sleep instead of spinning (libgomp spins by
    // default): the ranks' communication threads (gloo's, the collective worker) and the other
    // ranks need those cores. On the 2-core VM a 2-thread process ran 1.75x faster this way.
    base.emplace("OMP_WAIT_POLICY", "PASSIVE");
  }
  const int world = spec.world_size;
  for (int lr = 0; lr < n; ++lr) {
    Worker w;
    w.local_rank = lr;
    w.rank = spec.rank_base + lr;
    const std::string dir = attempt_dir + "/" + std::to_string(w.rank);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return "could not create " + dir + ": " + ec.message();
    w.error_file = dir + "/error.json";
    fs::remove(w.error_file, ec);  // a stale one from an earlier run is no root cause
    auto env = base;
    env["RANK"] = std::to_string(w.rank);
    env["LOCAL_RANK"] = std::to_string(lr);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(n);
    env["GROUP_RANK"] = std::to_string(spec.node_rank);
    env["GROUP_WORLD_SIZE"] = std::to_string(spec.nnodes);
    env["ROLE_RANK"] = std::to_string(w.rank);
    env["ROLE_WORLD_SIZE"] = std::to_string(world);
    env["ROLE_NAME"] = "default";
    env["MASTER_ADDR"] = spec.master_addr;
    env["MASTER_PORT"] = std::to_string(spec.master_port);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["EMBER_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(c_.max_restarts);
    env["TORCHELASTIC_RUN_ID"] = c_.rdzv_id;
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // rank 0 hosts the store
    env["TORCHELASTIC_ERROR_FILE"] = w.error_file;
    env["EMBER_ERROR_FILE"] = w.error_file;
    std::vector<std::string> env_strs;
    for (auto& [k, v] : env) env_strs.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : env_strs) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> arg_strs{c_.program};
    arg_strs.insert(arg_strs.end(), c_.args.begin(), c_.args.end());
    std::vector<char*> argv;
    for (auto& s : arg_strs) argv.push_back(s.data());
    argv.push_back(nullptr);

    // Log files and console routing.
    const bool redirect[2] = {c_.redirects[lr].out, c_.redirects[lr].err};
    const bool shown = !c_.local_ranks_filter ||
                       std::count(c_.local_ranks_filter->begin(), c_.local_ranks_filter->end(),
                                  lr) > 0;
    int pipes[2][2];
    for (int s = 0; s < 2; ++s) {
      if (pipe2(pipes[s], O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);
      fcntl(pipes[s][0], F_SETFL, O_NONBLOCK);
      w.streams[s].fd = pipes[s][0];
      w.streams[s].console_fd = (!redirect[s] && shown) ? (s == 0 ? 1 : 2) : -1;
      if (keep_logs_) {
        std::string path = dir + (s == 0 ? "/stdout.log" : "/stderr.log");
        w.streams[s].log_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (w.streams[s].log_fd < 0) return "could not open " + path + ": " + std::strerror(errno);
      }
    }
    int exec_pipe[2];
    if (pipe2(exec_pipe, O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);

    const pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return std::string("fork: ") + std::strerror(errno);
    if (pid == 0) {
      // Child: only async-signal-safe calls from here to exec.
      setpgid(0, 0);  // own process group, so stopping a worker reaches its children too
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // backstop: die with the agent
      if (getppid() != parent) _exit(127);
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) sigaction(sig, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
      dup2(pipes[0][1], 1);
      dup2(pipes[1][1], 2);
      execve(program_path_.c_str(), argv.data(), envp.data());
      int err = errno;
      [[maybe_unused]] ssize_t k = write(exec_pipe[1], &err, sizeof(err));
      _exit(127);
    }
    setpgid(pid, pid);  // also from the parent, so kill(-pid) works at once
    close(pipes[0][1]);
    close(pipes[1][1]);
    close(exec_pipe[1]);
    int err = 0;
    ssize_t got;
    do got = read(exec_pipe[0], &err, sizeof(err));
    while (got < 0 && errno == EINTR);
    close(exec_pipe[0]);
    w.pid = pid;
    workers_.push_back(std::move(w));
    if (got == sizeof(err)) {
      return "could not execute " + program_path_ + ": " + std::strerror(err);
    }
  }
  return "";
}

bool Group::pipes_open() const {
  for (auto& w : workers_)
    for (auto& s : w.streams)
      if (s.fd >= 0) return true;
  return false;
}

void Group::emit(Worker& w, int which, const std::string& line) {
  Stream& s = w.streams[which];
  if (s.console_fd >= 0) write_all(s.console_fd, "[rank " + std::to_string(w.rank) + "]: " + line + "\n");
  if (s.log_fd >= 0) write_all(s.log_fd, line + "\n");
  w.tail.push_back(line);
  if (w.tail.size() > kTailLines) w.tail.pop_front();
}

void Group::read_stream(Worker& w, int which) {
  Stream& s = w.streams[which];
  char buf[65536];
  while (s.fd >= 0) {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // EAGAIN: nothing more for now
    if (n == 0) {
      if (!s.partial.empty()) emit(w, which, s.partial);
      s.partial.clear();
      close(s.fd);
      s.fd = -1;
      return;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = s.partial.find('\n', start)) != std::string::npos) {
      emit(w, which, s.partial.substr(start, nl - start));
      start = nl + 1;
    }
    s.partial.erase(0, start);
    if (s.partial.size() > kMaxLine) {
      emit(w, which, s.partial);
      s.partial.clear();
    }
  }
}

void Group::pump(int timeout_ms, bool* got_signal) {
  std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
  std::vector<std::pair<Worker*, int>> owners{{nullptr, 0}};
  for (auto& w : workers_)
    for (int s = 0; s < 2; ++s)
      if (w.streams[s].fd >= 0) {
        fds.push_back({w.streams[s].fd, POLLIN, 0});
        owners.emplace_back(&w, s);
      }
  int r = poll(fds.data(), fds.size(), timeout_ms);
  if (r <= 0) return;
  for (size_t i = 1; i < fds.size(); ++i)
    if (fds[i].revents) read_stream(*owners[i].first, owners[i].second);
  if (fds[0].revents & POLLIN) {
    unsigned char b[64];
    ssize_t n = read(g_signal_pipe[0], b, sizeof(b));
    for (ssize_t i = 0; i < n; ++i) {
      if (b[i] != SIGCHLD) {
        interrupt_signal_ = b[i];
        if (got_signal) *got_signal = true;
      }
    }
  }
}

void Group::reap(bool blocking) {
  for (auto& w : workers_) {
    if (w.reaped) continue;
    int status = 0;
    pid_t r;
    do r = waitpid(w.pid, &status, blocking ? 0 : WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == w.pid) {
      w.reaped = true;
      w.status = status;
      w.reaped_at = Clock::now();
    }
  }
}

void Group::record_failure(Worker& w) {
  // The worker is dead: what it wrote is in the pipe; take it for the log tail.
  for (int s = 0; s < 2; ++s) read_stream(w, s);
  WorkerFailure f;
  f.rank = w.rank;
  f.local_rank = w.local_rank;
  f.pid = w.pid;
  if (WIFEXITED(w.status)) f.exit_code = WEXITSTATUS(w.status);
  if (WIFSIGNALED(w.status)) f.signal = WTERMSIG(w.status);
  f.time = now_string();
  if (keep_logs_) f.error_file = w.error_file;  // else it is in a folder removed at exit
  read_error_file(w.error_file, &f.error_message, &f.error_where);
  f.log_tail.assign(w.tail.begin(), w.tail.end());
  failures_.push_back(std::move(f));
}

Group::Outcome Group::monitor(const std::function<bool()>& peer_check) {
  const int interval_ms = std::max(1, static_cast<int>(c_.monitor_interval_s * 1000));
  const auto interval = std::chrono::milliseconds(interval_ms);
  auto next_check = Clock::now() + interval;
  for (;;) {
    bool sig = false;
    reap(false);
    for (auto& w : workers_) {
      bool failed = w.reaped && !(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0);
      bool known = std::any_of(failures_.begin(), failures_.end(),
                               [&](const WorkerFailure& f) { return f.rank == w.rank; });
      if (failed && !known) record_failure(w);
    }
    if (!failures_.empty()) return Outcome::kFailed;
    if (std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.reaped; }))
      return Outcome::kSucceeded;
    if (peer_check && Clock::now() >= next_check) {
      if (peer_check()) return Outcome::kPeer;
      next_check = Clock::now() + interval;
    }
    pump(interval_ms, &sig);
    if (sig) return Outcome::kInterrupted;
  }
}

void Group::stop(int sig) {
  for (auto& w : workers_)
    if (!w.reaped) kill(-w.pid, sig);
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(c_.grace_period_s));
  for (;;) {
    reap(false);
    if (std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.reaped; }))
      break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    bool again = false;
    pump(static_cast<int>(std::min<int64_t>(left.count(), 50)), &again);
    if (again) {
      log_line("second signal: killing the workers now");
      break;
    }
  }
  bool escalated = false;
  for (auto& w : workers_) {
    if (!w.reaped) {
      escalated = true;
      kill(-w.pid, SIGKILL);
    }
  }
  if (escalated) log_line("workers still running after the grace period: sent SIGKILL");
  reap(true);
  kill_all_groups();
}

void Group::finish() {
  auto deadline = Clock::now() + kDrainLimit;
  while (pipes_open() && Clock::now() < deadline) pump(50, nullptr);
  kill_all_groups();
  close_all();
}

void Group::kill_all_groups() {
  // Leftover children of workers (their process groups) go too: no orphans.
  for (auto& w : workers_) {
    if (w.pid > 0) kill(-w.pid, SIGKILL);
    if (!w.reaped && w.pid > 0) {
      int st;
      while (waitpid(w.pid, &st, 0) < 0 && errno == EINTR) {
      }
      w.reaped = true;
      w.status = st;
    }
  }
}

void Group::close_all() {
  for (auto& w : workers_)
    for (auto& s : w.streams) {
      if (s.fd >= 0) close(s.fd);
      if (s.log_fd >= 0) close(s.log_fd);
      s.fd = s.log_fd = -1;
    }
}

// A signal (other than SIGCHLD) waiting in the self-pipe, without blocking: how the rendezvous
// notices Ctrl-C while no group is running. 0 if none.
int take_pending_signal() {
  unsigned char b[64];
  int sig = 0;
  ssize_t n;
  while ((n = read(g_signal_pipe[0], b, sizeof(b))) > 0)
    for (ssize_t i = 0; i < n; ++i)
      if (b[i] != SIGCHLD) sig = b[i];
  return sig;
}

std::string describe_exit(const WorkerFailure& f) {
  return "rank " + std::to_string(f.rank) + " " +
         (f.signal ? "was killed by " + signal_name(f.signal)
                   : "exited with code " + std::to_string(f.exit_code));
}

// Node 0 keeps hosting the store until the other nodes have read what they need.
constexpr auto kExitWait = std::chrono::seconds(30);

// The agent's loop across nodes: rendezvous, run the group, watch the other nodes; on a
// failure anywhere every node stops its workers and, while restarts remain, joins the next
// round. See docs/launcher.md (Multi-node).
int run_multi_node(const LaunchConfig& c, Group& group) {
  int pending = 0;
  auto interrupted = [&] {
    if (int sig = take_pending_signal()) pending = sig;
    return pending != 0;
  };
  std::unique_ptr<Rendezvous> rdzv;
  try {
    rdzv = std::make_unique<Rendezvous>(c, interrupted);
  } catch (const RendezvousInterrupted&) {
    log_line("received " + signal_name(pending) + " while connecting to the rendezvous store");
    return 128 + pending;
  } catch (const RendezvousError& e) {
    log_line(e.what());
    return 1;
  }
  // Leaves for good: node 0 waits (bounded) until the others have seen the outcome.
  auto leave = [&](int round, int rc) {
    if (rdzv->is_host()) {
      if (!rdzv->wait_for_exits(round, kExitWait, false))
        log_line("not every node acknowledged the end of the run; stopping the rendezvous store");
    } else {
      rdzv->report_exit(round);
    }
    return rc;
  };
  for (int round = 0;; ++round) {
    RoundInfo info;
    try {
      info = rdzv->join(round);
    } catch (const RendezvousInterrupted&) {
      log_line("received " + signal_name(pending) + " during the rendezvous");
      rdzv->close(rdzv->describe_self() + " received " + signal_name(pending) +
                  " during the rendezvous");
      return 128 + pending;
    } catch (const RendezvousError& e) {
      log_line(e.what());
      return 1;
    }
    if (round == 0) {
      log_line(rdzv->describe_self() + " of " + std::to_string(info.nnodes) + ": ranks " +
               std::to_string(info.rank_base) + ".." +
               std::to_string(info.rank_base + c.nproc_per_node - 1) + " of " +
               std::to_string(info.world_size) + ", MASTER_ADDR=" + info.master_addr +
               ":" + std::to_string(info.master_port) + " (rendezvous " + rdzv->endpoint() + ")");
    }
    GroupSpec spec{info.node_rank, info.nnodes, info.rank_base, info.world_size,
                   info.master_addr, info.master_port};
    if (std::string err = group.spawn(round, spec); !err.empty()) {
      log_line(err);
      group.stop(SIGKILL);
      group.finish();
      try {
        rdzv->report_failure(round, rdzv->describe_self() + ": " + err);
      } catch (const RendezvousError&) {
      }
      rdzv->close(rdzv->describe_self() + ": " + err);
      return leave(round, 1);
    }
    std::optional<RoundFailure> peer;
    std::string lost;
    auto outcome = group.monitor([&] {
      try {
        peer = rdzv->poll_failure(round);
      } catch (const RendezvousError& e) {
        lost = e.what();
        return true;
      }
      return peer.has_value();
    });
    if (outcome == Group::Outcome::kSucceeded) {
      group.finish();
      if (!rdzv->is_host()) {
        rdzv->report_exit(round);
        return 0;
      }
      // Node 0 hosts the store: it stays until every node is done, or one fails.
      if (rdzv->wait_for_exits(round, std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::duration<double>(c.rdzv_timeout_s)),
                               true))
        return 0;
      if (pending) {
        log_line("received " + signal_name(pending) + " while waiting for the other nodes");
        rdzv->close(rdzv->describe_self() + " received " + signal_name(pending));
        return 128 + pending;
      }
      std::optional<RoundFailure> f;
      try {
        f = rdzv->poll_failure(round);
      } catch (const RendezvousError& e) {
        log_line(e.what());
        return 1;
      }
      if (f) {
        const std::string why = "node " + std::to_string(f->node_rank) + " failed after node 0's "
                                "workers had finished (no restart possible): " + f->what;
        log_line(why);
        rdzv->close(why);
        return leave(round, 1);
      }
      log_line("the other nodes did not report their end within --rdzv-timeout");
      return 1;
    }
    if (outcome == Group::Outcome::kInterrupted) {
      const int sig = group.interrupt_signal();
      log_line("received " + signal_name(sig) + ": forwarding it to the workers and stopping "
               "every node");
      const std::string why = rdzv->describe_self() + " received " + signal_name(sig);
      rdzv->close(why);
      try {
        rdzv->report_failure(round, why);
      } catch (const RendezvousError&) {
      }
      group.stop(sig);
      group.finish();
      return leave(round, 128 + sig);
    }
    if (outcome == Group::Outcome::kPeer && !lost.empty()) {
      log_line(lost + "; stopping this node's workers");
      group.stop(SIGTERM);
      group.finish();
      return 1;
    }
    // A failure here (recorded unless another node's came first) or on another node.
    bool root = false;
    if (outcome == Group::Outcome::kFailed) {
      const std::string what =
          rdzv->describe_self() + ": " + describe_exit(group.failures().front());
      try {
        peer = rdzv->report_failure(round, what);
        root = peer->node_rank == info.node_rank;
      } catch (const RendezvousError& e) {
        log_line(e.what());
        root = true;
      }
    } else {
      log_line("node " + std::to_string(peer->node_rank) + " failed (" + peer->what +
               "): stopping this node's workers");
    }
    group.stop(SIGTERM);
    group.finish();
    if (int sig = group.interrupt_signal()) {
      log_line("received " + signal_name(sig) + " while stopping the workers");
      rdzv->close(rdzv->describe_self() + " received " + signal_name(sig));
      if (root) write_all(STDERR_FILENO, format_failure_summary(c.program, group.failures()));
      return leave(round, 128 + sig);
    }
    if (round < c.max_restarts) {
      log_line((root ? rdzv->describe_self() + ": " + describe_exit(group.failures().front())
                     : "node " + std::to_string(peer->node_rank) + " failed") +
               "; restarting the group on every node (" + std::to_string(round + 1) + "/" +
               std::to_string(c.max_restarts) + ")");
      continue;
    }
    if (root) {
      write_all(STDERR_FILENO, format_failure_summary(c.program, group.failures()));
    } else {
      log_line("the run failed on node " + std::to_string(peer->node_rank) + " (" + peer->what +
               "); no restarts left");
    }
    rdzv->close("no restarts left after: " + (peer ? peer->what : std::string("a failure")));
    return leave(round, 1);
  }
}

std::string make_temp_dir() {
  std::string tmpl = (fs::temp_directory_path() / "emberrun_XXXXXX").string();
  if (!mkdtemp(tmpl.data())) return "";
  return tmpl;
}

}  // namespace

bool read_error_file(const std::string& path, std::string* message, std::string* where) {
  std::ifstream in(path);
  if (!in) return false;
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto text = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  if (j.contains("message") && j["message"].is_object()) {  // torch's layout
    const auto& m = j["message"];
    if (m.contains("message")) *message = text(m["message"]);
    if (m.contains("extraInfo") && m["extraInfo"].is_object() &&
        m["extraInfo"].contains("py_callstack"))
      *where = text(m["extraInfo"]["py_callstack"]);
  } else if (j.contains("message")) {
    *message = text(j["message"]);
  }
  if (j.contains("where")) *where = text(j["where"]);
  return true;
}

std::string format_failure_summary(const std::string& program,
                                   const std::vector<WorkerFailure>& failures) {
  std::ostringstream os;
  auto describe = [&](const WorkerFailure& f, bool full) {
    os << "  rank       : " << f.rank << " (local_rank: " << f.local_rank << ")\n";
    os << "  time       : " << f.time << "\n";
    if (f.signal) {
      os << "  exitcode   : -" << f.signal << " (killed by signal " << f.signal << ", "
         << signal_name(f.signal) << "; pid " << f.pid << ")\n";
    } else {
      os << "  exitcode   : " << f.exit_code << " (pid " << f.pid << ")\n";
    }
    if (!f.error_message.empty()) {
      os << "  error      : " << f.error_message << "\n";
      if (!f.error_where.empty()) os << "  where      : " << f.error_where << "\n";
      if (!f.error_file.empty()) os << "  error_file : " << f.error_file << "\n";
    } else {
      os << "  error_file : <N/A> (the worker wrote none; see EMBER_ERROR_FILE)\n";
    }
    if (full) {
      if (f.log_tail.empty()) {
        os << "  log tail   : <no output>\n";
      } else {
        os << "  log tail (last " << f.log_tail.size() << " lines):\n";
        for (const auto& l : f.log_tail) os << "    " << l << "\n";
      }
    }
  };
  os << "emberrun: " << program << " FAILED\n";
  os << "Root cause (first observed failure):\n";
  if (!failures.empty()) describe(failures.front(), true);
  if (failures.size() > 1) {
    os << "Other failures:\n";
    for (size_t i = 1; i < failures.size(); ++i) describe(failures[i], false);
  }
  return os.str();
}

LocalAgent::LocalAgent(LaunchConfig config) : config_(std::move(config)) {}

int LocalAgent::run() {
  const std::string program_path = resolve_program(config_.program);
  if (program_path.empty()) {
    log_line("cannot run '" + config_.program + "': not found or not executable");
    return 127;
  }
  // Per-attempt folders hold error files, and log files when asked for.
  bool keep_logs = !config_.log_dir.empty();
  bool wants_files = std::any_of(config_.redirects.begin(), config_.redirects.end(),
                                 [](StreamMask m) { return m.out || m.err; }) ||
                     std::any_of(config_.tee.begin(), config_.tee.end(),
                                 [](StreamMask m) { return m.out || m.err; });
  std::string tmp_dir;
  std::string base;
  if (keep_logs) {
    base = config_.log_dir;
  } else {
    tmp_dir = make_temp_dir();
    if (tmp_dir.empty()) {
      log_line(std::string("could not create a temporary folder: ") + std::strerror(errno));
      return 1;
    }
    base = tmp_dir;
    if (wants_files) {
      keep_logs = true;
      log_line("--redirects/--tee without --log-dir: log files under " + tmp_dir);
    }
  }
  const std::string run_dir = base + "/" + config_.rdzv_id;

  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    log_line(std::string("pipe: ") + std::strerror(errno));
    return 1;
  }
  struct sigaction sa{}, old[5];
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  const int sigs[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
  for (int i = 0; i < 4; ++i) sigaction(sigs[i], &sa, &old[i]);
  struct sigaction ign{};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &old[4]);

  int rc = 1;
  if (config_.multi_node()) {
    Group group(config_, program_path, run_dir, keep_logs);
    rc = run_multi_node(config_, group);
  } else {
    Group group(config_, program_path, run_dir, keep_logs);
    for (int attempt = 0;; ++attempt) {
      int port = config_.master_port;
      if (attempt > 0 && config_.standalone) port = pick_free_port();  // fresh rendezvous
      GroupSpec spec{config_.node_rank, 1, config_.node_rank * config_.nproc_per_node,
                     config_.world_size(), config_.master_addr, port};
      std::string err = group.spawn(attempt, spec);
      if (!err.empty()) {
        log_line(err);
        group.stop(SIGKILL);
        group.finish();
        rc = 1;
        break;
      }
      auto outcome = group.monitor();
      if (outcome == Group::Outcome::kSucceeded) {
        group.finish();
        rc = 0;
        break;
      }
      if (outcome == Group::Outcome::kInterrupted) {
        int sig = group.interrupt_signal();
        log_line("received " + signal_name(sig) + ": forwarding it to the workers");
        group.stop(sig);
        group.finish();
        rc = 128 + sig;
        break;
      }
      group.stop(SIGTERM);
      group.finish();
      if (int sig = group.interrupt_signal()) {  // interrupted while stopping: no restart
        log_line("received " + signal_name(sig) + " while stopping the workers");
        write_all(STDERR_FILENO, format_failure_summary(config_.program, group.failures()));
        rc = 128 + sig;
        break;
      }
      if (attempt < config_.max_restarts) {
        log_line(describe_exit(group.failures().front()) + "; restarting the group (" +
                 std::to_string(attempt + 1) + "/" + std::to_string(config_.max_restarts) + ")");
        continue;
      }
      write_all(STDERR_FILENO, format_failure_summary(config_.program, group.failures()));
      rc = 1;
      break;
    }
  }

  for (int i = 0; i < 4; ++i) sigaction(sigs[i], &old[i], nullptr);
  sigaction(SIGPIPE, &old[4], nullptr);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;
  if (!tmp_dir.empty() && !keep_logs) {
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
  }
  return rc;
}

}  // namespace ember::launcher
