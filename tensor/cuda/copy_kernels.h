// Kernels behind copy_cuda/fill_cuda (internal).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {
/// dst = convert(src) on one device; same shape; queued on `stream` (a cudaStream_t).
void convert_cuda(const Tensor& dst, const Tensor& src, void* stream);
void fill_cuda_kernel(const Tensor& t, const Scalar& v, void* stream);
}  // namespace ember::detail
