#include <ember/launcher/worker_group.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>

#include <ember/launcher/console.h>

extern char** environ;

namespace ember::launcher {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kTailLines = 20;       // lines of a failed worker's output in the summary
constexpr size_t kMaxLine = 64 * 1024;  // a longer line without '\n' is cut
constexpr auto kDrainLimit = std::chrono::seconds(2);  // output left after the group ended
// SIGQUIT too, as torchrun's: its default action would end emberrun at once (a core dump),
// leaving the workers to the death signal with no grace period.
constexpr int kCaughtSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD};
constexpr int kNumCaught = sizeof(kCaughtSignals) / sizeof(kCaughtSignals[0]);

// Self-pipe for signals: the handler only writes the signal number; the loops read it.
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

// The environment every rank shares: the caller's, plus the thread count.
std::map<std::string, std::string> base_environment(int nproc_per_node) {
  std::map<std::string, std::string> base;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto omp = base.find("OMP_NUM_THREADS"), emb = base.find("EMBER_NUM_THREADS");
  std::string threads;
  if (emb != base.end())
    threads = emb->second;
  else if (omp != base.end())
    threads = omp->second;
  else
    threads = std::to_string(std::max(1, available_cpus() / nproc_per_node));
  base.emplace("OMP_NUM_THREADS", threads);  // emplace: keeps a value the user set
  base.emplace("EMBER_NUM_THREADS", threads);
  // OpenMP threads that finish a parallel region sleep instead of spinning (libgomp spins by
  // default): the ranks' communication threads (gloo's, the collective worker) and the other
  // ranks need those cores, which matters most when ranks share few cores (docs/launcher.md).
  base.emplace("OMP_WAIT_POLICY", "PASSIVE");
  return base;
}

// What this agent's workers put in their shared-memory segments' names (EMBER_SHM_TAG): unique
// among the live agents of a node, since it is this process's pid.
std::string shm_tag() { return std::string("j") + std::to_string(::getpid()); }

// Removes the shared-memory names this agent's workers left: a rank killed (or interrupted)
// while setting up its group's segment never unlinks it. Called when none of them is running.
void sweep_shared_memory() {
  const std::string prefix = "ember-" + shm_tag() + "-";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) ::shm_unlink(("/" + name).c_str());
  }
}

// One rank's environment as "KEY=value" strings: `base` plus the launcher's variables.
std::vector<std::string> worker_environment(std::map<std::string, std::string> env,
                                            const LaunchConfig& c, const GroupSpec& spec,
                                            int rank, int local_rank,
                                            const std::string& error_file) {
  env["RANK"] = std::to_string(rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(spec.world_size);
  env["LOCAL_WORLD_SIZE"] = std::to_string(c.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(spec.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(spec.nnodes);
  env["ROLE_RANK"] = std::to_string(rank);
  env["ROLE_WORLD_SIZE"] = std::to_string(spec.world_size);
  env["ROLE_NAME"] = c.role;
  env["MASTER_ADDR"] = spec.master_addr;
  env["MASTER_PORT"] = std::to_string(spec.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(spec.restart_count);
  env["EMBER_RESTART_COUNT"] = std::to_string(spec.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(c.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = c.rdzv_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // rank 0 hosts the store
  env["TORCHELASTIC_ERROR_FILE"] = error_file;
  env["EMBER_ERROR_FILE"] = error_file;
  env["EMBER_SHM_TAG"] = shm_tag();
  for (const auto& [var, value] : c.store_limits) env[var] = value;  // for rank 0's store
  std::vector<std::string> out;
  for (auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::vector<char*> pointers(std::vector<std::string>& strs) {
  std::vector<char*> out;
  for (auto& s : strs) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// The child between fork and exec: only async-signal-safe calls. On an exec failure, errno
// goes to `exec_fd` for the parent to report.
[[noreturn]] void exec_child(pid_t parent, const int out_fds[2], int exec_fd, const char* path,
                             char* const argv[], char* const envp[]) {
  setpgid(0, 0);  // own process group, so stopping a worker reaches its children too
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // backstop: die with the agent
  if (getppid() != parent) _exit(127);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE})
    sigaction(sig, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0) dup2(devnull, 0);
  dup2(out_fds[0], 1);
  dup2(out_fds[1], 2);
  execve(path, argv, envp);
  int err = errno;
  [[maybe_unused]] ssize_t k = write(exec_fd, &err, sizeof(err));
  _exit(127);
}

}  // namespace

// ---- signals ----------------------------------------------------------------------------

SignalCapture::SignalCapture() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    error_ = std::string("pipe: ") + std::strerror(errno);
    return;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < kNumCaught; ++i) sigaction(kCaughtSignals[i], &sa, &old_[i]);
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &old_[kNumCaught]);
}

SignalCapture::~SignalCapture() {
  if (!error_.empty()) return;
  for (int i = 0; i < kNumCaught; ++i) sigaction(kCaughtSignals[i], &old_[i], nullptr);
  sigaction(SIGPIPE, &old_[kNumCaught], nullptr);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;
}

int take_pending_signal() {
  unsigned char b[64];
  int sig = 0;
  ssize_t n;
  while ((n = read(g_signal_pipe[0], b, sizeof(b))) > 0)
    for (ssize_t i = 0; i < n; ++i)
      if (b[i] != SIGCHLD) sig = b[i];
  return sig;
}

// ---- WorkerGroup --------------------------------------------------------------------------

WorkerGroup::WorkerGroup(const LaunchConfig& c, std::string program_path, std::string run_prefix,
                         bool keep_logs)
    : c_(c),
      program_path_(std::move(program_path)),
      run_prefix_(std::move(run_prefix)),
      keep_logs_(keep_logs) {}

WorkerGroup::~WorkerGroup() {
  kill_all_groups();
  close_all();
  sweep_shared_memory();
}

std::string WorkerGroup::spawn(int attempt, const GroupSpec& spec) {
  close_all();
  sweep_shared_memory();  // what the previous attempt's workers left
  workers_.clear();
  failures_.clear();
  if (run_dir_.empty()) {
    // torchrun's layout: a run's own folder under --log-dir, so two runs with one run id never
    // write into each other's files.
    std::error_code ec;
    fs::create_directories(fs::path(run_prefix_).parent_path(), ec);
    std::string tmpl = run_prefix_ + "XXXXXX";
    if (ec || !mkdtemp(tmpl.data())) {
      return "could not create " + tmpl + ": " + (ec ? ec.message() : std::strerror(errno));
    }
    run_dir_ = tmpl;
    if (keep_logs_) log_line("log files under " + run_dir_);
  }
  const std::string attempt_dir = run_dir_ + "/attempt_" + std::to_string(attempt);
  auto base = base_environment(c_.nproc_per_node);
  // Where the logs are kept, so are the flight recorder's dumps of a failed collective
  // (distributed/flight_recorder.h): one folder per attempt, for ember_flight_analyze.
  if (keep_logs_ && base.count("EMBER_FLIGHT_RECORDER_DIR") == 0) {
    base["EMBER_FLIGHT_RECORDER_DIR"] = attempt_dir + "/flight";
  }
  for (int lr = 0; lr < c_.nproc_per_node; ++lr) {
    Worker w;
    w.local_rank = lr;
    w.rank = spec.rank_base + lr;
    const std::string dir = attempt_dir + "/" + std::to_string(w.rank);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return "could not create " + dir + ": " + ec.message();
    w.error_file = dir + "/error.json";
    fs::remove(w.error_file, ec);  // a stale one from an earlier run is no root cause
    std::string err =
        spawn_worker(w, dir, worker_environment(base, c_, spec, w.rank, lr, w.error_file));
    if (!err.empty()) return err;
  }
  return "";
}

// Pipes for the worker's stdout and stderr (read ends kept in `w`), and its log files.
std::string WorkerGroup::open_streams(Worker& w, const std::string& dir, int pipes[2][2]) {
  const bool redirect[2] = {c_.redirects[w.local_rank].out, c_.redirects[w.local_rank].err};
  const bool shown =
      !c_.local_ranks_filter ||
      std::count(c_.local_ranks_filter->begin(), c_.local_ranks_filter->end(), w.local_rank) > 0;
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
  return "";
}

// Forks and execs one worker; once forked, it joins workers_ even if the exec failed, so that
// it is reaped with the others.
std::string WorkerGroup::spawn_worker(Worker& w, const std::string& dir,
                                      std::vector<std::string> env) {
  std::vector<std::string> args{c_.program};
  args.insert(args.end(), c_.args.begin(), c_.args.end());
  const std::vector<char*> envp = pointers(env), argv = pointers(args);
  int pipes[2][2];
  if (std::string err = open_streams(w, dir, pipes); !err.empty()) return err;
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) return std::string("pipe: ") + std::strerror(errno);

  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return std::string("fork: ") + std::strerror(errno);
  if (pid == 0) {
    const int out_fds[2] = {pipes[0][1], pipes[1][1]};
    exec_child(parent, out_fds, exec_pipe[1], program_path_.c_str(), argv.data(), envp.data());
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
  if (got == sizeof(err)) return "could not execute " + program_path_ + ": " + std::strerror(err);
  return "";
}

bool WorkerGroup::pipes_open() const {
  for (auto& w : workers_)
    for (auto& s : w.streams)
      if (s.fd >= 0) return true;
  return false;
}

bool WorkerGroup::all_reaped() const {
  return std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.reaped; });
}

void WorkerGroup::emit(Worker& w, int which, const std::string& line) {
  Stream& s = w.streams[which];
  if (s.console_fd >= 0)
    write_all(s.console_fd, "[rank " + std::to_string(w.rank) + "]: " + line + "\n");
  if (s.log_fd >= 0) write_all(s.log_fd, line + "\n");
  w.tail.push_back(line);
  if (w.tail.size() > kTailLines) w.tail.pop_front();
}

void WorkerGroup::read_stream(Worker& w, int which) {
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

void WorkerGroup::pump(int timeout_ms, bool* got_signal) {
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

void WorkerGroup::reap(bool blocking) {
  for (auto& w : workers_) {
    if (w.reaped) continue;
    // Seen exited but not yet reaped (WNOWAIT): its zombie still holds the pid, so the process
    // group of that number is still the worker's, and its leftover children go now. Once
    // reaped, the number may be reused by an unrelated group leader, which a later kill of
    // the group would reach.
    siginfo_t info{};
    int r;
    do
      r = waitid(P_PID, static_cast<id_t>(w.pid), &info,
                 WEXITED | WNOWAIT | (blocking ? 0 : WNOHANG));
    while (r < 0 && errno == EINTR);
    if (r != 0 || info.si_pid != w.pid) continue;
    kill(-w.pid, SIGKILL);
    int status = 0;
    pid_t done;
    do done = waitpid(w.pid, &status, 0);
    while (done < 0 && errno == EINTR);
    w.reaped = true;
    w.status = status;
  }
}

void WorkerGroup::record_failure(Worker& w) {
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

WorkerGroup::Outcome WorkerGroup::monitor(const std::function<bool()>& peer_check) {
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
    if (all_reaped()) return Outcome::kSucceeded;
    if (peer_check && Clock::now() >= next_check) {
      if (peer_check()) return Outcome::kPeer;
      next_check = Clock::now() + interval;
    }
    pump(interval_ms, &sig);
    if (sig) return Outcome::kInterrupted;
  }
}

void WorkerGroup::stop(int sig) {
  for (auto& w : workers_) {
    if (w.reaped) continue;
    kill(-w.pid, sig);
    // A stopped worker (SIGSTOP, a debugger's SIGTSTP) would hold the signal pending until the
    // grace period ran out: wake it so that it acts on the signal now.
    kill(-w.pid, SIGCONT);
  }
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(c_.grace_period_s));
  for (;;) {
    reap(false);
    if (all_reaped()) break;
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

void WorkerGroup::finish() {
  auto deadline = Clock::now() + kDrainLimit;
  while (pipes_open() && Clock::now() < deadline) pump(50, nullptr);
  kill_all_groups();
  close_all();
}

void WorkerGroup::kill_all_groups() {
  // Leftover children of workers (their process groups) go too: no orphans. A reaped worker's
  // group went when it was reaped (reap()); its number may be another's by now.
  for (auto& w : workers_) {
    if (w.reaped || w.pid <= 0) continue;
    kill(-w.pid, SIGKILL);
    int st;
    while (waitpid(w.pid, &st, 0) < 0 && errno == EINTR) {
    }
    w.reaped = true;
    w.status = st;
  }
}

void WorkerGroup::close_all() {
  for (auto& w : workers_)
    for (auto& s : w.streams) {
      if (s.fd >= 0) close(s.fd);
      if (s.log_fd >= 0) close(s.log_fd);
      s.fd = s.log_fd = -1;
    }
}

}  // namespace ember::launcher
