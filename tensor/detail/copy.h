// Backend kernels for copies and fills (the front end is in tensor.cpp and creation.cpp).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// dst = src converted to dst's dtype; both on the CPU, src already of dst's shape (may be a
/// broadcast view with zero strides).
void copy_cpu(const Tensor& dst, const Tensor& src);
/// Same, where at least one side is on a CUDA device. Queued on the current stream of the CUDA
/// side; waits for completion unless non_blocking (which is honoured only for pinned host memory).
void copy_cuda(const Tensor& dst, const Tensor& src, bool non_blocking);
/// Every element of t = v.
void fill_cpu(const Tensor& t, const Scalar& v);
void fill_cuda(const Tensor& t, const Scalar& v);

}  // namespace ember::detail
