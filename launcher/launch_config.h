// What one emberrun agent runs with: its settings, resolved. parse_args (launcher/config.h) makes
// them from the command line; the agent, its worker group and the rendezvous read them.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::launcher {

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
  bool node_rank_given = false;     // --node-rank (or EMBER_NODE_RANK) was set: static ranks
  std::string master_addr = "127.0.0.1";  // --master-addr
  int master_port = 29500;          // --master-port; --standalone picks a free one
  bool standalone = false;          // --standalone
  // Each attempt's MASTER_PORT is a free port the agent picks: --standalone, or one node given
  // a c10d --rdzv-endpoint (torchrun's way to stack jobs on one host without port clashes).
  bool pick_master_port = false;
  std::string rdzv_endpoint;        // --rdzv-endpoint host[:port] (multi-node), as given
  // Multi-node: the rendezvous store's host and port, resolved by parse_args: --rdzv-endpoint
  // (the backend's default port when it names none), else --master-addr:--master-port.
  std::string rdzv_host;
  int rdzv_port = 0;
  std::string rdzv_id = "none";     // --rdzv-id: the run id (names the log folder)
  std::string rdzv_backend = "static";  // --rdzv-backend: a name the rendezvous registry knows
  std::string local_addr;           // --local-addr: node 0's address for MASTER_ADDR
  double rdzv_timeout_s = 900.0;    // --rdzv-timeout / --join-timeout: node join limit, seconds
  double last_call_s = 30.0;        // --nnodes MIN:MAX: wait after MIN nodes joined, seconds
  double rdzv_read_timeout_s = 10.0;  // --rdzv-conf read_timeout: one rendezvous store request
  // --rdzv-backend etcd over TLS (--rdzv-conf protocol=https, cacert, cert, key: torchrun's
  // etcd backend's keys): etcd's certificate checked against etcd_cacert ("" = the system's
  // trust store), etcd_cert and etcd_key (PEM files) presented when given.
  bool etcd_https = false;
  std::string etcd_cacert, etcd_cert, etcd_key;
  // --rdzv-backend etcd with etcd's authentication: --rdzv-conf user=NAME and password_file=PATH
  // (read here: a password in argv would show in ps).
  std::string etcd_user, etcd_password;
  double heartbeat_interval_s = 5.0;  // --heartbeat-interval: an agent's beat in the store
  double heartbeat_timeout_s = 25.0;  // --heartbeat-timeout: node 0 ends a round on a silent one
  std::string role = "default";     // --role: the workers' ROLE_NAME
  int max_restarts = 0;             // --max-restarts
  double monitor_interval_s = 0.1;  // --monitor-interval, seconds
  double grace_period_s = 30.0;     // --grace-period: SIGTERM -> SIGKILL delay, seconds
  // --store-max-stored-bytes and the other store limits given (dist::store_limits()): their
  // EMBER_STORE_* variable and value, exported to the workers (rank 0's store reads them) and
  // applied to the rendezvous store node 0's agent hosts.
  std::vector<std::pair<std::string, std::string>> store_limits;
  std::string log_dir;              // --log-dir ("" = no log files unless --redirects/--tee)
  std::vector<StreamMask> redirects;  // per local rank: streams sent to the log file only
  std::vector<StreamMask> tee;        // per local rank: streams sent to console and log file
  std::optional<std::vector<int>> local_ranks_filter;  // console shows only these local ranks
  std::string program;              // PROGRAM (resolved through PATH by the agent)
  std::vector<std::string> args;    // ARGS
  /// Options accepted for torchrun's sake that do nothing here (--no-python, --start-method):
  /// one line each, which main() prints once on stderr.
  std::vector<std::string> notices;

  /// Total number of ranks on a single node (nproc_per_node); multi-node runs get theirs from
  /// the rendezvous.
  int world_size() const { return max_nodes * nproc_per_node; }
  /// More than one node: the agents rendezvous through a store (launcher/rendezvous.h).
  bool multi_node() const { return max_nodes > 1; }
  /// --nnodes MIN:MAX with MIN < MAX: a lost node leaves the job, a late one joins it.
  bool elastic() const { return min_nodes < max_nodes; }
  /// Multi-node: the rendezvous store's host and port (rdzv_host, rdzv_port).
  std::pair<std::string, int> rdzv_host_port() const { return {rdzv_host, rdzv_port}; }
};

}  // namespace ember::launcher
