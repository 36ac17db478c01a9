// ProcessGroupNccl's internals, shared by its two source files: process_group_nccl.cpp (the
// communicator's life: creation, split and destruction, the launch path, CUDA-graph replays and
// the watchdog) and process_group_nccl_collectives.cpp (each collective and send/recv, one
// function each). Internal: not part of the public API. Built only with CUDA and NCCL.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/backends/process_group_nccl.h>

namespace ember::trace {
class DeviceSpan;
}

namespace ember::dist {

namespace detail {
class NcclFailure;
struct NcclPending;
}  // namespace detail

/// One rank's communicator, its stream and its watchdog. Every operation goes through launch(),
/// which queues it on the group's stream behind the caller's current stream (Note [NCCL
/// stream-ordered work]) and hands it to the watchdog, which aborts the communicator on a
/// timeout or an asynchronous NCCL error.
class ProcessGroupNccl::Impl {
 public:
  /// Queues one NCCL operation (or a group of them) on `comm` and `stream`.
  using Enqueue = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;

  /// Rank `rank` of `size`: picks the device (NcclOptions::device, else the local rank), makes
  /// the group's stream and creates the communicator, exchanging the ncclUniqueId through `store`
  /// within the init timeout.
  Impl(int rank, int size, std::shared_ptr<Store> store, const NcclOptions& o);
  /// Rank `rank` of `size` of a group split from `parent` (ncclCommSplit with `color`, ordered
  /// by `key`), on parent's device with a stream of its own. Collective over parent.
  Impl(int rank, int size, Impl& parent, int color, int key, const NcclOptions& o);
  /// Waits (bounded) for queued work, stops the watchdog, then finalizes and destroys the
  /// communicator, or aborts it if work is still running or a peer no longer answers.
  ~Impl();

  /// The parent side of a split: this rank's part of ncclCommSplit, with NCCL_SPLIT_NOCOLOR for
  /// a rank outside the new group (which gets null).
  ncclComm_t split(int color, int key, Duration init_timeout);

  int device() const { return device_; }
  const cuda::Stream& stream() const { return stream_; }

  /// Runs enqueue on the group's stream after the caller's current stream's queued work; the
  /// Work's Future completes with `outputs` once it is queued (Note [NCCL stream-ordered
  /// work]). `keep` stays alive until the operation ends. `blocking`: wait() also blocks the CPU
  /// until the device is done (barrier). Throws the group's failure if it failed earlier, or
  /// this operation's if NCCL refuses it. In a CUDA-graph capture, the operation is watched at
  /// each replay instead (Note [NCCL in a CUDA graph]).
  WorkPtr launch(const std::string& what, Duration timeout, std::vector<Tensor> outputs,
                 std::vector<Tensor> keep, const Enqueue& enqueue, bool blocking = false);

 private:
  using Pending = detail::NcclPending;

  void watch_replays(const std::string& what, Duration timeout, std::vector<Tensor> keep);
  void watch_replay(const std::string& what, Duration timeout, const cuda::Stream& replayed,
                    const std::vector<Tensor>& keep);
  void trace_span(trace::DeviceSpan& span, const std::string& what,
                  const std::vector<Tensor>& outputs, int64_t launched_us);
  void check_init(ncclResult_t r, ncclComm_t comm, const char* call) const;
  void abort_all(const std::string& reason, const std::string& culprit = "",
                 std::exception_ptr error = nullptr);
  void watch();
  bool check_async_error();
  void retire(const std::vector<std::shared_ptr<Pending>>& done);
  ncclComm_t settled_or_throw(ncclComm_t comm, ncclResult_t r, Duration init_timeout,
                              const char* doing);
  void start(ncclComm_t comm);

  const int rank_;
  const int size_;
  const Duration timeout_;
  int device_ = 0;
  cuda::Stream stream_;

  std::mutex comm_mu_;  // guards comm_ (NCCL calls on it, abort, destroy)
  ncclComm_t comm_ = nullptr;

  std::mutex mu_;  // guards pending_, stop_
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  // The first failure; set once the communicator is aborted. Shared with the Works.
  const std::shared_ptr<detail::NcclFailure> failure_;
  std::thread watchdog_;
  // What a captured collective's replay hooks hold (Note [NCCL in a CUDA graph]): expires with
  // the group.
  const std::shared_ptr<Impl*> alive_ = std::make_shared<Impl*>(this);
  // The timeline row of this group's stream (device spans, tensor/gpu/trace_device.h).
  const int trace_row_;
  std::string trace_row_name_;
};

}  // namespace ember::dist
