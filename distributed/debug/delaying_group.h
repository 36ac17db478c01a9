// DelayingGroup: a process group that wraps any other and delays and scales every
// collective's result, so that a caller that forgets to wait for a Work (or, on CUDA, to make
// its stream wait for the collective) reads a wrong number instead of passing by luck. Tests
// run DDP through it over ProcessGroupThreads (distributed/backends/process_group_threads.h).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/forwarding_process_group.h>

namespace ember::dist {

/// Options of DelayingGroup.
struct DelayOptions {
  /// CUDA: GPU clock cycles cuda::spin holds the stream before each collective, and again on
  /// the collective's stream before its result is written back.
  int64_t cycles = 50'000'000;
  /// CPU: how long the completing thread holds each result back before writing it.
  Duration cpu_delay = std::chrono::milliseconds(2);
  /// Floating-point results are multiplied by this (1: only delay).
  double scale = 1.0;
};

/// Forwards every collective to `inner` on staging copies of the output tensors, and writes
/// the results into the caller's tensors only after a delay, scaled: on CUDA a cuda::spin on
/// the caller's current stream before the collective, then a spin and the write-back on the
/// group's own stream after the collective's ready events; on the CPU the write-back runs on
/// the group's delay thread cpu_delay after the collective completed. Until then the caller's tensors keep their old values,
/// so a read without the wait sees them even when the collective itself has finished. The
/// returned Work's Future completes (with the caller's tensors, ready events recorded after
/// the write-back) once they hold the result. send's tensor is left alone; integer results are
/// delayed, not scaled. Same threading rules as the wrapped group.
class DelayingGroup : public ForwardingProcessGroup {
 public:
  /// Throws ValueError if `inner` is null. Starts the delay thread.
  DelayingGroup(std::shared_ptr<ProcessGroup> inner, DelayOptions options = {});
  /// Lets the pending write-backs finish, then stops the delay thread.
  ~DelayingGroup() override;

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                              const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                const ReduceScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;

 private:
  /// Queues cuda::spin on the current stream of touching's CUDA device, if any.
  void spin(const std::vector<Tensor>& touching) const;
  /// Staging copies of `outputs` (same values) for the inner collective, after spin().
  std::vector<Tensor> stage(const std::vector<Tensor>& outputs) const;
  /// The Work of `inner`, delayed, writing `staged` back into `outputs`, scaled.
  WorkPtr after(const WorkPtr& inner, std::vector<Tensor> outputs,
                std::vector<Tensor> staged) const;
  class Delayer;
  DelayOptions options_;
  std::shared_ptr<Delayer> delayer_;
};

}  // namespace ember::dist
