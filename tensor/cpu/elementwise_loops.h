// CPU loops for the element-wise kernels (internal to tensor/cpu/).
//
// Every loop first tries the fast layouts without building a Geometry: all operands dense and of
// the output's element count (one flat loop over pointers, which the compiler vectorises), or
// one operand a single element (its value loaded once and hoisted out of the loop). Anything
// else goes through make_geometry + for_each_run, whose innermost runs again pick a dense,
// hoisted-scalar or strided loop. Functors follow Note [Functors compute in acc_t].
#pragma once

#include <cstdint>
#include <optional>

#include <ember/tensor/cpu/loops.h>
#include <ember/tensor/detail/elementwise_kernels.h>
#include <ember/tensor/detail/functors.h>

namespace ember::detail::cpu_ew {

/// fn(begin, end) over [0, n), split across the thread pool when n is large.
template <typename Fn>
inline void chunked(int64_t n, const Fn& fn) {
  if (n < 2 * kGrainSize || get_num_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  parallel_for(0, n, kGrainSize, fn);
}

template <typename T>
inline T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

/// out = Out(f(A(in))), same shape.
template <typename Out, typename T, typename F>
void unary_loop(const Tensor& out, const Tensor& in, const F& f) {
  using A = acc_t<T>;
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.is_contiguous() && in.is_contiguous()) {
    Out* o = ptr<Out>(out);
    const T* p = ptr<const T>(in);
    if (n == 1) {
      *o = Out(f(A(*p)));
      return;
    }
    chunked(n, [=](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = Out(f(A(p[i])));
    });
    return;
  }
  Geometry g = make_geometry(out.shape(), {&out, &in});
  cpu::for_each_run(g, [&](char** p, const int64_t* s, int64_t m) {
    if (s[0] == sizeof(Out) && s[1] == sizeof(T)) {
      Out* o = reinterpret_cast<Out*>(p[0]);
      const T* x = reinterpret_cast<const T*>(p[1]);
      for (int64_t i = 0; i < m; ++i) o[i] = Out(f(A(x[i])));
    } else {
      for (int64_t i = 0; i < m; ++i) {
        *reinterpret_cast<Out*>(p[0] + i * s[0]) =
            Out(f(A(*reinterpret_cast<const T*>(p[1] + i * s[1]))));
      }
    }
  });
}

/// o[i] = Out(f(x[i], s)) (or f(s, x[i]) when Reverse) over a dense run.
template <typename Out, typename T, bool Reverse, typename F>
inline void scalar_run(Out* o, const T* x, acc_t<T> s, int64_t b, int64_t e, const F& f) {
  using A = acc_t<T>;
  for (int64_t i = b; i < e; ++i) {
    if constexpr (Reverse) {
      o[i] = Out(f(s, A(x[i])));
    } else {
      o[i] = Out(f(A(x[i]), s));
    }
  }
}

/// out = Out(f(A(a), A(b))) with a and b broadcast to out's shape.
template <typename Out, typename T, typename F>
void binary_loop(const Tensor& out, const Tensor& a, const Tensor& b, const F& f) {
  using A = acc_t<T>;
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.is_contiguous()) {
    Out* o = ptr<Out>(out);
    const T* pa = ptr<const T>(a);
    const T* pb = ptr<const T>(b);
    const int64_t na = a.numel(), nb = b.numel();
    // An operand with out's element count that broadcasts to out's shape differs from it only by
    // size-1 dims, so when dense its elements are in out's order.
    const bool da = na == n && a.is_contiguous(), db = nb == n && b.is_contiguous();
    if (n == 1) {  // tiny tensors: skip the vectorised loop's set-up
      *o = Out(f(A(*pa), A(*pb)));
      return;
    }
    if (da && db) {
      chunked(n, [=](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) o[i] = Out(f(A(pa[i]), A(pb[i])));
      });
      return;
    }
    if (da && nb == 1) {
      const A s = A(*pb);
      chunked(n, [=](int64_t lo, int64_t hi) { scalar_run<Out, T, false>(o, pa, s, lo, hi, f); });
      return;
    }
    if (db && na == 1) {
      const A s = A(*pa);
      chunked(n, [=](int64_t lo, int64_t hi) { scalar_run<Out, T, true>(o, pb, s, lo, hi, f); });
      return;
    }
  }
  Geometry g = make_geometry(out.shape(), {&out, &a, &b});
  cpu::for_each_run(g, [&](char** p, const int64_t* s, int64_t m) {
    Out* o = reinterpret_cast<Out*>(p[0]);
    const T* x = reinterpret_cast<const T*>(p[1]);
    const T* y = reinterpret_cast<const T*>(p[2]);
    if (s[0] == sizeof(Out)) {
      if (s[1] == sizeof(T) && s[2] == sizeof(T)) {
        for (int64_t i = 0; i < m; ++i) o[i] = Out(f(A(x[i]), A(y[i])));
        return;
      }
      if (s[1] == sizeof(T) && s[2] == 0) return scalar_run<Out, T, false>(o, x, A(*y), 0, m, f);
      if (s[1] == 0 && s[2] == sizeof(T)) return scalar_run<Out, T, true>(o, y, A(*x), 0, m, f);
    }
    for (int64_t i = 0; i < m; ++i) {
      *reinterpret_cast<Out*>(p[0] + i * s[0]) =
          Out(f(A(*reinterpret_cast<const T*>(p[1] + i * s[1])),
                A(*reinterpret_cast<const T*>(p[2] + i * s[2]))));
    }
  });
}

/// out = Out(f(A(a), s)), or f(s, A(a)) when Reverse; a has out's shape.
template <typename Out, typename T, bool Reverse, typename F>
void scalar_loop(const Tensor& out, const Tensor& a, acc_t<T> s, const F& f) {
  using A = acc_t<T>;
  const int64_t n = out.numel();
  if (n == 0) return;
  if (out.is_contiguous() && a.is_contiguous()) {
    Out* o = ptr<Out>(out);
    const T* pa = ptr<const T>(a);
    if (n == 1) {
      *o = Reverse ? Out(f(s, A(*pa))) : Out(f(A(*pa), s));
      return;
    }
    chunked(n, [=](int64_t lo, int64_t hi) { scalar_run<Out, T, Reverse>(o, pa, s, lo, hi, f); });
    return;
  }
  Geometry g = make_geometry(out.shape(), {&out, &a});
  cpu::for_each_run(g, [&](char** p, const int64_t* st, int64_t m) {
    if (st[0] == sizeof(Out) && st[1] == sizeof(T)) {
      return scalar_run<Out, T, Reverse>(reinterpret_cast<Out*>(p[0]),
                                         reinterpret_cast<const T*>(p[1]), s, 0, m, f);
    }
    for (int64_t i = 0; i < m; ++i) {
      const A x = A(*reinterpret_cast<const T*>(p[1] + i * st[1]));
      *reinterpret_cast<Out*>(p[0] + i * st[0]) = Reverse ? Out(f(s, x)) : Out(f(x, s));
    }
  });
}

/// The CPU `Run` of Note [One op table for both devices]: out = f(a) / f(a, b) / f(a, s).
struct CpuRun {
  const Tensor& out;
  const Tensor& a;
  const Tensor& b;
  template <typename Out, typename T, typename F>
  void unary(const F& f) { unary_loop<Out, T>(out, a, f); }
  template <typename Out, typename T, typename F>
  void binary(const F& f) { binary_loop<Out, T>(out, a, b, f); }
  template <typename Out, typename T, bool Reverse, typename F>
  void scalar(acc_t<T> s, const F& f) { scalar_loop<Out, T, Reverse>(out, a, s, f); }
};

// Comparisons and logical ops live in compare.cpp; binary.cpp forwards to them.
void compare_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void compare_scalar_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Scalar& s,
                        bool reverse);

}  // namespace ember::detail::cpu_ew
