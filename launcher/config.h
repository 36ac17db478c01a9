// emberrun's settings: the command line (torchrun's options) and their EMBER_* variables.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember::launcher {

/// A bad command line or EMBER_* value; main() prints it with the usage hint and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// --help was given: what() is the help text; main() prints it and exits 0.
class HelpRequested : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Which of a worker's streams go to its log file only (torch's Std: 0 none, 1 stdout,
/// 2 stderr, 3 both).
struct StreamMask {
  bool out = false;
  bool err = false;
};

/// Everything one emberrun agent needs, resolved (defaults applied, values checked).
struct LaunchConfig {
  int min_nodes = 1;                // --nnodes N or MIN:MAX
  int max_nodes = 1;
  int nproc_per_node = 1;           // --nproc-per-node (int, "cpu", "gpu" or "auto")
  int node_rank = 0;                // --node-rank
  std::string master_addr = "127.0.0.1";  // --master-addr
  int master_port = 29500;          // --master-port; --standalone picks a free one
  bool standalone = false;          // --standalone
  std::string rdzv_endpoint;        // --rdzv-endpoint host[:port] (multi-node, later)
  std::string rdzv_id = "none";     // --rdzv-id: the run id (names the log folder)
  std::string rdzv_backend = "static";  // --rdzv-backend (accepted: static, c10d)
  std::string local_addr;           // --local-addr (multi-node, later)
  int max_restarts = 0;             // --max-restarts
  double monitor_interval_s = 0.1;  // --monitor-interval, seconds
  double grace_period_s = 30.0;     // --grace-period: SIGTERM -> SIGKILL delay, seconds
  std::string log_dir;              // --log-dir ("" = no log files unless --redirects/--tee)
  std::vector<StreamMask> redirects;  // per local rank: streams sent to the log file only
  std::vector<StreamMask> tee;        // per local rank: streams sent to console and log file
  std::optional<std::vector<int>> local_ranks_filter;  // console shows only these local ranks
  std::string program;              // PROGRAM (resolved through PATH by the agent)
  std::vector<std::string> args;    // ARGS

  /// Total number of ranks (nodes * nproc_per_node).
  int world_size() const { return max_nodes * nproc_per_node; }
};

/// Parses emberrun's command line (argv[0] excluded). An option not on the command line is
/// read from its EMBER_* variable (EMBER_NPROC_PER_NODE, EMBER_MASTER_PORT, ...), else takes
/// its default. Throws UsageError naming the option and the offending value, or HelpRequested.
LaunchConfig parse_args(const std::vector<std::string>& args);

/// Parses a --redirects/--tee value for `nproc` local ranks: "3" (all ranks) or "0:3,1:1"
/// (per local rank; ranks not named get 0). Throws UsageError naming `option`.
std::vector<StreamMask> parse_std_spec(const std::string& option, const std::string& value,
                                       int nproc);

/// The number of CPUs this process may run on (sched_getaffinity), at least 1.
int available_cpus();

/// A TCP port on which nothing listens now (bound with port 0 on 127.0.0.1 and released):
/// what --standalone uses. Racy by nature, as torch's. Throws std::runtime_error on failure.
int pick_free_port();

}  // namespace ember::launcher
