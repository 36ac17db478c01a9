// Copies that involve a CUDA device: device-to-device (with dtype conversion), host <-> device,
// and across devices.
#include <cuda_runtime_api.h>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/copy_kernels.h>
#include <ember/tensor/cuda/runtime/host_use.h>
#include <ember/tensor/detail/copy.h>

namespace ember::detail {

namespace cuda_loops {
cudaStream_t stream_of(Device d) {
  return static_cast<cudaStream_t>(cuda::current_stream(d.index).handle());
}
}  // namespace cuda_loops

namespace {

using cuda::detail::DeviceGuard;
using cuda_loops::stream_of;

bool dense_same(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.is_contiguous() && b.is_contiguous();
}

// src (on a CUDA device) into a contiguous tensor of dtype `t` on the same device.
Tensor dense_on_device(const Tensor& src, Dtype t) {
  if (src.dtype() == t && src.is_contiguous()) return src;
  Tensor out = make_empty(src.shape(), t, src.device());
  DeviceGuard g(src.device().index);
  convert_cuda(out, src, stream_of(src.device()));
  return out;
}

void finish(const cuda::Stream& s, bool non_blocking, const Tensor& host) {
  if (non_blocking && host.is_pinned()) {
    record_host_use(host.storage()->data(), s);
  } else {
    s.synchronize();
  }
}

}  // namespace

void copy_cuda(const Tensor& dst, const Tensor& src, bool non_blocking) {
  if (dst.numel() == 0) return;
  if (dst.is_cuda() && src.is_cuda()) {
    if (dst.device() == src.device()) {
      DeviceGuard g(dst.device().index);
      cudaStream_t s = stream_of(dst.device());
      if (dense_same(dst, src)) {
        EMBER_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                         cudaMemcpyDeviceToDevice, s));
      } else {
        convert_cuda(dst, src, s);
      }
      return;
    }
    // Across devices: make src dense in dst's dtype on its own device, wait for it, then a peer
    // copy on dst's stream; convert into dst's layout there if needed.
    Tensor a = dense_on_device(src, dst.dtype());
    cuda::current_stream(src.device().index).synchronize();
    DeviceGuard g(dst.device().index);
    cudaStream_t s = stream_of(dst.device());
    Tensor b = dst.is_contiguous() ? dst : make_empty(dst.shape(), dst.dtype(), dst.device());
    EMBER_CUDA_CHECK(cudaMemcpyPeerAsync(b.data_ptr(), dst.device().index, a.data_ptr(),
                                         src.device().index, a.nbytes(), s));
    if (!b.is_same(dst)) convert_cuda(dst, b, s);
    // Always wait: the staging tensor `a` belongs to the other device's stream.
    cuda::current_stream(dst.device().index).synchronize();
    return;
  }
  if (dst.is_cuda()) {  // host -> device
    Tensor h = src;
    if (!(h.dtype() == dst.dtype() && h.is_contiguous())) {
      h = make_empty(src.shape(), dst.dtype(), kCPU);
      copy_cpu(h, src);
    }
    DeviceGuard g(dst.device().index);
    cuda::Stream stream = cuda::current_stream(dst.device().index);
    cudaStream_t s = static_cast<cudaStream_t>(stream.handle());
    Tensor d = dst.is_contiguous() ? dst : make_empty(dst.shape(), dst.dtype(), dst.device());
    EMBER_CUDA_CHECK(cudaMemcpyAsync(d.data_ptr(), h.data_ptr(), h.nbytes(),
                                     cudaMemcpyHostToDevice, s));
    if (!d.is_same(dst)) convert_cuda(dst, d, s);
    // A staging copy on the host is freed when this returns: the copy must be complete by then.
    finish(stream, non_blocking && h.is_same(src), h);
    return;
  }
  // device -> host
  Tensor a = dense_on_device(src, dst.dtype());
  DeviceGuard g(src.device().index);
  cuda::Stream stream = cuda::current_stream(src.device().index);
  cudaStream_t s = static_cast<cudaStream_t>(stream.handle());
  const bool direct = dst.is_contiguous();
  Tensor h = direct ? dst : make_empty(dst.shape(), dst.dtype(), kCPU);
  EMBER_CUDA_CHECK(cudaMemcpyAsync(h.data_ptr(), a.data_ptr(), a.nbytes(), cudaMemcpyDeviceToHost, s));
  if (direct) {
    finish(stream, non_blocking, h);
  } else {
    stream.synchronize();
    copy_cpu(dst, h);
  }
}

void fill_cuda(const Tensor& t, const Scalar& v) {
  DeviceGuard g(t.device().index);
  fill_cuda_kernel(t, v, stream_of(t.device()));
}

}  // namespace ember::detail
