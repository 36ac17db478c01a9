// Future and Work: completion, callbacks and timeouts shared by every backend; the names of
// ReduceOp and OpType.
#include <algorithm>
#include <cstdio>

#include <ember/distributed/process_group.h>

#include <ember/distributed/detail/flight_ring.h>
#include <ember/distributed/flight_recorder.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

const char* to_string(OpType op) {
  switch (op) {
    case OpType::Allreduce: return "allreduce";
    case OpType::AllreduceCoalesced: return "allreduce_coalesced";
    case OpType::Broadcast: return "broadcast";
    case OpType::Reduce: return "reduce";
    case OpType::Allgather: return "allgather";
    case OpType::AllgatherIntoTensor: return "allgather_into_tensor";
    case OpType::Gather: return "gather";
    case OpType::Scatter: return "scatter";
    case OpType::ReduceScatter: return "reduce_scatter";
    case OpType::ReduceScatterTensor: return "reduce_scatter_tensor";
    case OpType::Alltoall: return "alltoall";
    case OpType::Barrier: return "barrier";
    case OpType::Send: return "send";
    case OpType::Recv: return "recv";
  }
  return "?";
}

// ---- Future -----------------------------------------------------------------------------------

bool Future::completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

namespace {
using Events = std::vector<std::shared_ptr<cuda::Event>>;

// How many Future callbacks are running on this thread (a callback may complete another future
// and so run its callbacks inside). ProcessGroup::next_op_label refuses collectives while it is
// not zero (see process_group.h, "Threads").
thread_local int tl_callback_depth = 0;

struct InCallback {
  InCallback() { ++tl_callback_depth; }
  ~InCallback() { --tl_callback_depth; }
  InCallback(const InCallback&) = delete;
  InCallback& operator=(const InCallback&) = delete;
};

void block_current_streams(const Events& ready) {
  for (const auto& e : ready) e->block(cuda::current_stream(e->device()));
}

/// Events recorded on the current streams of the devices of `after`: what a callback queued
/// there, ordered after `after`, is done when they pass.
Events record_current_streams(const Events& after) {
  Events out;
  std::vector<int> seen;
  for (const auto& e : after) {
    if (std::find(seen.begin(), seen.end(), e->device()) != seen.end()) continue;
    seen.push_back(e->device());
    auto next = std::make_shared<cuda::Event>();
    next->record(cuda::current_stream(e->device()));
    out.push_back(std::move(next));
  }
  return out;
}
}  // namespace

void Future::wait(std::optional<Duration> timeout) {
  wait_host(timeout);
  const Events ready = ready_events();
  if (ready.empty()) return;
  block_current_streams(ready);
  // The value was made on other streams (a collective's, a callback's); from here the waiting
  // thread's streams use it, so its memory is not reused until they are done with it, as
  // PyTorch's Future.wait records the value's storages on the current streams.
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Tensor& t : value_) {
    if (t.defined() && t.is_cuda()) cuda::record_stream(t, cuda::current_stream(t.device().index));
  }
}

void Future::wait_host(std::optional<Duration> timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout) {
    if (!cv_.wait_for(lock, *timeout, [&] { return completed_; })) {
      const std::string why = detail::str_cat(what_.empty() ? "[future]" : what_,
                                              " timed out after ", timeout->count(), " ms");
      lock.unlock();
      detail::flight_recorder_on_failure(why);
      throw DistTimeoutError(why);
    }
  } else {
    cv_.wait(lock, [&] { return completed_; });
  }
  if (error_) {
    // Every wait on a failed collective passes here, whatever the backend: the moment to keep
    // the ranks' recent collectives (flight_recorder.h).
    const std::exception_ptr error = error_;
    const std::string why = what_.empty() ? "[future] failed" : what_ + " failed";
    lock.unlock();
    detail::flight_recorder_on_failure(why);
    std::rethrow_exception(error);
  }
}

const std::vector<Tensor>& Future::value() {
  wait();
  return value_;
}

Events Future::ready_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ready_;
}

std::exception_ptr Future::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Future::set_description(std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  what_ = std::move(what);
}

void Future::complete(std::unique_lock<std::mutex>& lock) {
  EMBER_INTERNAL_ASSERT(!completed_, "Future completed twice: ", what_);
  completed_ = true;
  std::vector<std::function<void(Future&)>> callbacks = std::move(callbacks_);
  callbacks_.clear();
  lock.unlock();
  cv_.notify_all();
  for (auto& cb : callbacks) cb(*this);
}

void Future::set_value(std::vector<Tensor> value, Events ready) {
  std::unique_lock<std::mutex> lock(mutex_);
  value_ = std::move(value);
  ready_ = std::move(ready);
  complete(lock);
}

void Future::set_exception(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mutex_);
  error_ = std::move(error);
  complete(lock);
}

void Future::add_done_callback(std::function<void(Future&)> callback) {
  auto safe = [cb = std::move(callback)](Future& f) {
    InCallback in_callback;
    try {
      cb(f);
    } catch (const std::exception& e) {
      logging::error("exception in a Future callback was ignored: ", e.what());
    }
  };
  std::unique_lock<std::mutex> lock(mutex_);
  if (!completed_) {
    callbacks_.push_back(std::move(safe));
    return;
  }
  lock.unlock();
  safe(*this);
}

std::shared_ptr<Future> Future::then(std::function<std::vector<Tensor>(Future&)> callback) {
  auto next = std::make_shared<Future>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    next->what_ = what_;
  }
  add_done_callback([next, cb = std::move(callback)](Future& f) {
    try {
      const Events ready = f.ready_events();
      block_current_streams(ready);
      std::vector<Tensor> out = cb(f);
      next->set_value(std::move(out), record_current_streams(ready));
    } catch (...) {
      next->set_exception(std::current_exception());
    }
  });
  return next;
}

// ---- Work -------------------------------------------------------------------------------------

Work::Work(std::string what, Duration timeout) : what_(std::move(what)), timeout_(timeout) {
  future_->set_description(what_);
}

bool Work::wait(std::optional<Duration> timeout) {
  future_->wait(timeout.value_or(timeout_));
  return true;
}

// ---- ProcessGroup -----------------------------------------------------------------------------

ProcessGroup::ProcessGroup(int rank, int size, Options options)
    : rank_(rank), size_(size), options_(options) {
  EMBER_CHECK(size >= 1 && rank >= 0 && rank < size, "[ProcessGroup] expected 0 <= rank < size, "
              "got rank ", rank, " and size ", size);
  for (int r = 0; r < size; ++r) global_ranks_.push_back(r);
  if (const int n = flight_recorder_size(); n > 0) {
    flight_ = std::make_shared<detail::FlightRing>(static_cast<size_t>(n));
  }
}

WorkPtr ProcessGroup::record_flight(WorkPtr work, const std::vector<Tensor>& tensors) {
  if (flight_ && work) flight_->attach(flight_entry_, work, tensors);
  return work;
}

// Every operation of a group passes here: it refuses what a Future callback or a CUDA graph
// capture issues, and records the operation in the flight recorder.
void ProcessGroup::check_issue(const char* op, uint64_t seq, bool p2p) {
  EMBER_CHECK(
      tl_callback_depth == 0, "[", backend_name(), "] ", op, " on rank ", rank_, " of ", size_,
      ": collectives cannot be issued from a Future callback (then() or "
      "add_done_callback())\n  A callback runs on whichever thread completes the future, at "
      "a moment that differs between ranks, so the ranks could issue collectives in "
      "different orders. Issue it from the thread that issues the group's collectives; in "
      "a communication hook, chain it with GradBucket::defer");
  EMBER_CHECK(supports_graph_capture() || !cuda::thread_is_capturing(), "[", backend_name(), "] ",
              op, " on rank ", rank_, " of ", size_,
              ": cannot be captured in a CUDA graph: ", backend_name(),
              "'s collectives meet or stage on the host, which a replay would skip. Capture "
              "collectives with the nccl backend, or issue this one outside the capture");
  if (flight_) flight_entry_ = flight_->enqueue(*this, op, seq, p2p);
}

std::string ProcessGroup::next_op_label(const char* collective) {
  check_issue(collective, seq_, /*p2p=*/false);
  return detail::str_cat("[", backend_name(), "] ", collective, " #", seq_++, " on rank ", rank_,
                         " of ", size_);
}

std::string ProcessGroup::next_p2p_label(const char* op) {
  check_issue(op, p2p_seq_, /*p2p=*/true);
  return detail::str_cat("[", backend_name(), "] ", op, " #", p2p_seq_++, " on rank ", rank_,
                         " of ", size_);
}

void ProcessGroup::check_root(const char* op, int root) const {
  EMBER_CHECK(root >= 0 && root < size_, "[", backend_name(), "] ", op, ": root ", root,
              " is not a rank of this group of size ", size_);
}

void ProcessGroup::check_only_root_passes(const char* op, int root, size_t count,
                                          const char* what) const {
  EMBER_CHECK(rank_ == root || count == 0, "[", backend_name(), "] ", op, ": only the root (rank ",
              root, ") passes ", what, " tensors; rank ", rank_, " got ", count);
}

}  // namespace ember::dist
