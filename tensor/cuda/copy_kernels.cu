#include <ember/tensor/cuda/copy_kernels.h>
#include <ember/tensor/cuda/loops.cuh>

namespace ember::detail {

namespace {
template <typename To, typename From>
struct ConvertOp {
  __host__ __device__ To operator()(From v) const { return convert<To>(v); }
};
template <typename T>
struct FillOp {
  T value;
  __host__ __device__ T operator()() const { return value; }
};
}  // namespace

void convert_cuda(const Tensor& dst, const Tensor& src, void* stream) {
  Geometry g = make_geometry(dst.shape(), {&dst, &src});
  EMBER_DISPATCH_ALL(dst.dtype(), "copy_", [&]<typename To>() {
    EMBER_DISPATCH_ALL(src.dtype(), "copy_", [&]<typename From>() {
      cuda_loops::cuda_elementwise<To, From>(g, ConvertOp<To, From>{},
                                             static_cast<cudaStream_t>(stream));
    });
  });
}

void fill_cuda_kernel(const Tensor& t, const Scalar& v, void* stream) {
  Geometry g = make_geometry(t.shape(), {&t});
  EMBER_DISPATCH_ALL(t.dtype(), "fill_", [&]<typename T>() {
    cuda_loops::cuda_elementwise<T>(g, FillOp<T>{v.to<T>()}, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace ember::detail
