// Note [Element-wise geometry]
// Every element-wise loop (copy, fill, unary, binary, where, ...) runs over operands that all
// have the loop's shape after broadcasting. Geometry describes such a loop with the fewest
// dimensions: broadcast dims get stride 0, size-1 dims are dropped, and neighbouring dims are
// merged when every operand is contiguous across them, so a contiguous op is one flat loop of
// numel elements. Strides are in bytes, innermost dim last. The struct is plain data so it can
// be passed by value to a CUDA kernel; the CPU and CUDA loops in cpu/loops.h and cuda/loops.cuh
// both consume it.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <ember/tensor/shape.h>
#include <ember/tensor/tensor.h>

namespace ember::detail {

inline constexpr int kMaxOperands = 4;

struct Geometry {
  int ndim = 0;  ///< after coalescing; 0 only when numel == 0 or the loop is one element
  int nops = 0;
  int64_t numel = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxOperands][kMaxDims] = {};  ///< bytes
  char* data[kMaxOperands] = {};
  int64_t itemsize[kMaxOperands] = {};

  /// True when the loop is one flat run over densely packed elements of every operand.
  bool is_contiguous() const {
    if (ndim > 1) return false;
    if (ndim == 0) return true;
    for (int k = 0; k < nops; ++k) {
      if (strides[k][0] != itemsize[k]) return false;
    }
    return true;
  }
};

/// Geometry of a loop of `shape` over `operands` (operand 0 is usually the output). Each
/// operand must broadcast to `shape` (checked by the caller).
Geometry make_geometry(IntList shape, std::initializer_list<const Tensor*> operands);

}  // namespace ember::detail
