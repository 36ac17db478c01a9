// The reduction kernels that ProcessGroupGloo gives Gloo and the shared-memory collectives, and
// the buffer lists of the latter. Internal to process_group_gloo*.cpp and the hierarchical group
// (its Avg's division): not installed, not part of the public API.
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/detail/half_kernels.h>
#include <ember/distributed/process_group.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/tensor.h>

// In a namespace of its own so that its short names meet nothing else there.
namespace ember::dist::detail::pg_gloo {

using dist::ReduceOp;
using detail::ShmAllreduce;

struct SumF {
  template <typename A>
  A operator()(A a, A b) const {
    return a + b;
  }
};
struct ProdF {
  template <typename A>
  A operator()(A a, A b) const {
    return a * b;
  }
};
struct MinF {
  template <typename A>
  A operator()(A a, A b) const {
    return b < a ? b : a;
  }
};
struct MaxF {
  template <typename A>
  A operator()(A a, A b) const {
    return a < b ? b : a;
  }
};

// c[i] = f(a[i], b[i]); float16/bfloat16 compute in float32 and round once per step.
template <typename T, typename F>
void reduce_kernel(void* c, const void* a, const void* b, size_t n) {
  T* C = static_cast<T*>(c);
  const T* A = static_cast<const T*>(a);
  const T* B = static_cast<const T*>(b);
  if constexpr (std::is_same_v<T, Half> && std::is_same_v<F, SumF>) {
    static_assert(sizeof(Half) == sizeof(uint16_t));
    half_sum(static_cast<uint16_t*>(c), static_cast<const uint16_t*>(a),
             static_cast<const uint16_t*>(b), n);
  } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    for (size_t i = 0; i < n; ++i)
      C[i] = T(F{}(static_cast<float>(A[i]), static_cast<float>(B[i])));
  } else {
    for (size_t i = 0; i < n; ++i) C[i] = static_cast<T>(F{}(A[i], B[i]));
  }
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
ReduceFn reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return &reduce_kernel<T, SumF>;
    case ReduceOp::Product:
      return &reduce_kernel<T, ProdF>;
    case ReduceOp::Min:
      return &reduce_kernel<T, MinF>;
    case ReduceOp::Max:
      return &reduce_kernel<T, MaxF>;
  }
  return nullptr;
}

// In place: x[i] /= n (floating: in float32/float64; integers: truncating, like C).
template <typename T>
void divide_span(void* x, size_t k, int n) {
  T* p = static_cast<T*>(x);
  if constexpr (std::is_same_v<T, Half>) {
    half_divide(static_cast<uint16_t*>(x), k, static_cast<float>(n));
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    for (size_t i = 0; i < k; ++i) p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
  } else {
    for (size_t i = 0; i < k; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
  }
}

inline void divide_in_place(const Tensor& t, int n) {
  EMBER_DISPATCH_NUMERIC(t.dtype(), "[gloo] avg", [&]<typename T>() {
    divide_span<T>(t.data_ptr(), static_cast<size_t>(t.numel()), n);
  });
}

// Note [shared-memory collectives] (shm_collectives.cpp): how two ranks' values combine.
inline ShmAllreduce::Reduction shm_reduction(Dtype dtype, ReduceOp op) {
  ShmAllreduce::Reduction r{op, nullptr, nullptr};
  EMBER_DISPATCH_NUMERIC(dtype, "[gloo] reduction", [&]<typename T>() {
    r.fn = reduce_fn<T>(op);
    if (op == ReduceOp::Avg) r.divide = &divide_span<T>;
  });
  return r;
}

/// A list of tensors as the contiguous buffers that the shared-memory collectives read or
/// write: each tensor itself when contiguous, else a contiguous copy (inputs) or a stand-in
/// that finish() copies back (outputs).
class ShmList {
 public:
  static ShmList inputs(const std::vector<Tensor>& ts) {
    ShmList l;
    l.given_ = ts;
    for (const Tensor& t : ts) l.used_.push_back(t.contiguous());
    return l;
  }
  static ShmList outputs(const std::vector<Tensor>& ts) {
    ShmList l;
    l.given_ = ts;
    for (const Tensor& t : ts) l.used_.push_back(t.is_contiguous() ? t : empty_like(t));
    return l;
  }
  std::vector<const void*> reads() const {
    std::vector<const void*> p;
    for (const Tensor& t : used_) p.push_back(t.data_ptr());
    return p;
  }
  std::vector<void*> writes() const {
    std::vector<void*> p;
    for (const Tensor& t : used_) p.push_back(t.data_ptr());
    return p;
  }
  const std::vector<Tensor>& tensors() const { return used_; }
  /// The outputs, with the stand-ins' values copied in.
  std::vector<Tensor> finish() const {
    std::vector<Tensor> out = given_;
    for (size_t i = 0; i < out.size(); ++i) {
      if (used_[i].data_ptr() != out[i].data_ptr()) out[i].copy_(used_[i]);
    }
    return out;
  }

 private:
  std::vector<Tensor> given_, used_;
};

}  // namespace ember::dist::detail::pg_gloo
