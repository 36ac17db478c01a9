// Convolution on the CPU. float32 runs on oneDNN (float16/bfloat16 through float32); float64,
// which oneDNN does not support, runs on im2col + OpenBLAS dgemm.
//
// Note [oneDNN primitive cache]
// Creating a oneDNN primitive (descriptor, implementation choice, JIT code) costs far more than
// running a small convolution, so primitives are made once per geometry and kept in a map keyed
// by every size and parameter. Tensors stay in plain NCHW/OIHW memory; when the primitive wants
// a blocked layout (format_tag::any lets oneDNN choose) the operands are reordered around it,
// with the reorder primitives cached alongside. Scratchpads come from Ember's caching allocator
// (scratchpad_mode::user), which also makes one cached primitive safe to run from several
// threads at once.
#include <cblas.h>
#include <omp.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include <ember/tensor/detail/conv_kernels.h>
#include <ember/tensor/threading.h>

namespace ember::detail {

namespace {

using dnnl::memory;
using Tag = memory::format_tag;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

enum class Pass : int64_t { kForward, kBackwardData, kBackwardWeights };

// Whether to let oneDNN pick blocked layouts (reordering around the primitive) or force plain
// NCHW. Blocked layouts vectorise over channels and win clearly from 3 channels per group up
// (from 32 for 1x1 kernels, which are plain GEMMs where the reorders weigh more), and for
// depthwise convolutions (oneDNN's jit dw kernels). With 1-2
// input channels (a network's first layer) the forward pass still gains from oneDNN's kernel
// for plain input and blocked output, but the plain backward passes are clearly faster
// (compare with EMBER_DNNL_LAYOUT=plain|blocked).
bool use_blocked(Pass pass, const ConvGeom& g) {
  static const int forced = [] {
    const char* v = std::getenv("EMBER_DNNL_LAYOUT");
    if (!v) return -1;
    return std::strcmp(v, "blocked") == 0 ? 1 : 0;
  }();
  if (forced >= 0) return forced == 1;
  const int64_t cg = g.c / g.groups;
  if (g.groups > 1 && cg == 1) return true;  // depthwise
  if (g.kh == 1 && g.kw == 1 && cg < 32) return false;  // a small GEMM: reorders dominate
  return cg >= 3 || pass == Pass::kForward;
}

using Key = std::array<int64_t, 18>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    for (int64_t v : k) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

Key make_key(Pass pass, const ConvGeom& g, bool bias, bool blocked) {
  return {static_cast<int64_t>(pass), g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
          g.dh, g.dw, g.groups, bias, blocked, 0};
}

// One primitive argument: the plain memory the tensors use and the memory the primitive wants.
struct Operand {
  memory::desc plain, want;
  bool reorder = false;
  dnnl::reorder to_want, to_plain;

  void init(const memory::desc& p, const memory::desc& w, bool is_output) {
    plain = p;
    want = w;
    reorder = !(p == w);
    if (!reorder) return;
    if (is_output) {
      to_plain = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), w, cpu_engine(), p));
    } else {
      to_want = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), p, cpu_engine(), w));
    }
  }
};

struct Conv {
  dnnl::primitive prim;
  Operand src, wei, dst;  // for backward passes: the diff operands in the same roles
  memory::desc bias, scratch;
};

memory::dims dims_of(std::initializer_list<int64_t> l) { return memory::dims(l); }

struct Descs {
  memory::desc src, wei, dst, bias;
};

Descs plain_descs(const ConvGeom& g, bool bias) {
  Descs d;
  d.src = memory::desc(dims_of({g.n, g.c, g.h, g.w}), memory::data_type::f32, Tag::nchw);
  d.dst = memory::desc(dims_of({g.n, g.o, g.oh, g.ow}), memory::data_type::f32, Tag::nchw);
  if (g.groups == 1) {
    d.wei = memory::desc(dims_of({g.o, g.c, g.kh, g.kw}), memory::data_type::f32, Tag::oihw);
  } else {
    d.wei = memory::desc(dims_of({g.groups, g.o / g.groups, g.c / g.groups, g.kh, g.kw}),
                         memory::data_type::f32, Tag::goihw);
  }
  if (bias) d.bias = memory::desc(dims_of({g.o}), memory::data_type::f32, Tag::x);
  return d;
}

Descs any_descs(const Descs& p) {
  auto any = [](const memory::desc& m) {
    return memory::desc(m.dims(), memory::data_type::f32, Tag::any);
  };
  return {any(p.src), any(p.wei), any(p.dst), p.bias};
}

std::shared_ptr<Conv> build(Pass pass, const ConvGeom& g, bool with_bias, bool blocked) {
  const Descs plain = plain_descs(g, with_bias);
  const Descs req = blocked ? any_descs(plain) : plain;
  const memory::dims strides = {g.sh, g.sw};
  const memory::dims dilates = {g.dh - 1, g.dw - 1};  // oneDNN counts dilation from 0
  const memory::dims pad = {g.ph, g.pw};
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto fwd_kind = pass == Pass::kForward ? dnnl::prop_kind::forward_inference
                                               : dnnl::prop_kind::forward_training;
  dnnl::convolution_forward::desc fwd_desc(fwd_kind, dnnl::algorithm::convolution_direct,
                                           req.src, req.wei, req.bias, req.dst, strides, dilates,
                                           pad, pad);
  dnnl::convolution_forward::primitive_desc fwd_pd(fwd_desc, attr, cpu_engine());
  auto c = std::make_shared<Conv>();
  c->bias = plain.bias;
  switch (pass) {
    case Pass::kForward:
      c->prim = dnnl::convolution_forward(fwd_pd);
      c->src.init(plain.src, fwd_pd.src_desc(), false);
      c->wei.init(plain.wei, fwd_pd.weights_desc(), false);
      c->dst.init(plain.dst, fwd_pd.dst_desc(), true);
      c->scratch = fwd_pd.scratchpad_desc();
      break;
    case Pass::kBackwardData: {
      dnnl::convolution_backward_data::desc d(dnnl::algorithm::convolution_direct, req.src,
                                              req.wei, req.dst, strides, dilates, pad, pad);
      dnnl::convolution_backward_data::primitive_desc pd(d, attr, cpu_engine(), fwd_pd);
      c->prim = dnnl::convolution_backward_data(pd);
      c->src.init(plain.src, pd.diff_src_desc(), true);
      c->wei.init(plain.wei, pd.weights_desc(), false);
      c->dst.init(plain.dst, pd.diff_dst_desc(), false);
      c->scratch = pd.scratchpad_desc();
      break;
    }
    case Pass::kBackwardWeights: {
      dnnl::convolution_backward_weights::desc d(dnnl::algorithm::convolution_direct, req.src,
                                                 req.wei, memory::desc(), req.dst, strides,
                                                 dilates, pad, pad);
      dnnl::convolution_backward_weights::primitive_desc pd(d, attr, cpu_engine(), fwd_pd);
      c->prim = dnnl::convolution_backward_weights(pd);
      c->src.init(plain.src, pd.src_desc(), false);
      c->wei.init(plain.wei, pd.diff_weights_desc(), true);
      c->dst.init(plain.dst, pd.diff_dst_desc(), false);
      c->scratch = pd.scratchpad_desc();
      break;
    }
  }
  return c;
}

std::shared_ptr<Conv> get_conv(Pass pass, const ConvGeom& g, bool with_bias) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<Key, std::shared_ptr<Conv>, KeyHash>();
  const bool blocked = use_blocked(pass, g);
  const Key key = make_key(pass, g, with_bias, blocked);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  try {
    auto c = build(pass, g, with_bias, blocked);
    cache->emplace(key, c);
    return c;
  } catch (const dnnl::error& e) {
    throw Error(str_cat("[conv2d] oneDNN could not create a convolution primitive: ", e.what()));
  }
}

// Bytes from the caching allocator, alive as long as the returned tensor.
Tensor buffer(size_t bytes) {
  return make_empty({static_cast<int64_t>(bytes)}, kUInt8, kCPU);
}

// Runs a cached primitive on plain-layout data: `src`, `wei`, `dst` are the pointers for the
// three roles (the diff tensors in the backward passes); `pass` says which role is written.
void execute(const Conv& c, void* src, void* wei, void* dst, void* bias, Pass pass) {
  omp_set_num_threads(get_num_threads());
  thread_local dnnl::stream stream(cpu_engine());
  dnnl::engine& eng = cpu_engine();
  std::vector<Tensor> temps;
  // Memory in the primitive's layout for one role; inputs are reordered into it now.
  auto bind = [&](const Operand& op, void* ptr, bool is_output) {
    memory user(op.plain, eng, ptr);
    if (!op.reorder) return std::make_pair(user, user);
    temps.push_back(buffer(op.want.get_size()));
    memory want(op.want, eng, temps.back().data_ptr());
    if (!is_output) op.to_want.execute(stream, user, want);
    return std::make_pair(user, want);
  };
  const bool src_out = pass == Pass::kBackwardData;
  const bool wei_out = pass == Pass::kBackwardWeights;
  const bool dst_out = pass == Pass::kForward;
  auto [src_user, src_m] = bind(c.src, src, src_out);
  auto [wei_user, wei_m] = bind(c.wei, wei, wei_out);
  auto [dst_user, dst_m] = bind(c.dst, dst, dst_out);
  Tensor scratch = buffer(c.scratch.get_size());
  std::unordered_map<int, memory> args;
  args.emplace(DNNL_ARG_SCRATCHPAD, memory(c.scratch, eng, scratch.data_ptr()));
  switch (pass) {
    case Pass::kForward:
      args.emplace(DNNL_ARG_SRC, src_m);
      args.emplace(DNNL_ARG_WEIGHTS, wei_m);
      args.emplace(DNNL_ARG_DST, dst_m);
      if (bias) args.emplace(DNNL_ARG_BIAS, memory(c.bias, eng, bias));
      break;
    case Pass::kBackwardData:
      args.emplace(DNNL_ARG_DIFF_SRC, src_m);
      args.emplace(DNNL_ARG_WEIGHTS, wei_m);
      args.emplace(DNNL_ARG_DIFF_DST, dst_m);
      break;
    case Pass::kBackwardWeights:
      args.emplace(DNNL_ARG_SRC, src_m);
      args.emplace(DNNL_ARG_DIFF_WEIGHTS, wei_m);
      args.emplace(DNNL_ARG_DIFF_DST, dst_m);
      break;
  }
  c.prim.execute(stream, args);
  if (src_out && c.src.reorder) c.src.to_plain.execute(stream, src_m, src_user);
  if (wei_out && c.wei.reorder) c.wei.to_plain.execute(stream, wei_m, wei_user);
  if (dst_out && c.dst.reorder) c.dst.to_plain.execute(stream, dst_m, dst_user);
  stream.wait();
}

// ---- float64: im2col + dgemm --------------------------------------------------------------

// col [cg * kh * kw, oh * ow] from the cg channels of one image starting at `in`.
void im2col(const double* in, int64_t cg, const ConvGeom& g, double* col) {
  const int64_t L = g.oh * g.ow;
  for (int64_t c = 0; c < cg; ++c) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        double* row = col + ((c * g.kh + i) * g.kw + j) * L;
        for (int64_t oh = 0; oh < g.oh; ++oh) {
          const int64_t ih = oh * g.sh - g.ph + i * g.dh;
          for (int64_t ow = 0; ow < g.ow; ++ow) {
            const int64_t iw = ow * g.sw - g.pw + j * g.dw;
            const bool inside = ih >= 0 && ih < g.h && iw >= 0 && iw < g.w;
            row[oh * g.ow + ow] = inside ? in[(c * g.h + ih) * g.w + iw] : 0.0;
          }
        }
      }
    }
  }
}

// The adjoint of im2col: in += scatter(col).
void col2im(const double* col, int64_t cg, const ConvGeom& g, double* in) {
  const int64_t L = g.oh * g.ow;
  for (int64_t c = 0; c < cg; ++c) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const double* row = col + ((c * g.kh + i) * g.kw + j) * L;
        for (int64_t oh = 0; oh < g.oh; ++oh) {
          const int64_t ih = oh * g.sh - g.ph + i * g.dh;
          if (ih < 0 || ih >= g.h) continue;
          for (int64_t ow = 0; ow < g.ow; ++ow) {
            const int64_t iw = ow * g.sw - g.pw + j * g.dw;
            if (iw >= 0 && iw < g.w) in[(c * g.h + ih) * g.w + iw] += row[oh * g.ow + ow];
          }
        }
      }
    }
  }
}

// The three passes of the float64 path, one (image, group) block at a time.
struct Im2col {
  const ConvGeom& g;
  int64_t cg, og, K, L;
  std::vector<double> col;
  explicit Im2col(const ConvGeom& geom)
      : g(geom), cg(geom.c / geom.groups), og(geom.o / geom.groups),
        K(cg * geom.kh * geom.kw), L(geom.oh * geom.ow), col(K * L) {}

  void forward(const double* in, const double* w, const double* bias, double* out) {
    for (int64_t n = 0; n < g.n; ++n) {
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        im2col(in + (n * g.c + gi * cg) * g.h * g.w, cg, g, col.data());
        double* o = out + (n * g.o + gi * og) * L;
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, og, L, K, 1.0, w + gi * og * K, K,
                    col.data(), L, 0.0, o, L);
        if (bias) {
          for (int64_t oc = 0; oc < og; ++oc) {
            for (int64_t l = 0; l < L; ++l) o[oc * L + l] += bias[gi * og + oc];
          }
        }
      }
    }
  }
  void backward_input(const double* go, const double* w, double* gi_out) {
    std::memset(gi_out, 0, sizeof(double) * g.n * g.c * g.h * g.w);
    for (int64_t n = 0; n < g.n; ++n) {
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, L, og, 1.0, w + gi * og * K, K,
                    go + (n * g.o + gi * og) * L, L, 0.0, col.data(), L);
        col2im(col.data(), cg, g, gi_out + (n * g.c + gi * cg) * g.h * g.w);
      }
    }
  }
  void backward_weight(const double* go, const double* in, double* gw) {
    std::memset(gw, 0, sizeof(double) * g.o * K);
    for (int64_t n = 0; n < g.n; ++n) {
      for (int64_t gi = 0; gi < g.groups; ++gi) {
        im2col(in + (n * g.c + gi * cg) * g.h * g.w, cg, g, col.data());
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, og, K, L, 1.0,
                    go + (n * g.o + gi * og) * L, L, col.data(), L, 1.0, gw + gi * og * K, K);
      }
    }
  }
};

bool is_half(Dtype t) { return t == kFloat16 || t == kBFloat16; }
Tensor f32(const Tensor& t) { return t.defined() ? t.to(kFloat32) : t; }

}  // namespace

void conv2d_cpu(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                const ConvGeom& g) {
  switch (input.dtype()) {
    case kFloat32: {
      auto c = get_conv(Pass::kForward, g, bias.defined());
      execute(*c, input.data_ptr(), weight.data_ptr(), out.data_ptr(),
              bias.defined() ? bias.data_ptr() : nullptr, Pass::kForward);
      return;
    }
    case kFloat64:
      Im2col(g).forward(input.data<double>(), weight.data<double>(),
                        bias.defined() ? bias.data<double>() : nullptr, out.data<double>());
      return;
    default: {
      EMBER_INTERNAL_ASSERT(is_half(input.dtype()), "conv2d_cpu: unexpected dtype");
      Tensor o = make_empty(out.shape(), kFloat32, kCPU);
      conv2d_cpu(o, f32(input), f32(weight), f32(bias), g);
      Tensor(out).copy_(o);
    }
  }
}

void conv2d_backward_input_cpu(const Tensor& grad_input, const Tensor& grad_output,
                               const Tensor& weight, const ConvGeom& g) {
  switch (grad_output.dtype()) {
    case kFloat32: {
      auto c = get_conv(Pass::kBackwardData, g, false);
      execute(*c, grad_input.data_ptr(), weight.data_ptr(), grad_output.data_ptr(), nullptr,
              Pass::kBackwardData);
      return;
    }
    case kFloat64:
      Im2col(g).backward_input(grad_output.data<double>(), weight.data<double>(),
                               grad_input.data<double>());
      return;
    default: {
      EMBER_INTERNAL_ASSERT(is_half(grad_output.dtype()), "conv2d_cpu: unexpected dtype");
      Tensor gi = make_empty(grad_input.shape(), kFloat32, kCPU);
      conv2d_backward_input_cpu(gi, f32(grad_output), f32(weight), g);
      Tensor(grad_input).copy_(gi);
    }
  }
}

void conv2d_backward_weight_cpu(const Tensor& grad_weight, const Tensor& grad_output,
                                const Tensor& input, const ConvGeom& g) {
  switch (grad_output.dtype()) {
    case kFloat32: {
      auto c = get_conv(Pass::kBackwardWeights, g, false);
      execute(*c, input.data_ptr(), grad_weight.data_ptr(), grad_output.data_ptr(), nullptr,
              Pass::kBackwardWeights);
      return;
    }
    case kFloat64:
      Im2col(g).backward_weight(grad_output.data<double>(), input.data<double>(),
                                grad_weight.data<double>());
      return;
    default: {
      EMBER_INTERNAL_ASSERT(is_half(grad_output.dtype()), "conv2d_cpu: unexpected dtype");
      Tensor gw = make_empty(grad_weight.shape(), kFloat32, kCPU);
      conv2d_backward_weight_cpu(gw, f32(grad_output), f32(input), g);
      Tensor(grad_weight).copy_(gw);
    }
  }
}

}  // namespace ember::detail
