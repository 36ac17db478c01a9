// Indexing, joining and splitting. Index tensors are int64 (int32 accepted) on the same device
// as the data; out-of-range indices raise IndexError naming the op, the index and the bound
// (checked on the CPU; on CUDA, checked by a device-side flag read back at the end of the op).
#pragma once

#include <vector>

#include <ember/tensor/tensor.h>

namespace ember {

/// Entries of t along dim at the positions in the 1-d `index`.
Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index);
/// out[i][j] = t[index[i][j]][j] for dim 0 (torch.gather); index has t's ndim.
Tensor gather(const Tensor& t, int64_t dim, const Tensor& index);
/// self[index[i][j]][j] += src[i][j] for dim 0; returns a new tensor (scatter_add_ in place).
Tensor scatter_add(const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src);
Tensor& scatter_add_(Tensor& self, int64_t dim, const Tensor& index, const Tensor& src);
/// self[index[i]] += src[i] along dim (torch.index_add_), in place.
Tensor& index_add_(Tensor& self, int64_t dim, const Tensor& index, const Tensor& src,
                   const Scalar& alpha = 1);
/// Rows of weight [V, D] for each id in indices (any shape) -> [*indices.shape, D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// Gradient of embedding w.r.t. weight: sums grad rows into [num_weights, D].
Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights);
/// [*t.shape, num_classes] int64 with a 1 at each value of t (-1 infers max + 1).
Tensor one_hot(const Tensor& t, int64_t num_classes = -1);

/// Concatenates along an existing dim (shapes must match elsewhere; dtypes promote).
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
/// Stacks along a new dim.
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
/// Views of `split_size` along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& t, int64_t split_size, int64_t dim = 0);
/// Views with the given sizes along dim (they must add up to t.size(dim)).
std::vector<Tensor> split_with_sizes(const Tensor& t, IntList sizes, int64_t dim = 0);
/// `chunks` views along dim, as torch.chunk (the last may be smaller; fewer if not divisible).
std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);

}  // namespace ember
