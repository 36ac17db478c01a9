// ProcessGroupGloo's internals, shared by its two source files: process_group_gloo.cpp (the
// rendezvous, the threads that run queued operations, failure handling) and
// process_group_gloo_collectives.cpp (each collective and send/recv over shared memory or Gloo's
// TCP transport). Internal: not part of the public API.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/device.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/backends/detail/gloo_agreement.h>
#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/backends/process_group_gloo.h>

namespace ember::dist {

/// The group's connections, shared memory and threads: operations are queued by submit() and
/// run by execute() on a worker, the send/recv thread or the caller.
class ProcessGroupGloo::Impl {
 public:
  using Clock = std::chrono::steady_clock;

  struct Job {
    std::shared_ptr<Work> work;
    Clock::time_point deadline;
    std::function<std::vector<Tensor>(std::chrono::milliseconds)> run;
    int64_t queued_us = 0;  // trace clock when submitted, if tracing
  };

  /// Connects to the other ranks (none for world size 1) and starts the threads.
  Impl(const ProcessGroupGloo& pg, std::shared_ptr<Store> store, const GlooOptions& opts);
  /// Fails what is still queued, joins the threads and closes the connections.
  ~Impl();

  /// Where submit() runs an operation: a collective on the workers (Worker), or on the calling
  /// thread when the group is idle (InlineIfIdle, Note [inline collectives]); sends on the
  /// send threads, receives on the receive thread (Note [send and receive threads]).
  enum class Route { Worker, InlineIfIdle, Send, Recv };

  /// The route of a collective that moves `bytes` per rank (Note [inline collectives]): over
  /// shared memory a small one may run on the calling thread.
  Route route_for(size_t bytes) const;

  /// Queues an operation on its route's thread; for world size 1, runs it now.
  WorkPtr submit(const std::string& what, Duration timeout,
                 std::function<std::vector<Tensor>(std::chrono::milliseconds)> run,
                 Route route = Route::Worker);

  /// GlooOptions::receives_first_bytes.
  size_t receives_first_bytes() const { return receives_first_bytes_; }
  /// The Gloo context, or null for world size 1.
  const std::shared_ptr<gloo::Context>& context() const { return context_; }
  /// A Gloo error with each peer's address written as "rank r (address)".
  std::string name_peers(const std::string& msg) const;
  /// Whether a failure or an abort broke the group (its connections are then being closed).
  bool broken() {
    std::lock_guard<std::mutex> lock(mu_);
    return !broken_.empty();
  }
  /// The group's waits on peers, and its retired buffers (Note [buffers of a failed operation]).
  dist::detail::AbortableWaits& waits() { return waits_; }
  /// The shared-memory allreduce, or null (world size 1, turned off, or a rank elsewhere).
  dist::detail::ShmAllreduce* shm() const { return shm_.get(); }

  /// The collectives issued so far that have not completed (Note [barrier and two workers]).
  std::vector<WorkPtr> unfinished_collectives();

  /// ProcessGroupGloo::abort(): breaks the group for `reason` and tells the other ranks.
  void abort(const std::string& reason);
  /// A send or recv (`what`) that Gloo would not post, its connection closed (`gloo_msg`):
  /// breaks the group and returns the error, naming a peer's abort where one was recorded
  /// (Note [p2p failures end the group]).
  std::string p2p_post_failed(const std::string& what, const std::string& gloo_msg);

  /// The group is being destroyed after `issued` operations: writes where this rank stands
  /// (Note [where a rank stands] in gloo_agreement.h), unless a failure already did.
  void leave(uint64_t issued);

 private:
  void loop(std::deque<Job>& queue, std::condition_variable& cv, bool collectives);
  void send_loop();

 public:
  /// Orders a send after the previous send to `peer` on `tag` (Note [send and receive
  /// threads]): returns when that one finished (ready at once if none); `done` is this one's.
  std::shared_future<void> previous_send(int peer, int tag, std::shared_future<void> done);

 private:
  void execute(Job& job, bool mark_broken = true);
  /// `from_abort`: err reports a peer's abort, so this rank writes no record of its own.
  template <typename E>
  void fail(Job& job, const E& err, bool mark_broken, bool from_abort = false);

  // Note [abort through the store] in gloo_agreement.h.
  void watch();
  /// Breaks the group for the peer's abort record `text`, as its own failure would.
  void observe_abort(const std::string& text);
  /// Writes this rank's abort record `text` and wakes its peers' watchers, each write within
  /// `bound`.
  void write_abort(const std::string& text, std::chrono::milliseconds bound);
  /// A peer's abort record, waiting up to `bound` for it; "" if none (or this rank's own).
  std::string peer_abort(std::chrono::milliseconds bound);
  /// The abort record of a peer behind a failure: the one the watcher saw, else (`ask_store`:
  /// the failure looks like a closed connection) the store's, waited for briefly; "" if none.
  std::string abort_behind(bool ask_store);

  int rank_;
  int size_;
  size_t receives_first_bytes_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::vector<std::vector<std::string>> peer_addresses_;  // Note [naming peers by rank]
  std::shared_ptr<Store> store_;                          // Note [where a rank stands]
  std::chrono::milliseconds position_wait_{0};
  std::atomic<bool> record_each_{false};  // EMBER_DISTRIBUTED_DEBUG=DETAIL: each operation
  std::string last_issued_;  // the label of the latest operation issued (guarded by mu_)
  std::unique_ptr<dist::detail::ShmAllreduce> shm_;  // outlives the workers (joined in ~Impl)
  std::mutex mu_;
  std::condition_variable cv_;      // collectives' queue
  std::condition_variable p2p_cv_[2];  // the send and the receive queues
  bool stop_ = false;
  std::string broken_;
  std::string aborted_by_;  // a peer's abort record, once the watcher saw it
  size_t running_ = 0;      // operations in execute(): the watcher parks only while any run
  bool watching_ = false;   // the watcher is parked on the store
  std::condition_variable watch_cv_;
  std::thread watcher_;
  dist::detail::AbortableWaits waits_;  // this group's waits on peers, for observe_abort
  std::deque<Job> queue_;
  std::deque<Job> p2p_queue_[2];
  std::vector<std::weak_ptr<Work>> issued_;  // collectives, for barrier
  // Collectives queued or running on the workers; 0: the group is idle (Note [inline
  // collectives]).
  size_t in_flight_ = 0;
  std::vector<std::thread> workers_;  // collectives
  std::thread p2p_[2];            // [1]: receives; [0] unused (sends have senders_)
  std::vector<std::thread> senders_;
  size_t idle_senders_ = 0;
  std::map<std::pair<int, int>, std::shared_future<void>> last_send_;  // by (peer, tag)
};

/// A collective's label and, when it goes through shared memory, its ticket (taken after the
/// label: a collective refused from a callback must not take one).
struct ProcessGroupGloo::ShmTicket {
  std::string label;
  dist::detail::ShmAllreduce* shm = nullptr;
  uint64_t ticket = 0;
  explicit operator bool() const { return shm != nullptr; }
};

}  // namespace ember::dist
