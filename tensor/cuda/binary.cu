// CUDA kernels for binary arithmetic (add, sub, mul, div, pow, maximum, minimum), tensor-tensor
// and tensor-scalar. Comparisons and logical ops are in compare.cu.
#include <ember/tensor/cuda/elementwise_launch.cuh>
#include <ember/tensor/detail/elementwise_dispatch.h>

namespace ember::detail {

void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                 const Scalar& alpha) {
  cuda_ew::CudaRun run{out, a, b};
  if (!dispatch_binary(op, a.dtype(), alpha, run)) cuda_ew::compare(op, out, a, b);
}

void binary_scalar_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                        bool reverse) {
  cuda_ew::CudaRun run{out, a, a};
  if (!dispatch_binary_scalar(op, a.dtype(), s, reverse, run)) {
    // s < a is a > s: mirror the comparison instead of instantiating reversed kernels.
    cuda_ew::compare_scalar(reverse ? mirrored(op) : op, out, a, s);
  }
}

}  // namespace ember::detail
