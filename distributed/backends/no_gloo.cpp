// Stand-in for process_group_gloo.cpp in builds without gloo (EMBER_WITH_GLOO=OFF or libgloo
// not found): constructing the group throws.
#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/detail/unavailable_backend.h>

namespace ember::dist {

bool gloo_available() { return false; }

class ProcessGroupGloo::Impl {};

namespace {
[[noreturn]] void unavailable() {
  throw NotImplementedError("gloo is not available: built with EMBER_WITH_GLOO=OFF");
}
}  // namespace

ProcessGroupGloo::ProcessGroupGloo(std::shared_ptr<Store>, int rank, int size, GlooOptions options)
    : ProcessGroup(rank, size, Options{options.timeout}) {
  unavailable();
}
ProcessGroupGloo::~ProcessGroupGloo() = default;
bool ProcessGroupGloo::uses_shared_memory() const { return false; }
bool ProcessGroupGloo::abort(const std::string&) { unavailable(); }

WorkPtr ProcessGroupGloo::allreduce(Tensor&, const AllreduceOptions&) { unavailable(); }
WorkPtr ProcessGroupGloo::allreduce_coalesced(std::vector<Tensor>&, const AllreduceOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::broadcast(Tensor&, const BroadcastOptions&) { unavailable(); }
WorkPtr ProcessGroupGloo::reduce(Tensor&, const ReduceOptions&) { unavailable(); }
WorkPtr ProcessGroupGloo::allgather_into_tensor(Tensor&, const Tensor&, const CollectiveOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::allgather(std::vector<Tensor>&, const Tensor&,
                                    const CollectiveOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::reduce_scatter(Tensor&, const std::vector<Tensor>&,
                                         const ReduceScatterOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::reduce_scatter_tensor(Tensor&, const Tensor&,
                                                const ReduceScatterOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::gather(std::vector<Tensor>&, const Tensor&, const GatherOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::scatter(Tensor&, const std::vector<Tensor>&, const ScatterOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::alltoall(std::vector<Tensor>&, const std::vector<Tensor>&,
                                   const CollectiveOptions&) {
  unavailable();
}
WorkPtr ProcessGroupGloo::barrier(const CollectiveOptions&) { unavailable(); }
WorkPtr ProcessGroupGloo::send(const Tensor&, int, int) { unavailable(); }
WorkPtr ProcessGroupGloo::recv(Tensor&, int, int) { unavailable(); }

// The backend stays registered, so init_process_group says what the build lacks and how to
// get it, instead of "unknown backend".
const bool kRegistered = [] {
  register_backend("gloo", detail::unavailable_backend("gloo", "Gloo", "EMBER_WITH_GLOO",
                                                       "libgloo (Debian: libgloo-dev)"),
                   BackendTraits{.built = false});
  return true;
}();

}  // namespace ember::dist
