// addmm with its bias fused into the GEMM on CUDA: cuBLASLt's BIAS epilogue adds the [m] bias to
// every row as the product is written, where the general path first writes the broadcast bias
// into out and then has the GEMM read it back (beta = 1): two passes over [n, m] saved per
// Linear layer. Row-major out = a @ b + bias is the column-major out^T = b^T a^T + bias, whose
// rows the epilogue's bias vector indexes. Anything cuBLASLt has no algorithm for returns false
// and addmm takes the general path.
#include <cuda_runtime_api.h>

#include <array>
#include <climits>
#include <cstdint>
#include <map>

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

// The workspace cuBLASLt may use: its Hopper kernels want several MiB (PyTorch gives 32 MiB on
// sm_90); taken from the caching allocator per call, so it costs no cudaMalloc.
constexpr size_t kWorkspaceBytes = size_t{8} << 20;

cublasLtHandle_t lt_handle(Device device) {
  return cuda::detail::pooled_handle<cublasLtHandle_t>(device.index, +[] {
    cublasLtHandle_t created = nullptr;
    const cublasStatus_t st = cublas().lt_create(&created);
    if (st != CUBLAS_STATUS_SUCCESS) {
      throw CudaError(str_cat("[addmm] cublasLtCreate failed: ", cublas().get_status_name(st)));
    }
    return created;
  });
}

// The largest power of two (at most 256) dividing p's address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// Owners of the descriptors of one call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublas().lt_matmul_preference_destroy(pref);
    if (c) cublas().lt_matrix_layout_destroy(c);
    if (b) cublas().lt_matrix_layout_destroy(b);
    if (a) cublas().lt_matrix_layout_destroy(a);
    if (op) cublas().lt_matmul_desc_destroy(op);
  }
};

// The heuristic's first algorithm per problem (shape, layouts, dtype, alignments, device, TF32),
// per thread: the query costs more host time than the launch.
using AlgoKey = std::array<int64_t, 14>;
struct AlgoEntry {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

}  // namespace

bool gemm_bias_cuda(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& bias) {
  const Dtype dt = out.dtype();
  cudaDataType type;
  switch (dt) {
    case kFloat32: type = CUDA_R_32F; break;
    case kFloat16: type = CUDA_R_16F; break;
    case kBFloat16: type = CUDA_R_16BF; break;
    default: return false;
  }
  const int64_t n = out.size(0), m = out.size(1), k = a.size(1);
  if (n == 0 || m == 0 || k == 0 || bias.dim() != 1 || bias.size(0) != m ||
      !bias.is_contiguous() || !out.is_contiguous()) {
    return false;
  }
  const BlasLayout la = blas_layout(n, k, a.stride(0), a.stride(1));
  const BlasLayout lb = blas_layout(k, m, b.stride(0), b.stride(1));
  if (!la.ok || !lb.ok || n >= INT_MAX || m >= INT_MAX || k >= INT_MAX || la.ld >= INT_MAX ||
      lb.ld >= INT_MAX) {
    return false;
  }
  cuda::detail::DeviceGuard guard(out.device().index);
  cublasLtHandle_t lt = lt_handle(out.device());
  const CublasFunctions& api = cublas();
  Descs d;
  // Column-major: out^T [m, n] = op(b^T) [m, k] @ op(a^T) [k, n], as gemm_cuda's call.
  const cublasOperation_t ta = lb.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = la.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
  const void* bias_ptr = bias.data_ptr();
  const bool tf32 = dt == kFloat32 && cuda::matmul_allow_tf32();
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  if (api.lt_matmul_desc_create(&d.op, compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
      api.lt_matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) ||
      api.lt_matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) ||
      api.lt_matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)) ||
      api.lt_matmul_desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                       sizeof(bias_ptr)) ||
      api.lt_matrix_layout_create(&d.a, type, lb.trans ? k : m, lb.trans ? m : k, lb.ld) ||
      api.lt_matrix_layout_create(&d.b, type, la.trans ? n : k, la.trans ? k : n, la.ld) ||
      api.lt_matrix_layout_create(&d.c, type, m, n, m)) {
    return false;
  }
  const uint32_t al_a = alignment_of(b.data_ptr()), al_b = alignment_of(a.data_ptr()),
                 al_c = alignment_of(out.data_ptr()), al_bias = alignment_of(bias_ptr);
  const AlgoKey key = {out.device().index,
                       static_cast<int64_t>(dt),
                       m,
                       n,
                       k,
                       ta,
                       tb,
                       lb.ld,
                       la.ld,
                       al_a,
                       al_b,
                       al_c,
                       al_bias,
                       tf32};
  thread_local std::map<AlgoKey, AlgoEntry> algos;
  auto it = algos.find(key);
  if (it == algos.end()) {
    AlgoEntry e;
    const uint64_t ws = kWorkspaceBytes;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (api.lt_matmul_preference_create(&d.pref) == CUBLAS_STATUS_SUCCESS &&
        !api.lt_matmul_preference_set_attribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &ws, sizeof(ws)) &&
        !api.lt_matmul_preference_set_attribute(
            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)) &&
        !api.lt_matmul_preference_set_attribute(
            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)) &&
        !api.lt_matmul_preference_set_attribute(
            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)) &&
        !api.lt_matmul_preference_set_attribute(
            d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)) &&
        api.lt_matmul_algo_get_heuristic(lt, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result,
                                       &found) == CUBLAS_STATUS_SUCCESS &&
        found > 0) {
      e.found = true;
      e.algo = result.algo;
    }
    it = algos.emplace(key, e).first;
  }
  if (!it->second.found) return false;
  const Tensor ws = make_empty({static_cast<int64_t>(kWorkspaceBytes)}, kUInt8, out.device());
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st =
      api.lt_matmul(lt, d.op, &alpha, b.data_ptr(), d.a, a.data_ptr(), d.b, &beta,
                     out.data_ptr(), d.c, out.data_ptr(), d.c, &it->second.algo, ws.data_ptr(),
                     kWorkspaceBytes, cuda_loops::stream_of(out.device()));
  return st == CUBLAS_STATUS_SUCCESS;
}

}  // namespace ember::detail
