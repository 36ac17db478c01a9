// Backend kernels behind gather, index_select, embedding, scatter_add, index_add_ and one_hot
// (internal). The front end (tensor/ops/indexing.cpp) validates and then describes every op as one
// of two loops over "restrided" views, as PyTorch's TensorIterator-based index kernels do:
//
//   gather:  out[p] = src_r[p + index_r[p] * src_dim_stride]
//   scatter: self_r[p + index_r[p] * self_dim_stride] += alpha * src_r[p]
//
// where every operand is a view of the loop's shape and the *_r view of the indexed tensor has
// stride 0 along the indexed dim (so p's coordinate along that dim contributes nothing and the
// index supplies it). index_select and embedding are gathers whose index view has stride 0
// everywhere but the indexed dim; index_add_ and embedding_backward are such scatters.
#pragma once

#include <cstdint>

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// What an index is checked against, and how a bad one is reported.
struct IndexBound {
  const char* op;  ///< op name for the message
  int64_t dim;     ///< the indexed dim (as the user named it, wrapped)
  int64_t size;    ///< valid indices are [0, size)
};

/// Throws IndexError "[op] index I is out of bounds for dimension D with size S".
[[noreturn]] void throw_index_out_of_bounds(const IndexBound& b, int64_t index);

struct GatherArgs {
  Tensor out;    ///< contiguous, of the loop's shape
  Tensor src_r;  ///< loop's shape, stride 0 along the indexed dim
  Tensor index;  ///< loop's shape (int64 or int32)
  int64_t src_dim_stride;  ///< elements
  IndexBound bound;
};

struct ScatterArgs {
  Tensor self_r;  ///< loop's shape, stride 0 along `dim`
  Tensor src;     ///< loop's shape, self's dtype
  Tensor index;   ///< loop's shape (int64 or int32)
  int64_t dim;    ///< the loop dim the index runs along
  int64_t self_dim_stride;  ///< elements
  Scalar alpha;
  IndexBound bound;
};

/// Gathers on the CPU; parallel over outputs. Throws IndexError for an index outside the bound.
void gather_cpu(const GatherArgs& a);
/// Same on a CUDA device (current stream); the bound is checked by a device-side flag that is
/// read back (synchronising the stream) before returning.
void gather_cuda(const GatherArgs& a);

/// Scatter-adds on the CPU; parallel over the positions off `dim` (no two threads write the same
/// element), serial along it, so results are deterministic.
void scatter_add_cpu(const ScatterArgs& a);
/// Same on a CUDA device with atomicAdd (float64, float32, float16, bfloat16, int64, int32; other
/// dtypes raise TypeError). Float sums are not deterministic in order.
void scatter_add_cuda(const ScatterArgs& a);

}  // namespace ember::detail
