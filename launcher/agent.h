// The local agent: runs one node's worker group, pumps its output, restarts it on failure.
#pragma once

#include <ember/launcher/config.h>

namespace ember::launcher {

/// Spawns config.nproc_per_node workers of config.program and supervises them. With
/// --nnodes > 1 it first joins the other nodes' agents through the rendezvous store
/// (launcher/rendezvous.h), which gives it its node rank, its ranks and MASTER_ADDR/PORT; a
/// failure on any node stops the workers on every node, and restarts (a new rendezvous round)
/// or ends the run everywhere. With --nnodes MIN:MAX a lost node is left out of the next round
/// and an agent started while the job runs waits to be admitted by the next one (Note
/// [Elastic membership] in rendezvous.cpp).
///
/// Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK,
/// ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, EMBER_RESTART_COUNT,
/// TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE / EMBER_ERROR_FILE,
/// and OMP_NUM_THREADS / EMBER_NUM_THREADS (cores / nproc_per_node unless the user set one).
/// Each worker leads its own process group; stopping a worker signals the whole group.
class LocalAgent {
 public:
  explicit LocalAgent(LaunchConfig config);
  /// Runs the group to completion; returns the process exit status emberrun should use: 0
  /// when every worker exited 0; 1 when the group failed with no restarts left (the summary
  /// was printed on stderr by the node where it failed), or the rendezvous failed; 128 + signal
  /// when emberrun was interrupted by SIGINT/SIGTERM/SIGHUP/SIGQUIT (the signal was forwarded,
  /// then escalated to SIGKILL after the grace period). Installs signal handlers for SIGINT,
  /// SIGTERM, SIGHUP, SIGQUIT and SIGCHLD for its duration. Call once.
  int run();

 private:
  LaunchConfig config_;
};

}  // namespace ember::launcher
