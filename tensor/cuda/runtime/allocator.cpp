// CUDA caching allocator (Note [CUDA caching pool]) and pinned host allocator (Note [Caching
// allocators]).
#include <ember/tensor/allocator.h>

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/runtime/device_pool.h>
#include <ember/tensor/cuda/runtime/host_use.h>
#include <ember/tensor/detail/caching_pool.h>

namespace ember {

namespace {

// The raw memory and events of one device for its CachingPool (Note [CUDA caching pool]).
// Every call sets the device first: the pool is used from whichever thread allocates.
class CudaMemory final : public detail::PoolBackend {
 public:
  explicit CudaMemory(int device) : device_(device) {}

  void* raw_alloc(size_t bytes) override {
    cuda::detail::DeviceGuard g(device_);
    // A capture's private pool grows with cudaMalloc, which the capture would otherwise reject;
    // the segment is not part of the graph and stays until the graph's pool is released.
    cuda::detail::RelaxedCaptureMode relaxed;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky; clear it so later calls do not report it
      return nullptr;
    }
    EMBER_CUDA_CHECK(err);
    return p;
  }
  void raw_free(void* ptr) override {
    cuda::detail::DeviceGuard g(device_);
    EMBER_CUDA_CHECK(cudaFree(ptr));
  }
  void* record_event(void* stream) override {
    cuda::detail::DeviceGuard g(device_);
    cudaEvent_t e = nullptr;
    EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    const cudaError_t err = cudaEventRecord(e, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) cudaEventDestroy(e);
    EMBER_CUDA_CHECK(err);
    return e;
  }
  bool event_done(void* event) override {
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (q == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    EMBER_CUDA_CHECK(q);
    return true;
  }
  void destroy_event(void* event) override {
    EMBER_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  }
  void synchronize() override {
    cuda::detail::DeviceGuard g(device_);
    EMBER_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void mem_info(size_t* free, size_t* total) override {
    cuda::detail::DeviceGuard g(device_);
    EMBER_CUDA_CHECK(cudaMemGetInfo(free, total));
  }
  std::string name() const override { return detail::str_cat("GPU ", device_); }
  uint64_t capture_id(void* stream) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    EMBER_CUDA_CHECK(cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id));
    return status == cudaStreamCaptureStatusActive ? id : 0;
  }

 private:
  const int device_;
};

// Blocks belong to the stream that is current on the allocating thread (Note [CUDA caching
// pool]); the pool does the rest and its own locking.
class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device)
      : device_(device), pool_(std::make_unique<CudaMemory>(device)) {}

  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    return pool_.allocate(nbytes, cuda::current_stream(device_).handle());
  }
  void deallocate(void* p, size_t) override { pool_.free(p); }
  Device device() const override { return cuda_device(device_); }
  detail::CachingPool& pool() { return pool_; }

 private:
  const int device_;
  detail::CachingPool pool_;
};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
// Leaked: tensors in static storage may free their blocks after static destructors ran.
std::unordered_map<int, CudaCachingAllocator*>& registry() {
  static auto* all = new std::unordered_map<int, CudaCachingAllocator*>();
  return *all;
}

CudaCachingAllocator& device_allocator(int index) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& a = registry()[index];
  if (!a) a = new CudaCachingAllocator(index);
  return *a;
}

// The allocator of a device that has allocated before, else nullptr: statistics and
// empty_cache must not touch (and create a context on) a device the process does not use.
CudaCachingAllocator* existing_allocator(int index) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(index);
  return it == registry().end() ? nullptr : it->second;
}

// The allocator whose statistics `op` reads, as torch.cuda picks it: the current device for a
// negative index; nullptr (all zeros) where CUDA is unusable or the device never allocated.
CudaCachingAllocator* stats_allocator(const char* op, int device) {
  if (!cuda::is_available()) return nullptr;
  const int d = device < 0 ? cuda::current_device() : device;
  EMBER_CHECK(d < cuda::device_count(), "[", op, "] CUDA device ", d,
              " does not exist; this machine has ", cuda::device_count(), " CUDA device(s)");
  return existing_allocator(d);
}

detail::PoolStats device_stats(const char* op, int device) {
  CudaCachingAllocator* a = stats_allocator(op, device);
  return a ? a->pool().stats() : detail::PoolStats{};
}

// Page-locked host blocks, cached by size. A block used by an asynchronous copy is reused only
// after that copy's event has completed (record_host_use).
class PinnedAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    EMBER_CHECK_TYPE(
        NotImplementedError, cuda::is_available(),
        "[pin_memory] pinned memory needs a CUDA device: ", cuda::unavailable_reason());
    std::lock_guard<std::mutex> lock(mu_);
    reap();
    auto it = free_.lower_bound(nbytes);
    if (it != free_.end() && it->first <= 2 * nbytes) {
      void* p = it->second;
      sizes_[p] = it->first;
      free_.erase(it);
      return p;
    }
    void* p = nullptr;
    EMBER_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocDefault));
    sizes_[p] = nbytes;
    return p;
  }
  void deallocate(void* p, size_t) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto ev = events_.find(p);
    if (ev != events_.end()) {
      waiting_.emplace_back(p, std::move(ev->second));
      events_.erase(ev);
      return;
    }
    free_.emplace(sizes_[p], p);
  }
  Device device() const override { return kCPU; }
  bool is_pinned() const override { return true; }
  int64_t events_held() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [p, uses] : events_) n += static_cast<int64_t>(uses.size());
    for (const auto& [p, uses] : waiting_) n += static_cast<int64_t>(uses.size());
    return n;
  }

  void record_use(void* p, cudaStream_t s, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sizes_.count(p)) return;  // not ours (e.g. an interior pointer of a view): ignore
    cuda::detail::DeviceGuard g(device);
    // One event per stream, recorded again at each use: a stream runs in order, so its last use
    // is done only after every earlier one. (An event per copy piled up for as long as a pinned
    // buffer lived: one per step for a buffer copied every step.)
    // Keyed by device too: every device's legacy default stream is the null handle.
    Uses& uses = events_[p];
    for (auto& use : uses) {
      if (use.device == device && use.stream == s) {
        EMBER_CUDA_CHECK(cudaEventRecord(use.event, s));
        return;
      }
    }
    cudaEvent_t e;
    EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    uses.push_back({device, s, e});
    EMBER_CUDA_CHECK(cudaEventRecord(e, s));
  }

 private:
  void reap() {
    for (size_t i = 0; i < waiting_.size();) {
      bool done = true;
      for (const Use& use : waiting_[i].second) {
        if (cudaEventQuery(use.event) == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++i;
        continue;
      }
      for (const Use& use : waiting_[i].second) cudaEventDestroy(use.event);
      free_.emplace(sizes_[waiting_[i].first], waiting_[i].first);
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> sizes_;
  struct Use {  // a block's last use on one stream
    int device;
    cudaStream_t stream;
    cudaEvent_t event;
  };
  using Uses = std::vector<Use>;
  std::unordered_map<void*, Uses> events_;
  std::vector<std::pair<void*, Uses>> waiting_;
};

PinnedAllocator& pinned() {
  static auto* a = new PinnedAllocator();
  return *a;
}

}  // namespace

Allocator* cuda_allocator(int index) {
  EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(),
                   "[cuda] cannot allocate on cuda:", index, ": ", cuda::unavailable_reason());
  EMBER_CHECK(index >= 0 && index < cuda::device_count(), "[cuda] device cuda:", index,
              " does not exist; this machine has ", cuda::device_count(), " CUDA device(s)");
  return &device_allocator(index);
}

Allocator* pinned_allocator() { return &pinned(); }

namespace cuda {
void record_stream(void* ptr, const Stream& s) {
  device_allocator(s.device()).pool().record_stream(ptr, s.handle());
}
void empty_cache() {
  for (int d = 0; d < device_count(); ++d) {
    if (CudaCachingAllocator* a = existing_allocator(d)) a->pool().empty_cache();
  }
}
int64_t memory_allocated(int device) { return device_stats("memory_allocated", device).allocated; }
int64_t max_memory_allocated(int device) {
  return device_stats("max_memory_allocated", device).max_allocated;
}
int64_t memory_reserved(int device) { return device_stats("memory_reserved", device).reserved; }
int64_t max_memory_reserved(int device) {
  return device_stats("max_memory_reserved", device).max_reserved;
}
void reset_peak_memory_stats(int device) {
  if (CudaCachingAllocator* a = stats_allocator("reset_peak_memory_stats", device)) {
    a->pool().reset_peak_stats();
  }
}
}  // namespace cuda

namespace cuda::detail {
ember::detail::CachingPool& device_pool(int device) { return device_allocator(device).pool(); }
}  // namespace cuda::detail

namespace detail {
void record_host_use(void* host_ptr, const cuda::Stream& s) {
  pinned().record_use(host_ptr, static_cast<cudaStream_t>(s.handle()), s.device());
}
int64_t pinned_events_held() { return pinned().events_held(); }
}  // namespace detail

}  // namespace ember
