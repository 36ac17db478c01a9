// CUDA graphs: capture the work a piece of code queues on the GPU once, then replay it with one
// launch (torch.cuda.CUDAGraph and torch.cuda.graph). Note [CUDA graphs] in
// tensor/cuda/runtime/graph.cpp says what a capture records and what it may not contain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <ember/tensor/gpu/cuda.h>

namespace ember::cuda {

/// Names a private memory pool that graphs may share (torch.cuda.graph_pool_handle).
using MempoolId = uint64_t;

/// A new pool id: graphs captured with it share memory, and must then be replayed in the order
/// they were captured (each may overwrite what an earlier one left in the pool's free blocks).
MempoolId graph_pool_handle();

/// Whether the calling thread's current stream (on the current device) is being captured
/// (torch.cuda.is_current_stream_capturing); false without CUDA.
bool is_current_stream_capturing();
/// Whether the calling thread is capturing a CUDAGraph (on any device): a thread-local read that
/// touches no CUDA state, cheap enough for every collective to ask.
bool thread_is_capturing();

/// Which CUDA calls may run while a capture is underway (cudaStreamCaptureMode): kGlobal forbids
/// unsafe calls (cudaMalloc, synchronisations) on every thread, kThreadLocal on the capturing
/// thread only, kRelaxed nowhere. Ember's default is kThreadLocal, where PyTorch's is "global":
/// ranks run as threads sharing a GPU, and one rank's capture must not fail another's work.
enum class CaptureMode { kGlobal, kThreadLocal, kRelaxed };

/// A captured sequence of GPU work (torch.cuda.CUDAGraph). Capture it once, on a stream other
/// than the legacy default stream, after a warm-up that ran the same code eagerly; replay() then
/// reruns every kernel, copy and collective with the addresses and arguments of the capture:
/// inputs change by copying into the tensors the capture read, outputs are read from the tensors
/// it wrote. Random ops draw fresh numbers on each replay, the same ones eager calls would have
/// drawn from the generator at that point. Not copyable; one thread captures it.
class CUDAGraph {
 public:
  CUDAGraph();
  ~CUDAGraph();
  CUDAGraph(const CUDAGraph&) = delete;
  CUDAGraph& operator=(const CUDAGraph&) = delete;

  /// Starts capturing the current stream of the current device. Memory allocated on it until
  /// capture_end comes from private pool `pool` (0: a new pool of this graph's own).
  void capture_begin(MempoolId pool = 0, CaptureMode mode = CaptureMode::kThreadLocal);
  /// Ends the capture and makes the graph replayable. Throws CudaError if the capture was
  /// invalidated (an operation in it was not capturable); the graph is then reset.
  void capture_end();
  /// Launches the captured work on the current stream.
  void replay();
  /// Frees the graph; its pool's memory goes back once no other graph uses the pool and the
  /// tensors that the capture made and the caller kept are gone.
  void reset();
  /// The pool this graph's capture allocated from (0 before a capture).
  MempoolId pool() const;
  /// Whether a capture has ended and replay() may be called.
  bool ready() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// While the calling thread captures a graph: runs `fn` on the host before each launch of its
/// replays (the replay's stream is current, so what fn queues runs before the graph), and
/// returns true; false when no capture is underway. For device values that must follow host
/// state at every replay, such as a capturable optimizer's learning rate under a scheduler. What
/// fn refers to must outlive the graph.
bool on_each_replay(std::function<void()> fn);
/// As on_each_replay, but after each launch, given the stream the replay was launched on: for
/// host work that must follow the replay, such as recording an event a watchdog polls (the NCCL
/// group watches the collectives of a replayed graph this way).
bool after_each_replay(std::function<void(const Stream&)> fn);

struct GraphOptions {
  MempoolId pool = 0;
  /// The stream to capture on; null: a side stream of Ember's per device.
  const Stream* stream = nullptr;
  CaptureMode mode = CaptureMode::kThreadLocal;
};

/// torch.cuda.graph: waits for the device (so that the capture starts from settled memory),
/// makes the capture stream current, captures what `fn` queues into `g`, and restores the
/// current stream. If `fn` throws, the capture is abandoned, `g` is reset, and the error passes
/// on. Replay with g.replay() on any stream.
void graph(CUDAGraph& g, const std::function<void()>& fn, const GraphOptions& opts = {});

}  // namespace ember::cuda
