// Stand-in for process_group_nccl.cpp in builds without NCCL (EMBER_WITH_NCCL=OFF, CUDA off,
// or NCCL not found): constructing the group throws, and init_process_group's backend "nccl"
// says what the build lacks.
#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/detail/unavailable_backend.h>

namespace ember::dist {

bool nccl_available() { return false; }

class ProcessGroupNccl::Impl {};

namespace {
[[noreturn]] void unavailable() {
  throw NotImplementedError("nccl is not available: built with EMBER_WITH_NCCL=OFF");
}
}  // namespace

ProcessGroupNccl::ProcessGroupNccl(std::shared_ptr<Store>, int rank, int size, NcclOptions options)
    : ProcessGroup(rank, size, Options{options.timeout}) {
  unavailable();
}
ProcessGroupNccl::~ProcessGroupNccl() = default;

std::shared_ptr<ProcessGroupNccl> ProcessGroupNccl::split(const std::vector<int>&, NcclOptions) {
  unavailable();
}
int ProcessGroupNccl::device() const { unavailable(); }
cuda::Stream ProcessGroupNccl::stream() const { unavailable(); }
WorkPtr ProcessGroupNccl::allreduce(Tensor&, const AllreduceOptions&) { unavailable(); }
WorkPtr ProcessGroupNccl::broadcast(Tensor&, const BroadcastOptions&) { unavailable(); }
WorkPtr ProcessGroupNccl::reduce(Tensor&, const ReduceOptions&) { unavailable(); }
WorkPtr ProcessGroupNccl::allgather_into_tensor(Tensor&, const Tensor&, const CollectiveOptions&) {
  unavailable();
}
WorkPtr ProcessGroupNccl::reduce_scatter(Tensor&, const std::vector<Tensor>&,
                                         const ReduceScatterOptions&) {
  unavailable();
}
WorkPtr ProcessGroupNccl::reduce_scatter_tensor(Tensor&, const Tensor&,
                                                const ReduceScatterOptions&) {
  unavailable();
}
WorkPtr ProcessGroupNccl::alltoall(std::vector<Tensor>&, const std::vector<Tensor>&,
                                   const CollectiveOptions&) {
  unavailable();
}
WorkPtr ProcessGroupNccl::barrier(const CollectiveOptions&) { unavailable(); }
WorkPtr ProcessGroupNccl::send(const Tensor&, int, int) { unavailable(); }
WorkPtr ProcessGroupNccl::recv(Tensor&, int, int) { unavailable(); }
std::vector<WorkPtr> ProcessGroupNccl::batch_isend_irecv(const std::vector<P2POp>&) {
  unavailable();
}

// The backend stays registered, so init_process_group says what the build lacks and how to
// get it, instead of "unknown backend".
const bool kRegistered = [] {
  register_backend("nccl", detail::unavailable_backend("nccl", "NCCL", "EMBER_WITH_NCCL",
                                                       "CUDA and NCCL (NVIDIA's libnccl-dev)"),
                   BackendTraits{.built = false});
  return true;
}();

}  // namespace ember::dist
