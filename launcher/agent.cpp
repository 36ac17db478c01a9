#include <ember/launcher/agent.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>

#include <ember/launcher/console.h>
#include <ember/launcher/rendezvous.h>
#include <ember/launcher/worker_failure.h>
#include <ember/launcher/worker_group.h>

namespace ember::launcher {
namespace {

namespace fs = std::filesystem;

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
    struct stat st {};
    if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0) {
      return p;
    }
  }
  return "";
}

// Node 0 keeps hosting the store until the other nodes have read what they need.
constexpr auto kExitWait = std::chrono::seconds(30);

// The agent's loop across nodes: rendezvous, run the group, watch the other nodes; on a
// failure anywhere every node stops its workers and, while restarts remain, joins the next
// round. See docs/launcher.md (Multi-node).
class MultiNodeRun {
 public:
  MultiNodeRun(const LaunchConfig& c, WorkerGroup& group) : c_(c), group_(group) {}
  // Returns emberrun's exit status (LocalAgent::run's).
  int run();

 private:
  // Whether a signal arrived (polled by the rendezvous's waits); remembers it in pending_.
  bool interrupted();
  // One round: join, spawn, monitor. nullopt: restart with the next round. A node that
  // waited to join an elastic job joins a later round than `round`: it is updated.
  std::optional<int> run_round(int& round);
  int on_spawn_error(int round, const std::string& err);
  int on_success(int round);
  int on_interrupt(int round);
  std::optional<int> on_failure(int round, const RoundInfo& info, bool failed_here,
                                std::optional<RoundFailure> peer);
  // Leaves for good: node 0 waits (bounded) until the others have seen the outcome.
  int leave(int round, int rc);
  std::string received(int sig) const {
    return rdzv_->describe_self() + " received " + signal_name(sig);
  }

  const LaunchConfig& c_;
  WorkerGroup& group_;
  std::unique_ptr<Rendezvous> rdzv_;
  int pending_ = 0;  // a signal that arrived while no group was running
};

bool MultiNodeRun::interrupted() {
  if (int sig = take_pending_signal()) pending_ = sig;
  return pending_ != 0;
}

int MultiNodeRun::run() {
  try {
    rdzv_ = std::make_unique<Rendezvous>(c_, [this] { return interrupted(); });
  } catch (const RendezvousInterrupted&) {
    log_line("received " + signal_name(pending_) + " while connecting to the rendezvous store");
    return 128 + pending_;
  } catch (const RendezvousError& e) {
    log_line(e.what());
    return 1;
  }
  int round = 0;
  try {
    round = rdzv_->current_round();  // an agent started late joins the job where it stands
  } catch (const RendezvousError& e) {
    log_line(e.what());
    return 1;
  }
  for (;; ++round) {
    if (std::optional<int> rc = run_round(round)) return *rc;
  }
}

std::optional<int> MultiNodeRun::run_round(int& round) {
  RoundInfo info;
  try {
    info = rdzv_->join(round);
  } catch (const RendezvousInterrupted&) {
    log_line("received " + signal_name(pending_) + " during the rendezvous");
    // A node waiting to join an elastic job is no part of it yet: the job runs on.
    if (!rdzv_->waiting()) rdzv_->close(received(pending_) + " during the rendezvous");
    return 128 + pending_;
  } catch (const RendezvousError& e) {
    log_line(e.what());
    return 1;
  }
  round = info.round;
  // Every round: with --nnodes MIN:MAX the ranks and the world size may change.
  log_line(rdzv_->describe_self() + " of " + std::to_string(info.nnodes) + ": ranks " +
           std::to_string(info.rank_base) + ".." +
           std::to_string(info.rank_base + c_.nproc_per_node - 1) + " of " +
           std::to_string(info.world_size) + ", MASTER_ADDR=" + info.master_addr + ":" +
           std::to_string(info.master_port) + " (rendezvous " + rdzv_->endpoint() +
           (round > 0 ? ", round " + std::to_string(round) : std::string()) + ")");
  const GroupSpec spec{info.node_rank,   info.nnodes,      info.rank_base,
                       info.world_size,  info.master_addr, info.master_port,
                       info.restart_count};
  if (std::string err = group_.spawn(round, spec); !err.empty()) return on_spawn_error(round, err);
  std::optional<RoundFailure> peer;
  std::string lost;
  const auto outcome = group_.monitor([&] {
    try {
      peer = rdzv_->watch(round);
    } catch (const RendezvousError& e) {
      lost = e.what();
      return true;
    }
    return peer.has_value();
  });
  if (outcome == WorkerGroup::Outcome::kSucceeded) return on_success(round);
  if (outcome == WorkerGroup::Outcome::kInterrupted) return on_interrupt(round);
  if (outcome == WorkerGroup::Outcome::kPeer && !lost.empty()) {
    log_line(lost + "; stopping this node's workers");
    group_.stop(SIGTERM);
    group_.finish();
    return 1;
  }
  return on_failure(round, info, outcome == WorkerGroup::Outcome::kFailed, peer);
}

int MultiNodeRun::on_spawn_error(int round, const std::string& err) {
  log_line(err);
  group_.stop(SIGKILL);
  group_.finish();
  // An elastic job goes on without this node (Note [Elastic membership] in rendezvous.cpp);
  // node 0 hosts the store and cannot leave alone.
  const bool alone = c_.elastic() && !rdzv_->is_host();
  const std::string what =
      rdzv_->describe_self() + ": " + err + (alone ? "; it leaves the job" : "");
  try {
    rdzv_->report_failure(round, what);
  } catch (const RendezvousError&) {
  }
  if (!alone) rdzv_->close(what);
  return leave(round, 1);
}

int MultiNodeRun::on_success(int round) {
  group_.finish();
  if (!rdzv_->is_host()) {
    rdzv_->report_success(round);
    return 0;
  }
  // Node 0 hosts the store: it stays until every node is done, or one fails.
  if (rdzv_->wait_for_exits(round,
                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::duration<double>(c_.rdzv_timeout_s)),
                            true)) {
    rdzv_->close("the run finished");  // for nodes waiting to join it
    return 0;
  }
  if (pending_) {
    log_line("received " + signal_name(pending_) + " while waiting for the other nodes");
    rdzv_->close(received(pending_));
    return 128 + pending_;
  }
  std::optional<RoundFailure> f;
  try {
    f = rdzv_->poll_failure(round);
  } catch (const RendezvousError& e) {
    log_line(e.what());
    return 1;
  }
  if (f) {
    const std::string why = "node " + std::to_string(f->node_rank) + " failed after node 0's " +
                            "workers had finished (no restart possible): " + f->what;
    log_line(why);
    rdzv_->close(why);
    return leave(round, 1);
  }
  log_line("the other nodes did not report their end within --rdzv-timeout");
  return 1;
}

int MultiNodeRun::on_interrupt(int round) {
  const int sig = group_.interrupt_signal();
  log_line("received " + signal_name(sig) + ": forwarding it to the workers and stopping " +
           "every node");
  const std::string why = received(sig);
  rdzv_->close(why);
  try {
    rdzv_->report_failure(round, why);
  } catch (const RendezvousError&) {
  }
  group_.stop(sig);
  group_.finish();
  return leave(round, 128 + sig);
}

// A failure here (recorded unless another node's came first) or on another node (`peer`).
std::optional<int> MultiNodeRun::on_failure(int round, const RoundInfo& info, bool failed_here,
                                            std::optional<RoundFailure> peer) {
  bool root = false;  // this node's failure is the run's root cause: it prints the summary
  if (failed_here) {
    const std::string what =
        rdzv_->describe_self() + ": " + describe_exit(group_.failures().front());
    try {
      peer = rdzv_->report_failure(round, what);
      root = peer->node_rank == info.node_rank;
    } catch (const RendezvousError& e) {
      log_line(e.what());
      root = true;
    }
  }
  const bool new_nodes = peer && peer->new_nodes();  // Note [Elastic membership]
  if (new_nodes) {
    log_line(peer->what + ": stopping this node's workers to restart the group with them" +
             (failed_here ? " (" + describe_exit(group_.failures().front()) + " meanwhile)" : ""));
  } else if (!failed_here) {
    log_line("node " + std::to_string(peer->node_rank) + " failed (" + peer->what +
             "): stopping this node's workers");
  }
  group_.stop(SIGTERM);
  group_.finish();
  if (int sig = group_.interrupt_signal()) {
    log_line("received " + signal_name(sig) + " while stopping the workers");
    rdzv_->close(received(sig));
    if (root) write_all(STDERR_FILENO, format_failure_summary(c_.program, group_.failures()));
    return leave(round, 128 + sig);
  }
  if (new_nodes) {
    log_line("restarting the group on every node to admit the new nodes (no failure: " +
             std::to_string(info.restart_count) + "/" + std::to_string(c_.max_restarts) +
             " restarts used)");
    return std::nullopt;
  }
  if (info.restart_count < c_.max_restarts) {
    log_line((root ? rdzv_->describe_self() + ": " + describe_exit(group_.failures().front())
                   : "node " + std::to_string(peer->node_rank) + " failed") +
             "; restarting the group on every node (" +
             std::to_string(info.restart_count + 1) + "/" + std::to_string(c_.max_restarts) +
             ")");
    return std::nullopt;
  }
  if (root) {
    write_all(STDERR_FILENO, format_failure_summary(c_.program, group_.failures()));
  } else {
    log_line("the run failed on node " + std::to_string(peer->node_rank) + " (" + peer->what +
             "); no restarts left");
  }
  rdzv_->close("no restarts left after: " + (peer ? peer->what : std::string("a failure")));
  return leave(round, 1);
}

int MultiNodeRun::leave(int round, int rc) {
  if (rdzv_->is_host()) {
    if (!rdzv_->wait_for_exits(round, kExitWait, false))
      log_line("not every node acknowledged the end of the run; stopping the rendezvous store");
  } else {
    rdzv_->report_exit(round);
  }
  return rc;
}

// The agent's loop on one node: run the group; on a failure restart it while restarts remain.
int run_single_node(const LaunchConfig& c, WorkerGroup& group) {
  for (int attempt = 0;; ++attempt) {
    int port = c.master_port;
    if (attempt > 0 && c.pick_master_port) port = pick_free_port();  // fresh rendezvous
    const GroupSpec spec{c.node_rank,   1,    c.node_rank * c.nproc_per_node, c.world_size(),
                         c.master_addr, port, attempt};
    if (std::string err = group.spawn(attempt, spec); !err.empty()) {
      log_line(err);
      group.stop(SIGKILL);
      group.finish();
      return 1;
    }
    const auto outcome = group.monitor();
    if (outcome == WorkerGroup::Outcome::kSucceeded) {
      group.finish();
      return 0;
    }
    if (outcome == WorkerGroup::Outcome::kInterrupted) {
      const int sig = group.interrupt_signal();
      log_line("received " + signal_name(sig) + ": forwarding it to the workers");
      group.stop(sig);
      group.finish();
      return 128 + sig;
    }
    group.stop(SIGTERM);
    group.finish();
    if (int sig = group.interrupt_signal()) {  // interrupted while stopping: no restart
      log_line("received " + signal_name(sig) + " while stopping the workers");
      write_all(STDERR_FILENO, format_failure_summary(c.program, group.failures()));
      return 128 + sig;
    }
    if (attempt < c.max_restarts) {
      log_line(describe_exit(group.failures().front()) + "; restarting the group (" +
               std::to_string(attempt + 1) + "/" + std::to_string(c.max_restarts) + ")");
      continue;
    }
    write_all(STDERR_FILENO, format_failure_summary(c.program, group.failures()));
    return 1;
  }
}

// Where the per-attempt folders go (error files, and log files when asked for): a folder
// `<run-id>_XXXXXX` (WorkerGroup makes it) under --log-dir, else under a temporary folder that
// is removed at the end unless log files were asked for.
class RunFolder {
 public:
  explicit RunFolder(const LaunchConfig& c) : keep_logs_(!c.log_dir.empty()) {
    std::string base = c.log_dir;
    if (!keep_logs_) {
      std::string tmpl = (fs::temp_directory_path() / "emberrun_XXXXXX").string();
      if (!mkdtemp(tmpl.data())) {
        error_ = std::string("could not create a temporary folder: ") + std::strerror(errno);
        return;
      }
      base = tmp_dir_ = tmpl;
      keep_logs_ = wants_log_files(c);
    }
    run_prefix_ = base + "/" + c.rdzv_id + "_";
  }
  ~RunFolder() {
    if (!tmp_dir_.empty() && !keep_logs_) {
      std::error_code ec;
      fs::remove_all(tmp_dir_, ec);
    }
  }
  RunFolder(const RunFolder&) = delete;
  RunFolder& operator=(const RunFolder&) = delete;

  const std::string& error() const { return error_; }
  /// The run folder's name without its last six characters (WorkerGroup).
  const std::string& run_prefix() const { return run_prefix_; }
  bool keep_logs() const { return keep_logs_; }

 private:
  static bool wants_log_files(const LaunchConfig& c) {
    auto any = [](const std::vector<StreamMask>& v) {
      return std::any_of(v.begin(), v.end(), [](StreamMask m) { return m.out || m.err; });
    };
    return any(c.redirects) || any(c.tee);
  }

  bool keep_logs_;
  std::string tmp_dir_;  // "" with --log-dir
  std::string run_prefix_;
  std::string error_;
};

}  // namespace

LocalAgent::LocalAgent(LaunchConfig config) : config_(std::move(config)) {}

int LocalAgent::run() {
  const std::string program_path = resolve_program(config_.program);
  if (program_path.empty()) {
    log_line("cannot run '" + config_.program + "': not found or not executable");
    return 127;
  }
  RunFolder folder(config_);
  if (!folder.error().empty()) {
    log_line(folder.error());
    return 1;
  }
  const SignalCapture signals;
  if (!signals.error().empty()) {
    log_line(signals.error());
    return 1;
  }
  WorkerGroup group(config_, program_path, folder.run_prefix(), folder.keep_logs());
  return config_.multi_node() ? MultiNodeRun(config_, group).run()
                              : run_single_node(config_, group);
}

}  // namespace ember::launcher
