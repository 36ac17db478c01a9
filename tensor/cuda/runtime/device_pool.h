// What graph capture (graph.cpp) shares with the rest of tensor/cuda/: the caching allocator's
// pool, and the hooks for work a capture cannot hold.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>

#include <ember/tensor/detail/caching_pool.h>

namespace ember::cuda::detail {

/// The caching pool of `device`, made on first use.
ember::detail::CachingPool& device_pool(int device);

/// Whether the calling thread is capturing a CUDAGraph (on `device`; -1: on any).
bool capturing(int device = -1);

/// While the calling thread captures a CUDAGraph on `device`: adds `fn` to what each replay does
/// on the host after launching the graph, given the replay's stream (work a capture cannot hold,
/// such as copying a device-side check back to the host), and returns true; false otherwise.
bool after_each_replay(int device, std::function<void(cudaStream_t)> fn);

/// Lets the calling thread make calls that a capture forbids (cudaMalloc) for the scope: what
/// such a call does is not part of the graph, and the memory it gets outlives the replays.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace ember::cuda::detail
