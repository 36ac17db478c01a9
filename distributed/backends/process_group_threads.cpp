// ProcessGroupThreads: ranks as threads of one process, exchanging through memory.
//
// Note [thread rendezvous]: every call becomes a Call placed in a Slot of the world's table,
// keyed by (group index, sequence number) for collectives and by (group index, source,
// destination, tag, n-th such message) for send/recv. The call that fills a slot moves it to
// the worker's queue; the worker validates the calls against each other, runs the exchange
// with tensor ops and completes every call's Future. One worker per world keeps collectives in
// issue order and off the rank threads (they run on asynchronously, as with a real backend);
// the same loop expires slots whose deadline passed, so no rendezvous waits unbounded.
#include <ember/distributed/backends/process_group_threads.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

using Clock = std::chrono::steady_clock;

/// One rank's part of a rendezvous. What `in` and `out` hold depends on `kind` (see run_op).
struct ProcessGroupThreads::Call {
  OpType kind = OpType::Barrier;
  const char* name = "";
  std::vector<Tensor> in, out;
  std::vector<Tensor> value;  // the Future's value
  int root = 0;
  ReduceOp op = ReduceOp::Sum;
  int peer = -1;  // send: destination, recv: source
  int tag = 0;
  std::string label;
  Duration timeout{};
  Clock::time_point deadline;
  std::shared_ptr<Future> future;
  std::shared_ptr<cuda::Event> input_ready;  // CUDA: recorded on the caller's current stream
};

}  // namespace ember::dist

namespace ember::dist::detail {

using dist::Duration;
using Call = dist::ProcessGroupThreads::Call;
using Clock = std::chrono::steady_clock;

namespace {

std::string describe(const std::vector<Tensor>& ts) {
  std::string s = "[";
  for (size_t i = 0; i < ts.size(); ++i) {
    s += str_cat(i ? ", " : "", ts[i].dtype(), " ", ts[i].shape());
  }
  return s + "]";
}

bool same_meta(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape();
}

bool same_meta(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same_meta(a[i], b[i])) return false;
  }
  return true;
}

/// The tensors that must agree (dtype and shape) across the ranks of a collective.
const std::vector<Tensor>& signature(const Call& c) {
  switch (c.kind) {
    case OpType::Scatter:
    case OpType::ReduceScatter:
    case OpType::Recv:
      return c.out;
    default:
      return c.in;
  }
}


/// Why the calls of one rendezvous cannot be run together, or "" if they can. `who(i)` names
/// calls[i]'s rank.
std::string mismatch(const std::vector<Call>& calls, const std::function<int(size_t)>& who) {
  const Call& a = calls[0];
  for (size_t i = 1; i < calls.size(); ++i) {
    const Call& b = calls[i];
    const int r = who(i), r0 = who(0);
    if (a.kind != OpType::Send && b.kind != a.kind) {
      return str_cat("rank ", r, " called ", b.name, " but rank ", r0, " called ", a.name,
                     " (collectives must be issued in the same order on every rank)");
    }
    if (has_root(a.kind) && b.root != a.root) {
      return str_cat("rank ", r, " passed root ", b.root, " but rank ", r0, " root ", a.root);
    }
    if (reduces(a.kind) && b.op != a.op) {
      return str_cat("rank ", r, " passed op ", to_string(b.op), " but rank ", r0, " op ",
                     to_string(a.op));
    }
    if (a.kind != OpType::Alltoall && !same_meta(signature(b), signature(a))) {
      return str_cat("rank ", r, " passed ", describe(signature(b)), " but rank ", r0, " passed ",
                     describe(signature(a)));
    }
  }
  // Each rank's outputs[s] takes rank s's inputs[rank]: every pair, rank 0's outputs too.
  if (a.kind == OpType::Alltoall) {
    for (size_t i = 0; i < calls.size(); ++i) {
      for (size_t s = 0; s < calls.size(); ++s) {
        if (!same_meta(calls[i].out[s], calls[s].in[i])) {
          return str_cat("rank ", who(i), "'s outputs[", s, "] is ", describe({calls[i].out[s]}),
                         " but rank ", who(s), "'s inputs[", who(i), "] is ",
                         describe({calls[s].in[i]}));
        }
      }
    }
  }
  std::optional<Device> device;
  for (const Call& c : calls) {
    for (const auto* list : {&c.in, &c.out}) {
      for (const Tensor& t : *list) {
        if (!device) device = t.device();
        if (t.device() != *device) {
          return str_cat("every rank's tensors must be on one device, got ", *device, " and ",
                         t.device());
        }
      }
    }
  }
  return "";
}

/// The reduction of `ts` (float16 and bfloat16 in float32; Avg on integers truncates).
Tensor reduce_tensors(const std::vector<Tensor>& ts, dist::ReduceOp op) {
  const bool low = ts[0].dtype() == Dtype::Float16 || ts[0].dtype() == Dtype::BFloat16;
  auto load = [&](const Tensor& t) { return low ? t.to(kFloat32) : t; };
  Tensor acc = low ? load(ts[0]) : ts[0].clone();
  for (size_t k = 1; k < ts.size(); ++k) {
    const Tensor x = load(ts[k]);
    switch (op) {
      case dist::ReduceOp::Sum:
      case dist::ReduceOp::Avg:
        acc.add_(x);
        break;
      case dist::ReduceOp::Product:
        acc.mul_(x);
        break;
      case dist::ReduceOp::Min:
        acc = minimum(acc, x);
        break;
      case dist::ReduceOp::Max:
        acc = maximum(acc, x);
        break;
    }
  }
  if (op == dist::ReduceOp::Avg) {
    const auto n = static_cast<double>(ts.size());
    acc = is_floating(acc.dtype()) ? acc.div_(n) : div(acc.to(kFloat64), n);
  }
  return acc;
}

/// The exchange itself: ranks' calls in rank order (send/recv: the send, then the recv).
void run_op(std::vector<Call>& c) {
  const size_t n = c.size();
  auto column = [&](auto pick) {
    std::vector<Tensor> ts;
    for (size_t s = 0; s < n; ++s) ts.push_back(pick(c[s]));
    return ts;
  };
  const Call& a = c[0];
  switch (a.kind) {
    case OpType::Allreduce:
      for (size_t i = 0; i < a.in.size(); ++i) {
        const Tensor acc = reduce_tensors(column([&](const Call& x) { return x.in[i]; }), a.op);
        for (Call& x : c) x.in[i].copy_(acc);
      }
      break;
    case OpType::Reduce:
      c[a.root].in[0].copy_(reduce_tensors(column([](const Call& x) { return x.in[0]; }), a.op));
      break;
    case OpType::Broadcast:
      for (size_t r = 0; r < n; ++r) {
        if (static_cast<int>(r) != a.root) c[r].in[0].copy_(c[a.root].in[0]);
      }
      break;
    case OpType::AllgatherIntoTensor:
      for (Call& x : c) {
        const Tensor flat = x.out[0].view({-1});
        const int64_t k = a.in[0].numel();
        for (size_t s = 0; s < n; ++s) {
          flat.narrow(0, static_cast<int64_t>(s) * k, k).copy_(c[s].in[0].reshape({-1}));
        }
      }
      break;
    case OpType::Allgather:
    case OpType::Gather:
    case OpType::Alltoall:
      // outputs[s] of rank r receives rank s's input (allgather, gather) or inputs[r].
      for (size_t r = 0; r < n; ++r) {
        for (size_t s = 0; s < c[r].out.size(); ++s) {
          c[r].out[s].copy_(a.kind == OpType::Alltoall ? c[s].in[r] : c[s].in[0]);
        }
      }
      break;
    case OpType::Scatter:
      for (size_t r = 0; r < n; ++r) c[r].out[0].copy_(c[a.root].in[r]);
      break;
    case OpType::ReduceScatter:
      for (size_t r = 0; r < n; ++r) {
        c[r].out[0].copy_(reduce_tensors(column([&](const Call& x) { return x.in[r]; }), a.op));
      }
      break;
    case OpType::Send:
      c[1].out[0].copy_(c[0].in[0]);
      break;
    case OpType::Barrier:
    case OpType::Recv:
      break;
    case OpType::AllreduceCoalesced:   // issued as Allreduce (one exchange of every tensor)
    case OpType::ReduceScatterTensor:  // issued as ReduceScatter (ProcessGroup's composite)
      EMBER_INTERNAL_ASSERT(false, "[threads] no exchange of kind ", to_string(a.kind));
  }
}

std::optional<Device> device_of(const std::vector<Call>& calls) {
  for (const Call& c : calls) {
    if (!c.in.empty()) return c.in[0].device();
    if (!c.out.empty()) return c.out[0].device();
  }
  return std::nullopt;
}

}  // namespace

class ThreadWorldState {
 public:
  explicit ThreadWorldState(int size) : size_(size), groups_(size, 0) {}

  int size() const { return size_; }

  int register_group(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    return groups_[rank]++;
  }

  /// The number of earlier messages from src to dst with this tag on this side (Note [thread
  /// rendezvous]).
  uint64_t next_message(int group, int src, int dst, int tag, bool send) {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_[{group, src, dst, tag, send}]++;
  }

  /// Places `call` at `position` of the slot `key` (one of `expected` parts; Note [thread
  /// rendezvous]).
  void arrive(const std::tuple<int, int, int, int, int, uint64_t>& key, size_t position,
              size_t expected, Call call) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!aborted_.empty() || stop_) {
      const std::string why = stop_ ? "the world was destroyed" : aborted_;
      lock.unlock();
      call.future->set_exception(std::make_exception_ptr(
          dist::DistBackendError(str_cat(call.label, " failed: ", why))));
      return;
    }
    Slot& slot = slots_[key];
    if (slot.calls.empty()) slot.calls.resize(expected);
    if (!slot.dead.empty()) {
      const std::string why = slot.dead;
      lock.unlock();
      call.future->set_exception(std::make_exception_ptr(dist::DistTimeoutError(
          str_cat(call.label, " failed: the other ranks already timed out (", why, ")"))));
      return;
    }
    slot.calls[position] = std::move(call);
    if (++slot.arrived < expected) {
      cv_.notify_all();  // the worker's next deadline may be this call's
      return;
    }
    std::vector<Call> ready;
    for (auto& c : slot.calls) ready.push_back(std::move(*c));
    slots_.erase(key);
    ready_.push_back(std::move(ready));
    cv_.notify_all();
  }

  void abort(const std::string& reason) {
    std::vector<Call> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_.empty()) return;
      aborted_ = reason;
      take_pending(failed);
    }
    fail(failed, reason);
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
  }

  /// The worker: runs ready exchanges in order and expires late slots until stop().
  void work() {
    NoGradGuard no_grad;
    for (;;) {
      std::deque<std::vector<Call>> ready;
      std::vector<std::pair<Call, std::string>> expired;
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Every arrival notifies: the next deadline may have become earlier.
        while (!stop_ && ready_.empty()) {
          const Clock::time_point next = next_deadline();
          if (Clock::now() >= next) break;
          if (next == Clock::time_point::max()) {
            cv_.wait(lock);
          } else {
            cv_.wait_until(lock, next);
          }
        }
        ready.swap(ready_);
        if (stop_ && ready.empty()) {
          std::vector<Call> left;
          take_pending(left);
          lock.unlock();
          fail(left, "the world was destroyed");
          return;
        }
        expire(expired);
      }
      for (auto& [call, why] : expired) {
        call.future->set_exception(std::make_exception_ptr(dist::DistTimeoutError(why)));
      }
      for (auto& calls : ready) run(calls);
    }
  }

 private:
  struct Slot {
    std::vector<std::optional<Call>> calls;
    size_t arrived = 0;
    std::string dead;  // why it timed out
  };

  Clock::time_point next_deadline() const {
    auto t = Clock::time_point::max();
    for (const auto& [key, slot] : slots_) {
      if (!slot.dead.empty()) continue;
      for (const auto& c : slot.calls) {
        if (c) t = std::min(t, c->deadline);
      }
    }
    return t;
  }

  // A slot whose earliest call is past its deadline fails all its calls, each naming the
  // ranks that never came; it stays in the table, dead, so that late arrivals fail at once.
  void expire(std::vector<std::pair<Call, std::string>>& out) {
    const auto now = Clock::now();
    for (auto& [key, slot] : slots_) {
      if (!slot.dead.empty()) continue;
      bool late = false;
      for (const auto& c : slot.calls) late = late || (c && c->deadline <= now);
      if (!late) continue;
      const bool p2p = std::get<1>(key) != 0;
      std::string missing;
      for (size_t i = 0; i < slot.calls.size(); ++i) {
        if (slot.calls[i]) continue;
        const int r = p2p ? (i == 0 ? std::get<2>(key) : std::get<3>(key)) : static_cast<int>(i);
        missing += str_cat(missing.empty() ? "" : ", ", r);
      }
      slot.dead = str_cat("rank(s) ", missing, " did not call ",
                          p2p ? "the matching send/recv" : "it");
      for (auto& c : slot.calls) {
        if (!c) continue;
        std::string why =
            str_cat(c->label, " timed out after ", c->timeout.count(), " ms: ", slot.dead);
        out.emplace_back(std::move(*c), std::move(why));
        c.reset();
      }
    }
  }

  void take_pending(std::vector<Call>& out) {
    for (auto& [key, slot] : slots_) {
      for (auto& c : slot.calls) {
        if (c) out.push_back(std::move(*c));
        c.reset();
      }
    }
    slots_.clear();
  }

  static void fail(std::vector<Call>& calls, const std::string& why) {
    for (Call& c : calls) {
      c.future->set_exception(
          std::make_exception_ptr(dist::DistBackendError(str_cat(c.label, " failed: ", why))));
    }
  }

  cuda::Stream stream_for(int device) {
    auto it = streams_.find(device);
    if (it == streams_.end()) it = streams_.emplace(device, cuda::Stream::create(device)).first;
    return it->second;
  }

  // Validates, exchanges, completes. CUDA: queued on the collective stream after every rank's
  // input-ready event; the Futures complete with one ready event, with that stream current so
  // then() callbacks queue their work after the exchange.
  void run(std::vector<Call>& calls) {
    const bool p2p = calls[0].kind == OpType::Send;
    const std::string why = mismatch(calls, [&](size_t i) {
      return p2p ? (i == 0 ? calls[1].peer : calls[0].peer) : static_cast<int>(i);
    });
    if (!why.empty()) {
      for (Call& c : calls) {
        c.future->set_exception(std::make_exception_ptr(ValueError(str_cat(c.label, ": ", why))));
      }
      return;
    }
    const std::optional<Device> dev = device_of(calls);
    const bool on_cuda = dev && dev->is_cuda();
    std::optional<cuda::StreamGuard> guard;  // kept while the Futures complete
    std::vector<std::shared_ptr<cuda::Event>> ready;
    std::exception_ptr error;
    try {
      std::optional<cuda::Stream> s;
      if (on_cuda) {
        cuda::set_device(dev->index);
        s = stream_for(dev->index);
        guard.emplace(*s);
        for (Call& c : calls) c.input_ready->block(*s);
      }
      run_op(calls);
      if (on_cuda) {
        ready.push_back(std::make_shared<cuda::Event>());
        ready.back()->record(*s);
        for (Call& c : calls) {
          for (const auto* list : {&c.in, &c.out}) {
            for (const Tensor& t : *list) cuda::record_stream(t, *s);
          }
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    for (Call& c : calls) {
      if (error) {
        c.future->set_exception(error);
      } else {
        c.future->set_value(std::move(c.value), ready);
      }
    }
  }

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> groups_;  // groups made per rank
  std::map<std::tuple<int, int, int, int, bool>, uint64_t> messages_;
  std::map<std::tuple<int, int, int, int, int, uint64_t>, Slot> slots_;
  std::deque<std::vector<Call>> ready_;
  std::map<int, cuda::Stream> streams_;  // worker only
  std::string aborted_;
  bool stop_ = false;
};

}  // namespace ember::dist::detail

namespace ember::dist {

using dist::detail::describe;
using dist::detail::same_meta;
using dist::detail::str_cat;

// ---- ThreadWorld and run_rank_threads ----------------------------------------------------------

ThreadWorld::ThreadWorld(int size)
    : size_(size), state_(std::make_shared<dist::detail::ThreadWorldState>(size)) {}

std::shared_ptr<ThreadWorld> ThreadWorld::create(int size) {
  EMBER_CHECK(size >= 1, "[threads] a world needs at least one rank, got size ", size);
  std::shared_ptr<ThreadWorld> w(new ThreadWorld(size));
  // The worker owns the state too: a Future callback on the worker may drop the last reference
  // to the world, whose destructor then cannot join the worker (see ~ThreadWorld).
  w->worker_ = std::thread([state = w->state_] { state->work(); });
  return w;
}

ThreadWorld::~ThreadWorld() {
  state_->stop();
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();
  } else if (worker_.joinable()) {
    worker_.join();
  }
}

void ThreadWorld::abort(const std::string& reason) {
  std::vector<std::weak_ptr<ThreadWorld>> children;
  {
    std::lock_guard<std::mutex> lock(children_mu_);
    if (aborted_.empty()) aborted_ = reason;
    children = children_;
  }
  state_->abort(reason);
  for (const auto& c : children) {
    if (auto child = c.lock()) child->abort(reason);
  }
}

void ThreadWorld::abort_alone(const std::string& reason) { state_->abort(reason); }

void ThreadWorld::adopt(const std::shared_ptr<ThreadWorld>& child) {
  EMBER_CHECK(child != nullptr && child.get() != this, "[threads] adopt needs another world");
  std::string aborted;
  {
    std::lock_guard<std::mutex> lock(children_mu_);
    std::erase_if(children_, [](const std::weak_ptr<ThreadWorld>& c) { return c.expired(); });
    children_.push_back(child);
    aborted = aborted_;
  }
  if (!aborted.empty()) child->abort(aborted);
}

namespace {
std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}
}  // namespace

RankThreadError::RankThreadError(int rank, int size, std::exception_ptr cause,
                                 const std::string& what)
    : DistError(str_cat("[threads] rank ", rank, " of ", size, " failed: ", what)),
      rank_(rank),
      cause_(std::move(cause)) {}

RankThreadError::RankThreadError(int rank, int size, std::exception_ptr cause)
    : RankThreadError(rank, size, cause, what_of(cause)) {}

void run_rank_threads(const std::shared_ptr<ThreadWorld>& world,
                      const std::function<void(int rank)>& body) {
  EMBER_CHECK(world != nullptr, "[threads] run_rank_threads needs a world, got null");
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  std::vector<std::thread> threads;
  threads.reserve(world->size());
  for (int r = 0; r < world->size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        const std::exception_ptr e = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) {
            first = e;
            first_rank = r;
          }
        }
        world->abort(str_cat("rank ", r, " failed: ", what_of(e)));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) throw RankThreadError(first_rank, world->size(), first, what_of(first));
}

// ---- ProcessGroupThreads ------------------------------------------------------------------------

namespace {

void check_tensor(const char* op, const Tensor& t, const char* what) {
  EMBER_CHECK(t.defined(), "[threads] ", op, ": ", what, " is undefined");
}

void check_like(const char* op, const std::vector<Tensor>& list, size_t n, const Tensor& like,
                const char* what) {
  EMBER_CHECK(list.size() == n, "[threads] ", op, " expected ", n, " ", what,
              " tensors (one per rank), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    EMBER_CHECK(list[i].defined() && same_meta(list[i], like) && list[i].device() == like.device(),
                "[threads] ", op, ": ", what, "[", i, "] (", list[i].defined() ? "" : "undefined",
                list[i].defined() ? describe({list[i]}) : "", ") must match ", like.dtype(), " ",
                like.shape(), " on ", like.device());
  }
}

/// Waits a little longer than the collective's timeout by default, so that the worker's error,
/// which names the ranks that never came, reaches the caller rather than a bare timeout.
class ThreadsWork : public Work {
 public:
  using Work::Work;
  bool wait(std::optional<Duration> timeout = {}) override {
    future_->wait(timeout ? *timeout : timeout_ + kGrace);
    return true;
  }

 private:
  static constexpr Duration kGrace = std::chrono::seconds(2);
};

}  // namespace

ProcessGroupThreads::ProcessGroupThreads(std::shared_ptr<ThreadWorld> world, int rank,
                                         Options options, bool in_place_coalesced)
    : ProcessGroup(rank, world ? world->size() : 1, options),
      world_(std::move(world)),
      in_place_coalesced_(in_place_coalesced) {
  EMBER_CHECK(world_ != nullptr, "[threads] rank ", rank, ": the world is null");
  index_ = world_->state().register_group(rank);
}

bool ProcessGroupThreads::abort(const std::string& reason) {
  world_->abort_alone(str_cat("rank ", rank(), " aborted the group: ", reason));
  return true;
}

WorkPtr ProcessGroupThreads::issue(Call c) {
  auto work = std::make_shared<ThreadsWork>(c.label, c.timeout);
  // Before arrive(): the last rank to arrive runs the collective, which may complete it.
  record_flight(work, c.in.empty() ? c.out : c.in);
  c.future = work->future();
  std::optional<Device> dev;
  if (!c.in.empty()) dev = c.in[0].device();
  if (!dev && !c.out.empty()) dev = c.out[0].device();
  if (dev && dev->is_cuda()) {
    c.input_ready = std::make_shared<cuda::Event>();
    c.input_ready->record(cuda::current_stream(dev->index));
  }
  c.deadline = Clock::now() + c.timeout;
  const bool p2p = c.kind == OpType::Send || c.kind == OpType::Recv;
  if (p2p) {
    const bool send = c.kind == OpType::Send;
    const int src = send ? rank_ : c.peer, dst = send ? c.peer : rank_;
    const uint64_t n = world_->state().next_message(index_, src, dst, c.tag, send);
    world_->state().arrive({index_, 1, src, dst, c.tag, n}, send ? 0 : 1, 2, std::move(c));
  } else {
    // next_op_label took this call's sequence number.
    world_->state().arrive({index_, 0, 0, 0, 0, seq_ - 1}, static_cast<size_t>(rank_),
                           static_cast<size_t>(size_), std::move(c));
  }
  return work;
}

namespace {
ProcessGroupThreads::Call make_call(OpType kind, const char* name, std::string label,
                                    Duration timeout) {
  ProcessGroupThreads::Call c;
  c.kind = kind;
  c.name = name;
  c.label = std::move(label);
  c.timeout = timeout;
  return c;
}
}  // namespace

WorkPtr ProcessGroupThreads::collective(OpType kind, const char* name,
                                        const std::optional<Duration>& timeout,
                                        std::vector<Tensor> in, std::vector<Tensor> out,
                                        int root, ReduceOp op) {
  Call c = make_call(kind, name, next_op_label(name), timeout_of(timeout));
  c.value = out.empty() ? in : out;
  c.in = std::move(in);
  c.out = std::move(out);
  c.root = root;
  c.op = op;
  return issue(std::move(c));
}

WorkPtr ProcessGroupThreads::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  check_tensor("allreduce", tensor, "tensor");
  return collective(OpType::Allreduce, "allreduce", opts.timeout, {tensor}, {}, 0, opts.op);
}

WorkPtr ProcessGroupThreads::allreduce_coalesced(std::vector<Tensor>& tensors,
                                                 const AllreduceOptions& opts) {
  check_coalesced("threads", tensors);
  return collective(OpType::Allreduce, "allreduce_coalesced", opts.timeout, tensors, {}, 0,
                    opts.op);
}

WorkPtr ProcessGroupThreads::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  check_tensor("broadcast", tensor, "tensor");
  check_root("broadcast", opts.root);
  return collective(OpType::Broadcast, "broadcast", opts.timeout, {tensor}, {}, opts.root);
}

WorkPtr ProcessGroupThreads::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check_tensor("reduce", tensor, "tensor");
  check_root("reduce", opts.root);
  return collective(OpType::Reduce, "reduce", opts.timeout, {tensor}, {}, opts.root, opts.op);
}

WorkPtr ProcessGroupThreads::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                   const CollectiveOptions& opts) {
  check_tensor("allgather_into_tensor", input, "input");
  check_tensor("allgather_into_tensor", output, "output");
  EMBER_CHECK(output.is_contiguous() && output.dtype() == input.dtype() &&
                  output.device() == input.device() && output.numel() == size_ * input.numel(),
              "[threads] allgather_into_tensor expects a contiguous ", input.dtype(),
              " output on ", input.device(), " of ", size_, " x ", input.numel(),
              " elements, got ", describe({output}), " on ", output.device(),
              output.is_contiguous() ? "" : " (not contiguous)");
  return collective(OpType::AllgatherIntoTensor, "allgather_into_tensor", opts.timeout, {input},
                    {output});
}

WorkPtr ProcessGroupThreads::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                       const CollectiveOptions& opts) {
  check_tensor("allgather", input, "input");
  check_like("allgather", outputs, size_, input, "outputs");
  return collective(OpType::Allgather, "allgather", opts.timeout, {input}, outputs);
}

WorkPtr ProcessGroupThreads::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                    const GatherOptions& opts) {
  check_tensor("gather", input, "input");
  check_root("gather", opts.root);
  if (rank_ == opts.root) {
    check_like("gather", outputs, size_, input, "outputs");
  } else {
    check_only_root_passes("gather", opts.root, outputs.size(), "output");
  }
  return collective(OpType::Gather, "gather", opts.timeout, {input}, outputs, opts.root);
}

WorkPtr ProcessGroupThreads::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                     const ScatterOptions& opts) {
  check_tensor("scatter", output, "output");
  check_root("scatter", opts.root);
  if (rank_ == opts.root) {
    check_like("scatter", inputs, size_, output, "inputs");
  } else {
    check_only_root_passes("scatter", opts.root, inputs.size(), "input");
  }
  return collective(OpType::Scatter, "scatter", opts.timeout, inputs, {output}, opts.root);
}

WorkPtr ProcessGroupThreads::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                            const ReduceScatterOptions& opts) {
  check_tensor("reduce_scatter", output, "output");
  check_like("reduce_scatter", inputs, size_, output, "inputs");
  return collective(OpType::ReduceScatter, "reduce_scatter", opts.timeout, inputs, {output}, 0,
                    opts.op);
}

WorkPtr ProcessGroupThreads::alltoall(std::vector<Tensor>& outputs,
                                      const std::vector<Tensor>& inputs,
                                      const CollectiveOptions& opts) {
  EMBER_CHECK(inputs.size() == static_cast<size_t>(size_) &&
                  outputs.size() == static_cast<size_t>(size_),
              "[threads] alltoall expects ", size_, " inputs and outputs (one per rank), got ",
              inputs.size(), " and ", outputs.size());
  for (const Tensor& t : inputs) check_tensor("alltoall", t, "an input");
  for (const Tensor& t : outputs) check_tensor("alltoall", t, "an output");
  return collective(OpType::Alltoall, "alltoall", opts.timeout, inputs, outputs);
}

WorkPtr ProcessGroupThreads::barrier(const CollectiveOptions& opts) {
  return collective(OpType::Barrier, "barrier", opts.timeout, {}, {});
}

WorkPtr ProcessGroupThreads::send(const Tensor& tensor, int dst, int tag) {
  return point_to_point(true, tensor, dst, tag);
}

WorkPtr ProcessGroupThreads::recv(Tensor& tensor, int src, int tag) {
  return point_to_point(false, tensor, src, tag);
}

WorkPtr ProcessGroupThreads::point_to_point(bool send, const Tensor& tensor, int peer, int tag) {
  const char* op = send ? "send" : "recv";
  check_tensor(op, tensor, "tensor");
  EMBER_CHECK(peer >= 0 && peer < size_ && peer != rank_, "[threads] ", op, " on rank ", rank_,
              " of ", size_, ": ", send ? "destination " : "source ", peer,
              " must be another rank of the group");
  // Not a collective: numbered apart from them (the other ranks' collective numbers must stay
  // in step), and recorded in the flight recorder as a send or receive.
  Call c = make_call(
      send ? OpType::Send : OpType::Recv, op,
      str_cat(next_p2p_label(op), send ? " to" : " from", " rank ", peer, " (tag ", tag, ")"),
      options_.timeout);
  (send ? c.in : c.out) = {tensor};
  c.value = {tensor};
  c.peer = peer;
  c.tag = tag;
  return issue(std::move(c));
}

}  // namespace ember::dist
