// DDP's reducer: averages the gradients of DistributedDataParallel's parameters over the ranks
// during the backward pass (Note [DDP reducer] in reducer.cpp). Internal to
// DistributedDataParallel: not part of the public API.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp_options.h>
#include <ember/distributed/process_group.h>

namespace ember::dist::detail {

/// How one bucket is reduced in an iteration; Reducer::choose_reduction decides.
enum class BucketReduction {
  LocalOnly,         ///< one rank, every gradient left in grad(): nothing to do
  InPlaceCoalesced,  ///< every gradient left in grad() and all-reduced there (Note [DDP in place])
  FlatBuffer,        ///< copied into the bucket's flat buffer, all-reduced, copied back
  Hook,              ///< the flat buffer handed to the communication hook
};

/// Where the reducer stands between a forward and the next (Note [DDP reducer]).
enum class IterationState {
  Idle,       ///< no synchronised backward pending: gradients only accumulate locally
  Armed,      ///< a synchronised forward ran; its backward pass has not started
  Reducing,   ///< that backward pass runs: gradients fill buckets, finalize() is queued
  Finalized,  ///< it has finished: another gradient before the next forward is an error
};

/// What a DDP iteration does besides the module's forward, decided at forward. Under join()
/// every rank with data must agree on it, and a rank that has run out mirrors it.
struct IterationPlan {
  bool sync = false;      ///< the backward pass is synchronised
  bool rebuild = false;   ///< the buckets are rebuilt first (Note [bucket rebuild])
  bool buffers = false;   ///< buffers are broadcast before the module's forward
  bool used_map = false;  ///< finalize all-reduces the map of locally used parameters
};

/// How a bucket's sum over the ranks becomes its average (Note [DDP averaging]).
class Averaging {
 public:
  /// The collective averages over the whole group (ReduceOp::Avg).
  Averaging() = default;
  /// Under join(): average over the ranks that still have data (`with_data` of `size`), or over
  /// the whole group if `over_initial_world_size`.
  static Averaging for_join(bool over_initial_world_size, int with_data, int size);
  /// The op the bucket collectives use.
  dist::ReduceOp op() const;
  /// Whether the collective's result is already the average (nothing left to divide).
  bool in_collective() const { return divisor_ == 0; }
  /// Turns a bucket summed with op() into its average (no-op when in_collective()).
  void finish(const Tensor& flat) const;

 private:
  int divisor_ = 0;  // 0: the collective divides; otherwise Sum, then divide by this
};

/// A parameter DDP synchronises (one that requires grad).
struct ReducerParam {
  std::string name;  ///< in the wrapped module
  Tensor tensor;
  size_t index = 0;  ///< position in the module's parameters()
};

/// The reducer of one DistributedDataParallel. Every method runs on the thread that issues the
/// group's collectives (the training thread, which also runs backward).
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  using Clock = std::chrono::steady_clock;

  /// Lays out the buckets in reverse registration order (Note [bucket rebuild]). `group`: the
  /// group the collectives go to (DDP's, checked under DETAIL). `info`: log the layout and
  /// timings every `log_every` iterations (EMBER_DISTRIBUTED_DEBUG=INFO).
  Reducer(std::shared_ptr<dist::ProcessGroup> group, const dist::DDPOptions& options,
          std::vector<ReducerParam> params, bool info, int64_t log_every);

  /// Registers every parameter's post-accumulate-grad hook. A registered hook keeps the reducer
  /// alive, so it never runs on a freed one; remove_hooks() must be called to let it go.
  void register_hooks();
  /// Removes the hooks register_hooks() added (DDP's destructor).
  void remove_hooks();

  // ---- forward -------------------------------------------------------------------------------

  /// Before a forward (or before join() shadows): throws ValueError if the last synchronised
  /// backward pass started but never finished, after waiting for what it launched; then clears
  /// the iteration's state.
  void prepare_for_forward();
  /// Whether a synchronised backward pass has finished but the one-time rebuild has not run.
  bool rebuild_due() const { return !rebuild_done_ && finalized_ > 0; }
  /// Note [bucket rebuild]. Collective.
  void rebuild();
  /// Whether a synchronised backward would all-reduce the used-parameter map at its end.
  bool uses_used_map() const;
  /// How this iteration's buckets are averaged (join() sets it per iteration).
  void set_averaging(Averaging averaging) { averaging_ = averaging; }
  /// Marks the start of the module's forward (timings).
  void forward_started();
  /// After the module's forward: arms the next backward pass if `sync`.
  void prepare_for_backward(bool sync);

  /// no_sync(): whether forwards synchronise.
  bool sync_enabled() const { return sync_enabled_; }
  void set_sync_enabled(bool enabled) { sync_enabled_ = enabled; }
  /// Throws ValueError if a hook is already set or a backward pass has run. `name` is what
  /// stats() reports.
  void set_comm_hook(dist::CommHook hook, std::string name);

  // ---- after backward --------------------------------------------------------------------------

  /// Waits for every launched bucket, abandoning deferred hook steps still queued; returns the
  /// first error instead of throwing.
  std::exception_ptr wait_all();

  /// join(): a rank that has run out takes part in one iteration of the others (the same
  /// collectives, with zeros). `broadcast_buffers` broadcasts the module's buffers.
  void shadow(const IterationPlan& plan, const std::function<void()>& broadcast_buffers);

  /// The buckets as indices into the module's parameters(), in reduction order.
  std::vector<std::vector<size_t>> bucket_indices() const;
  bool buckets_rebuilt() const { return rebuild_done_; }
  /// DistributedDataParallel::stats()'s reducer part: buckets, rebuilds, unused parameters,
  /// timings (Note [DDP timings]).
  void fill_stats(dist::DDPStats& s) const;

 private:
  struct Param {
    Tensor tensor;
    std::string name;
    size_t index = 0;  // position in the module's parameters()
    size_t bucket = 0;
    int64_t offset = 0;  // in elements, into the bucket's flat buffer
    unsigned hook = 0;   // the post-accumulate-grad hook's handle
    bool ready = false;
    bool in_grad = false;  // this iteration's gradient was left in grad(), not copied
    // Got a gradient in an unsynchronised backward (no_sync) since the last synchronised one:
    // its grad() holds that, and the next synchronised backward averages it even if the
    // parameter gets nothing more there (PyTorch's local_used_map, set under no_sync too).
    bool used_unsynced = false;
  };
  struct Bucket {
    Tensor flat;
    Tensor shadow;                // a joined rank's zeros, all-reduced in place of flat
    std::vector<size_t> params;   // into Reducer::params_
    std::vector<Tensor> tensors;  // the parameters, for GradBucket
    std::vector<size_t> module_indices;
    size_t pending = 0;
    std::shared_ptr<dist::Future> future;      // the all-reduce's or the hook's
    std::optional<BucketReduction> reduction;  // set when launched
    // Bytes this rank sent for it this iteration (GradBucket::record_bytes_sent; -1: unknown).
    std::shared_ptr<std::atomic<int64_t>> sent = std::make_shared<std::atomic<int64_t>>(0);
  };
  // static_graph: what the first synchronised iteration found.
  struct StaticGraph {
    std::vector<char> used;         // locally
    std::vector<char> used_global;  // by some rank
  };
  // The all-reduce of the map of locally used parameters, in flight.
  struct UsedMap {
    Tensor counts;
    dist::WorkPtr work;
    std::vector<char> wait() const;  // used by some rank, per parameter
  };
  // One synchronised iteration's phases in ms (Note [DDP timings]).
  struct Phases {
    double forward = 0, backward = 0, comm = 0, wait = 0, overlap = 0;
    Phases& operator+=(const Phases& o);
  };
  // Note [DDP timings]: always kept (four clock reads per iteration), logged under
  // EMBER_DISTRIBUTED_DEBUG=INFO.
  struct Timings {
    Phases window;  // since the last INFO line
    int64_t window_iterations = 0;
    Phases last, total;
    int64_t iterations = 0;  // timed, since construction
    Clock::time_point forward_start, forward_end, first_launch;
    bool launched_any = false;
  };

  // layout (reducer_buckets.cpp)
  std::vector<std::vector<size_t>> assign(const std::vector<size_t>& order) const;
  std::vector<std::vector<size_t>> layout() const;
  void apply(std::vector<std::vector<size_t>> layout);
  Tensor slot(const Param& p) const;
  void log(const std::string& line) const;
  void log_layout(const std::string& when) const;

  // backward
  void mark_ready(size_t i);
  void begin_backward();
  void take_gradient(Param& p);
  bool may_stay_in_grad(const Tensor& grad, const Tensor& slot) const;
  BucketReduction choose_reduction(const Bucket& b, bool shadow) const;
  void launch(size_t index, bool shadow = false);
  void launch_ready();
  void mark_unused(size_t i);
  bool tolerates_unused() const;
  bool any_ready() const;
  void reset_iteration(IterationState next);

  // The autograd callback queued by the first gradient of a synchronised backward pass: waits
  // for every bucket and writes the averages into grad(). Throws for unused parameters (unless
  // tolerated), static_graph violations and the collectives' errors; the state is reset.
  void finalize();
  // finalize's stages
  std::vector<char> mark_unused_parameters();
  UsedMap start_used_map(const std::vector<char>& locally_used) const;
  std::vector<char> wait_for_reductions(const std::vector<char>& locally_used);
  void take_hook_results();
  void check_static_graph(const std::vector<char>& locally_used,
                          const std::vector<char>& used_anywhere);
  void learn_static_graph(const std::vector<char>& local, const std::vector<char>& global);
  void write_back(const std::vector<char>& used_anywhere);
  void record_timings(Clock::time_point backward_end, Clock::time_point done);
  [[noreturn]] void throw_unfinished();

  std::shared_ptr<dist::ProcessGroup> group_;
  dist::DDPOptions options_;
  std::vector<Param> params_;  // requiring grad, in registration order
  std::vector<Bucket> buckets_;
  dist::CommHook hook_;
  std::string hook_name_;
  std::shared_ptr<DeferredSteps> deferred_;

  IterationState state_ = IterationState::Idle;
  bool sync_enabled_ = true;  // false under no_sync()
  Averaging averaging_;
  size_t next_launch_ = 0;               // the lowest bucket not launched yet
  std::vector<std::string> violations_;  // this iteration's departures from the static graph

  bool backward_seen_ = false;
  int64_t finalized_ = 0;        // synchronised backward passes finalized (or failed)
  std::vector<size_t> arrival_;  // into params_, in the order gradients became ready
  bool rebuild_done_ = false;
  std::optional<StaticGraph> static_graph_;
  int64_t unused_last_ = 0;  // parameters no rank used in the last finalized iteration
  // Bytes sent (Note [DDP bytes]): the last finalized iteration's per bucket, and totals over
  // the iterations whose every bucket's bytes were known.
  std::vector<int64_t> bucket_sent_last_;
  int64_t sent_total_ = 0, allreduce_total_ = 0;
  void record_bytes();

  bool info_ = false;
  int64_t log_every_ = 100;
  Timings timings_;
};

}  // namespace ember::dist::detail
