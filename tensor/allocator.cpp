#include <ember/tensor/allocator.h>

#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ember/tensor/error.h>

namespace ember {

namespace {

constexpr size_t kAlign = 64;
// Below this, glibc's malloc serves from its arenas without page faults: no need to cache.
constexpr size_t kCacheMin = 128 * 1024;
// Cached-but-free host memory kept at most; beyond it the largest free blocks go back.
constexpr int64_t kMaxCachedBytes = int64_t{2} << 30;

// Below this, plain malloc (16-byte aligned): glibc's aligned_alloc costs about 900 extra
// instructions per call, which is half the whole cost of `a + b` on one-element tensors.
constexpr size_t kSmall = 1024;

// From a huge page's size, blocks are 2 MiB-aligned and their whole 2 MiB pages advised to be
// backed by transparent huge pages (where the kernel is in THP "madvise" mode, as Debian's
// default is): streaming over them then takes far fewer TLB misses, and cross-memory attach
// (the shared-memory collectives' single copies) pins one page per 2 MiB instead of 512. The
// tail past the last whole huge page keeps small pages, so no block is rounded up: advising it
// too would fault in a whole huge page for its last bytes. The cache keeps blocks, so the
// huge-page fault cost is paid once.
constexpr size_t kHugePage = size_t{2} << 20;

void* raw_alloc(size_t nbytes) {
  if (nbytes >= kHugePage) {
    // posix_memalign, not aligned_alloc: the size need not be a multiple of the alignment.
    void* p = nullptr;
    if (::posix_memalign(&p, kHugePage, nbytes) != 0) p = nullptr;
    EMBER_CHECK_TYPE(OutOfMemoryError, p != nullptr, "[cpu_allocator] out of host memory: failed "
                     "to allocate ", nbytes, " bytes");
    // Advice only: failure just means small pages.
    madvise(p, nbytes / kHugePage * kHugePage, MADV_HUGEPAGE);
    return p;
  }
  const size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = nbytes < kSmall ? std::malloc(nbytes) : std::aligned_alloc(kAlign, rounded);
  EMBER_CHECK_TYPE(OutOfMemoryError, p != nullptr, "[cpu_allocator] out of host memory: failed to "
                   "allocate ", nbytes, " bytes");
  return p;
}

class CpuCachingAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    if (nbytes < kCacheMin) return raw_alloc(nbytes);
    const size_t size = round(nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Smallest cached block that fits and wastes at most half of itself.
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= 2 * size) {
        void* p = it->second;
        const size_t bsize = it->first;
        free_.erase(it);
        stats_.cached -= bsize;
        live_[p] = bsize;
        add_allocated(bsize);
        ++stats_.num_reused;
        return p;
      }
    }
    void* p = raw_alloc(size);
    std::lock_guard<std::mutex> lock(mu_);
    live_[p] = size;
    add_allocated(size);
    ++stats_.num_fresh;
    return p;
  }

  void deallocate(void* p, size_t nbytes) override {
    if (p == nullptr) return;
    if (nbytes < kCacheMin) {
      std::free(p);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    EMBER_INTERNAL_ASSERT(it != live_.end(), "freeing a host block the allocator does not own");
    const size_t bsize = it->second;
    live_.erase(it);
    stats_.allocated -= bsize;
    free_.emplace(bsize, p);
    stats_.cached += bsize;
    while (stats_.cached > kMaxCachedBytes && !free_.empty()) {
      auto last = std::prev(free_.end());
      stats_.cached -= last->first;
      std::free(last->second);
      free_.erase(last);
    }
  }

  Device device() const override { return kCPU; }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void account(int64_t delta) {
    std::lock_guard<std::mutex> lock(mu_);
    if (delta > 0) {
      add_allocated(static_cast<size_t>(delta));
    } else {
      stats_.allocated += delta;
    }
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated = stats_.allocated;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, p] : free_) std::free(p);
    free_.clear();
    stats_.cached = 0;
  }

 private:
  static size_t round(size_t n) {
    constexpr size_t kPage = 4096;
    return (n + kPage - 1) / kPage * kPage;
  }
  void add_allocated(size_t n) {
    stats_.allocated += n;
    if (stats_.allocated > stats_.peak_allocated) stats_.peak_allocated = stats_.allocated;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> live_;
  AllocatorStats stats_;
};

CpuCachingAllocator& cpu_caching() {
  // Leaked on purpose: tensors in static storage may be freed after main returns.
  static auto* a = new CpuCachingAllocator();
  return *a;
}

}  // namespace

Allocator* cpu_allocator() { return &cpu_caching(); }
AllocatorStats cpu_allocator_stats() { return cpu_caching().stats(); }
void cpu_empty_cache() { cpu_caching().empty_cache(); }
void cpu_reset_peak_stats() { cpu_caching().reset_peak(); }
void cpu_allocator_account(int64_t delta) { cpu_caching().account(delta); }

Allocator* allocator_for(Device d) { return d.is_cpu() ? cpu_allocator() : cuda_allocator(d.index); }

}  // namespace ember
