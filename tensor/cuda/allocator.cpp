// CUDA caching allocator and pinned host allocator (Note [Caching allocators]).
#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "tensor/allocator.h"
#include "tensor/cuda.h"
#include "tensor/cuda/check.h"
#include "tensor/cuda/host_use.h"

namespace ember {

namespace {

constexpr size_t kRound = 512;

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  cudaStream_t stream = nullptr;     // the stream it was allocated on
  std::set<cudaStream_t> used_on;    // other streams (record_stream)
  std::vector<cudaEvent_t> pending;  // must complete before reuse
};

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const size_t size = (nbytes + kRound - 1) / kRound * kRound;
    cudaStream_t stream = static_cast<cudaStream_t>(cuda::current_stream(device_).handle());
    std::lock_guard<std::mutex> lock(mu_);
    cuda::detail::DeviceGuard g(device_);
    process_pending();
    if (void* p = take_free(stream, size)) return p;
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      release_free();  // give the cache back and try once more
      err = cudaMalloc(&p, size);
    }
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemoryError(detail::str_cat("[cuda_allocator] CUDA out of memory on device ",
                                             device_, ": tried to allocate ", nbytes,
                                             " bytes; ", live_bytes_, " bytes are in use"));
    }
    EMBER_CUDA_CHECK(err);
    auto b = std::make_unique<Block>();
    b->ptr = p;
    b->size = size;
    b->stream = stream;
    live_bytes_ += size;
    live_.emplace(p, std::move(b));
    return p;
  }

  void deallocate(void* p, size_t) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    EMBER_INTERNAL_ASSERT(it != live_.end(), "freeing a CUDA block the allocator does not own");
    std::unique_ptr<Block> b = std::move(it->second);
    live_.erase(it);
    live_bytes_ -= b->size;
    if (b->used_on.empty()) {
      insert_free(std::move(b));
      return;
    }
    // Used on other streams: reuse only after their work queued so far has finished.
    cuda::detail::DeviceGuard g(device_);
    for (cudaStream_t s : b->used_on) {
      cudaEvent_t e;
      EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      EMBER_CUDA_CHECK(cudaEventRecord(e, s));
      b->pending.push_back(e);
    }
    b->used_on.clear();
    pending_.push_back(std::move(b));
  }

  Device device() const override { return cuda_device(device_); }

  void record_stream(void* p, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    EMBER_CHECK(it != live_.end(), "[record_stream] pointer was not allocated by Ember's CUDA "
                "allocator on device ", device_);
    if (s != it->second->stream) it->second->used_on.insert(s);
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    cuda::detail::DeviceGuard g(device_);
    process_pending();
    release_free();
  }

 private:
  void* take_free(cudaStream_t stream, size_t size) {
    auto& bins = free_[stream];
    auto it = bins.lower_bound(size);
    if (it == bins.end() || it->first > 2 * size) return nullptr;
    std::unique_ptr<Block> b = std::move(it->second);
    bins.erase(it);
    void* p = b->ptr;
    live_bytes_ += b->size;
    live_.emplace(p, std::move(b));
    return p;
  }
  void insert_free(std::unique_ptr<Block> b) {
    const size_t size = b->size;
    free_[b->stream].emplace(size, std::move(b));
  }
  void process_pending() {
    for (size_t i = 0; i < pending_.size();) {
      Block& b = *pending_[i];
      bool done = true;
      for (cudaEvent_t e : b.pending) {
        cudaError_t q = cudaEventQuery(e);
        if (q == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++i;
        continue;
      }
      for (cudaEvent_t e : b.pending) cudaEventDestroy(e);
      b.pending.clear();
      insert_free(std::move(pending_[i]));
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  void release_free() {
    for (auto& [stream, bins] : free_) {
      for (auto& [size, b] : bins) cudaFree(b->ptr);
      bins.clear();
    }
  }

  const int device_;
  std::mutex mu_;
  std::unordered_map<void*, std::unique_ptr<Block>> live_;
  std::unordered_map<cudaStream_t, std::multimap<size_t, std::unique_ptr<Block>>> free_;
  std::vector<std::unique_ptr<Block>> pending_;
  size_t live_bytes_ = 0;
};

CudaCachingAllocator& device_allocator(int index) {
  static std::mutex mu;
  static std::unordered_map<int, CudaCachingAllocator*> all;  // leaked: outlives static tensors
  std::lock_guard<std::mutex> lock(mu);
  auto& a = all[index];
  if (!a) a = new CudaCachingAllocator(index);
  return *a;
}

// Page-locked host blocks, cached by size. A block used by an asynchronous copy is reused only
// after that copy's event has completed (record_host_use).
class PinnedAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(),
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

  void record_use(void* p, cudaStream_t s, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sizes_.count(p)) return;  // not ours (e.g. an interior pointer of a view): ignore
    cuda::detail::DeviceGuard g(device);
    cudaEvent_t e;
    EMBER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    EMBER_CUDA_CHECK(cudaEventRecord(e, s));
    events_[p].push_back(e);
  }

 private:
  void reap() {
    for (size_t i = 0; i < waiting_.size();) {
      bool done = true;
      for (cudaEvent_t e : waiting_[i].second) {
        if (cudaEventQuery(e) == cudaErrorNotReady) {
          (void)cudaGetLastError();
          done = false;
          break;
        }
      }
      if (!done) {
        ++i;
        continue;
      }
      for (cudaEvent_t e : waiting_[i].second) cudaEventDestroy(e);
      free_.emplace(sizes_[waiting_[i].first], waiting_[i].first);
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> sizes_;
  std::unordered_map<void*, std::vector<cudaEvent_t>> events_;
  std::vector<std::pair<void*, std::vector<cudaEvent_t>>> waiting_;
};

PinnedAllocator& pinned() {
  static auto* a = new PinnedAllocator();
  return *a;
}

}  // namespace

Allocator* cuda_allocator(int index) {
  EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(), "[cuda] cannot allocate on cuda:",
                   index, ": ", cuda::unavailable_reason());
  EMBER_CHECK(index >= 0 && index < cuda::device_count(), "[cuda] device cuda:", index,
              " does not exist; this machine has ", cuda::device_count(), " CUDA device(s)");
  return &device_allocator(index);
}

Allocator* pinned_allocator() { return &pinned(); }

namespace cuda {
void record_stream(void* ptr, const Stream& s) {
  device_allocator(s.device()).record_stream(ptr, static_cast<cudaStream_t>(s.handle()));
}
void empty_cache() {
  for (int d = 0; d < device_count(); ++d) device_allocator(d).empty_cache();
}
}  // namespace cuda

namespace detail {
void record_host_use(void* host_ptr, const cuda::Stream& s) {
  pinned().record_use(host_ptr, static_cast<cudaStream_t>(s.handle()), s.device());
}
}  // namespace detail

}  // namespace ember
