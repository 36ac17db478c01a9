// Hierarchical gloo collectives: local groups, node leaders and a flat group (see the header).
//
// Note [hierarchical pipeline]
// An allreduce goes in P pieces (an eighth of the buffer each, within [kMinPieceBytes,
// pipeline_bytes]). For piece k, the node's ranks all-reduce it in their local group (L k), the
// leaders all-reduce the node sums over TCP (X k) and each leader broadcasts the result to its
// node (B k). The leader issues
//   L0, then for k = 0..P: [k < P] wait L k, issue X k, issue L k+1;
//                          [k > 0] wait X k-1, issue B k-1
// so that two leaders' transfers are in flight at once (the link never idles between pieces
// while a piece's round trips start) and the local reduction of the next piece and the
// broadcast of the previous one run on the local group's worker threads meanwhile. The other
// ranks of the node issue L0, then for k = 0..P: [k+1 < P] issue L k+1; [k > 0] wait L k-1,
// issue B k-1: the local group sees the same order on every rank (a collective order that
// differed between ranks would pair different pieces), and B k-1 (which writes piece k-1) never
// starts while this rank's L k-1 may still write it.
#include <ember/distributed/backends/process_group_hierarchical.h>

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include <ember/distributed/backends/detail/shm_kernels.h>
#include <ember/distributed/store/prefix_store.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The smallest piece worth its own round of steps (Note [hierarchical pipeline]).
constexpr int64_t kMinPieceBytes = 256 << 10;

std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

// ---- nodes --------------------------------------------------------------------------------------

NodeLayout::NodeLayout(const std::vector<std::string>& keys) {
  std::vector<std::string> seen;
  for (const std::string& key : keys) {
    auto it = std::find(seen.begin(), seen.end(), key);
    if (it == seen.end()) {
      seen.push_back(key);
      members_.emplace_back();
      it = seen.end() - 1;
    }
    const int node = static_cast<int>(it - seen.begin());
    members_[node].push_back(static_cast<int>(node_of_.size()));
    node_of_.push_back(node);
  }
}

std::vector<int> NodeLayout::leaders() const {
  std::vector<int> out;
  for (const auto& m : members_) out.push_back(m.front());
  return out;
}

bool NodeLayout::pays() const {
  return nodes() >= 2 && std::any_of(members_.begin(), members_.end(),
                                     [](const std::vector<int>& m) { return m.size() >= 2; });
}

std::string NodeLayout::describe() const {
  std::string out = detail::str_cat(nodes(), nodes() == 1 ? " node:" : " nodes:");
  for (const auto& m : members_) out += " [" + join_ranks(m) + "]";
  return out;
}

std::string local_node_key() {
  if (const char* k = std::getenv("EMBER_NODE_KEY"); k && *k) return std::string("env:") + k;
  const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  char net[256] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", net, sizeof(net) - 1);
  // Without the boot id, the network namespace alone does not tell machines apart: the host's
  // namespace has the same inode on every Linux machine. Unknown then (a node of its own).
  if (boot.empty()) return {};
  return boot + "|" + (n > 0 ? std::string(net, static_cast<size_t>(n)) : std::string());
}

NodeLayout exchange_node_keys(Store& store, int rank, int size, const std::string& key, bool flag,
                              bool* all_flags, Duration timeout) {
  // A rank whose key cannot be read gets one of its own: a node of one rank never shares memory
  // by mistake. Lines of the combined list are "<flag><key>", so a key holds no newline.
  std::string mine = key.empty() ? "?rank" + std::to_string(rank) : key;
  std::replace(mine.begin(), mine.end(), '\n', ' ');
  store.set("ember_node/" + std::to_string(rank), std::string(flag ? "1" : "0") + mine);
  // Rank 0 gathers the keys and publishes them as one value: 2 * size store requests in all,
  // not size * size.
  const auto deadline = Clock::now() + timeout;
  auto left = [&] {
    return std::max(Duration(1), std::chrono::duration_cast<Duration>(deadline - Clock::now()));
  };
  int awaited = 0;
  try {
    if (rank == 0) {
      std::string list;
      for (awaited = 0; awaited < size; ++awaited) {
        list += store.get_string("ember_node/" + std::to_string(awaited), left()) + "\n";
      }
      store.set("ember_node/all", list);
    }
    awaited = 0;
    const std::string list = store.get_string("ember_node/all", left());
    std::vector<std::string> keys;
    bool all = true;
    for (size_t at = 0; at < list.size();) {
      const size_t end = list.find('\n', at);
      const std::string line = list.substr(at, end - at);
      all = all && !line.empty() && line[0] == '1';
      keys.push_back(line.empty() ? std::string() : line.substr(1));
      at = end == std::string::npos ? list.size() : end + 1;
    }
    EMBER_INTERNAL_ASSERT(static_cast<int>(keys.size()) == size, "[gloo] node list of ",
                          keys.size(), " ranks for a group of ", size);
    if (all_flags) *all_flags = all && flag;
    return NodeLayout(keys);
  } catch (const DistTimeoutError& e) {
    throw DistTimeoutError(detail::str_cat("[gloo] finding the nodes of a group of ", size,
                                           " on rank ", rank, ": rank ", awaited,
                                           awaited == 0 && rank != 0 ? " did not publish the"
                                           " ranks' node keys" : " did not publish its node key",
                                           " within ", timeout.count(), " ms: ", e.what()));
  }
}

// ---- Impl ---------------------------------------------------------------------------------------

class ProcessGroupHierarchical::Impl {
 public:
  using Run = std::function<std::vector<Tensor>(Clock::time_point deadline)>;

  Impl(const ProcessGroupHierarchical& pg, const std::shared_ptr<Store>& store,
       const NodeLayout& layout, const HierarchicalOptions& o)
      : layout_(layout),
        rank_(pg.rank()),
        size_(pg.size()),
        node_(layout.node_of(pg.rank())),
        pipeline_bytes_(o.pipeline_bytes),
        flat_below_bytes_(o.flat_below_bytes) {
    const std::vector<int>& mine = layout.members(node_);
    local_rank_ = static_cast<int>(std::find(mine.begin(), mine.end(), rank_) - mine.begin());
    flat_ = std::make_unique<ProcessGroupGloo>(std::make_shared<PrefixStore>("flat", store), rank_,
                                               size_, o.gloo);
    if (mine.size() > 1) {
      local_ = std::make_unique<ProcessGroupGloo>(
          std::make_shared<PrefixStore>(detail::str_cat("local_", node_), store), local_rank_,
          static_cast<int>(mine.size()), o.gloo);
      local_shm_ = local_->uses_shared_memory();
    }
    if (layout.nodes() > 1 && local_rank_ == 0) {
      ProcessGroupGloo::GlooOptions lo = o.gloo;
      lo.shared_memory = false;  // leaders are on different nodes (unless keys were forced)
      leaders_ = std::make_unique<ProcessGroupGloo>(
          std::make_shared<PrefixStore>("leaders", store), node_, layout.nodes(), lo);
    }
    worker_ = std::thread([this] { loop(); });
  }

  ~Impl() {
    std::deque<Task> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      dropped.swap(queue_);
    }
    cv_.notify_all();
    for (auto& t : dropped) {
      t.work->finish_with_error(std::make_exception_ptr(DistBackendError(
          detail::str_cat(t.work->describe(), " failed: the process group was destroyed"))));
    }
    if (worker_.joinable()) worker_.join();
  }

  /// Queues run(deadline) for the group's thread; the returned Work completes with its result.
  WorkPtr submit(const std::string& label, Duration timeout, Run run) {
    auto work = std::make_shared<StepWork>(label, timeout);
    {
      std::lock_guard<std::mutex> lock(mu_);
      EMBER_CHECK(!stop_, label, ": the process group is being destroyed");
      queue_.push_back(Task{work, Clock::now() + timeout, std::move(run)});
    }
    cv_.notify_one();
    return work;
  }

  std::vector<Tensor> allreduce(Tensor t, ReduceOp op, Clock::time_point deadline);
  std::vector<Tensor> broadcast(Tensor t, int root, Clock::time_point deadline);

  const NodeLayout& layout() const { return layout_; }
  int node() const { return node_; }
  bool local_shm() const { return local_shm_; }
  ProcessGroupGloo& flat() { return *flat_; }
  // The inner groups, for abort(): set at construction, so safe to read from any thread.
  std::vector<ProcessGroupGloo*> groups() const {
    return {flat_.get(), local_.get(), leaders_.get()};
  }
  /// Whether a collective on `t` goes through the flat group (HierarchicalOptions).
  bool small(const Tensor& t) const {
    return static_cast<size_t>(t.nbytes()) <= flat_below_bytes_;
  }

 private:
  /// A Work whose default wait outlasts the group's own deadline a little, so that the step's
  /// error (which says what failed) reaches the caller rather than a bare timeout.
  class StepWork : public Work {
   public:
    using Work::Work;
    bool wait(std::optional<Duration> timeout = {}) override {
      future_->wait(timeout.value_or(timeout_ + 2s));
      return true;
    }
  };
  struct Task {
    std::shared_ptr<Work> work;
    Clock::time_point deadline;
    Run run;
  };
  /// A failed step: its description and the inner group's error.
  struct StepFailure {
    std::string step;
    std::exception_ptr error;
  };

  void loop();
  void execute(Task& task);
  /// Waits for w (a step of the current collective) until the deadline, plus a grace period for
  /// the inner group's own deadline to report first; throws StepFailure.
  static void await(const WorkPtr& w, const std::string& step, Clock::time_point deadline);
  /// The time left until the deadline, at least 1 ms (for the inner collectives' timeouts).
  static Duration left(Clock::time_point deadline) {
    return std::max(Duration(1),
                    std::chrono::duration_cast<Duration>(deadline - Clock::now()));
  }
  std::string local_step(const char* what, size_t piece, size_t pieces) const;
  std::string leaders_step(const char* what, size_t piece, size_t pieces) const;
  void allreduce_pieces_leader(const std::vector<Tensor>& pieces, ReduceOp op,
                               Clock::time_point deadline);
  void allreduce_pieces_member(const std::vector<Tensor>& pieces, ReduceOp op,
                               Clock::time_point deadline);

  NodeLayout layout_;
  int rank_;
  int size_;
  int node_;
  int local_rank_ = 0;
  size_t pipeline_bytes_;
  size_t flat_below_bytes_;
  bool local_shm_ = false;
  std::unique_ptr<ProcessGroupGloo> flat_;
  std::unique_ptr<ProcessGroupGloo> local_;    // null on a node of one rank
  std::unique_ptr<ProcessGroupGloo> leaders_;  // null unless a leader of several nodes
  std::string failed_;                         // the first failure (group thread only)

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Task> queue_;
  std::thread worker_;
};

void ProcessGroupHierarchical::Impl::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(task);
  }
}

namespace {
/// Rethrows `inner` as the same kind of error with `prefix` before its message.
[[noreturn]] void rethrow_with(const std::string& prefix, const std::exception_ptr& inner) {
  try {
    std::rethrow_exception(inner);
  } catch (const DistTimeoutError& e) {
    throw DistTimeoutError(prefix + e.what());
  } catch (const DistNetworkError& e) {
    throw DistNetworkError(prefix + e.what());
  } catch (const TypeError& e) {
    throw TypeError(prefix + e.what());
  } catch (const ValueError& e) {
    throw ValueError(prefix + e.what());
  } catch (const std::exception& e) {
    throw DistBackendError(prefix + e.what());
  }
}
}  // namespace

void ProcessGroupHierarchical::Impl::execute(Task& task) {
  const std::string& what = task.work->describe();
  if (!failed_.empty()) {
    task.work->finish_with_error(std::make_exception_ptr(DistBackendError(detail::str_cat(
        what, " failed: the group is unusable after an earlier failure: ", failed_))));
    return;
  }
  try {
    task.work->finish(task.run(task.deadline));
    return;
  } catch (const StepFailure& f) {
    try {
      rethrow_with(detail::str_cat(what, " (hierarchical, ", layout_.describe(), ") failed in ",
                                   f.step, ": "),
                   f.error);
    } catch (const std::exception& e) {
      failed_ = e.what();
      task.work->finish_with_error(std::current_exception());
    }
  } catch (const std::exception& e) {
    failed_ = e.what();
    task.work->finish_with_error(std::current_exception());
  }
  // The ranks are out of step now, and peers may wait on this rank in the local or leaders'
  // group until their timeout. Aborting a gloo group closes its connections, gives up its
  // shared-memory waits and tells its other ranks why through its store: the peers blocked on
  // this rank fail now, naming this failure, and in turn fail their other groups. (Destroying
  // the groups would instead wait, here, for their running collectives.)
  for (ProcessGroupGloo* g : {local_.get(), leaders_.get()}) {
    if (g != nullptr) g->abort(failed_);
  }
}

void ProcessGroupHierarchical::Impl::await(const WorkPtr& w, const std::string& step,
                                           Clock::time_point deadline) {
  try {
    w->wait(left(deadline) + 1s);
  } catch (...) {
    throw StepFailure{step, std::current_exception()};
  }
}

std::string ProcessGroupHierarchical::Impl::local_step(const char* what, size_t piece,
                                                       size_t pieces) const {
  const std::string part =
      pieces > 1 ? detail::str_cat(" of piece ", piece + 1, " of ", pieces) : std::string();
  return detail::str_cat("the local ", what, part, " of node ", node_, " (its ranks ",
                         join_ranks(layout_.members(node_)), " are ranks 0.. of that group; this"
                         " is its rank ", local_rank_, ")");
}

std::string ProcessGroupHierarchical::Impl::leaders_step(const char* what, size_t piece,
                                                         size_t pieces) const {
  const std::string part =
      pieces > 1 ? detail::str_cat(" of piece ", piece + 1, " of ", pieces) : std::string();
  return detail::str_cat("the leaders' ", what, part, " (the node leaders ",
                         join_ranks(layout_.leaders()), " are ranks 0.. of that group; this is "
                         "its rank ", node_, ")");
}

void ProcessGroupHierarchical::Impl::allreduce_pieces_leader(const std::vector<Tensor>& pieces,
                                                             ReduceOp op,
                                                             Clock::time_point deadline) {
  const size_t n = pieces.size();
  const ReduceOp sum_op = op == ReduceOp::Avg ? ReduceOp::Sum : op;
  std::vector<WorkPtr> local(n), cross(n), bcast(n);
  std::vector<Tensor> ps = pieces;
  if (local_) local[0] = local_->allreduce(ps[0], AllreduceOptions{sum_op, left(deadline)});
  for (size_t k = 0; k <= n; ++k) {
    if (k < n) {
      if (local_) await(local[k], local_step("allreduce", k, n), deadline);
      cross[k] = leaders_->allreduce(ps[k], AllreduceOptions{sum_op, left(deadline)});
      if (local_ && k + 1 < n) {
        local[k + 1] = local_->allreduce(ps[k + 1], AllreduceOptions{sum_op, left(deadline)});
      }
    }
    if (k >= 1) {
      await(cross[k - 1], leaders_step("allreduce", k - 1, n), deadline);
      if (op == ReduceOp::Avg) detail::pg_gloo::divide_in_place(ps[k - 1], size_);
      if (local_) bcast[k - 1] = local_->broadcast(ps[k - 1], BroadcastOptions{0, left(deadline)});
    }
  }
  if (!local_) return;
  for (size_t k = 0; k < n; ++k) await(bcast[k], local_step("broadcast", k, n), deadline);
}

void ProcessGroupHierarchical::Impl::allreduce_pieces_member(const std::vector<Tensor>& pieces,
                                                             ReduceOp op,
                                                             Clock::time_point deadline) {
  // ReduceOp::Avg: a sum here; the leader divides before its broadcast.
  const ReduceOp sum_op = op == ReduceOp::Avg ? ReduceOp::Sum : op;
  const size_t n = pieces.size();
  std::vector<WorkPtr> local(n), bcast(n);
  std::vector<Tensor> ps = pieces;
  local[0] = local_->allreduce(ps[0], AllreduceOptions{sum_op, left(deadline)});
  for (size_t k = 0; k <= n; ++k) {
    if (k + 1 < n) {
      local[k + 1] = local_->allreduce(ps[k + 1], AllreduceOptions{sum_op, left(deadline)});
    }
    if (k >= 1) {
      await(local[k - 1], local_step("allreduce", k - 1, n), deadline);
      bcast[k - 1] = local_->broadcast(ps[k - 1], BroadcastOptions{0, left(deadline)});
    }
  }
  for (size_t k = 0; k < n; ++k) await(bcast[k], local_step("broadcast", k, n), deadline);
}

std::vector<Tensor> ProcessGroupHierarchical::Impl::allreduce(Tensor t, ReduceOp op,
                                                              Clock::time_point deadline) {
  if (layout_.nodes() == 1) {  // one node: its local group is the whole group
    if (local_) await(local_->allreduce(t, AllreduceOptions{op, left(deadline)}),
                      local_step("allreduce", 0, 1), deadline);
    return {t};
  }
  // Every rank cuts the same pieces: they depend only on the element count and dtype, which
  // the ranks' calls must agree on anyway.
  const Tensor flat = t.reshape({-1});
  const int64_t numel = flat.numel(), item = itemsize(t.dtype());
  int64_t count = 1;
  if (pipeline_bytes_ > 0) {
    const int64_t most = static_cast<int64_t>(pipeline_bytes_);
    const int64_t least = std::min<int64_t>(kMinPieceBytes, most);
    const int64_t per = std::max<int64_t>(1, std::clamp(numel * item / 8, least, most) / item);
    count = (numel + per - 1) / per;
  }
  std::vector<Tensor> pieces;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t start = numel * k / count, end = numel * (k + 1) / count;
    pieces.push_back(flat.narrow(0, start, end - start));
  }
  if (leaders_) {
    allreduce_pieces_leader(pieces, op, deadline);
  } else {
    allreduce_pieces_member(pieces, op, deadline);
  }
  return {t};
}

std::vector<Tensor> ProcessGroupHierarchical::Impl::broadcast(Tensor t, int root,
                                                              Clock::time_point deadline) {
  const int root_node = layout_.node_of(root);
  const std::vector<int>& root_members = layout_.members(root_node);
  const int root_local =
      static_cast<int>(std::find(root_members.begin(), root_members.end(), root) -
                       root_members.begin());
  // Root's node first hands root's tensor to its leader (all of that node gets it then).
  const bool root_node_done = node_ == root_node && root_local != 0;
  if (root_node_done && local_) {
    await(local_->broadcast(t, BroadcastOptions{root_local, left(deadline)}),
          local_step("broadcast from the root", 0, 1), deadline);
  }
  if (leaders_) {
    await(leaders_->broadcast(t, BroadcastOptions{root_node, left(deadline)}),
          leaders_step("broadcast", 0, 1), deadline);
  }
  if (!root_node_done && local_) {
    await(local_->broadcast(t, BroadcastOptions{0, left(deadline)}),
          local_step("broadcast", 0, 1), deadline);
  }
  return {t};
}

// ---- ProcessGroupHierarchical -------------------------------------------------------------------

ProcessGroupHierarchical::ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank,
                                                   int size, const NodeLayout& layout,
                                                   HierarchicalOptions options)
    : ProcessGroup(rank, size, Options{options.gloo.timeout}) {
  EMBER_CHECK(store != nullptr, "[gloo] ProcessGroupHierarchical needs a store");
  EMBER_CHECK(layout.size() == size, "[gloo] ProcessGroupHierarchical: the node layout has ",
              layout.size(), " ranks, the group ", size);
  impl_ = std::make_unique<Impl>(*this, store, layout, options);
}

ProcessGroupHierarchical::ProcessGroupHierarchical(std::shared_ptr<Store> store, int rank,
                                                   int size, HierarchicalOptions options)
    : ProcessGroupHierarchical(
          store, rank, size,
          [&] {
            EMBER_CHECK(store != nullptr, "[gloo] ProcessGroupHierarchical needs a store");
            return exchange_node_keys(*store, rank, size, local_node_key(), true, nullptr,
                                      options.gloo.timeout);
          }(),
          options) {}

ProcessGroupHierarchical::~ProcessGroupHierarchical() = default;

const NodeLayout& ProcessGroupHierarchical::layout() const { return impl_->layout(); }
int ProcessGroupHierarchical::node() const { return impl_->node(); }

bool ProcessGroupHierarchical::abort(const std::string& reason) {
  // Sends and receives go through the flat group, whose ranks are this group's, so its abort
  // record names the rank as the peers know it; the node and leaders' groups fail with it, and
  // the group's thread records the first failure when their collectives fail.
  for (ProcessGroupGloo* g : impl_->groups()) {
    if (g != nullptr) g->abort(reason);
  }
  return true;
}
bool ProcessGroupHierarchical::local_uses_shared_memory() const { return impl_->local_shm(); }

namespace {
void check_cpu_tensor(const char* op, const Tensor& t) {
  EMBER_CHECK(t.defined(), "[gloo] ", op, ": tensor is undefined");
  EMBER_CHECK(t.device().is_cpu(), "[gloo] ", op, " expects CPU or CUDA tensors, got ",
              t.device());
  EMBER_CHECK(t.is_contiguous(), "[gloo] ", op, " expects a contiguous tensor (shape ", t.shape(),
              ")");
  EMBER_CHECK_TYPE(TypeError, t.dtype() != kBool, "[gloo] ", op,
                   " supports float32, float64, float16, bfloat16, int32, int64 and uint8, got ",
                   t.dtype());
}

/// A CUDA tensor's collective runs on a host copy; the result is copied back (as gloo does).
template <typename Run>
WorkPtr via_host(const char* name, Tensor& tensor, Run run) {
  auto host = std::make_shared<Tensor>(tensor.contiguous().to(kCPU));
  WorkPtr inner = run(*host);
  Tensor dev = tensor;
  return chain_work(inner, name, [dev, host]() mutable {
    dev.copy_(*host);
    return std::vector<Tensor>{dev};
  });
}
}  // namespace

WorkPtr ProcessGroupHierarchical::issue(const char* name, Tensor& tensor,
                                        std::optional<Duration> timeout, const FlatOp& flat,
                                        const StepsOp& steps) {
  if (tensor.defined() && tensor.is_cuda()) {
    const std::string what = detail::str_cat(name, " of a CUDA tensor");
    return via_host(what.c_str(), tensor,
                    [&](Tensor& host) { return issue(name, host, timeout, flat, steps); });
  }
  check_cpu_tensor(name, tensor);
  if (impl_->small(tensor)) {
    next_op_label(name);
    return record_flight(flat(impl_->flat(), tensor), {tensor});
  }
  Tensor t = tensor;
  Impl* impl = impl_.get();
  return record_flight(impl_->submit(next_op_label(name), timeout_of(timeout),
                                     [impl, t, steps](Clock::time_point deadline) {
                                       return steps(*impl, t, deadline);
                                     }),
                       {t});
}

WorkPtr ProcessGroupHierarchical::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  return issue(
      "allreduce", tensor, opts.timeout,
      [&](ProcessGroup& flat, Tensor& t) { return flat.allreduce(t, opts); },
      [op = opts.op](Impl& impl, const Tensor& t, Clock::time_point deadline) {
        return impl.allreduce(t, op, deadline);
      });
}

WorkPtr ProcessGroupHierarchical::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  check_root("broadcast", opts.root);
  return issue(
      "broadcast", tensor, opts.timeout,
      [&](ProcessGroup& flat, Tensor& t) { return flat.broadcast(t, opts); },
      [root = opts.root](Impl& impl, const Tensor& t, Clock::time_point deadline) {
        return impl.broadcast(t, root, deadline);
      });
}

// The flat group's collectives: next_op_label keeps this group's sequence numbers counting
// every collective (the flat group's own labels name the collective in its errors).
WorkPtr ProcessGroupHierarchical::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                        const CollectiveOptions& opts) {
  next_op_label("allgather_into_tensor");
  return record_flight(impl_->flat().allgather_into_tensor(output, input, opts), {input});
}

WorkPtr ProcessGroupHierarchical::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                            const CollectiveOptions& opts) {
  next_op_label("allgather");
  return record_flight(impl_->flat().allgather(outputs, input, opts), {input});
}

WorkPtr ProcessGroupHierarchical::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                         const GatherOptions& opts) {
  next_op_label("gather");
  return record_flight(impl_->flat().gather(outputs, input, opts), {input});
}

WorkPtr ProcessGroupHierarchical::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                          const ScatterOptions& opts) {
  next_op_label("scatter");
  return record_flight(impl_->flat().scatter(output, inputs, opts), {output});
}

WorkPtr ProcessGroupHierarchical::alltoall(std::vector<Tensor>& outputs,
                                           const std::vector<Tensor>& inputs,
                                           const CollectiveOptions& opts) {
  next_op_label("alltoall");
  return record_flight(impl_->flat().alltoall(outputs, inputs, opts), inputs);
}

WorkPtr ProcessGroupHierarchical::barrier(const CollectiveOptions& opts) {
  // Issued on the flat group now, in the caller's order of flat collectives; completed by the
  // group's thread, which reaches it only after every earlier hierarchical collective.
  const std::string label = next_op_label("barrier");
  WorkPtr flat = impl_->flat().barrier(opts);
  return record_flight(
      impl_->submit(label, timeout_of(opts.timeout),
                    [flat](Clock::time_point deadline) {
                      flat->wait(std::max(Duration(1), std::chrono::duration_cast<Duration>(
                                                           deadline - Clock::now())) +
                                 1s);
                      return std::vector<Tensor>{};
                    }),
      {});
}

WorkPtr ProcessGroupHierarchical::send(const Tensor& tensor, int dst, int tag) {
  next_p2p_label("send");
  return record_flight(impl_->flat().send(tensor, dst, tag), {tensor});
}

WorkPtr ProcessGroupHierarchical::recv(Tensor& tensor, int src, int tag) {
  next_p2p_label("recv");
  return record_flight(impl_->flat().recv(tensor, src, tag), {tensor});
}

}  // namespace ember::dist
