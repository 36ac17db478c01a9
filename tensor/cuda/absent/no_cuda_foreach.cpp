// Linked instead of tensor/cuda/foreach.cu when Ember is built with EMBER_WITH_CUDA=OFF.
#include <vector>

#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/error.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

Tensor total_norm_cuda(const std::vector<Tensor>&, double) { no_cuda("total_norm"); }
void foreach_mul_cuda(const std::vector<Tensor>&, const Tensor&) { no_cuda("foreach_mul_"); }

}  // namespace ember::detail
