// The MPI process group in builds without MPI (EMBER_WITH_MPI=OFF or MPI not found).
#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/distributed/detail/unavailable_backend.h>

namespace ember::dist {

std::shared_ptr<ProcessGroupMpi> ProcessGroupMpi::create(std::vector<int>, ProcessGroup::Options) {
  throw NotImplementedError("mpi is not available: built with EMBER_WITH_MPI=OFF");
}

bool ProcessGroupMpi::is_available() { return false; }

// The backend stays registered, so init_process_group says what the build lacks and how to
// get it, instead of "unknown backend".
const bool kRegistered = [] {
  register_backend("mpi", detail::unavailable_backend("mpi", "MPI", "EMBER_WITH_MPI",
                                                       "MPI (Debian: libopenmpi-dev openmpi-bin)"),
                   BackendTraits{.built = false});
  return true;
}();

}  // namespace ember::dist
