// The MPI backend's registrations: the "mpi" backend, and the init method that lets ranks
// started by mpirun find each other without MASTER_ADDR (through MPI itself). Built with MPI
// only; no_mpi.cpp registers the backend's refusal otherwise.
#include <ember/distributed/backends/process_group_mpi.h>

#include <unistd.h>

#include <algorithm>

#include <ember/distributed/detail/environment.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/ops/creation.h>

namespace ember::dist {

namespace {

using detail::env_set;
using detail::Environment;

std::shared_ptr<ProcessGroup> make_mpi(const BackendArgs& a) {
  // MPI knows its own ranks; the store is not needed. Every process takes part in creating the
  // communicator, members or not.
  std::shared_ptr<ProcessGroup> pg = ProcessGroupMpi::create(a.global_ranks, {a.timeout});
  if (pg != nullptr) {
    EMBER_CHECK(pg->rank() == a.rank && pg->size() == a.size, "[init_process_group] the mpi "
                "backend sees rank ", pg->rank(), " of ", pg->size(), " but the rendezvous "
                "gave rank ", a.rank, " of ", a.size, " (launch with mpirun, or make RANK and "
                "WORLD_SIZE agree with MPI's)");
  }
  return pg;
}

/// Whether mpirun (Open MPI, or a PMI launcher such as MPICH's) started this process and nothing
/// names rank 0's host: the ranks can then agree on the store's address through MPI itself.
bool mpi_without_master(const Environment& env) {
  return !env_set(env, "RANK") &&
         (env_set(env, "OMPI_COMM_WORLD_RANK") || env_set(env, "PMI_RANK")) &&
         !env_set(env, "MASTER_ADDR") && !env_set(env, "SLURM_JOB_NODELIST") &&
         !env_set(env, "SLURM_NODELIST");
}

/// Rank 0 starts the job's store on a port the OS picks and broadcasts "host:port" over MPI;
/// the others connect to it. On one node the store stays on loopback; across nodes rank 0
/// advertises its host name and listens on every interface.
std::shared_ptr<Store> mpi_bootstrap_store(const Environment& env,
                                           Duration timeout, int* rank, int* size,
                                           std::string* master_addr) {
  auto mpi = ProcessGroupMpi::create({}, {timeout});
  *rank = mpi->rank();
  *size = mpi->size();
  constexpr int64_t kMax = 512;
  Tensor msg = zeros({kMax}, TensorOptions(kUInt8));
  std::shared_ptr<TCPStore> store;
  if (*rank == 0) {
    const char* local_size_var = env_set(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
                                     ? "OMPI_COMM_WORLD_LOCAL_SIZE"
                                     : "MPI_LOCALNRANKS";
    const bool one_node = env_set(env, local_size_var) &&
                          env.at(local_size_var) == std::to_string(*size);
    std::string host = "127.0.0.1";
    TCPStoreOptions so;
    if (!one_node) {
      char name[256] = {};
      EMBER_CHECK_TYPE(DistNetworkError, gethostname(name, sizeof(name) - 1) == 0,
                       "[init_process_group] mpi bootstrap: gethostname failed");
      host = name;
      so.listen_host = "0.0.0.0";
    }
    so.is_server = true;
    so.world_size = *size;
    so.wait_for_workers = false;
    so.timeout = timeout;
    store = std::make_shared<TCPStore>(host, 0, so);
    const std::string addr = host + ":" + std::to_string(store->port());
    EMBER_CHECK(static_cast<int64_t>(addr.size()) < kMax,
                "[init_process_group] mpi bootstrap: host name too long: ", host);
    std::copy(addr.begin(), addr.end(), msg.data<uint8_t>());
  }
  mpi->broadcast(msg, {0, timeout})->wait();
  const std::string addr(reinterpret_cast<const char*>(msg.data<uint8_t>()));
  const size_t colon = addr.rfind(':');
  EMBER_INTERNAL_ASSERT(colon != std::string::npos, "mpi bootstrap got '", addr, "'");
  *master_addr = addr.substr(0, colon);
  if (*rank != 0) {
    TCPStoreOptions so;
    so.world_size = *size;
    so.timeout = timeout;
    const auto port = static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)));
    store = std::make_shared<TCPStore>(*master_addr, port, so);
  }
  return store;
}

// mpirun's init method: env:// when MPI started this process and nothing names rank 0's host,
// or any env:// of backend "mpi" without MASTER_ADDR (MPI finds the peers itself: no rendezvous
// and no TCP store; groups made later get prefixes of a process-local store, which MPI never
// reads). For other backends rank 0 starts the job's TCP store and tells the others its address
// over MPI.
bool mpirun_accepts(const std::string& url, const std::string& backend) {
  if (url.rfind("env://", 0) != 0) return false;
  if (backend == "mpi" && !std::getenv("MASTER_ADDR")) return true;
  return mpi_without_master(detail::environment());
}

Rendezvous mpirun_rendezvous(const std::string&, const InitOptions& o, Duration timeout) {
  Rendezvous r;
  if (o.backend == "mpi") {
    r.world = ProcessGroupMpi::create({}, {timeout});
    r.rank = r.world->rank();
    r.world_size = r.world->size();
    r.store = std::make_shared<HashStore>();
  } else {
    r.store = mpi_bootstrap_store(detail::environment(), timeout, &r.rank, &r.world_size,
                                  &r.master_addr);
  }
  EMBER_CHECK(
      (o.rank < 0 || o.rank == r.rank) && (o.world_size < 0 || o.world_size == r.world_size),
      "[init_process_group] ", o.backend == "mpi" ? "backend mpi: " : "", "MPI gives rank ", r.rank,
      " of ", r.world_size, " but rank ", o.rank, " and world_size ", o.world_size, " were passed");
  return r;
}

const bool kRegistered = [] {
  register_backend("mpi", make_mpi);
  register_init_method({"mpirun", mpirun_accepts, mpirun_rendezvous, /*priority=*/10});
  return true;
}();

}  // namespace

}  // namespace ember::dist
