// Checks that an op's output does not share memory with its inputs in ways that would make the
// result depend on the order its loops visit the elements (PyTorch's assert_no_internal_overlap
// and assert_no_partial_overlap).
#pragma once

#include <ember/tensor/tensor.h>

namespace ember::detail {

/// Throws ValueError naming `op` if several elements of `t` share one memory location (an
/// expanded view): writing into it would race and give order-dependent results.
void check_writable(const char* op, const Tensor& t);

/// Throws ValueError naming `op` if `out` and `in` share some memory but are not the same
/// elements (a.add_(a.t()), x[1:].copy_(x[:-1])): the loop would read elements it had already
/// overwritten. Both the same view (a.add_(a)) or disjoint views of one storage are fine. As in
/// PyTorch, only tensors whose elements fill one block without gaps (any order of dims) are
/// compared; for others overlap is too costly to decide and is not checked.
void check_no_partial_overlap(const char* op, const Tensor& out, const Tensor& in);

}  // namespace ember::detail
