// Note [Per-thread library handles]
// cuBLAS and cuDNN handles are used by one thread at a time, one per (device, thread). Creating
// one takes milliseconds, so the handles of threads that exit go back to a pool for reuse
// instead of being destroyed (destroying them at process exit can also race with the driver's
// own teardown).
#pragma once

#include <mutex>
#include <vector>

#include <ember/tensor/error.h>

namespace ember::cuda::detail {

inline constexpr int kMaxHandleDevices = 64;

/// The calling thread's handle of type Handle (a library's opaque pointer type) for `device`,
/// taken from the pool of exited threads' handles or made with create() on first use.
template <typename Handle>
Handle pooled_handle(int device, Handle (*create)()) {
  struct Pool {
    std::mutex mu;
    std::vector<Handle> free[kMaxHandleDevices];
  };
  static auto* pool = new Pool;  // leaked on purpose: outlives every thread
  struct Mine {
    Handle h[kMaxHandleDevices] = {};
    ~Mine() {
      std::lock_guard<std::mutex> lock(pool->mu);
      for (int d = 0; d < kMaxHandleDevices; ++d) {
        if (h[d]) pool->free[d].push_back(h[d]);
      }
    }
  };
  thread_local Mine mine;
  EMBER_INTERNAL_ASSERT(device >= 0 && device < kMaxHandleDevices, "device index ", device);
  Handle& h = mine.h[device];
  if (!h) {
    {
      std::lock_guard<std::mutex> lock(pool->mu);
      if (!pool->free[device].empty()) {
        h = pool->free[device].back();
        pool->free[device].pop_back();
      }
    }
    if (!h) h = create();
  }
  return h;
}

}  // namespace ember::cuda::detail
