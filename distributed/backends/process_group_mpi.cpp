// ProcessGroupMpi: one worker thread per group runs its MPI calls in issue order.
//
// Note [MPI threading]: MPI is initialised asking for MPI_THREAD_MULTIPLE. With it, each
// group's worker (and group creation on the caller's thread) calls MPI freely. If the library
// only offers MPI_THREAD_SERIALIZED, one process-wide mutex serialises the calls. A plain
// mutex (c10d's choice) can deadlock across ranks: rank 0's worker for group A may take it
// first and block in a collective that needs rank 1, while rank 1's worker for group B took it
// first and waits for rank 0. So every blocking piece of work (a task, a group creation or
// its communicator's release) takes a ticket when it is issued and gets the mutex in ticket
// order: the process then calls MPI in the order the program issued the work, as a
// single-threaded MPI program would. Only MPI_Test on outstanding sends/receives takes the
// mutex out of turn (it never blocks).
//
// Note [MPI exit]: a worker stuck in an MPI call cannot be joined or interrupted. The group's
// destructor detaches it (the worker owns a reference to the group's state, so nothing
// dangles), and the atexit handler calls MPI_Abort instead of MPI_Finalize while any worker is
// still inside MPI, so the process (and the job) ends with an error rather than hanging.
#include <ember/distributed/backends/process_group_mpi.h>

// Only MPI's C API: without these, mpi.h pulls in the deprecated C++ bindings (libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <optional>
#include <thread>

#include <ember/distributed/debug/collective_trace.h>
#include <ember/tensor/observe/log.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

using Clock = std::chrono::steady_clock;

// How often a worker with outstanding sends/receives and nothing queued tests them.
constexpr auto kPollInterval = std::chrono::microseconds(200);

struct MpiGlobal {
  std::once_flag once;
  bool thread_multiple = false;
  std::mutex call_mutex;  // held around every MPI call without MPI_THREAD_MULTIPLE
  // Serialized mode: the order in which work gets call_mutex (Note [MPI threading]).
  std::mutex order_mu;
  std::condition_variable order_cv;
  uint64_t next_ticket = 0;  // handed out next
  uint64_t serving = 0;      // may call MPI now
  // Workers inside an MPI call or with outstanding requests (stuck ones stay counted).
  std::atomic<int> busy{0};
  MPI_Datatype half_type = MPI_DATATYPE_NULL;
  MPI_Datatype bf16_type = MPI_DATATYPE_NULL;
  MPI_Op ops16[2][4] = {};  // [float16, bfloat16][sum, product, min, max]
  int tag_ub = 32767;       // the largest tag (MPI guarantees at least 32767)
};

// Leaked on purpose: the atexit handler and detached workers use it after static destruction.
MpiGlobal& global() {
  static MpiGlobal* g = new MpiGlobal;
  return *g;
}

// True on a thread that holds its turn (and so the MPI mutex).
thread_local bool t_holds_turn = false;

/// Holds the process-wide MPI mutex when MPI is not thread-multiple, unless this thread
/// already holds it through an MpiTurn (Note [MPI threading]).
class MpiLock {
 public:
  MpiLock() {
    if (!global().thread_multiple && !t_holds_turn) {
      lock_ = std::unique_lock<std::mutex>(global().call_mutex);
    }
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

/// Serialized mode: a place in the order of blocking MPI work; nullopt when thread-multiple.
std::optional<uint64_t> take_ticket() {
  MpiGlobal& g = global();
  if (g.thread_multiple) return std::nullopt;
  std::lock_guard<std::mutex> lock(g.order_mu);
  return g.next_ticket++;
}

/// Waits for `ticket`'s turn, then holds the MPI mutex until destroyed (no-op for nullopt).
class MpiTurn {
 public:
  explicit MpiTurn(std::optional<uint64_t> ticket) : ticket_(ticket) {
    if (!ticket_) return;
    MpiGlobal& g = global();
    {
      std::unique_lock<std::mutex> lock(g.order_mu);
      g.order_cv.wait(lock, [&] { return g.serving == *ticket_; });
    }
    lock_ = std::unique_lock<std::mutex>(g.call_mutex);
    t_holds_turn = true;
  }
  ~MpiTurn() {
    if (!ticket_) return;
    MpiGlobal& g = global();
    t_holds_turn = false;
    lock_.unlock();
    {
      std::lock_guard<std::mutex> lock(g.order_mu);
      ++g.serving;
    }
    g.order_cv.notify_all();
  }
  MpiTurn(const MpiTurn&) = delete;
  MpiTurn& operator=(const MpiTurn&) = delete;

 private:
  std::optional<uint64_t> ticket_;
  std::unique_lock<std::mutex> lock_;
};

void check_mpi(int rc, const std::string& what, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw DistBackendError(detail::str_cat(what, ": ", call, " failed: ", std::string(text, len)));
}

// ---- float16 / bfloat16 reductions: MPI has none, so user ops compute in float ------------

template <typename T, typename F>
void apply16(void* in, void* inout, const int* len, F f) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
template <typename T>
void sum16(void* in, void* io, int* len, MPI_Datatype*) {
  apply16<T>(in, io, len, [](float x, float y) { return x + y; });
}
template <typename T>
void prod16(void* in, void* io, int* len, MPI_Datatype*) {
  apply16<T>(in, io, len, [](float x, float y) { return x * y; });
}
template <typename T>
void min16(void* in, void* io, int* len, MPI_Datatype*) {
  apply16<T>(in, io, len, [](float x, float y) { return y < x ? y : x; });
}
template <typename T>
void max16(void* in, void* io, int* len, MPI_Datatype*) {
  apply16<T>(in, io, len, [](float x, float y) { return y > x ? y : x; });
}

void mpi_exit() {
  MpiGlobal& g = global();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g.busy.load() > 0) {
    logging::error("[mpi] ", g.busy.load(),
               " process group worker(s) still inside MPI at exit (a collective or send/recv "
               "never completed); calling MPI_Abort instead of MPI_Finalize");
    MPI_Abort(MPI_COMM_WORLD, 1);
    return;
  }
  MpiTurn turn(take_ticket());
  MPI_Finalize();
}

void init_mpi() {
  MpiGlobal& g = global();
  std::call_once(g.once, [&] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      // EMBER_MPI_THREAD_LEVEL=serialized asks for less, to exercise the locked path.
      const char* level = std::getenv("EMBER_MPI_THREAD_LEVEL");
      const bool serialized = level && std::string(level) == "serialized";
      check_mpi(
          MPI_Init_thread(nullptr, nullptr,
                          serialized ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE, &provided),
          "[mpi] init", "MPI_Init_thread");
      std::atexit(mpi_exit);  // only finalise what Ember initialised
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      throw DistBackendError(detail::str_cat(
          "[mpi] init: the MPI library offers thread level ", provided,
          ", expected at least MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED, ")"));
    }
    g.thread_multiple = provided >= MPI_THREAD_MULTIPLE;
    MpiLock lock;
    check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "[mpi] init",
              "MPI_Comm_set_errhandler");
    for (MPI_Datatype* t : {&g.half_type, &g.bf16_type}) {
      check_mpi(MPI_Type_contiguous(2, MPI_BYTE, t), "[mpi] init", "MPI_Type_contiguous");
      check_mpi(MPI_Type_commit(t), "[mpi] init", "MPI_Type_commit");
    }
    int* tag_ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag);
    if (flag && tag_ub) g.tag_ub = *tag_ub;
    MPI_User_function* fns[2][4] = {
        {sum16<Half>, prod16<Half>, min16<Half>, max16<Half>},
        {sum16<BFloat16>, prod16<BFloat16>, min16<BFloat16>, max16<BFloat16>}};
    for (int t = 0; t < 2; ++t) {
      for (int o = 0; o < 4; ++o) {
        check_mpi(MPI_Op_create(fns[t][o], /*commute=*/1, &g.ops16[t][o]), "[mpi] init",
                  "MPI_Op_create");
      }
    }
  });
}

MPI_Datatype mpi_type(Dtype d) {
  switch (d) {
    case Dtype::Float32:
      return MPI_FLOAT;
    case Dtype::Float64:
      return MPI_DOUBLE;
    case Dtype::Int32:
      return MPI_INT32_T;
    case Dtype::Int64:
      return MPI_INT64_T;
    case Dtype::UInt8:
      return MPI_UINT8_T;
    case Dtype::Bool:
      return MPI_BYTE;  // moved, never reduced
    case Dtype::Float16:
      return global().half_type;
    case Dtype::BFloat16:
      return global().bf16_type;
  }
  EMBER_INTERNAL_ASSERT(false, "[mpi] unknown dtype");
}

MPI_Op mpi_op(ReduceOp op, Dtype d) {
  int index = 0;  // sum (and avg, divided afterwards), product, min, max
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      index = 0;
      break;
    case ReduceOp::Product:
      index = 1;
      break;
    case ReduceOp::Min:
      index = 2;
      break;
    case ReduceOp::Max:
      index = 3;
      break;
  }
  if (d == Dtype::Float16 || d == Dtype::BFloat16) {
    return global().ops16[d == Dtype::Float16 ? 0 : 1][index];
  }
  const MPI_Op native[4] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  return native[index];
}

// ---- argument checks (caller's thread, before a sequence number is taken) --------------------

void check_tensor(const char* op, const Tensor& t, const char* what) {
  EMBER_CHECK(t.defined(), "[mpi] ", op, ": ", what, " is an undefined tensor");
  EMBER_CHECK_TYPE(TypeError, t.is_cpu(), "[mpi] ", op, ": expected a CPU tensor for ", what,
                   ", got one on ", t.device());
  EMBER_CHECK(t.numel() <= INT_MAX, "[mpi] ", op, ": ", what, " has ", t.numel(),
              " elements; MPI counts are int, at most ", INT_MAX);
}

void check_reducible(const char* op, const Tensor& t, ReduceOp r) {
  EMBER_CHECK_TYPE(TypeError, t.dtype() != Dtype::Bool, "[mpi] ", op, " ", to_string(r),
                   ": bool tensors cannot be reduced");
  EMBER_CHECK_TYPE(TypeError, r != ReduceOp::Avg || is_floating(t.dtype()), "[mpi] ", op,
                   " avg needs a floating dtype, got ", t.dtype());
}

void check_like(const char* op, const std::vector<Tensor>& list, int n, const Tensor& like,
                const char* what) {
  EMBER_CHECK(static_cast<int>(list.size()) == n, "[mpi] ", op, ": expected ", n, " ", what,
              " tensors (one per rank), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    check_tensor(op, list[i], what);
    EMBER_CHECK(list[i].shape() == like.shape() && list[i].dtype() == like.dtype(), "[mpi] ", op,
                ": ", what, "[", i, "] (shape ", list[i].shape(), ", ", list[i].dtype(),
                ") must match shape ", like.shape(), " and ", like.dtype());
  }
}

Tensor contig(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }
void write_back(Tensor& dst, const Tensor& buf) {
  if (!buf.is_same(dst)) dst.copy_(buf);
}
int count(const Tensor& t) { return static_cast<int>(t.numel()); }

/// An empty contiguous [n, *like.shape] tensor.
Tensor stacked(int n, const Tensor& like) {
  Shape s = like.shape();
  s.insert(0, n);
  return empty(s, like.options());
}

}  // namespace

// ---- the worker ----------------------------------------------------------------------------

struct ProcessGroupMpi::Impl {
  /// Runs on the worker; returns the outputs, or nullopt when it registered a Pending request
  /// that finishes the Work later (send/recv).
  using Fn = std::function<std::optional<std::vector<Tensor>>(Impl&, const WorkPtr&)>;
  struct Task {
    WorkPtr work;
    Fn fn;
    std::optional<uint64_t> ticket;  // serialized mode (Note [MPI threading])
    int64_t queued_us = 0;           // trace clock when issued, if tracing
    bool traced = true;              // false: the group's own housekeeping, not on the timeline
  };
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    WorkPtr work;
    Clock::time_point deadline;
    std::function<std::vector<Tensor>()> done;  // also keeps the buffer alive
    int64_t queued_us = 0;   // its task's trace stamps: its span runs from the task's start
    int64_t started_us = 0;  // until MPI reports the request complete
  };

  MPI_Comm comm = MPI_COMM_NULL;
  std::thread thread;

  std::mutex mu;
  std::condition_variable cv;        // worker: a task was queued, or stop
  std::condition_variable state_cv;  // destructor: the worker exited
  std::deque<Task> queue;
  bool stop = false;
  bool exited = false;
  bool running = false;
  Clock::time_point deadline;  // of the running task

  std::vector<Pending> pending;    // worker only
  std::vector<Pending> abandoned;  // worker only: given up at stop, buffers kept alive
  Task* current = nullptr;         // worker only: the task running now (for add_pending)
  int64_t current_started_us = 0;  // worker only: its trace stamp

  WorkPtr enqueue(std::string what, Duration timeout, Fn fn, bool traced = true) {
    auto work = std::make_shared<Work>(std::move(what), timeout);
    {
      std::lock_guard<std::mutex> lock(mu);
      EMBER_INTERNAL_ASSERT(!stop, "[mpi] collective issued on a group being destroyed");
      queue.push_back(Task{work, std::move(fn), take_ticket(), tracing::stamp(), traced});
    }
    cv.notify_one();
    return work;
  }

  void add_pending(const WorkPtr& work, MPI_Request request,
                   std::function<std::vector<Tensor>()> done) {
    global().busy.fetch_add(1);
    pending.push_back(Pending{request, work, Clock::now() + work->timeout(), std::move(done),
                              current != nullptr ? current->queued_us : 0, current_started_us});
  }

  void run_task(Task& task) {
    global().busy.fetch_add(1);
    try {
      std::optional<std::vector<Tensor>> out;
      int64_t started_us = 0;
      {
        MpiTurn turn(task.ticket);
        if (task.traced) started_us = tracing::stamp();  // after its turn: waiting counts as queued
        current = &task;
        current_started_us = started_us;
        out = task.fn(*this, task.work);
        current = nullptr;
      }
      global().busy.fetch_sub(1);
      if (out) {
        tracing::record_collective(task.work->describe(), task.queued_us, started_us, *out);
        task.work->finish(std::move(*out));
      }
    } catch (...) {
      current = nullptr;
      global().busy.fetch_sub(1);
      task.work->finish_with_error(std::current_exception());
    }
  }

  /// Tests the outstanding requests; finishes the Works of those that completed. When
  /// `stopping`, requests past their deadline are given up (their Work fails with a timeout).
  void poll_pending(bool stopping) {
    std::vector<Pending> still;
    for (Pending& p : pending) {
      int flag = 0;
      int rc;
      {
        MpiLock lock;
        rc = MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE);
      }
      if (rc != MPI_SUCCESS) {
        global().busy.fetch_sub(1);
        try {
          check_mpi(rc, p.work->describe(), "MPI_Test");
        } catch (...) {
          p.work->finish_with_error(std::current_exception());
        }
      } else if (flag) {
        global().busy.fetch_sub(1);
        try {
          std::vector<Tensor> out = p.done();
          tracing::record_collective(p.work->describe(), p.queued_us, p.started_us, out);
          p.work->finish(std::move(out));
        } catch (...) {
          p.work->finish_with_error(std::current_exception());
        }
      } else if (stopping && Clock::now() > p.deadline) {
        p.work->finish_with_error(std::make_exception_ptr(DistTimeoutError(
            detail::str_cat(p.work->describe(), " timed out after ", p.work->timeout().count(),
                            " ms and was abandoned when its group was destroyed"))));
        abandoned.push_back(std::move(p));  // stays counted in busy: MPI still owns the buffer
      } else {
        still.push_back(std::move(p));
      }
    }
    pending = std::move(still);
  }

  void run() {
    trace::set_thread_name("mpi worker");
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      if (!queue.empty()) {
        Task task = std::move(queue.front());
        queue.pop_front();
        running = true;
        deadline = Clock::now() + task.work->timeout();
        lock.unlock();
        run_task(task);
        lock.lock();
        running = false;
        continue;
      }
      if (!pending.empty()) {
        const bool stopping = stop;
        lock.unlock();
        poll_pending(stopping);
        lock.lock();
        if (queue.empty() && !pending.empty()) cv.wait_for(lock, kPollInterval);
        continue;
      }
      if (stop) break;
      cv.wait(lock, [&] { return stop || !queue.empty(); });
    }
    exited = true;
    lock.unlock();
    state_cv.notify_all();
  }
};

// ---- creation and destruction --------------------------------------------------------------

bool ProcessGroupMpi::is_available() { return true; }

ProcessGroupMpi::ProcessGroupMpi(int rank, int size, Options options, std::shared_ptr<Impl> impl)
    : ProcessGroup(rank, size, options), impl_(std::move(impl)) {}

std::shared_ptr<ProcessGroupMpi> ProcessGroupMpi::create(std::vector<int> ranks,
                                                         ProcessGroup::Options options) {
  init_mpi();
  int world_rank = 0;
  int world_size = 0;
  MpiTurn turn(take_ticket());  // the whole creation: every call below is MPI
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "[mpi] create", "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "[mpi] create", "MPI_Comm_size");
  if (ranks.empty()) {
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  }
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    EMBER_CHECK(ranks[i] >= 0 && ranks[i] < world_size, "[mpi] create: rank ", ranks[i],
                " is not in the world of size ", world_size);
    EMBER_CHECK(i == 0 || ranks[i] != ranks[i - 1], "[mpi] create: rank ", ranks[i],
                " is listed twice");
  }
  const bool member = std::binary_search(ranks.begin(), ranks.end(), world_rank);

  auto impl = std::make_shared<Impl>();
  // Even the whole world gets its own communicator, so groups' collectives never mix.
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, world_rank, &impl->comm),
            "[mpi] create", "MPI_Comm_split");
  if (!member) return nullptr;
  int rank = 0;
  int size = 0;
  check_mpi(MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN), "[mpi] create",
            "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(impl->comm, &rank), "[mpi] create", "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(impl->comm, &size), "[mpi] create", "MPI_Comm_size");
  std::shared_ptr<ProcessGroupMpi> group(new ProcessGroupMpi(rank, size, options, impl));
  group->set_global_ranks(ranks);
  impl->thread = std::thread([impl] { impl->run(); });
  return group;
}

ProcessGroupMpi::~ProcessGroupMpi() {
  // The communicator is released by the worker, as its last task, so the release is ordered
  // after the group's collectives (and, in serialized mode, with every other MPI call).
  impl_->enqueue("[mpi] release of the communicator", options_.timeout,
                 [](Impl& im, const WorkPtr&) -> std::optional<std::vector<Tensor>> {
                   int finalized = 0;
                   MPI_Finalized(&finalized);
                   if (!finalized && im.comm != MPI_COMM_NULL) MPI_Comm_free(&im.comm);
                   return std::vector<Tensor>{};
                 },
                 /*traced=*/false);
  if (std::this_thread::get_id() == impl_->thread.get_id()) {
    // The last reference was dropped by a callback on the worker itself: it cannot join
    // itself, so it finishes the queue and exits on its own.
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
    impl_->thread.detach();
    return;
  }
  bool stuck = false;
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->stop = true;
    impl_->cv.notify_all();
    // Queued collectives still run (the other ranks expect them); a call past its deadline
    // will not return, so stop waiting for it (Note [MPI exit]).
    while (!impl_->exited) {
      if (impl_->running && Clock::now() > impl_->deadline) {
        stuck = true;
        break;
      }
      impl_->state_cv.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  if (stuck) {
    logging::warn("[mpi] group of rank ", rank_, "/", size_,
              " destroyed while its worker is stuck in an MPI call past its timeout; detaching "
              "the worker");
    impl_->thread.detach();
    return;
  }
  impl_->thread.join();
}

// ---- collectives ---------------------------------------------------------------------------

WorkPtr ProcessGroupMpi::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  check_tensor("allreduce", tensor, "tensor");
  check_reducible("allreduce", tensor, opts.op);
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("allreduce"), timeout_of(opts.timeout),
                     [tensor, op = opts.op, n](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       Tensor buf = contig(tensor);
                       {
                         MpiLock lock;
                         check_mpi(
                             MPI_Allreduce(MPI_IN_PLACE, buf.data_ptr(), count(buf),
                                           mpi_type(buf.dtype()), mpi_op(op, buf.dtype()), im.comm),
                             w->describe(), "MPI_Allreduce");
                       }
                       if (op == ReduceOp::Avg) buf.div_(n);
                       write_back(tensor, buf);
                       return std::vector<Tensor>{tensor};
                     }),
      {tensor});
}

WorkPtr ProcessGroupMpi::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  check_tensor("broadcast", tensor, "tensor");
  check_root("broadcast", opts.root);
  return record_flight(
      impl_->enqueue(next_op_label("broadcast"), timeout_of(opts.timeout),
                     [tensor, root = opts.root](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       Tensor buf = contig(tensor);
                       {
                         MpiLock lock;
                         check_mpi(MPI_Bcast(buf.data_ptr(), count(buf), mpi_type(buf.dtype()),
                                             root, im.comm),
                                   w->describe(), "MPI_Bcast");
                       }
                       write_back(tensor, buf);
                       return std::vector<Tensor>{tensor};
                     }),
      {tensor});
}

WorkPtr ProcessGroupMpi::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check_tensor("reduce", tensor, "tensor");
  check_reducible("reduce", tensor, opts.op);
  check_root("reduce", opts.root);
  const bool is_root = rank_ == opts.root;
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("reduce"), timeout_of(opts.timeout),
                     [tensor, op = opts.op, root = opts.root, is_root, n](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       Tensor buf = contig(tensor);
                       {
                         MpiLock lock;
                         check_mpi(MPI_Reduce(is_root ? MPI_IN_PLACE : buf.data_ptr(),
                                              is_root ? buf.data_ptr() : nullptr, count(buf),
                                              mpi_type(buf.dtype()), mpi_op(op, buf.dtype()), root,
                                              im.comm),
                                   w->describe(), "MPI_Reduce");
                       }
                       if (is_root) {
                         if (op == ReduceOp::Avg) buf.div_(n);
                         write_back(tensor, buf);
                       }
                       return std::vector<Tensor>{tensor};
                     }),
      {tensor});
}

WorkPtr ProcessGroupMpi::allgather_into_tensor(Tensor& output, const Tensor& input,
                                               const CollectiveOptions& opts) {
  check_tensor("allgather_into_tensor", input, "input");
  check_tensor("allgather_into_tensor", output, "output");
  EMBER_CHECK(output.dtype() == input.dtype() && output.numel() == input.numel() * size_,
              "[mpi] allgather_into_tensor: output (shape ", output.shape(), ", ", output.dtype(),
              ") must hold ", size_, " x ", input.numel(), " elements of ", input.dtype());
  return record_flight(
      impl_->enqueue(next_op_label("allgather_into_tensor"), timeout_of(opts.timeout),
                     [output, input](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor in = contig(input);
                       Tensor out = contig(output);
                       const MPI_Datatype t = mpi_type(in.dtype());
                       {
                         MpiLock lock;
                         check_mpi(MPI_Allgather(in.data_ptr(), count(in), t, out.data_ptr(),
                                                 count(in), t, im.comm),
                                   w->describe(), "MPI_Allgather");
                       }
                       write_back(output, out);
                       return std::vector<Tensor>{output};
                     }),
      {input});
}

WorkPtr ProcessGroupMpi::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                   const CollectiveOptions& opts) {
  check_tensor("allgather", input, "input");
  check_like("allgather", outputs, size_, input, "outputs");
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("allgather"), timeout_of(opts.timeout),
                     [outputs, input, n](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor in = contig(input);
                       Tensor flat = stacked(n, in);
                       const MPI_Datatype t = mpi_type(in.dtype());
                       {
                         MpiLock lock;
                         check_mpi(MPI_Allgather(in.data_ptr(), count(in), t, flat.data_ptr(),
                                                 count(in), t, im.comm),
                                   w->describe(), "MPI_Allgather");
                       }
                       for (int r = 0; r < n; ++r) outputs[r].copy_(flat[r]);
                       return outputs;
                     }),
      {input});
}

WorkPtr ProcessGroupMpi::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                const GatherOptions& opts) {
  check_tensor("gather", input, "input");
  check_root("gather", opts.root);
  const bool is_root = rank_ == opts.root;
  if (is_root) {
    check_like("gather", outputs, size_, input, "outputs");
  } else {
    check_only_root_passes("gather", opts.root, outputs.size(), "output");
  }
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("gather"), timeout_of(opts.timeout),
                     [outputs, input, n, is_root, root = opts.root](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor in = contig(input);
                       Tensor flat = is_root ? stacked(n, in) : Tensor();
                       const MPI_Datatype t = mpi_type(in.dtype());
                       {
                         MpiLock lock;
                         check_mpi(MPI_Gather(in.data_ptr(), count(in), t,
                                              is_root ? flat.data_ptr() : nullptr, count(in), t,
                                              root, im.comm),
                                   w->describe(), "MPI_Gather");
                       }
                       for (size_t r = 0; r < outputs.size(); ++r) outputs[r].copy_(flat[r]);
                       return outputs;
                     }),
      {input});
}

WorkPtr ProcessGroupMpi::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                 const ScatterOptions& opts) {
  check_tensor("scatter", output, "output");
  check_root("scatter", opts.root);
  const bool is_root = rank_ == opts.root;
  if (is_root) {
    check_like("scatter", inputs, size_, output, "inputs");
  } else {
    check_only_root_passes("scatter", opts.root, inputs.size(), "input");
  }
  return record_flight(
      impl_->enqueue(next_op_label("scatter"), timeout_of(opts.timeout),
                     [output, inputs, is_root, root = opts.root](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor packed = is_root ? pack(inputs) : Tensor();
                       Tensor out = contig(output);
                       const MPI_Datatype t = mpi_type(out.dtype());
                       {
                         MpiLock lock;
                         check_mpi(MPI_Scatter(is_root ? packed.data_ptr() : nullptr, count(out), t,
                                               out.data_ptr(), count(out), t, root, im.comm),
                                   w->describe(), "MPI_Scatter");
                       }
                       write_back(output, out);
                       return std::vector<Tensor>{output};
                     }),
      {output});
}

WorkPtr ProcessGroupMpi::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                        const ReduceScatterOptions& opts) {
  check_tensor("reduce_scatter", output, "output");
  check_reducible("reduce_scatter", output, opts.op);
  check_like("reduce_scatter", inputs, size_, output, "inputs");
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("reduce_scatter"), timeout_of(opts.timeout),
                     [output, inputs, op = opts.op, n](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor packed = pack(inputs);
                       Tensor out = contig(output);
                       {
                         MpiLock lock;
                         check_mpi(MPI_Reduce_scatter_block(packed.data_ptr(), out.data_ptr(),
                                                            count(out), mpi_type(out.dtype()),
                                                            mpi_op(op, out.dtype()), im.comm),
                                   w->describe(), "MPI_Reduce_scatter_block");
                       }
                       if (op == ReduceOp::Avg) out.div_(n);
                       write_back(output, out);
                       return std::vector<Tensor>{output};
                     }),
      {output});
}

WorkPtr ProcessGroupMpi::alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                                  const CollectiveOptions& opts) {
  EMBER_CHECK(!inputs.empty(), "[mpi] alltoall: expected ", size_, " input tensors, got none");
  check_like("alltoall", inputs, size_, inputs[0], "inputs");
  check_like("alltoall", outputs, size_, inputs[0], "outputs");
  const int n = size_;
  return record_flight(
      impl_->enqueue(next_op_label("alltoall"), timeout_of(opts.timeout),
                     [outputs, inputs, n](
                         Impl& im, const WorkPtr& w) mutable -> std::optional<std::vector<Tensor>> {
                       const Tensor packed = pack(inputs);
                       Tensor flat = stacked(n, inputs[0]);
                       const int each = count(inputs[0]);
                       const MPI_Datatype t = mpi_type(packed.dtype());
                       {
                         MpiLock lock;
                         check_mpi(MPI_Alltoall(packed.data_ptr(), each, t, flat.data_ptr(), each,
                                                t, im.comm),
                                   w->describe(), "MPI_Alltoall");
                       }
                       for (int r = 0; r < n; ++r) outputs[r].copy_(flat[r]);
                       return outputs;
                     }),
      inputs);
}

WorkPtr ProcessGroupMpi::barrier(const CollectiveOptions& opts) {
  return record_flight(
      impl_->enqueue(next_op_label("barrier"), timeout_of(opts.timeout),
                     [](Impl& im, const WorkPtr& w) -> std::optional<std::vector<Tensor>> {
                       MpiLock lock;
                       check_mpi(MPI_Barrier(im.comm), w->describe(), "MPI_Barrier");
                       return std::vector<Tensor>{};
                     }),
      {});
}

namespace {
void check_peer(const char* op, int peer, int rank, int size, int tag) {
  EMBER_CHECK(peer >= 0 && peer < size && peer != rank, "[mpi] ", op, ": peer rank ", peer,
              " must be another rank of this group of size ", size, " (this is rank ", rank, ")");
  const int max_tag = global().tag_ub;
  EMBER_CHECK(tag >= 0 && tag <= max_tag, "[mpi] ", op, ": tag ", tag, " must be in [0, ", max_tag,
              "]");
}
}  // namespace

WorkPtr ProcessGroupMpi::send(const Tensor& tensor, int dst, int tag) {
  return point_to_point(/*is_send=*/true, tensor, dst, tag);
}

WorkPtr ProcessGroupMpi::recv(Tensor& tensor, int src, int tag) {
  return point_to_point(/*is_send=*/false, tensor, src, tag);
}

WorkPtr ProcessGroupMpi::point_to_point(bool is_send, const Tensor& tensor, int peer, int tag) {
  const char* op = is_send ? "send" : "recv";
  check_tensor(op, tensor, "tensor");
  check_peer(op, peer, rank_, size_, tag);
  return record_flight(
      impl_->enqueue(next_p2p_label(op), options_.timeout,
                     [=](Impl& im, const WorkPtr& w) -> std::optional<std::vector<Tensor>> {
                       const Tensor buf = contig(tensor);
                       MPI_Request request = MPI_REQUEST_NULL;
                       {
                         MpiLock lock;
                         if (is_send) {
                           check_mpi(MPI_Isend(buf.data_ptr(), count(buf), mpi_type(buf.dtype()),
                                               peer, tag, im.comm, &request),
                                     w->describe(), "MPI_Isend");
                         } else {
                           check_mpi(MPI_Irecv(buf.data_ptr(), count(buf), mpi_type(buf.dtype()),
                                               peer, tag, im.comm, &request),
                                     w->describe(), "MPI_Irecv");
                         }
                       }
                       // buf stays captured until MPI is done with it; a received contiguous copy
                       // is written back to the caller's tensor.
                       im.add_pending(w, request, [tensor, buf, is_send]() mutable {
                         Tensor t = tensor;
                         if (!is_send) write_back(t, buf);
                         return std::vector<Tensor>{tensor};
                       });
                       return std::nullopt;
                     }),
      {tensor});
}

}  // namespace ember::dist
