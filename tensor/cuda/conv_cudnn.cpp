// Convolution on CUDA with cuDNN: NCHW tensors, the algorithm from cuDNN's heuristics
// (cudnnGet*Algorithm_v7, cached per geometry), workspaces from Ember's caching allocator.
// float32 may use TF32 tensor cores (CUDNN_DEFAULT_MATH), as PyTorch allows by default for
// convolutions; float16/bfloat16 accumulate in float32, float64 in float64.
#include <cudnn.h>
#include <cuda_runtime_api.h>

#include <array>
#include <climits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/gpu/cudnn.h>
#include <ember/tensor/cuda/runtime/handle_pool.h>
#include <ember/tensor/cuda/runtime/cudnn_handle.h>
#include <ember/tensor/detail/conv_kernels.h>

namespace ember {

bool cuda::cudnn_is_available() { return true; }

}  // namespace ember

namespace ember::detail {

namespace cuda_loops {
cudaStream_t stream_of(Device d);
}

namespace {

void check_cudnn(cudnnStatus_t st, const char* what, const char* op) {
  if (st == CUDNN_STATUS_SUCCESS) return;
  if (st == CUDNN_STATUS_ALLOC_FAILED) {
    throw OutOfMemoryError(str_cat("[", op, "] cuDNN could not allocate memory in ", what));
  }
  throw CudaError(str_cat("[", op, "] cuDNN error in ", what, ": ", cudnnGetErrorString(st)));
}

void check_cudnn(cudnnStatus_t st, const char* what) { check_cudnn(st, what, "conv2d"); }

}  // namespace

// Per-(device, thread) handles (Note [Per-thread library handles]).
cudnnHandle_t cudnn_handle(Device device, const char* op) {
  cudnnHandle_t h = cuda::detail::pooled_handle<cudnnHandle_t>(device.index, +[] {
    cudnnHandle_t created = nullptr;
    check_cudnn(cudnnCreate(&created), "cudnnCreate", "cudnn");
    return created;
  });
  check_cudnn(cudnnSetStream(h, cuda_loops::stream_of(device)), "cudnnSetStream", op);
  return h;
}

namespace {

cudnnDataType_t data_type(Dtype t) {
  switch (t) {
    case kFloat32: return CUDNN_DATA_FLOAT;
    case kFloat64: return CUDNN_DATA_DOUBLE;
    case kFloat16: return CUDNN_DATA_HALF;
    case kBFloat16: return CUDNN_DATA_BFLOAT16;
    default: throw_unsupported_dtype("conv2d", t, "floating dtypes");
  }
}

int to_int(int64_t v) {
  EMBER_CHECK(v < INT_MAX, "[conv2d] sizes must be below 2^31 for cuDNN, got ", v);
  return static_cast<int>(v);
}

// RAII wrappers of the three descriptors one convolution needs.
struct Descriptors {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;

  Descriptors(const ConvGeom& g, Dtype dtype) {
    const cudnnDataType_t dt = data_type(dtype);
    check_cudnn(cudnnCreateTensorDescriptor(&x), "cudnnCreateTensorDescriptor");
    check_cudnn(cudnnCreateTensorDescriptor(&y), "cudnnCreateTensorDescriptor");
    check_cudnn(cudnnCreateFilterDescriptor(&w), "cudnnCreateFilterDescriptor");
    check_cudnn(cudnnCreateConvolutionDescriptor(&conv), "cudnnCreateConvolutionDescriptor");
    check_cudnn(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, dt, to_int(g.n), to_int(g.c),
                                           to_int(g.h), to_int(g.w)),
                "cudnnSetTensor4dDescriptor");
    check_cudnn(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, dt, to_int(g.n), to_int(g.o),
                                           to_int(g.oh), to_int(g.ow)),
                "cudnnSetTensor4dDescriptor");
    check_cudnn(cudnnSetFilter4dDescriptor(w, dt, CUDNN_TENSOR_NCHW, to_int(g.o),
                                           to_int(g.c / g.groups), to_int(g.kh), to_int(g.kw)),
                "cudnnSetFilter4dDescriptor");
    const cudnnDataType_t compute = dtype == kFloat64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    check_cudnn(cudnnSetConvolution2dDescriptor(conv, to_int(g.ph), to_int(g.pw), to_int(g.sh),
                                                to_int(g.sw), to_int(g.dh), to_int(g.dw),
                                                CUDNN_CROSS_CORRELATION, compute),
                "cudnnSetConvolution2dDescriptor");
    check_cudnn(cudnnSetConvolutionGroupCount(conv, to_int(g.groups)),
                "cudnnSetConvolutionGroupCount");
    const cudnnMathType_t math = (dtype == kFloat16 || dtype == kBFloat16)
                                     ? CUDNN_TENSOR_OP_MATH
                                     : CUDNN_DEFAULT_MATH;
    check_cudnn(cudnnSetConvolutionMathType(conv, math), "cudnnSetConvolutionMathType");
  }
  ~Descriptors() {
    cudnnDestroyTensorDescriptor(x);
    cudnnDestroyTensorDescriptor(y);
    cudnnDestroyFilterDescriptor(w);
    cudnnDestroyConvolutionDescriptor(conv);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

enum class Pass : int64_t { kForward, kBackwardData, kBackwardFilter };

// An algorithm (as int: the three passes have distinct enums) and its workspace size.
struct Algo {
  int algo = 0;
  size_t workspace = 0;
};

using Key = std::array<int64_t, 18>;
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    for (int64_t v : k) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

// The first algorithm of cuDNN's heuristic ranking that works for these descriptors.
template <typename Perf, typename Query>
Algo pick(Query&& query, const char* what) {
  constexpr int kMax = 16;
  Perf perf[kMax];
  int returned = 0;
  check_cudnn(query(kMax, &returned, perf), what);
  for (int i = 0; i < returned; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS) {
      return {static_cast<int>(perf[i].algo), perf[i].memory};
    }
  }
  throw CudaError(str_cat("[conv2d] cuDNN found no algorithm in ", what));
}

Algo choose(Pass pass, const ConvGeom& g, Dtype dtype, Device device, cudnnHandle_t h,
            const Descriptors& d) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<Key, Algo, KeyHash>();
  const Key key = {static_cast<int64_t>(pass), static_cast<int64_t>(dtype), device.index, g.n,
                   g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.groups,
                   0};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  Algo a;
  switch (pass) {
    case Pass::kForward:
      a = pick<cudnnConvolutionFwdAlgoPerf_t>(
          [&](int n, int* r, cudnnConvolutionFwdAlgoPerf_t* p) {
            return cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.conv, d.y, n, r, p);
          },
          "cudnnGetConvolutionForwardAlgorithm_v7");
      break;
    case Pass::kBackwardData:
      a = pick<cudnnConvolutionBwdDataAlgoPerf_t>(
          [&](int n, int* r, cudnnConvolutionBwdDataAlgoPerf_t* p) {
            return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w, d.y, d.conv, d.x, n, r, p);
          },
          "cudnnGetConvolutionBackwardDataAlgorithm_v7");
      break;
    case Pass::kBackwardFilter:
      a = pick<cudnnConvolutionBwdFilterAlgoPerf_t>(
          [&](int n, int* r, cudnnConvolutionBwdFilterAlgoPerf_t* p) {
            return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x, d.y, d.conv, d.w, n, r,
                                                                 p);
          },
          "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
      break;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache->emplace(key, a);
  return a;
}

// alpha = 1, beta = 0 in the scaling type cuDNN wants (double for double data, else float).
struct Scale {
  float f[2] = {1.f, 0.f};
  double d[2] = {1.0, 0.0};
  bool is_double;
  explicit Scale(Dtype t) : is_double(t == kFloat64) {}
  const void* one() const { return is_double ? static_cast<const void*>(&d[0]) : &f[0]; }
  const void* zero() const { return is_double ? static_cast<const void*>(&d[1]) : &f[1]; }
};

Tensor workspace(size_t bytes, Device device) {
  return make_empty({static_cast<int64_t>(bytes)}, kUInt8, device);
}

}  // namespace

void conv2d_cuda(const Tensor& out, const Tensor& input, const Tensor& weight, const Tensor& bias,
                 const ConvGeom& g) {
  const Device dev = out.device();
  cuda::detail::DeviceGuard guard(dev.index);
  cudnnHandle_t h = cudnn_handle(dev, "conv2d");
  Descriptors d(g, out.dtype());
  const Algo a = choose(Pass::kForward, g, out.dtype(), dev, h, d);
  Tensor ws = workspace(a.workspace, dev);
  const Scale s(out.dtype());
  check_cudnn(cudnnConvolutionForward(h, s.one(), d.x, input.data_ptr(), d.w, weight.data_ptr(),
                                      d.conv, static_cast<cudnnConvolutionFwdAlgo_t>(a.algo),
                                      ws.data_ptr(), a.workspace, s.zero(), d.y, out.data_ptr()),
              "cudnnConvolutionForward");
  if (bias.defined()) add_channel_bias_cuda(out, bias);
}

void conv2d_backward_input_cuda(const Tensor& grad_input, const Tensor& grad_output,
                                const Tensor& weight, const ConvGeom& g) {
  const Device dev = grad_input.device();
  cuda::detail::DeviceGuard guard(dev.index);
  cudnnHandle_t h = cudnn_handle(dev, "conv2d");
  Descriptors d(g, grad_input.dtype());
  const Algo a = choose(Pass::kBackwardData, g, grad_input.dtype(), dev, h, d);
  Tensor ws = workspace(a.workspace, dev);
  const Scale s(grad_input.dtype());
  check_cudnn(cudnnConvolutionBackwardData(
                  h, s.one(), d.w, weight.data_ptr(), d.y, grad_output.data_ptr(), d.conv,
                  static_cast<cudnnConvolutionBwdDataAlgo_t>(a.algo), ws.data_ptr(), a.workspace,
                  s.zero(), d.x, grad_input.data_ptr()),
              "cudnnConvolutionBackwardData");
}

void conv2d_backward_weight_cuda(const Tensor& grad_weight, const Tensor& grad_output,
                                 const Tensor& input, const ConvGeom& g) {
  const Device dev = grad_weight.device();
  cuda::detail::DeviceGuard guard(dev.index);
  cudnnHandle_t h = cudnn_handle(dev, "conv2d");
  Descriptors d(g, grad_weight.dtype());
  const Algo a = choose(Pass::kBackwardFilter, g, grad_weight.dtype(), dev, h, d);
  Tensor ws = workspace(a.workspace, dev);
  const Scale s(grad_weight.dtype());
  check_cudnn(cudnnConvolutionBackwardFilter(
                  h, s.one(), d.x, input.data_ptr(), d.y, grad_output.data_ptr(), d.conv,
                  static_cast<cudnnConvolutionBwdFilterAlgo_t>(a.algo), ws.data_ptr(),
                  a.workspace, s.zero(), d.w, grad_weight.data_ptr()),
              "cudnnConvolutionBackwardFilter");
}

}  // namespace ember::detail
