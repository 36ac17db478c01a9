// Note [CUDA graphs]
// A capture records what the code queues on the capturing stream (and on streams that wait on
// it during the capture: collectives, prefetches) into a cudaGraph_t instead of running it;
// replay() launches all of it at once, so a step of a few hundred small kernels costs one launch
// instead of a few hundred. Everything is replayed with the arguments it was captured with:
//  - Memory: addresses are baked in, so what the capture allocates comes from a private pool
//    that outlives the capture (Note [Graph pools]); the tensors the caller keeps from the
//    capture are the graph's static outputs, and its inputs are tensors made before it, which
//    the caller refills (copy_) before each replay.
//  - Random numbers: an op captured with (seed, offset) as arguments would draw the same numbers
//    on every replay. So during a capture an op's counter range is relative to two words on the
//    device that the graph owns per generator (detail::PhiloxArgs), and replay() reserves the
//    whole graph's range from each generator on the host and writes {seed, first} there before
//    launching: each replay draws what the same ops run eagerly at that point would have drawn.
//    A generator drawn from during a capture must outlive the graph's replays.
//  - What cannot be captured: anything that waits for the GPU or reads its results on the host
//    (item(), a copy to pageable host memory, synchronize, event queries), since nothing has run
//    yet. CUDA reports it as an invalidated capture; Ember's allocator and random ops keep clear
//    of it themselves. Code meant for capture keeps such reads outside it (e.g. the loss is read
//    from the static output after replay()).
// Ember's capture mode is thread-local by default (PyTorch's is global): rank threads share a GPU,
// and another thread's cudaMalloc must not invalidate this thread's capture.
#include <ember/tensor/gpu/cuda_graph.h>

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <vector>

#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/runtime/device_pool.h>
#include <ember/tensor/detail/random_kernels.h>
#include <ember/tensor/ops/random.h>

namespace ember::cuda {

struct CUDAGraph::Impl {
  // A generator drawn from during the capture: the device words its ops read, and how many
  // counter values one replay uses.
  struct RngSlot {
    Generator* gen = nullptr;
    uint64_t* words = nullptr;
    uint64_t used = 0;
  };

  int device = -1;
  MempoolId pool = 0;
  bool holds_pool = false;  // a user of `pool` that reset() gives up
  cudaStream_t stream = nullptr;
  unsigned long long capture_id = 0;
  bool capturing = false;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<RngSlot> rng;
  std::vector<std::function<void(cudaStream_t)>> after_launch;
  std::vector<std::function<void()>> before_launch;

  // Ends a capture that failed or was abandoned, discarding what it recorded.
  void abandon() noexcept;
  void release();
};

namespace {

std::atomic<MempoolId> g_next_pool{1};
thread_local CUDAGraph::Impl* t_capture = nullptr;

cudaStreamCaptureMode raw_mode(CaptureMode m) {
  switch (m) {
    case CaptureMode::kGlobal:
      return cudaStreamCaptureModeGlobal;
    case CaptureMode::kThreadLocal:
      return cudaStreamCaptureModeThreadLocal;
    case CaptureMode::kRelaxed:
      return cudaStreamCaptureModeRelaxed;
  }
  return cudaStreamCaptureModeThreadLocal;
}

// Ember's capture streams (torch.cuda.graph's side stream): one per capture in progress, so no
// thread's work lands in another thread's graph through a shared stream (a thread-local capture
// records whatever reaches its stream, from any thread). A stream goes back to its device's free
// list when the capture ends; there are as many as captures ever ran at once. (Captures on one
// GPU from several threads at once are still not supported: docs/tensor.md.)
class SideStream {
 public:
  explicit SideStream(int device) : device_(device) {
    EMBER_CHECK(device >= 0 && device < kMaxDevices, "[cuda::graph] bad device ", device);
    {
      std::lock_guard<std::mutex> lock(mu());
      std::vector<Stream>& idle = free_list(device);
      if (!idle.empty()) {
        stream_ = idle.back();
        idle.pop_back();
        return;
      }
    }
    stream_ = Stream::create(device);
  }
  ~SideStream() {
    std::lock_guard<std::mutex> lock(mu());
    free_list(device_).push_back(stream_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  const Stream& stream() const { return stream_; }

 private:
  static constexpr int kMaxDevices = 64;
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<Stream>& free_list(int device) {
    static std::array<std::vector<Stream>, kMaxDevices> lists;
    return lists[device];
  }

  int device_;
  Stream stream_;
};

}  // namespace

void CUDAGraph::Impl::abandon() noexcept {
  if (t_capture == this) t_capture = nullptr;
  if (capturing) {
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial) {
      cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();
    capturing = false;
    try {
      detail::device_pool(device).end_private(capture_id);
    } catch (...) {  // the routing ended already: nothing left to undo
    }
  }
}

void CUDAGraph::Impl::release() {
  abandon();
  if (exec) cudaGraphExecDestroy(std::exchange(exec, nullptr));
  if (graph) cudaGraphDestroy(std::exchange(graph, nullptr));
  if (!rng.empty()) {
    detail::DeviceGuard guard(device);
    for (RngSlot& r : rng) cudaFree(r.words);
    rng.clear();
  }
  after_launch.clear();
  before_launch.clear();
  if (holds_pool) {
    holds_pool = false;
    detail::device_pool(device).release_private(pool);
  }
}

MempoolId graph_pool_handle() { return g_next_pool.fetch_add(1); }

bool is_current_stream_capturing() {
  if (!is_available()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EMBER_CUDA_CHECK(cudaStreamIsCapturing(detail::raw(current_stream().handle()), &status));
  return status == cudaStreamCaptureStatusActive;
}

bool thread_is_capturing() { return t_capture != nullptr; }

CUDAGraph::CUDAGraph() : impl_(std::make_unique<Impl>()) {}

CUDAGraph::~CUDAGraph() {
  try {
    impl_->release();
  } catch (...) {  // a destructor must not throw; the graph's memory stays with the device
  }
}

void CUDAGraph::capture_begin(MempoolId pool, CaptureMode mode) {
  Impl& g = *impl_;
  EMBER_CHECK_TYPE(NotImplementedError, is_available(), "[CUDAGraph::capture_begin] ",
                   unavailable_reason());
  EMBER_CHECK(!g.capturing && !g.exec,
              "[CUDAGraph::capture_begin] this graph holds a capture already; reset() it first");
  EMBER_CHECK(t_capture == nullptr,
              "[CUDAGraph::capture_begin] this thread is capturing another graph; captures do "
              "not nest");
  const int device = current_device();
  const Stream s = current_stream(device);
  EMBER_CHECK(s.handle() != nullptr,
              "[CUDAGraph::capture_begin] cannot capture the legacy default stream of cuda:",
              device, "; make another stream current (cuda::graph() does, with a side stream)");
  detail::DeviceGuard guard(device);
  g.release();
  g.device = device;
  g.pool = pool != 0 ? pool : graph_pool_handle();
  g.stream = detail::raw(s.handle());
  EMBER_CUDA_CHECK(cudaStreamBeginCapture(g.stream, raw_mode(mode)));
  g.capturing = true;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  try {
    EMBER_CUDA_CHECK(cudaStreamGetCaptureInfo(g.stream, &status, &g.capture_id));
    detail::device_pool(device).begin_private(g.pool, g.capture_id);
  } catch (...) {
    g.capturing = false;
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(g.stream, &partial) == cudaSuccess && partial) {
      cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();
    throw;
  }
  g.holds_pool = true;
  t_capture = &g;
}

void CUDAGraph::capture_end() {
  Impl& g = *impl_;
  EMBER_CHECK(g.capturing, "[CUDAGraph::capture_end] no capture is underway on this graph");
  EMBER_CHECK(t_capture == &g,
              "[CUDAGraph::capture_end] the capture must end on the thread that began it");
  detail::DeviceGuard guard(g.device);
  t_capture = nullptr;
  g.capturing = false;
  const cudaError_t err = cudaStreamEndCapture(g.stream, &g.graph);
  detail::device_pool(g.device).end_private(g.capture_id);
  if (err == cudaErrorStreamCaptureUnjoined) {
    (void)cudaGetLastError();
    g.graph = nullptr;
    g.release();
    throw CudaError(::ember::detail::str_cat(
        "[CUDAGraph::capture_end] the capture on cuda:", g.device,
        " failed: work it forked to another stream was not joined back before it ended (wait() "
        "on every collective's Work, or make the capturing stream wait for the other stream's "
        "event, inside the capture)"));
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    g.graph = nullptr;
    g.release();
    throw CudaError(::ember::detail::str_cat(
        "[CUDAGraph::capture_end] the capture on cuda:", g.device,
        " failed: ", cudaGetErrorString(err),
        ". Something in it waited for the GPU or read its results on the host (item(), a copy "
        "to the host, synchronize), or another thread used the GPU unsafely under a global "
        "capture; keep such work outside the capture"));
  }
  const cudaError_t inst = cudaGraphInstantiate(&g.exec, g.graph, 0);
  if (inst != cudaSuccess) {
    (void)cudaGetLastError();
    g.exec = nullptr;
    g.release();
    EMBER_CUDA_CHECK(inst);
  }
}

void CUDAGraph::replay() {
  Impl& g = *impl_;
  EMBER_CHECK(g.exec, "[CUDAGraph::replay] nothing to replay: capture the graph first");
  detail::DeviceGuard guard(g.device);
  void* stream = current_stream(g.device).handle();
  // First: a hook that refuses the replay (its process group failed) must leave the generators
  // where eager steps would find them.
  for (const auto& fn : g.before_launch) fn();
  for (Impl::RngSlot& r : g.rng) {
    const Generator::Draw d = r.gen->reserve(r.used);
    ::ember::detail::write_philox_replay(r.words, d.seed, d.offset, stream);
  }
  EMBER_CUDA_CHECK(cudaGraphLaunch(g.exec, detail::raw(stream)));
  for (const auto& fn : g.after_launch) fn(detail::raw(stream));
}

void CUDAGraph::reset() {
  detail::DeviceGuard guard(impl_->device >= 0 ? impl_->device : current_device());
  impl_->release();
}

MempoolId CUDAGraph::pool() const { return impl_->pool; }

bool CUDAGraph::ready() const { return impl_->exec != nullptr; }

bool on_each_replay(std::function<void()> fn) {
  if (t_capture == nullptr) return false;
  t_capture->before_launch.push_back(std::move(fn));
  return true;
}

bool after_each_replay(std::function<void(const Stream&)> fn) {
  if (t_capture == nullptr) return false;
  t_capture->after_launch.push_back(
      [fn = std::move(fn), device = t_capture->device](cudaStream_t s) { fn(Stream(s, device)); });
  return true;
}

void graph(CUDAGraph& g, const std::function<void()>& fn, const GraphOptions& opts) {
  const int device = current_device();
  std::optional<SideStream> side;
  if (opts.stream == nullptr) side.emplace(device);
  const Stream s = opts.stream != nullptr ? *opts.stream : side->stream();
  synchronize(device);
  StreamGuard current(s);
  g.capture_begin(opts.pool, opts.mode);
  try {
    fn();
  } catch (...) {
    g.reset();
    throw;
  }
  g.capture_end();
}

}  // namespace ember::cuda

namespace ember::cuda::detail {

bool capturing(int device) {
  return t_capture != nullptr && (device < 0 || t_capture->device == device);
}

bool after_each_replay(int device, std::function<void(cudaStream_t)> fn) {
  if (!capturing(device)) return false;
  t_capture->after_launch.push_back(std::move(fn));
  return true;
}

}  // namespace ember::cuda::detail

namespace ember::detail {

bool cuda_capture_draw(Generator& gen, uint64_t n, int device, PhiloxArgs* out) {
  cuda::CUDAGraph::Impl* g = cuda::t_capture;
  if (g == nullptr || g->device != device) return false;
  cuda::CUDAGraph::Impl::RngSlot* slot = nullptr;
  for (auto& r : g->rng) {
    if (r.gen == &gen) slot = &r;
  }
  if (slot == nullptr) {
    // Not part of the graph: memory for the replays to write before they launch.
    cuda::detail::DeviceGuard guard(device);
    cuda::detail::RelaxedCaptureMode relaxed;
    void* words = nullptr;
    EMBER_CUDA_CHECK(cudaMalloc(&words, 2 * sizeof(uint64_t)));
    g->rng.push_back({&gen, static_cast<uint64_t*>(words), 0});
    slot = &g->rng.back();
  }
  out->seed = 0;
  out->offset = slot->used;
  out->replay = slot->words;
  slot->used += n;
  return true;
}

}  // namespace ember::detail
