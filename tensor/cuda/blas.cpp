// Batched GEMM on CUDA with cuBLAS (cublasGemmStridedBatchedEx): float32 and float64 in their own
// precision, float16 and bfloat16 with float32 accumulation. Row-major C = A B is computed as the
// column-major C^T = B^T A^T, so row-major operands need no copy and transposed views become
// transpose flags.
#include <cuda_runtime_api.h>

#include <climits>
#include <mutex>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/runtime/cublas_loader.h>
#include <ember/tensor/cuda/runtime/handle_pool.h>
#include <ember/tensor/detail/linalg_kernels.h>

namespace ember::detail {

namespace cuda_loops {
cudaStream_t stream_of(Device d);
}

namespace {


void check_cublas(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  if (st == CUBLAS_STATUS_ALLOC_FAILED) {
    throw OutOfMemoryError(str_cat("[matmul] cuBLAS could not allocate memory in ", what));
  }
  throw CudaError(str_cat("[matmul] cuBLAS error in ", what, ": ", cublas().get_status_name(st),
                          " (", cublas().get_status_string(st), ")"));
}

// The calling thread's handle for `device` (the current device), set on its current stream
// (Note [Per-thread library handles]).
cublasHandle_t cublas_handle(Device device) {
  cublasHandle_t h = cuda::detail::pooled_handle<cublasHandle_t>(device.index, +[] {
    cublasHandle_t created = nullptr;
    check_cublas(cublas().create(&created), "cublasCreate");
    return created;
  });
  check_cublas(cublas().set_stream(h, cuda_loops::stream_of(device)), "cublasSetStream");
  return h;
}

struct TypeInfo {
  cudaDataType data;
  cublasComputeType_t compute;
  bool f64;
};
TypeInfo type_info(Dtype t) {
  switch (t) {
    case kFloat32:
      return {CUDA_R_32F,
              cuda::matmul_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, false};
    case kFloat64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F, true};
    case kFloat16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F, false};
    case kBFloat16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, false};
    default: throw_unsupported_dtype("matmul", t, "floating dtypes");
  }
}

// One stride for all batch dims of t (dims [0, nb)) when they merge into one, else -1. The
// batch sizes are out's, so a broadcast operand has zero strides on its expanded dims.
int64_t merged_batch_stride(const Tensor& t, int nb) {
  int64_t stride = 0;
  int64_t span = -1;  // stride expected of the next dim of size > 1 after merging
  for (int d = nb - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (span < 0) {
      stride = t.stride(d);
    } else if (t.stride(d) != span) {
      return -1;
    }
    span = t.stride(d) * t.size(d);
  }
  return stride;
}

// t with a BLAS layout and mergeable batch dims; copies it when it has neither.
Tensor prepare(const Tensor& t, int nb, BlasLayout& l, int64_t& batch_stride) {
  const int64_t nd = t.dim();
  l = blas_layout(t.size(nd - 2), t.size(nd - 1), t.stride(nd - 2), t.stride(nd - 1));
  batch_stride = merged_batch_stride(t, nb);
  if (l.ok && batch_stride >= 0) return t;
  Tensor c = t.contiguous();
  l = blas_layout(c.size(nd - 2), c.size(nd - 1), c.stride(nd - 2), c.stride(nd - 1));
  batch_stride = merged_batch_stride(c, nb);
  EMBER_INTERNAL_ASSERT(l.ok && batch_stride >= 0, "a contiguous operand must fit cuBLAS");
  return c;
}

}  // namespace

void gemm_cuda(const Tensor& out, const Tensor& a_in, const Tensor& b_in, double alpha,
               double beta) {
  if (out.numel() == 0) return;
  cuda::detail::DeviceGuard guard(out.device().index);
  const int64_t nd = out.dim();
  const int nb = static_cast<int>(nd - 2);
  const int64_t n = out.size(nd - 2), m = out.size(nd - 1), k = a_in.size(nd - 1);
  const TypeInfo ti = type_info(out.dtype());
  cublasHandle_t h = cublas_handle(out.device());
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* alpha_p = ti.f64 ? static_cast<const void*>(&alpha) : &alpha_f;
  const void* beta_p = ti.f64 ? static_cast<const void*>(&beta) : &beta_f;
  if (k == 0) {  // an empty sum: out = beta * out
    if (beta == 0.0) {
      EMBER_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(),
                                       cuda_loops::stream_of(out.device())));
    } else if (beta != 1.0) {
      EMBER_CHECK(out.numel() < INT_MAX, "[matmul] too many elements for cuBLAS: ", out.numel());
      check_cublas(cublas().scal_ex(h, static_cast<int>(out.numel()), beta_p,
                                ti.f64 ? CUDA_R_64F : CUDA_R_32F, out.data_ptr(), ti.data, 1,
                                ti.f64 ? CUDA_R_64F : CUDA_R_32F),
                   "cublasScalEx");
    }
    return;
  }
  BlasLayout la, lb;
  int64_t sa = 0, sb = 0;
  Tensor a = prepare(a_in, nb, la, sa);
  Tensor b = prepare(b_in, nb, lb, sb);
  const int64_t batches = out.numel() / (n * m);
  EMBER_CHECK(n < INT_MAX && m < INT_MAX && k < INT_MAX && la.ld < INT_MAX && lb.ld < INT_MAX &&
                  batches < INT_MAX,
              "[matmul] dims must be below 2^31 for cuBLAS, got a of shape ", a.shape(),
              " and b of shape ", b.shape());
  // Column-major view: C^T [m, n] = B^T [m, k] @ A^T [k, n].
  check_cublas(
      cublas().gemm_strided_batched_ex(
          h, lb.trans ? CUBLAS_OP_T : CUBLAS_OP_N, la.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
          static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha_p, b.data_ptr(),
          ti.data, static_cast<int>(lb.ld), sb, a.data_ptr(), ti.data, static_cast<int>(la.ld),
          sa, beta_p, out.data_ptr(), ti.data, static_cast<int>(m), n * m,
          static_cast<int>(batches), ti.compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmStridedBatchedEx");
  // Temporaries made by prepare() die here; the caching allocator reuses their blocks only in
  // this stream's order, after the GEMM.
}

}  // namespace ember::detail
