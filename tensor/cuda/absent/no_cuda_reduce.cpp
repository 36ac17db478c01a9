// Linked instead of tensor/cuda/reduce.cu and softmax.cu when Ember is built with
// EMBER_WITH_CUDA=OFF.
#include <ember/tensor/cuda/absent/no_cuda.h>
#include <ember/tensor/detail/reduce_kernels.h>
#include <ember/tensor/error.h>

namespace ember::detail {

void reduce_cuda(ReduceKind, const Tensor&, const Tensor&, uint32_t, const ReduceParams&) {
  no_cuda("reduce");
}
void arg_reduce_cuda(const Tensor&, const Tensor&, const Tensor&, int64_t, bool is_max) {
  no_cuda(is_max ? "argmax" : "argmin");
}
void topk_cuda(const Tensor&, const Tensor&, int64_t, bool) { no_cuda("topk"); }
void softmax_cuda(const Tensor&, const Tensor&, int64_t, bool log) {
  no_cuda(log ? "log_softmax" : "softmax");
}
Tensor softmax_backward_cuda(const Tensor&, const Tensor&, bool log) {
  no_cuda(log ? "log_softmax backward" : "softmax backward");
}
void cross_entropy_rows_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("cross_entropy");
}
void cross_entropy_rows_backward_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("cross_entropy backward");
}

}  // namespace ember::detail
