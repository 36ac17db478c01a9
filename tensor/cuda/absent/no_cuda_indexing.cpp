// CPU-only builds (EMBER_WITH_CUDA=OFF): the CUDA side of the indexing and random families.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/detail/indexing_kernels.h>
#include <ember/tensor/detail/random_kernels.h>

namespace ember::detail {

void gather_cuda(const GatherArgs& a) { no_cuda(a.bound.op); }
void scatter_add_cuda(const ScatterArgs& a) { no_cuda(a.bound.op); }
void random_fill_cuda(const Tensor&, const RandomSpec&, const PhiloxArgs&) { no_cuda("random"); }
bool cuda_capture_draw(Generator&, uint64_t, int, PhiloxArgs*) { return false; }
void write_philox_replay(uint64_t*, uint64_t, uint64_t, void*) { no_cuda("CUDAGraph::replay"); }

}  // namespace ember::detail
