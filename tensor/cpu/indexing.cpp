// CPU kernels for gather-like and scatter-like index loops (see tensor/detail/indexing_kernels.h).
#include <cstring>

#include <ember/tensor/cpu/loops.h>
#include <ember/tensor/detail/indexing_kernels.h>

namespace ember::detail {

void throw_index_out_of_bounds(const IndexBound& b, int64_t index) {
  throw IndexError(str_cat("[", b.op, "] index ", index, " is out of bounds for dimension ", b.dim,
                           " with size ", b.size));
}

namespace {

template <typename I>
inline int64_t checked(const char* p, const IndexBound& b) {
  const int64_t ix = *reinterpret_cast<const I*>(p);
  // One unsigned compare rejects negatives too.
  if (__builtin_expect(static_cast<uint64_t>(ix) >= static_cast<uint64_t>(b.size), 0)) {
    throw_index_out_of_bounds(b, ix);
  }
  return ix;
}

// Gathers only move bytes, so they dispatch on the element size, not the dtype.
template <typename Fn>
void dispatch_size(int64_t size, Fn&& fn) {
  switch (size) {
    case 1: return fn.template operator()<uint8_t>();
    case 2: return fn.template operator()<uint16_t>();
    case 4: return fn.template operator()<uint32_t>();
    case 8: return fn.template operator()<uint64_t>();
    default: EMBER_INTERNAL_ASSERT(false, "element size ", size);
  }
}

template <typename Fn>
void dispatch_index(Dtype t, const char* op, Fn&& fn) {
  if (t == kInt64) return fn.template operator()<int64_t>();
  if (t == kInt32) return fn.template operator()<int32_t>();
  throw TypeError(str_cat("[", op, "] expected an int64 or int32 index, got ", t));
}

template <typename T, typename I>
void gather_typed(const GatherArgs& a) {
  Geometry g = make_geometry(a.out.shape(), {&a.out, &a.src_r, &a.index});
  const int64_t sds = a.src_dim_stride * static_cast<int64_t>(sizeof(T));
  const IndexBound b = a.bound;
  if (g.ndim == 2 && g.strides[2][1] == 0 && g.strides[0][1] == sizeof(T) &&
      g.strides[1][1] == sizeof(T)) {
    // Dense rows picked by one index each (index_select along dim 0, embedding). The rows are
    // scattered through memory, so a copy waits on DRAM: prefetch the rows a few indices ahead.
    const int64_t rows = g.sizes[0], row_bytes = g.sizes[1] * static_cast<int64_t>(sizeof(T));
    const int64_t so = g.strides[0][0], ss = g.strides[1][0], si = g.strides[2][0];
    parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / g.sizes[1]), [&](int64_t r0, int64_t r1) {
      constexpr int64_t kAhead = 8;
      for (int64_t r = r0; r < r1; ++r) {
        if (r + kAhead < r1) {
          const int64_t ix = *reinterpret_cast<const I*>(g.data[2] + (r + kAhead) * si);
          if (static_cast<uint64_t>(ix) < static_cast<uint64_t>(b.size)) {
            const char* row = g.data[1] + (r + kAhead) * ss + ix * sds;
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
          }
        }
        const int64_t ix = checked<I>(g.data[2] + r * si, b);
        std::memcpy(g.data[0] + r * so, g.data[1] + r * ss + ix * sds, row_bytes);
      }
    });
    return;
  }
  cpu::for_each_run(g, [&](char** p, const int64_t* s, int64_t n) {
    char* out = p[0];
    const char* src = p[1];
    const char* idx = p[2];
    if (s[2] == 0) {  // one index for the whole run (index_select, embedding): copy a row
      const char* row = src + checked<I>(idx, b) * sds;
      if (s[0] == sizeof(T) && s[1] == sizeof(T)) {
        std::memcpy(out, row, n * sizeof(T));
      } else {
        for (int64_t k = 0; k < n; ++k) {
          *reinterpret_cast<T*>(out + k * s[0]) = *reinterpret_cast<const T*>(row + k * s[1]);
        }
      }
      return;
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t ix = checked<I>(idx + k * s[2], b);
      *reinterpret_cast<T*>(out + k * s[0]) = *reinterpret_cast<const T*>(src + k * s[1] + ix * sds);
    }
  });
}

template <typename T, typename I>
void scatter_typed(const ScatterArgs& a) {
  using A = acc_t<T>;
  Shape loop = a.index.shape();
  const int64_t rows = loop[a.dim];
  loop[a.dim] = 1;  // the loop runs off `dim`; each run walks `dim` itself, serially
  Geometry g = make_geometry(loop, {&a.self_r, &a.src, &a.index});
  const int64_t src_js = a.src.stride(a.dim) * static_cast<int64_t>(sizeof(T));
  const int64_t idx_js = a.index.stride(a.dim) * static_cast<int64_t>(sizeof(I));
  const int64_t sds = a.self_dim_stride * static_cast<int64_t>(sizeof(T));
  const A alpha = a.alpha.to<A>();
  const IndexBound b = a.bound;
  cpu::for_each_run(g, [&](char** p, const int64_t* s, int64_t n) {
    for (int64_t j = 0; j < rows; ++j) {
      const char* src = p[1] + j * src_js;
      const char* idx = p[2] + j * idx_js;
      if (s[2] == 0) {  // one index for the run (index_add_, embedding_backward): add a row
        char* dst = p[0] + checked<I>(idx, b) * sds;
        if (s[0] == sizeof(T) && s[1] == sizeof(T)) {
          T* d = reinterpret_cast<T*>(dst);
          const T* v = reinterpret_cast<const T*>(src);
          for (int64_t k = 0; k < n; ++k) d[k] = convert<T>(A(d[k]) + alpha * A(v[k]));
        } else {
          for (int64_t k = 0; k < n; ++k) {
            T* d = reinterpret_cast<T*>(dst + k * s[0]);
            *d = convert<T>(A(*d) + alpha * A(*reinterpret_cast<const T*>(src + k * s[1])));
          }
        }
        continue;
      }
      for (int64_t k = 0; k < n; ++k) {
        const int64_t ix = checked<I>(idx + k * s[2], b);
        T* d = reinterpret_cast<T*>(p[0] + k * s[0] + ix * sds);
        *d = convert<T>(A(*d) + alpha * A(*reinterpret_cast<const T*>(src + k * s[1])));
      }
    }
  });
}

}  // namespace

void gather_cpu(const GatherArgs& a) {
  if (a.out.numel() == 0) return;
  dispatch_size(a.out.element_size(), [&]<typename T>() {
    dispatch_index(a.index.dtype(), a.bound.op, [&]<typename I>() { gather_typed<T, I>(a); });
  });
}

void scatter_add_cpu(const ScatterArgs& a) {
  if (a.index.numel() == 0) return;
  EMBER_DISPATCH_NUMERIC(a.self_r.dtype(), a.bound.op, [&]<typename T>() {
    dispatch_index(a.index.dtype(), a.bound.op, [&]<typename I>() { scatter_typed<T, I>(a); });
  });
}

}  // namespace ember::detail
