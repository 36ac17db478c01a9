// CUDA kernels for unary element-wise ops, where and clamp.
#include <limits>

#include <ember/tensor/cuda/elementwise_launch.cuh>
#include <ember/tensor/detail/elementwise_dispatch.h>

namespace ember::detail {

void unary_cuda(UnaryOp op, const Tensor& out, const Tensor& in) {
  cuda_ew::CudaRun run{out, in, in};
  dispatch_unary(op, in.dtype(), run);
}

void where_cuda(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (out.numel() == 0) return;
  cuda_ew::DeviceGuard guard(out.device().index);
  const Geometry g = make_geometry(out.shape(), {&out, &cond, &a, &b});
  EMBER_DISPATCH_ALL(out.dtype(), "where", [&]<typename T>() {
    cuda_ew::cuda_elementwise<T, bool, T, T>(g, fn::Where<T>{}, cuda_ew::stream_of(out.device()));
  });
}

void clamp_cuda(const Tensor& out, const Tensor& in, const std::optional<Scalar>& lo,
                const std::optional<Scalar>& hi) {
  cuda_ew::CudaRun run{out, in, in};
  dispatch_clamp(in.dtype(), lo, hi, run);
}

}  // namespace ember::detail
