// FSDP's arena on a CUDA device (detail/fsdp_arena.h), the device's counterpart of HostArena.
//
// Note [CUDA arenas]
// The range is reserved once (cuMemAddressReserve, rounded up to the allocation granularity);
// commit() creates physical memory on the arena's device and maps it there (cuMemCreate,
// cuMemMap, cuMemSetAccess), release() unmaps it and frees it (cuMemUnmap, cuMemRelease). The
// parameters' views keep their data pointers across releases, as on the CPU.
//  - The driver API is reached through the runtime (cudaGetDriverEntryPointByVersion), so the
//    library does not link libcuda: a machine without a driver still loads it, and fails only
//    when an arena is made.
//  - Unmapping does not wait for the work that reads the memory, and kernels are queued ahead
//    of the CPU, so release() does not unmap: it records an event on the calling thread's
//    current stream (where the parameters were used and where the gathers into the arena were
//    waited for, Work::wait) and leaves the arena mapped, pending, on its device's list. The
//    memory goes back when that event has completed, checked without waiting whenever an arena
//    of the device commits; a commit of a still-mapped arena takes the mapping back instead of
//    mapping new memory (the gather that fills it is queued after the reads, as every backend
//    orders a collective after the caller's current stream). So the step never waits on the
//    host, except to bound what is pending: with more than kMaxPending arenas pending from one
//    thread on a device (its CPU side has run that many reshards ahead of its stream), the
//    oldest of them is waited for and unmapped, as PyTorch's FSDP limits each rank's all-gathers
//    in flight. Per releasing thread, so ranks as threads sharing a GPU each get the bound. On out
//    of memory every pending arena is waited for and unmapped before the allocation is retried.
//    flush_released_cuda_arenas() gives back everything pending (tests, and a caller that wants
//    the driver's free memory to show it).
//  - The memory is not the caching allocator's: cuda::memory_allocated() does not count it;
//    fsdp_memory_stats() and cuda_arena_held_bytes() do. On out of memory, commit() empties the
//    caching allocator's cache and tries once more, since freed tensors may hold the memory.
//  - Reading a released arena (module->forward(x), which skips fully_shard's hooks) is an
//    illegal address in the kernel, a CUDA error that ends the context: the CPU arena's fault
//    report has no device counterpart.
#include <ember/distributed/sharding/detail/fsdp_arena.h>

#include <array>
#include <atomic>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/error.h>

#if EMBER_WITH_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include <ember/tensor/cuda/runtime/check.h>
#endif

namespace ember::dist::detail {
namespace {

constexpr int kMaxDevices = 128;  // Device::index is an int8_t
std::array<std::atomic<int64_t>, kMaxDevices> g_held{};

}  // namespace

int64_t cuda_arena_held_bytes(int device) {
  return device >= 0 && device < kMaxDevices ? g_held[static_cast<size_t>(device)].load() : 0;
}

#if EMBER_WITH_CUDA

namespace {

using ::ember::detail::str_cat;

// The driver functions the arena uses, looked up once.
struct Driver {
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  std::string missing;  // the functions the driver did not give
};

// The ABI the PFN_*_v* types above describe: the newest version of each as of CUDA 12.0.
constexpr unsigned kDriverAbi = 12000;

template <typename F>
void lookup(const char* name, F& fn, std::string& missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &p, kDriverAbi, cudaEnableDefault, &status);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &status);
#endif
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    missing += (missing.empty() ? "" : ", ") + std::string(name);
    return;
  }
  fn = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    lookup("cuGetErrorString", d.error_string, d.missing);
    lookup("cuDeviceGet", d.device_get, d.missing);
    lookup("cuDeviceGetAttribute", d.attribute, d.missing);
    lookup("cuMemGetAllocationGranularity", d.granularity, d.missing);
    lookup("cuMemAddressReserve", d.reserve, d.missing);
    lookup("cuMemAddressFree", d.address_free, d.missing);
    lookup("cuMemCreate", d.create, d.missing);
    lookup("cuMemRelease", d.release, d.missing);
    lookup("cuMemMap", d.map, d.missing);
    lookup("cuMemUnmap", d.unmap, d.missing);
    lookup("cuMemSetAccess", d.set_access, d.missing);
  });
  return d;
}

std::string describe(CUresult r) {
  const char* s = nullptr;
  if (driver().error_string != nullptr) driver().error_string(r, &s);
  return s != nullptr ? std::string(s) : "CUresult " + std::to_string(static_cast<int>(r));
}

class CudaArena;

// Arenas released but maybe still mapped, per device, oldest first, with the thread that
// released each (Note [CUDA arenas]). An entry may be stale (the arena was committed again, or
// is gone): unmap() skips those.
struct PendingArena {
  std::weak_ptr<CudaArena> arena;
  std::thread::id by;
};
constexpr size_t kMaxPending = 2;  // per releasing thread
std::mutex g_pending_mu;
std::array<std::deque<PendingArena>, kMaxDevices> g_pending;

class CudaArena final : public FsdpArena, public std::enable_shared_from_this<CudaArena> {
 public:
  CudaArena(int device, size_t nbytes, std::string label)
      : d_(driver()), device_(device), nbytes_(nbytes), label_(std::move(label)) {
    EMBER_CHECK(nbytes > 0, "[", label_, "] an arena needs at least one byte");
    EMBER_CHECK_TYPE(NotImplementedError, d_.missing.empty(), "[", label_, "] parameters on cuda:",
                     device, ": the CUDA driver lacks ", d_.missing,
                     " (virtual memory management), which fully_shard needs on CUDA");
    cuda::detail::DeviceGuard guard(device_);  // makes the device's primary context current
    CUdevice dev = 0;
    check(d_.device_get(&dev, device_), "cuDeviceGet");
    int vmm = 0;
    check(d_.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
          "cuDeviceGetAttribute");
    EMBER_CHECK_TYPE(NotImplementedError, vmm != 0, "[", label_, "] parameters on cuda:", device_,
                     ": the device does not support CUDA virtual memory management, which "
                     "fully_shard needs to release gathered parameters in place");
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = dev;
    size_t granularity = 0;
    check(d_.granularity(&granularity, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity");
    if (granularity == 0) granularity = size_t{2} << 20;
    size_ = (nbytes_ + granularity - 1) / granularity * granularity;
    check(d_.reserve(&base_, size_, granularity, 0, 0), "cuMemAddressReserve");
  }

  ~CudaArena() override {
    try {
      bool was_committed = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        was_committed = committed_;
        committed_ = false;
      }
      // Still holding gathered parameters: the streams that read them are unknown here (another
      // rank thread may destroy the module), so the whole device is waited for once.
      if (was_committed) cuda::synchronize(device_);
      unmap(/*wait=*/true);
      cuda::detail::DeviceGuard guard(device_);
      d_.address_free(base_, size_);
    } catch (const std::exception&) {
      // At process exit the driver may already be shut down; the range goes with the context.
    }
  }

  void* data() const override { return reinterpret_cast<void*>(static_cast<uintptr_t>(base_)); }
  size_t nbytes() const override { return nbytes_; }
  size_t held_bytes() const override { return size_; }
  Device device() const override { return cuda_device(device_); }
  bool committed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return committed_;
  }

  void commit() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (committed_) return;
      if (mapped_) {  // released, not given back yet: take the mapping back
        committed_ = true;
        std::lock_guard<std::mutex> list_lock(g_pending_mu);  // order: mu_, then the list's
        auto& pending = g_pending[static_cast<size_t>(device_)];
        const std::weak_ptr<CudaArena> self = weak_from_this();
        std::erase_if(pending, [&self](const PendingArena& e) {
          return !e.arena.owner_before(self) && !self.owner_before(e.arena);
        });
        return;
      }
    }
    // Only this arena's unit commits it; reclaim() on other threads leaves an unmapped arena
    // alone, so the new memory is mapped without the lock and published under it.
    reclaim(device_, /*wait_all=*/false);
    cuda::detail::DeviceGuard guard(device_);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d_.create(&h, size_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      reclaim(device_, /*wait_all=*/true);
      cuda::empty_cache();  // blocks cached by the allocator may hold what the arena needs
      r = d_.create(&h, size_, &prop_, 0);
    }
    check(r, "cuMemCreate");
    r = d_.map(base_, size_, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      d_.release(h);
      check(r, "cuMemMap");
    }
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d_.set_access(base_, size_, &access, 1);
    if (r != CUDA_SUCCESS) {
      d_.unmap(base_, size_);
      d_.release(h);
      check(r, "cuMemSetAccess");
    }
    g_held[static_cast<size_t>(device_)] += static_cast<int64_t>(size_);
    std::lock_guard<std::mutex> lock(mu_);
    handle_ = h;
    committed_ = true;
    mapped_ = true;
  }

  void release() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!committed_) return;
      // Note [CUDA arenas]: the queued reads and gathers must be done before the unmap, which
      // waits for this event (or finds it complete) later.
      done_.record(cuda::current_stream(device_));
      committed_ = false;
    }
    std::shared_ptr<CudaArena> oldest;
    {
      std::lock_guard<std::mutex> lock(g_pending_mu);
      auto& pending = g_pending[static_cast<size_t>(device_)];
      const std::thread::id me = std::this_thread::get_id();
      pending.push_back({weak_from_this(), me});
      const auto mine = [me](const PendingArena& e) { return e.by == me; };
      if (static_cast<size_t>(std::count_if(pending.begin(), pending.end(), mine)) > kMaxPending) {
        const auto first = std::find_if(pending.begin(), pending.end(), mine);
        oldest = first->arena.lock();
        pending.erase(first);
      }
    }
    if (oldest != nullptr) oldest->unmap(/*wait=*/true);
  }

  /// Gives back the memory of a released arena once its event says the GPU is done with it
  /// (waiting for that with `wait`). True while it stays pending: released, mapped, busy.
  bool unmap(bool wait) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!mapped_ || committed_) return false;
    if (!wait && !done_.query()) return true;
    done_.synchronize();
    cuda::detail::DeviceGuard guard(device_);
    check(d_.unmap(base_, size_), "cuMemUnmap");
    mapped_ = false;
    g_held[static_cast<size_t>(device_)] -= static_cast<int64_t>(size_);
    check(d_.release(handle_), "cuMemRelease");
    return false;
  }

  /// Gives back the memory of the device's released arenas whose GPU work is done (of all of
  /// them, waiting, with `wait_all`).
  static void reclaim(int device, bool wait_all) {
    std::deque<PendingArena> todo;
    {
      std::lock_guard<std::mutex> lock(g_pending_mu);
      todo.swap(g_pending[static_cast<size_t>(device)]);
    }
    std::deque<PendingArena> kept;
    for (auto& e : todo) {
      if (auto a = e.arena.lock(); a != nullptr && a->unmap(wait_all)) kept.push_back(std::move(e));
    }
    if (kept.empty()) return;
    std::lock_guard<std::mutex> lock(g_pending_mu);
    auto& pending = g_pending[static_cast<size_t>(device)];
    pending.insert(pending.begin(), kept.begin(), kept.end());
  }

 private:
  void check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) return;
    const std::string msg = str_cat("[", label_, "] ", call, " for ", size_ != 0 ? size_ : nbytes_,
                                    " bytes on cuda:", device_, " failed: ", describe(r));
    if (r == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemoryError(msg);
    throw CudaError(msg);
  }

  const Driver& d_;
  int device_;
  size_t nbytes_;
  size_t size_ = 0;  // nbytes_ rounded up to the granularity: what is reserved and mapped
  std::string label_;
  CUmemAllocationProp prop_{};
  CUdeviceptr base_ = 0;
  mutable std::mutex mu_;  // the state below: ranks as threads share the device's lists
  CUmemGenericAllocationHandle handle_ = 0;
  bool committed_ = false;  // in use: gathered parameters live here
  bool mapped_ = false;     // backed by memory: committed, or released and pending
  cuda::Event done_;        // recorded at release: the GPU's last use before then
};

}  // namespace

std::shared_ptr<FsdpArena> make_cuda_arena(int device, size_t nbytes, const std::string& label) {
  EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(), "[", label,
                   "] parameters on cuda:", device, ": ", cuda::unavailable_reason());
  EMBER_CHECK(device >= 0 && device < cuda::device_count(), "[", label, "] cuda:", device,
              " is not a device of this machine (", cuda::device_count(), " found)");
  return std::make_shared<CudaArena>(device, nbytes, label);
}

void flush_released_cuda_arenas(int device) {
  if (device >= 0 && device < kMaxDevices) CudaArena::reclaim(device, /*wait_all=*/true);
}

int64_t cuda_free_bytes(int device) {
  EMBER_CHECK_TYPE(NotImplementedError, cuda::is_available(), "[cuda_free_bytes] ",
                   cuda::unavailable_reason());
  cuda::detail::DeviceGuard guard(device);
  size_t free = 0, total = 0;
  EMBER_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free);
}

#else  // !EMBER_WITH_CUDA

std::shared_ptr<FsdpArena> make_cuda_arena(int device, size_t, const std::string& label) {
  EMBER_CHECK_TYPE(NotImplementedError, false, "[", label, "] parameters on cuda:", device,
                   ": Ember was built without CUDA");
  return nullptr;
}

void flush_released_cuda_arenas(int) {}

int64_t cuda_free_bytes(int) {
  EMBER_CHECK_TYPE(NotImplementedError, false, "[cuda_free_bytes] Ember was built without CUDA");
  return 0;
}

#endif

}  // namespace ember::dist::detail
