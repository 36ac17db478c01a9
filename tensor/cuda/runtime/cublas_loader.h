// cuBLAS and cuBLASLt, opened at their first use instead of linked. Linked, their static
// initialisers run in every process that loads ember_tensor, GPU or not, and cost it about 90 ms
// at start (docs/benchmarks.md): a CPU training job pays it once, a test suite that starts a
// process per test pays it per test. The functions Ember calls are reached through cublas().
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

namespace ember::detail {

// cublas_api.h overloads cublasGemmStridedBatchedEx in C++ (an inline one taking a cudaDataType
// compute type); this is the exported function's own type.
using CublasGemmStridedBatchedEx = cublasStatus_t (*)(
    cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*, const void*,
    cudaDataType, int, long long, const void*, cudaDataType, int, long long, const void*, void*,
    cudaDataType, int, long long, int, cublasComputeType_t, cublasGemmAlgo_t);

// X(member, function, type): every cuBLAS and cuBLASLt function Ember calls. A name that
// cublas_v2.h maps to a versioned symbol (cublasCreate -> cublasCreate_v2) is looked up under
// that symbol.
#define EMBER_CUBLAS_FUNCTIONS(X)                                                              \
  X(create, cublasCreate, decltype(&cublasCreate))                                             \
  X(set_stream, cublasSetStream, decltype(&cublasSetStream))                                   \
  X(scal_ex, cublasScalEx, decltype(&cublasScalEx))                                            \
  X(gemm_strided_batched_ex, cublasGemmStridedBatchedEx, CublasGemmStridedBatchedEx)           \
  X(get_status_name, cublasGetStatusName, decltype(&cublasGetStatusName))                      \
  X(get_status_string, cublasGetStatusString, decltype(&cublasGetStatusString))
#define EMBER_CUBLASLT_FUNCTIONS(X)                                                            \
  X(lt_create, cublasLtCreate, decltype(&cublasLtCreate))                                      \
  X(lt_matmul, cublasLtMatmul, decltype(&cublasLtMatmul))                                      \
  X(lt_matmul_algo_get_heuristic, cublasLtMatmulAlgoGetHeuristic,                              \
    decltype(&cublasLtMatmulAlgoGetHeuristic))                                                 \
  X(lt_matmul_desc_create, cublasLtMatmulDescCreate, decltype(&cublasLtMatmulDescCreate))      \
  X(lt_matmul_desc_destroy, cublasLtMatmulDescDestroy, decltype(&cublasLtMatmulDescDestroy))   \
  X(lt_matmul_desc_set_attribute, cublasLtMatmulDescSetAttribute,                              \
    decltype(&cublasLtMatmulDescSetAttribute))                                                 \
  X(lt_matrix_layout_create, cublasLtMatrixLayoutCreate, decltype(&cublasLtMatrixLayoutCreate)) \
  X(lt_matrix_layout_destroy, cublasLtMatrixLayoutDestroy,                                     \
    decltype(&cublasLtMatrixLayoutDestroy))                                                    \
  X(lt_matmul_preference_create, cublasLtMatmulPreferenceCreate,                               \
    decltype(&cublasLtMatmulPreferenceCreate))                                                 \
  X(lt_matmul_preference_destroy, cublasLtMatmulPreferenceDestroy,                             \
    decltype(&cublasLtMatmulPreferenceDestroy))                                                \
  X(lt_matmul_preference_set_attribute, cublasLtMatmulPreferenceSetAttribute,                  \
    decltype(&cublasLtMatmulPreferenceSetAttribute))

struct CublasFunctions {
#define EMBER_CUBLAS_MEMBER(member, function, type) type member = nullptr;
  EMBER_CUBLAS_FUNCTIONS(EMBER_CUBLAS_MEMBER)
  EMBER_CUBLASLT_FUNCTIONS(EMBER_CUBLAS_MEMBER)
#undef EMBER_CUBLAS_MEMBER
};

/// The functions, the libraries opened on the first call (thread-safe). Throws CudaError naming
/// the library and the loader's reason when one cannot be opened or lacks a function; the next
/// call tries again.
const CublasFunctions& cublas();

}  // namespace ember::detail
