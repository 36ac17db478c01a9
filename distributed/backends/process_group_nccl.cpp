// ProcessGroupNccl over NCCL: the communicator's life (creation, split, destruction), the launch
// path every operation takes, CUDA-graph replays and the watchdog. The collectives are in
// process_group_nccl_collectives.cpp, the backend's registration in nccl_registration.cpp. Built
// only with CUDA and NCCL (distributed/CMakeLists.txt); no_nccl.cpp stands in otherwise.
#include <ember/distributed/backends/detail/process_group_nccl_impl.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include <ember/distributed/backends/net.h>
#include <ember/distributed/debug/collective_trace.h>
#include <ember/distributed/debug/debug.h>
#include <ember/distributed/environment.h>
#include <ember/distributed/flight_recorder.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/observe/log.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/gpu/trace_device.h>

namespace ember::dist {

bool nccl_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// How often the watchdog looks at the end events while work is pending: how late it notices a
// timeout or an asynchronous error. Works and Futures do not wait for it (see NcclWork).
constexpr auto kPollInterval = 200us;
// A blocking wait (barrier, or wait with an explicit timeout) polls the end event this often
// once past its first spins: cudaEventSynchronize has no timeout.
constexpr auto kHostPollInterval = 50us;
// A barrier's wait() blocks this much longer than the group's deadline, so that the watchdog's
// error (which says the communicator was aborted) reaches the caller rather than a bare timeout.
constexpr Duration kBlockingGrace = 2s;
// The destructor waits at most this long for queued work and for ncclCommFinalize.
constexpr Duration kDestroyLimit = 60s;
// Key of rank 0's ncclUniqueId in the group's (private) store.
constexpr const char* kUniqueIdKey = "nccl_unique_id";

/// NCCL's name for r, plus the communicator's last error message when there is one.
std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last) s += detail::str_cat(" (", last, ")");
  }
  return s;
}

/// A non-blocking communicator answers ncclInProgress while an operation is still being set up
/// (creation, group end, finalize); this polls until it settles or the deadline passes (then
/// ncclInProgress). Spins briefly, then backs off to 1 ms: creation may wait minutes for peers.
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, Clock::time_point deadline) {
  for (int spins = 0; r == ncclInProgress; ++spins) {
    if (Clock::now() >= deadline) return ncclInProgress;
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(1ms);
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  return r;
}

int choose_device(const ProcessGroupNccl::NcclOptions& o, int rank, int count) {
  if (o.device >= 0) {
    EMBER_CHECK(o.device < count, "[nccl] rank ", rank, ": device ", o.device,
                " does not exist (this process sees ", count, " CUDA devices)");
    return o.device;
  }
  EMBER_CHECK(o.device == -1, "[nccl] rank ", rank, ": device must be >= 0, or -1 to choose, got ",
              o.device);
  if (local_rank().has_value()) return local_cuda_device();
  // No launcher said which rank of the node this is: one process per GPU on one node.
  EMBER_CHECK(rank < count, "[nccl] rank ", rank, ": no local rank in the environment (LOCAL_RANK, "
              "OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID) and group rank ", rank,
              " is not below the ", count, " CUDA devices this process sees\n  Pass "
              "NcclOptions::device or launch with emberrun, mpirun or srun");
  return rank;
}

Duration init_timeout_of(const ProcessGroupNccl::NcclOptions& o) {
  if (o.init_timeout) return *o.init_timeout;
  return timeout_from_env("EMBER_NCCL_INIT_TIMEOUT")
      .value_or(std::min<Duration>(o.timeout, std::chrono::minutes(5)));
}

}  // namespace

namespace detail {

/// The group's first failure (a timeout, an NCCL error, destruction with work queued), shared
/// with its Works, which outlive the group: once recorded, every later collective and every
/// Work's wait() throws it (Note [NCCL stream-ordered work]).
class NcclFailure {
 public:
  /// Keeps the first failure only. `culprit`: the label of the collective that failed, whose
  /// Work reports `error` itself; every other Work reports the reason.
  void record(const std::string& reason, const std::string& culprit, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!reason_.empty()) return;
    reason_ = reason;
    culprit_ = culprit;
    error_ = std::move(error);
  }
  bool failed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !reason_.empty();
  }
  /// The error a wait() of the collective labelled `what` (or a new one) throws; null if none.
  std::exception_ptr error_for(const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (reason_.empty()) return nullptr;
    if (what == culprit_ && error_) return error_;
    return std::make_exception_ptr(DistBackendError(detail::str_cat(
        what, " failed: the group is unusable after an earlier failure: ", reason_)));
  }

 private:
  mutable std::mutex mu_;
  std::string reason_;
  std::string culprit_;
  std::exception_ptr error_;
};

}  // namespace detail

namespace {

using detail::NcclFailure;

// Note [NCCL stream-ordered work]: as c10d's CUDA futures, a collective's Future is completed
// as soon as the collective is queued, with its end event as the ready event: wait(), value()
// and then() order the caller's current stream after the collective instead of blocking the
// CPU, so DDP's backward, its buffer broadcast, SyncBatchNorm and PowerSGD never wait on the
// host for communication. The watchdog only polls end events for timeouts and asynchronous
// NCCL errors, aborts the communicator then, and records the failure (NcclFailure); errors
// reach the user at the next collective or Work::wait(), which throw it. Work::is_completed()
// is device completion (the end event has passed, c10d's isCompleted) or failure. Only
// barrier() and a wait() given an explicit timeout block the CPU (until device completion).

/// The Work of one NCCL operation (Note [NCCL stream-ordered work]). A collective captured in a
/// CUDA graph runs at each replay, not now: its end event is a node of the capture, which only
/// the capturing streams may wait on and nothing may query, so its Work answers from the group's
/// failure alone (Note [NCCL in a CUDA graph]).
class NcclWork : public Work {
 public:
  NcclWork(std::string what, Duration timeout, std::shared_ptr<cuda::Event> end, int device,
           std::shared_ptr<const NcclFailure> failure, bool blocking, bool captured)
      : Work(std::move(what), timeout),
        end_(std::move(end)),
        device_(device),
        failure_(std::move(failure)),
        blocking_(blocking),
        captured_(captured) {}

  /// Called once the operation and its end event are queued: completes the Future.
  void queued(std::vector<Tensor> outputs) { future_->set_value(std::move(outputs), {end_}); }

  bool wait(std::optional<Duration> timeout = {}) override {
    if (captured_) {
      EMBER_CHECK(!timeout, what_, " was captured in a CUDA graph: wait(timeout) would block the ",
                  "host on a collective that runs only when the graph is replayed; call wait() ",
                  "without a timeout");
      throw_if_failed();
      cuda::detail::DeviceGuard guard(device_);
      // Inside the capture, the join of the group's stream back into the caller's; after it,
      // replays order the collective themselves.
      if (cuda::is_current_stream_capturing()) end_->block(cuda::current_stream(device_));
      return true;
    }
    if (timeout) {
      block_host(*timeout, *timeout);
    } else if (blocking_) {
      block_host(timeout_ + kBlockingGrace, timeout_);
    }
    throw_if_failed();
    end_->block(cuda::current_stream(device_));
    return true;
  }

  bool is_completed() const override {
    if (captured_ || failure_->failed()) return true;  // captured: queued in its graph
    try {
      return end_->query();
    } catch (const std::exception&) {
      return true;  // failed on the device: exception() says how
    }
  }

  std::exception_ptr exception() const override {
    if (std::exception_ptr e = failure_->error_for(what_)) return e;
    if (captured_) return nullptr;
    try {
      (void)end_->query();
    } catch (const std::exception& e) {
      return std::make_exception_ptr(
          DistBackendError(detail::str_cat(what_, " failed on the device: ", e.what())));
    }
    return nullptr;
  }

 private:
  void throw_if_failed() const {
    if (std::exception_ptr e = exception()) std::rethrow_exception(e);
  }

  // Blocks the CPU until the operation has finished on the device or the group failed (then
  // throws), or `limit` passes: DistTimeoutError saying `shown`. The collective stays queued:
  // the watchdog aborts it at its own deadline.
  void block_host(Duration limit, Duration shown) const {
    const auto deadline = Clock::now() + limit;
    for (int spins = 0;; ++spins) {
      throw_if_failed();
      if (end_->query()) return;
      if (Clock::now() >= deadline) {
        throw DistTimeoutError(detail::str_cat(what_, " timed out after ", shown.count(),
                                               " ms (still running on the device)"));
      }
      if (spins < 100) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(kHostPollInterval);
      }
    }
  }

  std::shared_ptr<cuda::Event> end_;
  int device_;
  std::shared_ptr<const NcclFailure> failure_;
  bool blocking_;
  bool captured_;
};

}  // namespace

namespace detail {

/// What the watchdog tracks of a queued operation until its end event passes.
struct NcclPending {
  std::string what;
  Duration timeout;
  std::shared_ptr<cuda::Event> end;
  Clock::time_point deadline;
  std::vector<Tensor> keep;  // alive until the operation ends (outputs, inputs, packed buffers)
};

}  // namespace detail

// ---- Impl ---------------------------------------------------------------------------------------

ProcessGroupNccl::Impl::Impl(int rank, int size, std::shared_ptr<Store> store, const NcclOptions& o)
    : rank_(rank),
      size_(size),
      timeout_(o.timeout),
      failure_(std::make_shared<detail::NcclFailure>()),
      trace_row_(trace::unique_row()) {
  EMBER_CHECK(store != nullptr, "[nccl] rank ", rank,
              ": needs a store to exchange the "
              "ncclUniqueId, got null");
  const int count = cuda::device_count();
  if (count == 0) {
    throw NotImplementedError(detail::str_cat("[nccl] rank ", rank, " of ", size,
                                              ": no CUDA device: ", cuda::unavailable_reason()));
  }
  device_ = choose_device(o, rank, count);
  // As torch.cuda.set_device in a training script: the tensors this rank makes without naming
  // a device land on the group's GPU, and no context is created on any other.
  cuda::set_device(device_);
  stream_ = cuda::Stream::create(device_);
  const Duration init_timeout = init_timeout_of(o);
  if (debug_level() != DebugLevel::Off) {
    int version = 0;
    ncclGetVersion(&version);
    logging::info("[nccl] rank ", rank, " of ", size, ": NCCL ", version / 10000, ".",
                  version / 100 % 100, ".", version % 100, " on ", cuda_device(device_).str(), ", ",
                  net::nccl_network_summary());
  }

  ncclUniqueId id;
  if (rank == 0) {
    check_init(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    const auto* b = reinterpret_cast<const uint8_t*>(&id);
    store->set(kUniqueIdKey, Bytes(b, b + sizeof(id)));
  } else {
    Bytes b;
    try {
      b = store->get(kUniqueIdKey, init_timeout);
    } catch (const DistTimeoutError& e) {
      throw DistTimeoutError(detail::str_cat("[nccl] rank ", rank, " of ", size,
                                             ": rank 0 did not publish its ncclUniqueId within ",
                                             init_timeout.count(), " ms: ", e.what()));
    }
    if (b.size() != sizeof(id)) {
      throw DistBackendError(detail::str_cat("[nccl] rank ", rank, " of ", size, ": the store's '",
                                             kUniqueIdKey, "' holds ", b.size(),
                                             " bytes, expected an ncclUniqueId of ", sizeof(id)));
    }
    std::memcpy(&id, b.data(), sizeof(id));
  }

  // Non-blocking, so that creation (which waits for every rank) is bounded by the timeout.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  comm = settled_or_throw(comm, r, init_timeout, "creating the communicator");
  start(comm);
}

ProcessGroupNccl::Impl::Impl(int rank, int size, Impl& parent, int color, int key,
                             const NcclOptions& o)
    : rank_(rank),
      size_(size),
      timeout_(o.timeout),
      failure_(std::make_shared<detail::NcclFailure>()),
      trace_row_(trace::unique_row()) {
  device_ = parent.device_;
  cuda::set_device(device_);
  stream_ = cuda::Stream::create(device_);
  ncclComm_t comm = parent.split(color, key, init_timeout_of(o));
  start(comm);
}

ncclComm_t ProcessGroupNccl::Impl::split(int color, int key, Duration init_timeout) {
  std::lock_guard<std::mutex> cl(comm_mu_);
  EMBER_CHECK(comm_ != nullptr, "[nccl] rank ", rank_, " of ", size_,
              ": cannot split a communicator that was aborted");
  cuda::detail::DeviceGuard guard(device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommSplit(comm_, color, key, &comm, &config);
  if (comm == nullptr) {  // not a member: the split still had to settle on the parent
    settled_or_throw(comm_, r, init_timeout, "splitting the communicator");
    return nullptr;
  }
  return settled_or_throw(comm, r, init_timeout, "splitting the communicator");
}

ProcessGroupNccl::Impl::~Impl() {
  // The watchdog runs no user code and holds no reference to the group (Future callbacks run
  // on the threads that issue collectives), so this never runs on it.
  const auto limit = Clock::now() + std::min<Duration>(timeout_, kDestroyLimit);
  std::deque<std::shared_ptr<Pending>> left;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, limit, [&] { return pending_.empty(); });
    stop_ = true;
    left.swap(pending_);
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (!left.empty()) {
    failure_->record(detail::str_cat("[nccl] rank ", rank_, " of ", size_,
                                     ": the process group was destroyed while ", left.front()->what,
                                     " was still running (the communicator was aborted)"),
                     "", nullptr);
  }
  {
    std::lock_guard<std::mutex> cl(comm_mu_);
    if (comm_ != nullptr) {
      std::optional<cuda::detail::DeviceGuard> guard;
      try {
        guard.emplace(device_);
      } catch (...) {  // the device is gone: still release NCCL's resources
      }
      if (left.empty() && settle(comm_, ncclCommFinalize(comm_), limit) == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);  // work still running, or a peer no longer answers
      }
      comm_ = nullptr;
    }
  }
  // Dropped only now: the operations still queued were aborted with the communicator.
  left.clear();
}

// Note [NCCL in a CUDA graph]: a collective captured in a CUDA graph runs at each replay, not
// when it was issued, so the watchdog has nothing to poll at capture time. Instead the capture
// gains two host hooks: before each launch, the group's failure (or its destruction) is
// thrown rather than replaying collectives on an aborted communicator; after each launch, an
// event recorded on the replay's stream joins the pending operations with the collective's
// timeout, so a peer that never replays its graph aborts the communicator as an eager
// collective would. The hooks keep the collective's tensors alive for the graph's life.
void ProcessGroupNccl::Impl::watch_replays(const std::string& what, Duration timeout,
                                           std::vector<Tensor> keep) {
  std::weak_ptr<Impl*> alive = alive_;
  const bool held = cuda::on_each_replay([alive, failure = failure_, what] {
    if (std::exception_ptr e = failure->error_for(what)) std::rethrow_exception(e);
    if (alive.expired()) {
      throw DistError(detail::str_cat(what, " was captured in this CUDA graph, but its ",
                                      "process group has been destroyed: reset the graph "
                                      "first"));
    }
  });
  EMBER_CHECK(held, what,
              " is being captured in a CUDA graph that Ember did not begin: "
              "capture with cuda::CUDAGraph or cuda::graph, which replay it under the "
              "group's watchdog");
  auto buffers = std::make_shared<const std::vector<Tensor>>(std::move(keep));
  cuda::after_each_replay([alive, what, timeout, buffers](const cuda::Stream& s) {
    if (std::shared_ptr<Impl*> self = alive.lock()) {
      (*self)->watch_replay(what, timeout, s, *buffers);
    }
  });
}

void ProcessGroupNccl::Impl::watch_replay(const std::string& what, Duration timeout,
                                          const cuda::Stream& replayed,
                                          const std::vector<Tensor>& keep) {
  auto end = std::make_shared<cuda::Event>();
  end->record(replayed);
  auto p = std::make_shared<Pending>(
      Pending{what + " (replayed in a CUDA graph)", timeout, end, Clock::now() + timeout, keep});
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    pending_.push_back(std::move(p));
  }
  cv_.notify_all();
}

WorkPtr ProcessGroupNccl::Impl::launch(const std::string& what, Duration timeout,
                                       std::vector<Tensor> outputs, std::vector<Tensor> keep,
                                       const Enqueue& enqueue, bool blocking) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    EMBER_CHECK(!stop_, what, ": the process group is being destroyed");
  }
  if (std::exception_ptr e = failure_->error_for(what)) std::rethrow_exception(e);
  cuda::detail::DeviceGuard guard(device_);
  // Note [NCCL in a CUDA graph]
  const bool captured = cuda::is_current_stream_capturing();
  auto end = std::make_shared<cuda::Event>();
  auto work = std::make_shared<NcclWork>(what, timeout, end, device_, failure_, blocking, captured);
  if (captured && blocking) {
    throw ValueError(detail::str_cat(
        what, " cannot be captured in a CUDA graph: its wait() blocks the host until the ",
        "device is done; issue it outside the capture"));
  }
  const int64_t launched_us = tracing::stamp();
  {
    cuda::Event start;
    start.record(cuda::current_stream(device_));
    start.block(stream_);
  }
  // After the wait for the caller's stream: the span is the collective's own device time.
  // None in a capture: a span's events are read back later, which a capture forbids.
  std::optional<trace::DeviceSpan> device_span;
  if (!captured) device_span.emplace(stream_);
  {
    std::unique_lock<std::mutex> cl(comm_mu_);
    if (comm_ == nullptr) {  // aborted since the check above
      cl.unlock();
      std::rethrow_exception(failure_->error_for(what));
    }
    const ncclResult_t r =
        settle(comm_, enqueue(comm_, cuda::detail::raw(stream_.handle())), Clock::now() + timeout);
    if (r != ncclSuccess) {
      const std::string reason =
          r == ncclInProgress
              ? detail::str_cat(what, " timed out after ", timeout.count(),
                                " ms while NCCL set it up; the communicator was aborted")
              : detail::str_cat(what, " (timeout ", timeout.count(),
                                " ms) failed: ", nccl_error(r, comm_),
                                "; the communicator was aborted");
      cl.unlock();
      std::exception_ptr e = r == ncclInProgress
                                 ? std::make_exception_ptr(DistTimeoutError(reason))
                                 : std::make_exception_ptr(DistBackendError(reason));
      abort_all(reason, what, e);
      std::rethrow_exception(e);
    }
  }
  // Its end event before `end`: once the watchdog sees `end` pass, the span can be resolved.
  if (device_span && device_span->active()) {
    trace_span(*device_span, what, outputs, launched_us);
  }
  end->record(stream_);
  // Before the Work is returned: once the caller has it, it may drop the tensors at once.
  for (const Tensor& t : outputs) cuda::record_stream(t, stream_);
  for (const Tensor& t : keep) cuda::record_stream(t, stream_);
  keep.insert(keep.end(), outputs.begin(), outputs.end());
  if (captured) {
    watch_replays(what, timeout, std::move(keep));
    work->queued(std::move(outputs));
    return work;
  }
  auto p = std::make_shared<Pending>(
      Pending{what, timeout, end, Clock::now() + timeout, std::move(keep)});
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
  }
  cv_.notify_all();
  work->queued(std::move(outputs));
  return work;
}

// The collective's span on the timeline, as gloo's and MPI's but measured on the group's
// stream (its own row): from the device starting it until it finished, queued_us the time
// from its launch on the host until the device started it.
void ProcessGroupNccl::Impl::trace_span(trace::DeviceSpan& span, const std::string& what,
                                        const std::vector<Tensor>& outputs, int64_t launched_us) {
  trace::CollectiveFields f = trace::collective_fields(what, tracing::result_bytes(outputs));
  span.finish(stream_, trace::DeviceSpanInfo{std::move(f.name), "collective", std::move(f.args),
                                             trace_row_, trace_row_name_, launched_us});
}

void ProcessGroupNccl::Impl::check_init(ncclResult_t r, ncclComm_t comm, const char* call) const {
  if (r != ncclSuccess) {
    throw DistBackendError(detail::str_cat("[nccl] rank ", rank_, " of ", size_, ": ", call,
                                           " failed: ", nccl_error(r, comm)));
  }
}

// Aborts the communicator (wakes kernels stuck waiting for peers), records the failure, which
// every later call and Work::wait() throws (the operation labelled `culprit` reports `error`),
// and forgets the pending operations: the abort stopped them.
void ProcessGroupNccl::Impl::abort_all(const std::string& reason, const std::string& culprit,
                                       std::exception_ptr error) {
  // The watchdog's timeouts reach no wait(): dump the recent collectives here as well, before
  // the abort, while each one's end event still says whether the device finished it (an
  // aborted collective's kernel returns, and its event may then pass as if it had).
  dist::detail::flight_recorder_on_failure(reason);
  {
    std::lock_guard<std::mutex> cl(comm_mu_);
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }
  failure_->record(reason, culprit, std::move(error));
  std::deque<std::shared_ptr<Pending>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed.swap(pending_);
  }
  cv_.notify_all();
}

// The watchdog: forgets operations whose end event has passed, and aborts on a timeout or an
// asynchronous NCCL error. It runs no user code (Note [NCCL stream-ordered work]). CUDA and
// NCCL are queried without holding mu_.
void ProcessGroupNccl::Impl::watch() {
  try {
    cuda::set_device(device_);
  } catch (...) {
  }
  // Event queries are among the calls a global-mode capture forbids on every thread but a
  // relaxed one: the polls here must not invalidate a graph another thread is capturing.
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&relaxed);
  for (;;) {
    std::vector<std::shared_ptr<Pending>> snapshot;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (pending_.empty()) cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_) return;
      cv_.wait_for(lock, kPollInterval, [&] { return stop_; });
      if (stop_) return;
      snapshot.assign(pending_.begin(), pending_.end());
    }
    if (snapshot.empty()) continue;
    if (check_async_error()) continue;
    std::vector<std::shared_ptr<Pending>> done;
    const auto now = Clock::now();
    for (auto& p : snapshot) {
      bool finished = false;
      try {
        finished = p->end->query();
      } catch (const std::exception& e) {
        const std::string reason = detail::str_cat(p->what, " failed on the device: ", e.what(),
                                                   "; the communicator was aborted");
        abort_all(reason, p->what, std::make_exception_ptr(DistBackendError(reason)));
        done.clear();
        break;
      }
      if (finished) {
        done.push_back(p);
      } else if (now >= p->deadline) {
        const std::string reason = detail::str_cat(p->what, " timed out after ", p->timeout.count(),
                                                   " ms; the communicator was aborted");
        abort_all(reason, p->what, std::make_exception_ptr(DistTimeoutError(reason)));
        done.clear();
        break;
      }
    }
    retire(done);
    // Off the collectives' path: the spans of what just finished reach the timeline.
    if (trace::enabled()) trace::resolve_device_spans();
  }
}

// An asynchronous error (a peer failed, a network error) dooms every pending operation: aborts
// and returns true.
bool ProcessGroupNccl::Impl::check_async_error() {
  std::unique_lock<std::mutex> cl(comm_mu_, std::try_to_lock);
  if (!cl.owns_lock() || comm_ == nullptr) return false;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
  const ncclResult_t async = q != ncclSuccess ? q : state;
  if (async == ncclSuccess || async == ncclInProgress) return false;
  const std::string reason =
      detail::str_cat("[nccl] rank ", rank_, " of ", size_,
                      ": NCCL reported an asynchronous error: ", nccl_error(async, comm_));
  cl.unlock();
  abort_all(reason);
  return true;
}

// Forgets operations that have finished on the device (their tensors may be freed now).
void ProcessGroupNccl::Impl::retire(const std::vector<std::shared_ptr<Pending>>& done) {
  if (done.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : done) {
      auto it = std::find(pending_.begin(), pending_.end(), p);
      if (it != pending_.end()) pending_.erase(it);
    }
  }
  cv_.notify_all();
}

// Waits for a non-blocking NCCL call on `comm` (creation, split) to settle; throws
// DistTimeoutError or DistBackendError naming `doing`, after aborting the communicator.
ncclComm_t ProcessGroupNccl::Impl::settled_or_throw(ncclComm_t comm, ncclResult_t r,
                                                    Duration init_timeout, const char* doing) {
  if (comm != nullptr) r = settle(comm, r, Clock::now() + init_timeout);
  if (r == ncclInProgress) {
    ncclCommAbort(comm);
    throw DistTimeoutError(detail::str_cat(
        "[nccl] rank ", rank_, " of ", size_, ": ", doing, " on ", cuda_device(device_),
        " did not complete within ", init_timeout.count(),
        " ms (EMBER_NCCL_INIT_TIMEOUT)\n  Did every rank create the group, and can they reach "
        "each other? ",
        net::nccl_network_summary()));
  }
  if (r != ncclSuccess) {
    const std::string msg = nccl_error(r, comm);
    if (comm != nullptr) ncclCommAbort(comm);
    throw DistBackendError(detail::str_cat("[nccl] rank ", rank_, " of ", size_, ": ", doing,
                                           " on ", cuda_device(device_), " failed: ", msg, "; ",
                                           net::nccl_network_summary()));
  }
  return comm;
}

void ProcessGroupNccl::Impl::start(ncclComm_t comm) {
  comm_ = comm;
  trace_row_name_ = detail::str_cat("nccl stream, ", cuda_device(device_).str(), " (rank ", rank_,
                                    " of ", size_, ")");
  watchdog_ = std::thread([this] { watch(); });
}

// ---- ProcessGroupNccl -------------------------------------------------------------------------

ProcessGroupNccl::ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size,
                                   NcclOptions options)
    : ProcessGroup(rank, size, Options{options.timeout}),
      impl_(std::make_unique<Impl>(rank, size, std::move(store), options)) {}

ProcessGroupNccl::ProcessGroupNccl(int rank, int size, std::unique_ptr<Impl> impl,
                                   const NcclOptions& options)
    : ProcessGroup(rank, size, Options{options.timeout}), impl_(std::move(impl)) {}

std::shared_ptr<ProcessGroupNccl> ProcessGroupNccl::split(const std::vector<int>& ranks,
                                                          NcclOptions options) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  EMBER_CHECK(!sorted.empty() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                  sorted.front() >= 0 && sorted.back() < size_,
              "[nccl] split: expected distinct ranks of this group of size ", size_);
  const auto me = std::find(sorted.begin(), sorted.end(), rank_);
  if (me == sorted.end()) {
    impl_->split(NCCL_SPLIT_NOCOLOR, rank_, init_timeout_of(options));
    return nullptr;
  }
  // Every member passes the same color (the group's smallest rank), ordered by its rank here.
  const int new_rank = static_cast<int>(me - sorted.begin());
  auto impl = std::make_unique<Impl>(new_rank, static_cast<int>(sorted.size()), *impl_,
                                     sorted.front(), rank_, options);
  return std::shared_ptr<ProcessGroupNccl>(
      new ProcessGroupNccl(new_rank, static_cast<int>(sorted.size()), std::move(impl), options));
}

ProcessGroupNccl::~ProcessGroupNccl() = default;

int ProcessGroupNccl::device() const { return impl_->device(); }
cuda::Stream ProcessGroupNccl::stream() const { return impl_->stream(); }

}  // namespace ember::dist
