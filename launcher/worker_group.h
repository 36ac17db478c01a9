// One node's workers: spawned with the launcher's environment, their output pumped line by line
// to the console and log files, reaped, and stopped as a group. Internal to the launcher (the
// agent's loops in agent.cpp drive it); one thread.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <deque>
#include <functional>
#include <string>
#include <vector>

#include <ember/launcher/config.h>
#include <ember/launcher/worker_failure.h>

namespace ember::launcher {

/// Where this node's workers sit in the job: from the command line on one node, from the
/// rendezvous across nodes.
struct GroupSpec {
  int node_rank = 0;
  int nnodes = 1;
  int rank_base = 0;  // global rank of local rank 0
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: restarts after failures so far
};

/// Routes SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGCHLD to a self-pipe that WorkerGroup and
/// take_pending_signal read, and ignores SIGPIPE, for its lifetime; restores the previous
/// handlers on destruction. One at a time per process.
class SignalCapture {
 public:
  SignalCapture();
  ~SignalCapture();
  SignalCapture(const SignalCapture&) = delete;
  SignalCapture& operator=(const SignalCapture&) = delete;
  /// "" when the handlers are installed, else why not (the pipe could not be made).
  const std::string& error() const { return error_; }

 private:
  std::string error_;
  struct sigaction old_[6] = {};  // SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE
};

/// A signal (other than SIGCHLD) waiting in the self-pipe, without blocking: how the
/// rendezvous notices Ctrl-C while no group is running. 0 if none.
int take_pending_signal();

class WorkerGroup {
 public:
  /// `program_path` is the resolved PROGRAM; per-attempt folders (error files, logs when
  /// `keep_logs`) go under a new folder `run_prefix` + six characters (mkdtemp), made at the
  /// first spawn, so an agent that cannot make it has joined its job and leaves it like any
  /// other that cannot start its workers. `c` must outlive the group.
  WorkerGroup(const LaunchConfig& c, std::string program_path, std::string run_prefix,
              bool keep_logs);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  /// Spawns every worker of attempt `attempt` (the log folder attempt_<attempt>: the restart
  /// count on one node, the rendezvous round across nodes). Returns "" or an error message.
  std::string spawn(int attempt, const GroupSpec& spec);
  enum class Outcome { kSucceeded, kFailed, kInterrupted, kPeer };
  /// Pumps output and reaps workers until all succeeded, one failed, a signal arrived, or
  /// `peer_check` (called at most once per monitor interval) returned true.
  Outcome monitor(const std::function<bool()>& peer_check = nullptr);
  /// `sig` to every worker's process group, SIGKILL after the grace period; reaps all.
  void stop(int sig);
  /// Drains output left in pipes (bounded) and closes everything; kills leftover groups.
  void finish();
  /// The failures seen by monitor(), the first observed first.
  const std::vector<WorkerFailure>& failures() const { return failures_; }
  /// The signal that interrupted monitor() or stop(), 0 if none.
  int interrupt_signal() const { return interrupt_signal_; }

 private:
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
    Stream streams[2];  // stdout, stderr
    std::deque<std::string> tail;
    std::string error_file;
  };

  std::string spawn_worker(Worker& w, const std::string& dir, std::vector<std::string> env);
  std::string open_streams(Worker& w, const std::string& dir, int pipes[2][2]);
  void pump(int timeout_ms, bool* got_signal);
  void read_stream(Worker& w, int which);
  void emit(Worker& w, int which, const std::string& line);
  void reap(bool blocking);
  void record_failure(Worker& w);
  void kill_all_groups();
  void close_all();
  bool pipes_open() const;
  bool all_reaped() const;

  const LaunchConfig& c_;
  std::string program_path_;
  std::string run_prefix_;
  std::string run_dir_;  // "" until the first spawn makes it
  bool keep_logs_;
  std::vector<Worker> workers_;
  std::vector<WorkerFailure> failures_;
  int interrupt_signal_ = 0;
};

}  // namespace ember::launcher
