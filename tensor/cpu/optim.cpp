// CPU kernels of the fused optimizer updates (tensor/ops/optim.h): one pass over the parameter and
// its state, with the math of tensor/detail/optim_kernels.h.
#include <algorithm>
#include <cmath>

#include <ember/tensor/detail/optim_kernels.h>
#include <ember/tensor/dtype.h>
#include <ember/tensor/detail/reduce_kernels.h>  // EMBER_SIMD_CLONES
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

// The flags that guard memory accesses (amsgrad's max buffer, SGD's momentum buffer) become
// template parameters, so each loop body is branch-free and vectorises; the others are selects.
// Stage 1 and 2 of AdamFunctor over blocks of kBlock elements, with the square roots taken in
// between in a loop of their own, which GCC vectorises (tensor/ is built with -fno-math-errno).
constexpr int64_t kBlock = 512;

template <typename A>
inline void sqrt_block(A* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) r[i] = std::sqrt(r[i]);
}

template <bool kAmsgrad, typename T, typename A>
EMBER_SIMD_CLONES void adam_stage1(const AdamFunctor<A>& f0, const T* p, const T* g, T* m, T* v,
                                   T* vmax, A* root, int64_t n) {
  AdamFunctor<A> f = f0;
  f.amsgrad = kAmsgrad;
  for (int64_t i = 0; i < n; ++i) {
    f.moments(p[i], g[i], m[i], v[i], kAmsgrad ? vmax + i : nullptr);
    root[i] = static_cast<A>(kAmsgrad ? vmax[i] : v[i]);
  }
}

template <typename T, typename A>
EMBER_SIMD_CLONES void adam_stage2(const AdamFunctor<A>& f, T* p, const T* m, const A* root,
                                   int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = f.finish(p[i], m[i], root[i]);
}

template <bool kAmsgrad, typename T, typename A>
void adam_loop(const AdamFunctor<A>& f, T* p, const T* g, T* m, T* v, T* vmax, int64_t n) {
  alignas(64) A root[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    adam_stage1<kAmsgrad>(f, p + b, g + b, m + b, v + b, kAmsgrad ? vmax + b : vmax, root, len);
    sqrt_block(root, len);
    adam_stage2(f, p + b, m + b, root, len);
  }
}

template <bool kMomentum, bool kInit, typename T, typename A>
EMBER_SIMD_CLONES void sgd_loop(SgdFunctor<A> f, T* p, const T* g, T* buf, int64_t n) {
  f.use_momentum = kMomentum;
  f.init_buffer = kInit;
  for (int64_t i = 0; i < n; ++i) f(p[i], g[i], kMomentum ? buf + i : nullptr);
}

}  // namespace

void adam_update_cpu(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                     const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq,
                     const AdamStepArgs& args) {
  EMBER_DISPATCH_FLOATING(param.dtype(), "adam_update_", [&]<typename T>() {
    using A = acc_t<T>;
    const AdamFunctor<A> f = make_adam_functor<A>(args);
    T* p = static_cast<T*>(param.data_ptr());
    const T* g = static_cast<const T*>(grad.data_ptr());
    T* m = static_cast<T*>(exp_avg.data_ptr());
    T* v = static_cast<T*>(exp_avg_sq.data_ptr());
    T* vmax = args.amsgrad ? static_cast<T*>(max_exp_avg_sq.data_ptr()) : nullptr;
    parallel_for(0, param.numel(), kGrainSize, [&](int64_t b, int64_t e) {
      if (args.amsgrad) {
        adam_loop<true>(f, p + b, g + b, m + b, v + b, vmax + b, e - b);
      } else {
        adam_loop<false>(f, p + b, g + b, m + b, v + b, static_cast<T*>(nullptr), e - b);
      }
    });
  });
}

void sgd_update_cpu(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                    const SgdStepArgs& args) {
  EMBER_DISPATCH_FLOATING(param.dtype(), "sgd_update_", [&]<typename T>() {
    using A = acc_t<T>;
    const SgdFunctor<A> f = make_sgd_functor<A>(args);
    T* p = static_cast<T*>(param.data_ptr());
    const T* g = static_cast<const T*>(grad.data_ptr());
    T* buf = args.momentum != 0 ? static_cast<T*>(momentum_buffer.data_ptr()) : nullptr;
    parallel_for(0, param.numel(), kGrainSize, [&](int64_t b, int64_t e) {
      if (args.momentum == 0) {
        sgd_loop<false, false>(f, p + b, g + b, static_cast<T*>(nullptr), e - b);
      } else if (args.init_buffer) {
        sgd_loop<true, true>(f, p + b, g + b, buf + b, e - b);
      } else {
        sgd_loop<true, false>(f, p + b, g + b, buf + b, e - b);
      }
    });
  });
}

}  // namespace ember::detail
