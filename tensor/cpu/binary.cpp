// CPU kernels for binary arithmetic (add, sub, mul, div, pow, maximum, minimum), tensor-tensor
// and tensor-scalar. Comparisons and logical ops are in compare.cpp.
#include <ember/tensor/cpu/elementwise_loops.h>
#include <ember/tensor/cpu/wide_loops.h>
#include <ember/tensor/detail/elementwise_dispatch.h>

namespace ember::detail {

void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                const Scalar& alpha) {
  if (cpu_ew::binary_wide(op, out, a, b)) return;
  cpu_ew::CpuRun run{out, a, b};
  if (!dispatch_binary(op, a.dtype(), alpha, run)) cpu_ew::compare_cpu(op, out, a, b);
}

void binary_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                       bool reverse) {
  cpu_ew::CpuRun run{out, a, a};
  if (!dispatch_binary_scalar(op, a.dtype(), s, reverse, run)) {
    cpu_ew::compare_scalar_cpu(op, out, a, s, reverse);
  }
}

}  // namespace ember::detail
