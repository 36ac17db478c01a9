// Rendezvous backends: what differs between --rdzv-backend c10d and etcd (who hosts the store,
// how a node arrives, who closes a round, how an agent's death shows), behind one interface, and
// the registry that --rdzv-backend NAME picks from. The rendezvous protocol itself
// (launcher/rendezvous.h) is written once over RendezvousBackend. Adding a backend: one file,
// launcher/rendezvous_<name>.cpp, and one row of EMBER_RENDEZVOUS_BACKENDS in
// rendezvous_backend.cpp (docs/launcher.md, "Adding a rendezvous backend").
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ember/launcher/launch_config.h>
#include <ember/launcher/rendezvous_store.h>

namespace ember::launcher {

/// One agent's side of a rendezvous backend: the store it connects to and the coordination
/// steps that differ between backends. The protocol (launcher/rendezvous.cpp) calls these in
/// order: connect (retried), check_run, then per round open_round, arrive (without
/// --node-rank), registered, complete, and while the round runs read_counter; finished at the
/// end. A backend works on the RendezvousStore it was made with (RendezvousBackendType::make),
/// which outlives it; dist::DistError from the store propagates (the caller reports a lost
/// store), RendezvousError ends the rendezvous with its message. Not thread-safe.
class RendezvousBackend {
 public:
  virtual ~RendezvousBackend() = default;

  /// Connects this agent to the store within `timeout` and attaches the client(s) to the
  /// RendezvousStore. Called again until it succeeds or --rdzv-timeout passed: throw
  /// dist::DistNetworkError or dist::DistTimeoutError to be retried, anything else is final.
  virtual void connect(std::chrono::milliseconds timeout) = 0;
  /// What emberrun says when the store could not be reached within --rdzv-timeout; `last` is
  /// the last connection error.
  virtual std::string unreachable(const std::string& last) const = 0;
  /// What losing the store suggests, in "lost the rendezvous store at EP while OP (HINT): ...":
  /// "node 0's agent gone?".
  virtual std::string lost_hint() const = 0;
  /// Whether this agent hosts the store: it is node 0 of every round, opens and closes them,
  /// and must outlive the others' use of the store (the agent waits for their exits).
  virtual bool is_host() const = 0;

  /// Called once by an agent before it reads the round to join: throws RendezvousError when it
  /// must not join this run (etcd: the run id belongs to a run that is over). Default: nothing.
  virtual void check_run() {}
  /// This agent's part in opening round `round`, before it registers in it: publishing the
  /// round (its restart count, MASTER_ADDR where the backend picks it then, the current round)
  /// where this agent is the one to do it.
  virtual void open_round(int round) = 0;
  /// This agent's arrival in `round` without --node-rank: creates the first missing node record
  /// r<R>/node/<k> (Note [Arriving is registering] in rendezvous.cpp) and returns its k;
  /// --nnodes MAX when every one is taken.
  virtual int arrive(int round) = 0;
  /// This node registered as node `k` of `round`. Default: nothing.
  virtual void registered(int /*round*/, int /*k*/) {}
  /// Closes `round` (this agent leads it) or waits until it is closed; returns its number of
  /// nodes (RendezvousStore::round_size: `k` past it waits for the next round, elastic).
  virtual int complete(int round, int k) = 0;
  /// The end of "waited ... for rendezvous round R, ...": who failed to open it ("which node 0
  /// did not open").
  virtual std::string round_not_opened() const = 0;

  /// Whether this agent watches the other nodes' heartbeats while the round runs (Note
  /// [Heartbeats] in rendezvous.cpp).
  virtual bool watches_heartbeats() const = 0;
  /// A counter's value (a heartbeat), or -1 when its key vanished with its writer's lease.
  virtual int64_t read_counter(const std::string& key) = 0;
  /// This node's workers finished round `round` of `nnodes` nodes, and it reported its exit.
  /// Default: nothing.
  virtual void finished(int /*round*/, int /*nnodes*/) {}
};

/// A kind of rendezvous backend, as registered: what parse_args asks of it before any agent
/// runs, and how an agent makes one. Each backend's file defines one (a constant).
struct RendezvousBackendType {
  /// --rdzv-endpoint's port when it names none.
  int default_port;
  /// The backend in --help, after its name(s): "node 0's agent hosts the store".
  const char* help;
  /// Checks and adjusts the options for this backend at parse time (after --rdzv-conf, before
  /// the endpoint is resolved); throws UsageError naming the option, may add a notice. nullptr:
  /// nothing to check.
  void (*check_options)(LaunchConfig& c);
  /// Makes an agent's backend over `s` (which outlives it); it may start serving the store
  /// (c10d's node 0). Throws RendezvousError when it cannot.
  std::unique_ptr<RendezvousBackend> (*make)(RendezvousStore& s);
};

/// One name --rdzv-backend accepts, and its backend.
struct RegisteredRendezvousBackend {
  const char* name;
  const RendezvousBackendType* type;
};

/// Every registered name, in the order errors and --help list them; names of one backend are
/// next to each other.
const std::vector<RegisteredRendezvousBackend>& rendezvous_backends();
/// The backend registered as `name`, or nullptr.
const RendezvousBackendType* find_rendezvous_backend(const std::string& name);
/// The registered names for a message: "static, c10d or etcd".
std::string rendezvous_backend_names();

}  // namespace ember::launcher
