// Launch helpers shared by the element-wise CUDA kernels (internal to tensor/cuda/). Each builds
// the Geometry of the loop, sets the device and queues one cuda_elementwise kernel on the
// current stream, running a functor from tensor/detail/functors.h through its adapter.
#pragma once

#include <ember/tensor/cuda/loops.cuh>
#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/detail/functors.h>

namespace ember::detail::cuda_ew {

using cuda::detail::DeviceGuard;
using cuda_loops::cuda_elementwise;
using cuda_loops::stream_of;

template <typename Out, typename T, typename F>
void unary(const Tensor& out, const Tensor& in, const F& f) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  const Geometry g = make_geometry(out.shape(), {&out, &in});
  cuda_elementwise<Out, T>(g, fn::UnaryAdapter<Out, T, F>{f}, stream_of(out.device()));
}

template <typename Out, typename T, typename F>
void binary(const Tensor& out, const Tensor& a, const Tensor& b, const F& f) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  const Geometry g = make_geometry(out.shape(), {&out, &a, &b});
  cuda_elementwise<Out, T, T>(g, fn::BinaryAdapter<Out, T, F>{f}, stream_of(out.device()));
}

template <typename Out, typename T, bool Reverse, typename F>
void scalar(const Tensor& out, const Tensor& a, acc_t<T> s, const F& f) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index);
  const Geometry g = make_geometry(out.shape(), {&out, &a});
  cuda_elementwise<Out, T>(g, fn::ScalarAdapter<Out, T, F, Reverse>{f, s}, stream_of(out.device()));
}

/// The CUDA `Run` of Note [One op table for both devices].
struct CudaRun {
  const Tensor& out;
  const Tensor& a;
  const Tensor& b;
  template <typename Out, typename T, typename F>
  void unary(const F& f) { cuda_ew::unary<Out, T>(out, a, f); }
  template <typename Out, typename T, typename F>
  void binary(const F& f) { cuda_ew::binary<Out, T>(out, a, b, f); }
  template <typename Out, typename T, bool Reverse, typename F>
  void scalar(acc_t<T> s, const F& f) { cuda_ew::scalar<Out, T, Reverse>(out, a, s, f); }
};

void compare(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void compare_scalar(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s);

}  // namespace ember::detail::cuda_ew
