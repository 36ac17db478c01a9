// init_process_group and the default (world) group (torch.distributed's module-level API).
//
//   dist::init_process_group();                   // env:// from RANK, WORLD_SIZE, ...; nccl on a
//                                                 // GPU, else gloo (default_backend)
//   auto& pg = *dist::default_group();
//   pg.allreduce(t)->wait();
//   auto sub = dist::new_group({0, 2});                        // every rank calls it
//   dist::destroy_process_group();
//
// The default group is process-wide state guarded by a mutex; the functions here may be
// called from any thread, but collectives follow ProcessGroup's threading rules.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/environment.h>
#include <ember/distributed/process_group.h>
#include <ember/distributed/store/store.h>

namespace ember::dist {

/// Arguments of init_process_group (torch.distributed.init_process_group's).
struct InitOptions {
  /// A registered backend: "gloo", "mpi", "nccl", "threads" (those built), or one added with
  /// register_backend. Empty (the default): the backend of this process's device,
  /// default_backend(cuda::is_available(), is_backend_available("nccl")): "nccl" where the
  /// build has NCCL and the process sees a CUDA device, else "gloo". Name "gloo" to all-reduce
  /// CPU tensors on a machine with GPUs.
  std::string backend;
  /// "env://" (the default when empty and no store is given), "tcp://host:port",
  /// "file:///path", or a URL that an init method added with register_init_method takes.
  /// Each takes rank and world_size from the fields below, from "?rank=R&world_size=N" in the
  /// URL, or from the environment, in that order (env://'s address still comes from
  /// MASTER_ADDR and MASTER_PORT).
  std::string init_method;
  /// A ready store instead of init_method (then rank and world_size must be given).
  std::shared_ptr<Store> store;
  /// -1: from the URL or the environment.
  int rank = -1;
  int world_size = -1;
  /// Collective timeout of the default group (and of the rendezvous). Unset:
  /// default_collective_timeout(backend).
  std::optional<Duration> timeout;
};

/// The backend init_process_group picks when InitOptions::backend is empty: "nccl" when
/// `nccl_built` (this build has the nccl backend) and `cuda_available` (the process sees a CUDA
/// device), else "gloo", as PyTorch (>= 2.6) picks the backend of the device. PyTorch without
/// a device_id makes both (gloo for CPU tensors, NCCL for CUDA ones); an Ember group has one
/// backend, so the process's device decides.
std::string default_backend(bool cuda_available, bool nccl_built);

/// The default group's timeout when the program sets none: EMBER_PG_TIMEOUT (whole seconds)
/// when the environment has it, else 10 minutes for "nccl" and 30 for the other backends (as
/// PyTorch's init_process_group). Throws ValueError for a malformed EMBER_PG_TIMEOUT.
Duration default_collective_timeout(const std::string& backend);

/// What a backend factory gets to create one group.
struct BackendArgs {
  std::shared_ptr<Store> store;  // private to this group (a PrefixStore)
  int rank = 0;                  // group rank
  int size = 1;                  // group size
  Duration timeout = kDefaultCollectiveTimeout;
  std::string master_addr;  // rank 0's address when known ("" otherwise): a hint for
                            // which interface to use (loopback stays on loopback)
  /// The group's members as world ranks, sorted (empty: the whole world). Factories are called
  /// on every process, members or not (MPI creates communicators collectively); on a
  /// non-member `rank` is -1 and the factory returns nullptr.
  std::vector<int> global_ranks;
  /// new_group: the default group the new group is made from (a backend may derive it from
  /// that group: NCCL splits its communicator, threads ties the new world's failure to it);
  /// null for the default group itself.
  std::shared_ptr<ProcessGroup> parent;
};
/// Creates a process group; registered per backend name.
using BackendFactory = std::function<std::shared_ptr<ProcessGroup>(const BackendArgs&)>;

/// How init_process_group holds a backend's default group.
struct BackendTraits {
  /// The default group made with this backend belongs to the calling thread, not the process:
  /// each rank thread of one process (the threads backend) calls init_process_group and has
  /// its own default group, new_group and destroy_process_group (PyTorch's threaded test
  /// groups do the same).
  bool default_group_per_thread = false;
  /// False for the stand-in a build without the backend registers in its place
  /// (backends/no_*.cpp): its factory throws, saying what the build lacks.
  bool built = true;
};

/// Makes `name` usable in init_process_group and new_group (replacing an earlier factory). Each
/// backend registers itself from its own file (backends/), from a static initializer; a
/// program may register its own. Throws ValueError for an empty name or a null factory.
void register_backend(const std::string& name, BackendFactory factory, BackendTraits traits = {});

/// The names of the registered backends, sorted (the stand-ins of backends not built included).
std::vector<std::string> registered_backends();

/// Whether `name` is registered and built in (torch.distributed.is_backend_available): false
/// for an unknown name and for the stand-in of a backend this build lacks.
bool is_backend_available(const std::string& name);

/// What an init method found: the job's store, this process's rank, the world size, and rank
/// 0's address when known (a hint for which interface the backend should use).
struct Rendezvous {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
  std::string master_addr;
  /// The default group itself, for a backend whose processes found each other without a store
  /// (MPI under mpirun); `store` is then a process-local one that later groups' prefixes use.
  std::shared_ptr<ProcessGroup> world;
};

/// One way for the ranks to meet (torch's rendezvous handlers): env://, tcp://, file://, and
/// MPI's own under mpirun. init_process_group asks the registered methods in order of
/// priority (highest first) whether they take the URL, and runs the first that does.
struct InitMethod {
  /// For messages: "env://", "tcp://host:port", "file:///path", "mpirun".
  std::string name;
  /// Whether this method handles `url` (the init_method, "env://" when none was given) for
  /// `backend`.
  std::function<bool(const std::string& url, const std::string& backend)> accepts;
  /// Meets the other ranks. `options` carries rank and world_size when the caller gave them
  /// (-1 otherwise); they must agree with what the method finds. Throws ValueError naming what
  /// is missing or contradictory, and the store's errors.
  std::function<Rendezvous(const std::string& url, const InitOptions& options, Duration timeout)>
      rendezvous;
  /// Asked before methods of lower priority: MPI's (env:// under mpirun, no MASTER_ADDR)
  /// comes before env://'s own.
  int priority = 0;
};

/// Adds an init method (replacing one of the same name). Throws ValueError for an empty name or
/// a missing function.
void register_init_method(InitMethod method);

/// Rendezvous with the other ranks and create the default group. Throws ValueError naming
/// what it found if a variable or argument is missing or contradictory, ValueError if a group
/// is already initialized, and the store's or backend's error (DistTimeoutError,
/// DistNetworkError, DistBackendError) if the rendezvous fails.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

/// True between init_process_group and destroy_process_group.
bool is_initialized();

/// The default group; throws ValueError if none is initialized.
std::shared_ptr<ProcessGroup> default_group();

/// The store behind the default group (unprefixed); throws ValueError if none.
std::shared_ptr<Store> default_store();

/// The rank of this process in `group` (default: the world). -1 if it is not a member
/// (group is null and no default group: throws ValueError).
int get_rank(const std::shared_ptr<ProcessGroup>& group = nullptr);
/// The size of `group` (default: the world).
int get_world_size(const std::shared_ptr<ProcessGroup>& group = nullptr);

/// A group of the given world ranks (sorted, distinct, each < world size), with the default
/// group's backend unless `backend` names another. Every rank of the world must call it with
/// the same arguments in the same order (as torch); returns null on ranks outside the group.
/// Group rank r is global rank ranks[r] (see ProcessGroup::global_ranks()). Empty `ranks`
/// means the whole world.
std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks,
                                        std::optional<Duration> timeout = {},
                                        const std::string& backend = "");

/// The global rank of `group`'s rank `group_rank`; ValueError if out of range.
int get_global_rank(const ProcessGroup& group, int group_rank);
/// `global_rank`'s rank in `group`, or ValueError if it is not a member.
int get_group_rank(const ProcessGroup& group, int global_rank);

/// Forgets the default group and every group made by new_group (they are destroyed when the
/// last reference goes). A no-op if none is initialized.
void destroy_process_group();

}  // namespace ember::dist
