// CPU-only builds (EMBER_WITH_CUDA=OFF): the CUDA side of the indexing and random families.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/detail/indexing_kernels.h>
#include <ember/tensor/detail/random_kernels.h>

namespace ember::detail {

void gather_cuda(const GatherArgs& a) { no_cuda(a.bound.op); }
void scatter_add_cuda(const ScatterArgs& a) { no_cuda(a.bound.op); }
void random_fill_cuda(const Tensor&, const RandomSpec&, uint64_t, uint64_t) { no_cuda("random"); }

}  // namespace ember::detail
