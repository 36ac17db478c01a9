// CPU loops over a Geometry (Note [Element-wise geometry]).
//
// for_each_run calls `run(ptrs, strides, n)` for every innermost run of n elements, splitting
// the runs across the thread pool when the loop is large. cpu_elementwise builds on it: it
// applies a functor `Out f(In...)` element by element, with a tight loop the compiler
// vectorises when every operand is dense and a strided loop otherwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>

#include <ember/tensor/detail/iter.h>
#include <ember/tensor/threading.h>

namespace ember::detail::cpu {

template <typename Run>
void for_each_run(const Geometry& g, Run&& run) {
  if (g.numel == 0) return;
  const int nd = g.ndim;
  const int64_t inner = g.sizes[nd - 1];
  const int64_t outer = g.numel / inner;
  int64_t inner_strides[kMaxOperands];
  for (int k = 0; k < g.nops; ++k) inner_strides[k] = g.strides[k][nd - 1];

  auto do_range = [&](int64_t begin, int64_t end) {
    // begin/end index runs (outer positions); recover the multi-index of `begin` once, then
    // advance it like an odometer.
    int64_t idx[kMaxDims] = {};
    int64_t rem = begin;
    for (int d = nd - 2; d >= 0; --d) {
      idx[d] = rem % g.sizes[d];
      rem /= g.sizes[d];
    }
    char* ptrs[kMaxOperands];
    for (int64_t r = begin; r < end; ++r) {
      for (int k = 0; k < g.nops; ++k) {
        int64_t off = 0;
        for (int d = 0; d < nd - 1; ++d) off += idx[d] * g.strides[k][d];
        ptrs[k] = g.data[k] + off;
      }
      run(ptrs, inner_strides, inner);
      for (int d = nd - 2; d >= 0; --d) {
        if (++idx[d] < g.sizes[d]) break;
        idx[d] = 0;
      }
    }
  };

  if (outer == 1) {
    // One long run: split it into pieces instead.
    if (inner < 2 * kGrainSize || get_num_threads() == 1) {
      char* ptrs[kMaxOperands];
      for (int k = 0; k < g.nops; ++k) ptrs[k] = g.data[k];
      run(ptrs, inner_strides, inner);
      return;
    }
    parallel_for(0, inner, kGrainSize, [&](int64_t b, int64_t e) {
      char* ptrs[kMaxOperands];
      for (int k = 0; k < g.nops; ++k) ptrs[k] = g.data[k] + b * inner_strides[k];
      run(ptrs, inner_strides, e - b);
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(inner, 1));
  if (g.numel < 2 * kGrainSize || get_num_threads() == 1) {
    do_range(0, outer);
  } else {
    parallel_for(0, outer, grain, do_range);
  }
}

namespace loops_impl {
template <typename Out, typename... In, typename F, size_t... I>
inline void run_typed(char** ptrs, const int64_t* strides, int64_t n, F& f,
                      std::index_sequence<I...>) {
  bool dense = strides[0] == sizeof(Out);
  ((dense = dense && strides[I + 1] == sizeof(In)), ...);
  if (dense) {
    Out* out = reinterpret_cast<Out*>(ptrs[0]);
    std::tuple<const In*...> in{reinterpret_cast<const In*>(ptrs[I + 1])...};
    for (int64_t i = 0; i < n; ++i) out[i] = f(std::get<I>(in)[i]...);
    return;
  }
  // Second-fastest case: dense output with scalar-broadcast (stride 0) inputs mixed in.
  for (int64_t i = 0; i < n; ++i) {
    *reinterpret_cast<Out*>(ptrs[0] + i * strides[0]) =
        f(*reinterpret_cast<const In*>(ptrs[I + 1] + i * strides[I + 1])...);
  }
}
}  // namespace loops_impl

/// out = f(in...) over the geometry; operand 0 is the output of type Out, operands 1.. have
/// the types In... in order.
template <typename Out, typename... In, typename F>
void cpu_elementwise(const Geometry& g, F f) {
  for_each_run(g, [&](char** ptrs, const int64_t* strides, int64_t n) {
    loops_impl::run_typed<Out, In...>(ptrs, strides, n, f, std::index_sequence_for<In...>{});
  });
}

}  // namespace ember::detail::cpu
