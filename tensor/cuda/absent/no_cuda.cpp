// Linked instead of tensor/cuda/*.cpp|cu when Ember is built with EMBER_WITH_CUDA=OFF: every
// entry point exists and says why it cannot work.
#include <ember/tensor/allocator.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/detail/copy.h>
#include <ember/tensor/error.h>
#include <ember/tensor/cuda/runtime/host_use.h>

namespace ember {

namespace {
constexpr const char* kReason = "CUDA is not available: Ember was built with EMBER_WITH_CUDA=OFF";
[[noreturn]] void no_cuda(const char* what) {
  throw NotImplementedError(detail::str_cat("[", what, "] ", kReason));
}
}  // namespace

Allocator* cuda_allocator(int) { no_cuda("cuda_allocator"); }
Allocator* pinned_allocator() { no_cuda("pin_memory"); }

namespace detail {
void copy_cuda(const Tensor&, const Tensor&, bool) { no_cuda("copy_"); }
void fill_cuda(const Tensor&, const Scalar&) { no_cuda("fill_"); }
int64_t pinned_events_held() { return 0; }  // no pinned memory without CUDA
}  // namespace detail

namespace cuda {
int device_count() { return 0; }
bool is_available() { return false; }
bool is_built() { return false; }
const char* unavailable_reason() { return kReason; }
int current_device() { return 0; }
void set_device(int) { no_cuda("set_device"); }
bool has_context(int) { return false; }
void synchronize(int) { no_cuda("synchronize"); }
std::string get_device_name(int) { no_cuda("get_device_name"); }
Stream Stream::create(int, int) { no_cuda("Stream::create"); }
void Stream::synchronize() const { no_cuda("Stream::synchronize"); }
bool Stream::query() const { no_cuda("Stream::query"); }
Stream current_stream(int device) { return Stream(nullptr, device < 0 ? 0 : device); }
void set_current_stream(const Stream&) { no_cuda("set_current_stream"); }
Stream default_stream(int device) { return Stream(nullptr, device < 0 ? 0 : device); }
StreamGuard::StreamGuard(const Stream&) { no_cuda("StreamGuard"); }
StreamGuard::~StreamGuard() = default;
Event::~Event() = default;
void Event::record(const Stream&) { no_cuda("Event::record"); }
void Event::block(const Stream&) const { no_cuda("Event::block"); }
void Event::synchronize() const { no_cuda("Event::synchronize"); }
bool Event::query() const { no_cuda("Event::query"); }
float Event::elapsed_ms(const Event&) const { no_cuda("Event::elapsed_ms"); }
void record_stream(void*, const Stream&) { no_cuda("record_stream"); }
void empty_cache() {}
// As torch.cuda's statistics without CUDA: nothing is allocated, so there is nothing to count.
int64_t memory_allocated(int) { return 0; }
int64_t max_memory_allocated(int) { return 0; }
int64_t memory_reserved(int) { return 0; }
int64_t max_memory_reserved(int) { return 0; }
void reset_peak_memory_stats(int) {}
void spin(int64_t, const Stream&) { no_cuda("spin"); }
void spin(int64_t) { no_cuda("spin"); }
MempoolId graph_pool_handle() { return 1; }
bool is_current_stream_capturing() { return false; }
bool thread_is_capturing() { return false; }
bool on_each_replay(std::function<void()>) { return false; }
bool after_each_replay(std::function<void(const Stream&)>) { return false; }
struct CUDAGraph::Impl {};
CUDAGraph::CUDAGraph() : impl_(std::make_unique<Impl>()) {}
CUDAGraph::~CUDAGraph() = default;
void CUDAGraph::capture_begin(MempoolId, CaptureMode) { no_cuda("CUDAGraph::capture_begin"); }
void CUDAGraph::capture_end() { no_cuda("CUDAGraph::capture_end"); }
void CUDAGraph::replay() { no_cuda("CUDAGraph::replay"); }
void CUDAGraph::reset() {}
MempoolId CUDAGraph::pool() const { return 0; }
bool CUDAGraph::ready() const { return false; }
void graph(CUDAGraph&, const std::function<void()>&, const GraphOptions&) {
  no_cuda("cuda::graph");
}
}  // namespace cuda

}  // namespace ember
