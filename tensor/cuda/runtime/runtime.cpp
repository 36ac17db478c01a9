// Devices, streams and events (tensor/gpu/cuda.h) over the CUDA runtime API: the probe that finds
// the devices once (and why there are none), the per-thread current device and stream, and
// stream-ordered events.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>

namespace ember::cuda {

namespace {
constexpr int kMaxDevices = 64;

struct Probe {
  int count = 0;
  std::string reason;
};

const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      r.reason = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
      return r;
    }
    r.count = n;
    if (n == 0) r.reason = "no CUDA device found";
    return r;
  }();
  return p;
}

thread_local Stream tl_current[kMaxDevices];
thread_local bool tl_set[kMaxDevices] = {};

int resolve(int device) { return device < 0 ? current_device() : device; }

void check_device(const char* op, int device) {
  EMBER_CHECK_TYPE(NotImplementedError, is_available(), "[", op, "] ", unavailable_reason());
  EMBER_CHECK(device >= 0 && device < device_count(), "[", op, "] CUDA device ", device,
              " does not exist; this machine has ", device_count());
}
}  // namespace

int device_count() { return probe().count; }
bool is_available() { return probe().count > 0; }
bool is_built() { return true; }
const char* unavailable_reason() { return probe().reason.c_str(); }

bool has_context(int device) {
  if (device < 0 || device >= device_count()) return false;
  // Through the runtime's driver entry point, so that Ember links no driver library.
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const GetState get_state = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<GetState>(nullptr);
    }
    return reinterpret_cast<GetState>(fn);
  }();
  if (get_state == nullptr) return true;  // cannot tell: restore, as before CUDA 12
  unsigned int flags = 0;
  int active = 0;
  if (get_state(static_cast<CUdevice>(device), &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

int current_device() {
  if (!is_available()) return 0;
  int d = 0;
  EMBER_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int index) {
  check_device("set_device", index);
  EMBER_CUDA_CHECK(cudaSetDevice(index));
}

std::string get_device_name(int device) {
  device = resolve(device);
  check_device("get_device_name", device);
  cudaDeviceProp prop{};
  EMBER_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

void synchronize(int device) {
  device = resolve(device);
  check_device("synchronize", device);
  detail::DeviceGuard g(device);
  EMBER_CUDA_CHECK(cudaDeviceSynchronize());
}

Stream Stream::create(int device, int priority) {
  device = resolve(device);
  check_device("Stream::create", device);
  detail::DeviceGuard g(device);
  cudaStream_t s;
  EMBER_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return Stream(s, device);
}

void Stream::synchronize() const {
  detail::DeviceGuard g(device_);
  EMBER_CUDA_CHECK(cudaStreamSynchronize(detail::raw(handle_)));
}

bool Stream::query() const {
  detail::DeviceGuard g(device_);
  cudaError_t e = cudaStreamQuery(detail::raw(handle_));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  EMBER_CUDA_CHECK(e);
  return true;
}

Stream current_stream(int device) {
  device = resolve(device);
  EMBER_CHECK(device >= 0 && device < kMaxDevices, "[current_stream] bad device index ", device);
  return tl_set[device] ? tl_current[device] : Stream(nullptr, device);
}

void set_current_stream(const Stream& s) {
  EMBER_CHECK(s.device() >= 0 && s.device() < kMaxDevices, "[set_current_stream] bad device ",
              s.device());
  tl_current[s.device()] = s;
  tl_set[s.device()] = true;
}

Stream default_stream(int device) { return Stream(nullptr, resolve(device)); }

StreamGuard::StreamGuard(const Stream& s) : prev_(current_stream(s.device())) {
  set_current_stream(s);
}
StreamGuard::~StreamGuard() { set_current_stream(prev_); }

Event::~Event() {
  if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

void Event::record(const Stream& s) {
  detail::DeviceGuard g(s.device());
  if (!handle_) {
    cudaEvent_t e;
    EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    handle_ = e;
    device_ = s.device();
  }
  EMBER_CHECK(device_ == s.device(), "[Event::record] event of device ", device_,
              " cannot be recorded on a stream of device ", s.device());
  EMBER_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), detail::raw(s.handle())));
}

void Event::block(const Stream& s) const {
  if (!handle_) return;  // never recorded: nothing to wait for
  detail::DeviceGuard g(s.device());
  EMBER_CUDA_CHECK(cudaStreamWaitEvent(detail::raw(s.handle()), static_cast<cudaEvent_t>(handle_), 0));
}

void Event::synchronize() const {
  if (handle_) EMBER_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

bool Event::query() const {
  if (!handle_) return true;
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  EMBER_CUDA_CHECK(e);
  return true;
}

float Event::elapsed_ms(const Event& end) const {
  EMBER_CHECK(handle_ && end.handle_ && timing_ && end.timing_,
              "[Event::elapsed_ms] both events must be recorded and created with enable_timing");
  float ms = 0;
  EMBER_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_),
                                        static_cast<cudaEvent_t>(end.handle_)));
  return ms;
}

}  // namespace ember::cuda
