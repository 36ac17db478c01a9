// The MPI process group in builds without MPI (EMBER_WITH_MPI=OFF or MPI not found).
#include <ember/distributed/process_group_mpi.h>

namespace ember::dist {

std::shared_ptr<ProcessGroupMpi> ProcessGroupMpi::create(std::vector<int>, ProcessGroup::Options) {
  throw NotImplementedError("mpi is not available: built with EMBER_WITH_MPI=OFF");
}

bool ProcessGroupMpi::is_available() { return false; }

}  // namespace ember::dist
