#include "distributed/ddp.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <utility>

#include "autograd/engine.h"
#include "distributed/debug.h"
#include "distributed/init.h"
#include "tensor/creation.h"
#include "tensor/grad_mode.h"

namespace ember::dist {

namespace detail {

// Note [DDP reducer]: the per-iteration state machine behind DistributedDataParallel.
// forward() arms it; each parameter's post-accumulate-grad hook copies the gradient into its
// bucket slot; when the lowest not-yet-launched bucket is complete, it and every complete bucket
// after it are launched (all-reduced, or handed to the communication hook); launching strictly
// in bucket order keeps the collective sequence identical on every rank even if gradients arrive
// in a different order. The first hook of the iteration queues an autograd callback (finalize)
// that runs once the backward pass is over: it deals with parameters that got no gradient, runs
// the hooks' deferred steps (Note [comm hook ordering]), waits for every bucket and writes the
// averages back into grad(). Hooks hold a weak_ptr, so they are harmless after the DDP object is
// gone (leaf hooks cannot be removed).
//
// Note [bucket rebuild]: the first synchronised backward pass records the order in which
// gradients became ready. At the next forward (with grad mode on) rank 0 broadcasts its order
// and every rank rebuilds the same buckets from it (torch's _rebuild_buckets), once. Collective:
// every rank reaches it at the same forward because every rank finalizes the same iterations
// (under join(), a joined rank counts the iterations it shadows, and follows the others' flag).
//
// Note [DDP join]: inside join(), every forward of a rank that still has data and every round
// of a rank that has run out all-reduce one small vector (JoinRound): a 1 in each rank's own
// slot if it has data, and flags saying what this iteration does (synchronise the backward,
// rebuild, broadcast buffers, all-reduce the used-parameter map). A rank that has run out
// learns from it which collectives the others are about to issue and issues the same ones
// (shadow()), with zero gradients; the sum of the slots is the number of ranks with data, and
// 0 ends the loop.
struct Reducer {
  using Clock = std::chrono::steady_clock;

  struct Param {
    Tensor tensor;
    std::string name;
    size_t index = 0;  // position in module->parameters()
    size_t bucket = 0;
    int64_t offset = 0;  // in elements, into the bucket's flat buffer
    bool ready = false;
    bool in_place = false;  // this iteration's gradient was left in grad(), not copied (below)
  };
  struct Bucket {
    Tensor flat;
    Tensor shadow;                // a joined rank's zeros, all-reduced in place of flat
    std::vector<size_t> params;   // into Reducer::params
    std::vector<Tensor> tensors;  // the parameters, for GradBucket
    std::vector<size_t> module_indices;
    size_t pending = 0;
    std::shared_ptr<Future> future;  // the all-reduce's or the hook's
    bool launched = false;
    bool in_place = false;  // all-reduced where the gradients lie (Note [DDP in place])
  };

  std::shared_ptr<ProcessGroup> group;  // DDP's communication group (checked under DETAIL)
  DDPOptions options;
  std::vector<Param> params;  // requiring grad, in registration order
  std::vector<Bucket> buckets;
  bool armed = false;
  bool callback_queued = false;
  size_t next_launch = 0;
  bool sync_enabled = true;  // false under no_sync()
  // A synchronised backward pass finished since the last forward: another gradient now comes
  // from a second, unsynchronised backward pass.
  bool finalized_since_forward = false;

  CommHook hook;
  std::shared_ptr<DeferredSteps> deferred;
  bool backward_seen = false;
  int64_t finalized = 0;        // synchronised backward passes finalized (or failed)
  std::vector<size_t> arrival;  // into params, in the order gradients became ready
  bool rebuild_done = false;

  // static_graph: what the first synchronised iteration found.
  bool static_known = false;
  std::vector<char> static_used;         // locally
  std::vector<char> static_used_global;  // by some rank
  std::vector<std::string> violations;   // this iteration's departures from it

  // join(): 0 means ReduceOp::Avg; otherwise Sum, then divide by this (the ranks with data).
  int divisor = 0;

  // EMBER_DISTRIBUTED_DEBUG=INFO statistics (Note [DDP timings]).
  bool info = false;
  int64_t log_every = 100;
  Clock::time_point forward_start, forward_end, first_launch;
  bool launched_any = false;
  struct Sums {
    double forward = 0, backward = 0, comm = 0, wait = 0, overlap = 0;
    int64_t iterations = 0;
  } sums;

  bool tolerates_unused() const { return options.find_unused_parameters || options.static_graph; }
  // One rank, no hook, gradients not bucket views: the average is each gradient itself, so the
  // buckets are skipped altogether (no copy in, no division, no copy back: DDP's whole overhead
  // at one rank, 5 ms of a 45 ms step for a 10M-parameter MLP on 16 cores, 5 of 30 ms on 2).
  // Parameters are still marked ready, so the errors (unused, ready twice, static_graph
  // changes) are the same as with more ranks.
  bool local_only() const {
    return group->size() == 1 && !hook && !options.gradient_as_bucket_view;
  }

  // Note [DDP in place]: when the group all-reduces a list of tensors where they lie
  // (coalesced_without_copies(): CPU tensors over gloo with every rank on one machine), a
  // bucket without a hook skips its flat buffer: the gradients stay in grad() as they arrive,
  // the bucket all-reduces them with allreduce_coalesced, and finalize has nothing to copy back.
  // That saves two passes over every gradient (into the bucket, and back), 10 ms of a 68 ms
  // step for a 10M-parameter MLP on the 2-core VM. A bucket falls back to the flat buffer
  // (copying what it kept in place) if any of its gradients is missing or unusable (an unused
  // parameter, a non-contiguous gradient) or join() divides by the ranks with data.
  // grad() of a parameter whose bucket has launched is then being averaged during the rest of
  // backward (torch: it holds the local gradient until backward ends); after backward, both
  // hold the average.
  bool in_place_possible(const Device& device) const {
    return !hook && !options.gradient_as_bucket_view && group->size() > 1 &&
           group->coalesced_without_copies(device);
  }

  // Whether the coming finalize all-reduces the map of locally used parameters.
  bool uses_used_map() const {
    return options.static_graph ? !static_known : options.find_unused_parameters;
  }

  Tensor slot(const Param& p) const {
    return buckets[p.bucket].flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.shape());
  }

  void reset() {
    armed = false;
    callback_queued = false;
    next_launch = 0;
    launched_any = false;
    violations.clear();
    for (auto& p : params) {
      p.ready = false;
      p.in_place = false;
    }
    for (auto& b : buckets) {
      b.pending = b.params.size();
      b.future.reset();
      b.shadow = Tensor();
      b.launched = false;
      b.in_place = false;
    }
  }

  void log(const std::string& line) const {
    std::cerr << "[ddp rank " << group->rank() << "] " << line << std::endl;
  }

  // One line: every bucket's size, dtype and parameter names (at most 8 shown per bucket).
  void log_layout(const std::string& when) const {
    std::ostringstream os;
    os << buckets.size() << " bucket(s) " << when << ":";
    for (size_t i = 0; i < buckets.size(); ++i) {
      const Bucket& b = buckets[i];
      os << (i ? ";" : "") << " [" << i << "] " << b.flat.nbytes() << " B " << b.flat.dtype() << " "
         << b.flat.device() << " {";
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (k == 8) {
          os << ", ... " << b.params.size() - 8 << " more";
          break;
        }
        os << (k ? ", " : "") << params[b.params[k]].name;
      }
      os << "}";
    }
    log(os.str());
  }

  // Buckets from an order of parameters (indices into params): one open bucket per (dtype,
  // device); a bucket closes once it reaches its cap (the first of each kind: the first-bucket
  // cap). Buckets are ordered by the position of their first parameter in `order`.
  std::vector<std::vector<size_t>> assign(const std::vector<size_t>& order) const {
    constexpr double kMiB = 1024.0 * 1024.0;
    const double cap = options.bucket_cap_mb * kMiB;
    const double first_cap = std::min(options.first_bucket_cap_mb, options.bucket_cap_mb) * kMiB;
    struct Open {
      std::vector<size_t> members;
      double bytes = 0;
      size_t closed = 0;
    };
    std::map<std::pair<int, std::string>, Open> open;
    std::vector<std::vector<size_t>> out;
    for (size_t k : order) {
      const Tensor& t = params[k].tensor;
      Open& o = open[std::make_pair(static_cast<int>(t.dtype()), t.device().str())];
      o.members.push_back(k);
      o.bytes += static_cast<double>(t.nbytes());
      if (o.bytes >= (o.closed == 0 ? first_cap : cap)) {
        out.push_back(std::move(o.members));
        o.members.clear();
        o.bytes = 0;
        ++o.closed;
      }
    }
    for (auto& [key, o] : open) {
      if (!o.members.empty()) out.push_back(std::move(o.members));
    }
    std::vector<size_t> position(params.size());
    for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
    std::stable_sort(out.begin(), out.end(), [&](const auto& a, const auto& b) {
      return position[a.front()] < position[b.front()];
    });
    return out;
  }

  std::vector<std::vector<size_t>> layout() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& b : buckets) out.push_back(b.params);
    return out;
  }

  // Allocates the buckets of `layout`. With gradient_as_bucket_view, a grad() that is a view
  // into an old bucket moves (values and all) into the new bucket.
  void apply(std::vector<std::vector<size_t>> layout) {
    std::vector<Tensor> moved(params.size());
    if (options.gradient_as_bucket_view) {
      for (size_t k = 0; k < params.size(); ++k) {
        const Tensor g = params[k].tensor.grad();
        if (g.defined() && params[k].bucket < buckets.size() &&
            g.storage() == buckets[params[k].bucket].flat.storage()) {
          moved[k] = g;
        }
      }
    }
    std::vector<Bucket> fresh;
    for (auto& members : layout) {
      Bucket b;
      int64_t numel = 0;
      for (size_t k : members) {
        auto& p = params[k];
        p.bucket = fresh.size();
        p.offset = numel;
        numel += p.tensor.numel();
        b.tensors.push_back(p.tensor);
        b.module_indices.push_back(p.index);
      }
      b.flat = zeros({numel}, params[members.front()].tensor.options());
      b.params = std::move(members);
      b.pending = b.params.size();
      fresh.push_back(std::move(b));
    }
    buckets = std::move(fresh);
    deferred = std::make_shared<DeferredSteps>(buckets.size(), group->timeout());
    NoGradGuard no_grad;
    for (size_t k = 0; k < params.size(); ++k) {
      if (!moved[k].defined()) continue;
      Tensor s = slot(params[k]);
      s.copy_(moved[k]);
      params[k].tensor.set_grad(s);
    }
  }

  // Note [bucket rebuild].
  void rebuild() {
    rebuild_done = true;
    // With find_unused_parameters the recorded order may lack parameters (static_graph
    // completes it at the end of the first backward).
    if (options.find_unused_parameters && !options.static_graph) return;
    const size_t n = params.size();
    std::vector<int64_t> msg(n + 1, 0);
    if (group->rank() == 0 && arrival.size() == n) {
      msg[0] = 1;
      for (size_t i = 0; i < n; ++i) msg[i + 1] = static_cast<int64_t>(arrival[i]);
    }
    arrival.clear();
    arrival.shrink_to_fit();
    if (group->size() > 1) {
      Tensor t = from_vector(msg).to(group->default_device());
      group->broadcast(t, BroadcastOptions{})->wait();
      msg = t.to_vector<int64_t>();
    }
    if (msg[0] != 1) {
      if (info) log("bucket rebuild skipped (rank 0's first backward did not see every parameter)");
      return;
    }
    std::vector<size_t> order(n);
    std::vector<char> seen(n, 0);
    for (size_t i = 0; i < n; ++i) {
      const int64_t k = msg[i + 1];
      EMBER_INTERNAL_ASSERT(k >= 0 && static_cast<size_t>(k) < n && !seen[k],
                            "[DistributedDataParallel] rank 0's gradient order is not a "
                            "permutation of the ",
                            n, " parameters");
      seen[k] = 1;
      order[i] = static_cast<size_t>(k);
    }
    auto fresh = assign(order);
    const bool changed = fresh != layout();
    if (changed) apply(std::move(fresh));
    if (info)
      log_layout(changed ? "after the rebuild (rank 0's gradient order)"
                         : "after the rebuild (unchanged)");
  }

  // `shadow`: all-reduce zeros of the bucket's size instead of its gradients (a joined rank).
  void launch(size_t index, bool shadow = false) {
    Bucket& b = buckets[index];
    b.launched = true;
    if (info && !launched_any) first_launch = Clock::now();
    launched_any = true;
    if (shadow) b.shadow = zeros({b.flat.numel()}, b.flat.options());
    Tensor& buffer = shadow ? b.shadow : b.flat;
    if (hook) {
      GradBucket gb(index, buckets.size(), buffer, b.tensors, b.module_indices, group, deferred);
      b.future = hook(gb);
      EMBER_CHECK(b.future != nullptr,
                  "[DistributedDataParallel] the communication hook returned "
                  "a null future for bucket ",
                  index, "; it must return a Future");
      return;
    }
    if (group->size() == 1) return;  // the average of one rank is its own gradient
    AllreduceOptions o;
    o.op = divisor > 0 ? ReduceOp::Sum : ReduceOp::Avg;
    if (!shadow) {  // Note [DDP in place]
      bool all = divisor == 0;
      for (size_t k : b.params) all = all && params[k].in_place;
      if (all) {
        std::vector<Tensor> grads;
        for (size_t k : b.params) grads.push_back(params[k].tensor.grad());
        b.in_place = true;
        b.future = group->allreduce_coalesced(grads, o)->future();
        return;
      }
      NoGradGuard no_grad;
      for (size_t k : b.params) {
        if (params[k].in_place) slot(params[k]).copy_(params[k].tensor.grad());
      }
    }
    b.future = group->allreduce(buffer, o)->future();
  }

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
  }

  // Marks parameter i ready with its slot zeroed (it gets no gradient this iteration).
  void mark_unused(size_t i) {
    Param& p = params[i];
    NoGradGuard no_grad;
    slot(p).zero_();
    p.ready = true;
    --buckets[p.bucket].pending;
  }

  void on_grad_ready(const std::shared_ptr<Reducer>& self, size_t i) {
    backward_seen = true;
    Param& p = params[i];
    if (!armed) {
      EMBER_CHECK(!(finalized_since_forward && sync_enabled), "[DistributedDataParallel] rank ",
                  group->rank(), ": parameter '", p.name, "' (index ", p.index,
                  ") got a gradient in a second backward pass after the synchronised backward "
                  "of the same forward. Its gradient was already averaged over the ranks and this "
                  "backward pass is not synchronised, so the replicas would silently diverge. "
                  "Each synchronised forward takes exactly one backward pass: to accumulate over "
                  "several backward passes, run all but the last forward and backward under "
                  "no_sync() (or call forward again before each backward; do not backward twice "
                  "through one graph with retain_graph); a loss term computed from the "
                  "parameters outside the wrapped module's forward belongs inside it");
      return;
    }
    if (!callback_queued) {
      std::weak_ptr<Reducer> weak = self;
      autograd::queue_callback([weak] {
        if (auto r = weak.lock()) r->finalize();
      });
      callback_queued = true;
      if (static_known) {
        // static_graph: the parameters the first iteration did not use are ready at once, so
        // their buckets need not wait for the end of backward.
        for (size_t k = 0; k < params.size(); ++k) {
          if (!static_used[k]) mark_unused(k);
        }
        launch_ready();
      }
    }
    if (static_known && !static_used[i]) {
      violations.push_back(ember::detail::str_cat(
          "'", p.name, "' got a gradient (it got none in the first iteration)"));
      return;
    }
    EMBER_CHECK(!p.ready, "[DistributedDataParallel] rank ", group->rank(), ": parameter '", p.name,
                "' (index ", p.index,
                ") was marked ready twice in one iteration: its "
                "gradient arrived a second time before its bucket's reduction finished. This "
                "happens when the parameter takes part in several reentrant backward passes "
                "(a backward run inside another one, e.g. activation checkpointing that reuses "
                "it) or when a second backward over the same forward starts before the first "
                "ends. DDP reduces each parameter once per forward: let each parameter get its "
                "gradient once per backward pass, or run the extra backward passes under "
                "no_sync()");
    if (!rebuild_done && finalized == 0) arrival.push_back(i);
    const Tensor g = p.tensor.grad();
    Tensor s = slot(p);
    NoGradGuard no_grad;
    if (!g.defined()) {
      s.zero_();
    } else if (g.data_ptr() != s.data_ptr() && !local_only()) {  // a bucket view: in place
      if (in_place_possible(s.device()) && g.is_contiguous() && g.dtype() == s.dtype() &&
          g.device() == s.device()) {
        p.in_place = true;  // Note [DDP in place]
      } else {
        s.copy_(g);
      }
    }
    p.ready = true;
    if (--buckets[p.bucket].pending == 0) launch_ready();
  }

  // Waits for every launched bucket (so no collective is left running on a buffer we reuse),
  // remembering the first error. Deferred hook steps still queued (a backward pass that threw)
  // are abandoned: their futures fail instead of waiting forever.
  std::exception_ptr wait_all() {
    if (deferred && !deferred->empty()) {
      deferred->abandon(std::make_exception_ptr(DistError(
          "[DistributedDataParallel] the backward pass ended before the communication hook's "
          "deferred steps could run")));
    }
    std::exception_ptr first;
    for (auto& b : buckets) {
      if (!b.future) continue;
      try {
        b.future->wait(group->timeout());
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    return first;
  }

  // A hook's result, checked and copied into its bucket if it lives elsewhere.
  void take_hook_results() {
    NoGradGuard no_grad;
    for (size_t i = 0; i < buckets.size(); ++i) {
      Bucket& b = buckets[i];
      if (!b.future) continue;
      const std::vector<Tensor>& v = b.future->value();
      EMBER_CHECK(!v.empty() && v[0].defined() && v[0].numel() == b.flat.numel(),
                  "[DistributedDataParallel] the communication hook's future for bucket ", i,
                  " must hold a tensor of ", b.flat.numel(), " elements, got ",
                  v.empty()         ? std::string("no tensor")
                  : !v[0].defined() ? std::string("an undefined tensor")
                                    : std::to_string(v[0].numel()) + " elements");
      if (v[0].data_ptr() != b.flat.data_ptr() || v[0].dtype() != b.flat.dtype()) {
        b.flat.copy_(v[0].reshape({-1}));
      }
    }
  }

  // The all-reduce of the map of locally used parameters (find_unused_parameters and the first
  // static_graph iteration): counts the ranks that used each parameter.
  WorkPtr allreduce_used_map(const std::vector<char>& locally_used, Tensor& out) {
    std::vector<float> used(locally_used.begin(), locally_used.end());
    out = (used.empty() ? zeros({0}, kFloat32) : from_vector(used)).to(group->default_device());
    return group->allreduce(out, AllreduceOptions{});
  }

  // static_graph, end of the first iteration: remember who used what; complete rank 0's
  // gradient order with the unused parameters so the rebuild sees a permutation.
  void learn_static_graph(const std::vector<char>& local, const std::vector<char>& global) {
    static_known = true;
    static_used = local;
    static_used_global = global;
    if (!rebuild_done && arrival.size() < params.size()) {
      for (size_t k = params.size(); k-- > 0;) {
        if (!local[k]) arrival.push_back(k);
      }
    }
  }

  // Note [DDP timings]: forward = the module's forward; backward = from the end of forward to
  // the end of the autograd pass (includes computing the loss); communication = from the first
  // bucket launch to the moment every bucket is reduced (as seen by finalize); overlap = the
  // part of it before the end of the autograd pass; wait = the time finalize blocks.
  void record_timings(Clock::time_point backward_end, Clock::time_point done) {
    auto ms = [](Clock::duration d) {
      return std::chrono::duration<double, std::milli>(d).count();
    };
    sums.forward += ms(forward_end - forward_start);
    sums.backward += ms(backward_end - forward_end);
    if (launched_any) {
      sums.comm += ms(done - first_launch);
      sums.overlap += std::max(0.0, ms(backward_end - first_launch));
    }
    sums.wait += ms(done - backward_end);
    if (++sums.iterations < log_every) return;
    const double n = static_cast<double>(sums.iterations);
    std::ostringstream os;
    os.setf(std::ios::fixed);
    os.precision(3);
    os << "iterations " << finalized - sums.iterations + 1 << "-" << finalized
       << " average: forward " << sums.forward / n << " ms, backward " << sums.backward / n
       << " ms, communication " << sums.comm / n << " ms (overlapped with backward "
       << sums.overlap / n << " ms), waited at the end of backward " << sums.wait / n << " ms";
    log(os.str());
    sums = Sums{};
  }

  void finalize() {
    if (!armed) return;
    const Clock::time_point backward_end = info ? Clock::now() : Clock::time_point{};
    ++finalized;
    finalized_since_forward = true;
    std::vector<std::string> unused;
    for (const auto& p : params) {
      if (!p.ready) unused.push_back(p.name);
    }
    std::vector<char> locally_used(params.size(), 1);
    const bool static_first = options.static_graph && !static_known;
    if (!unused.empty()) {
      if (!tolerates_unused()) {
        // The launched buckets' deferred hook steps still run, so every rank that launched
        // them issues the same collectives.
        if (deferred) deferred->run_all();
        std::exception_ptr err = wait_all();
        reset();
        if (err) std::rethrow_exception(err);
        std::ostringstream names;
        for (size_t k = 0; k < unused.size(); ++k)
          names << (k ? ", " : "") << "'" << unused[k] << "'";
        throw ValueError(ember::detail::str_cat(
            "[DistributedDataParallel] rank ", group->rank(), ": ", unused.size(),
            " parameter(s) received no gradient in this backward pass: ", names.str(),
            ". Every parameter that requires grad must take part in computing the loss; "
            "construct DistributedDataParallel with find_unused_parameters = true if some do "
            "not (or static_graph = true if it is always the same ones)"));
      }
      // Unused here: contribute zeros, so the buckets still complete in order on every rank.
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].ready) continue;
        locally_used[i] = 0;
        if (static_known) {
          violations.push_back(ember::detail::str_cat(
              "'", params[i].name, "' got no gradient (it got one in the first iteration)"));
        }
        mark_unused(i);
      }
      try {
        launch_ready();
      } catch (...) {
        (void)wait_all();
        reset();
        throw;
      }
    }
    if (static_known) {
      for (size_t i = 0; i < params.size(); ++i) locally_used[i] = static_used[i];
    }
    // With find_unused_parameters, a parameter no rank used keeps its grad() (as in torch):
    // one more small all-reduce counts the ranks that used each parameter.
    Tensor global_used;
    WorkPtr used_work;
    if (uses_used_map() && group->size() > 1)
      used_work = allreduce_used_map(locally_used, global_used);
    // The hooks' later collectives, in rounds and bucket order (Note [comm hook ordering]).
    if (deferred) deferred->run_all();
    std::exception_ptr err = wait_all();
    if (used_work && !err) {
      try {
        used_work->wait();
      } catch (...) {
        err = std::current_exception();
      }
    }
    std::vector<char> used_anywhere = locally_used;
    if (global_used.defined() && !err) {
      const std::vector<float> counts = global_used.to_vector<float>();
      for (size_t i = 0; i < params.size(); ++i) used_anywhere[i] = counts[i] > 0.5f;
    } else if (static_known) {
      used_anywhere = static_used_global;
    }
    if (hook && !err) {
      try {
        take_hook_results();
      } catch (...) {
        err = std::current_exception();
      }
    }
    if (err) {
      reset();
      std::rethrow_exception(err);
    }
    if (static_first) learn_static_graph(locally_used, used_anywhere);
    if (!violations.empty()) {
      std::ostringstream what;
      for (size_t k = 0; k < violations.size(); ++k) what << (k ? "; " : "") << violations[k];
      reset();
      throw ValueError(ember::detail::str_cat(
          "[DistributedDataParallel] rank ", group->rank(),
          ": static_graph = true, but in "
          "iteration ",
          finalized,
          " the set of parameters that get gradients differs from the "
          "first iteration's: ",
          what.str(),
          ". static_graph promises that every iteration uses "
          "the same parameters; if the set changes from iteration to iteration, construct "
          "DistributedDataParallel with static_graph = false and find_unused_parameters = true. "
          "The gradients of this iteration were not written"));
    }
    NoGradGuard no_grad;
    const bool local = local_only();
    if (divisor > 0 && !hook && !local) {
      for (auto& b : buckets) {
        if (!b.in_place) b.flat.div_(divisor);
      }
    }
    for (size_t i = 0; i < params.size(); ++i) {
      Param& p = params[i];
      if (!used_anywhere[i]) continue;
      Tensor s = slot(p);
      const Tensor g = p.tensor.grad();
      if (options.gradient_as_bucket_view) {
        if (!g.defined() || g.data_ptr() != s.data_ptr()) p.tensor.set_grad(s);
      } else if (g.defined()) {
        if (local || buckets[p.bucket].in_place) continue;  // already the average
        Tensor dst = g;
        dst.copy_(s);
      } else {
        p.tensor.set_grad(s.clone());
      }
    }
    reset();
    if (info) record_timings(backward_end, Clock::now());
  }

  // forward() found the previous synchronised backward started but not finished (it threw, so
  // its finalize callback never ran): waits for what it launched, resets, and explains.
  void throw_unfinished() {
    std::vector<std::string> missing;
    size_t launched = 0;
    for (const auto& p : params) {
      if (!p.ready) missing.push_back("'" + p.name + "'");
    }
    for (const auto& b : buckets) launched += b.launched ? 1 : 0;
    (void)wait_all();
    reset();
    std::ostringstream names;
    for (size_t k = 0; k < missing.size(); ++k) names << (k ? ", " : "") << missing[k];
    throw ValueError(ember::detail::str_cat(
        "[DistributedDataParallel] rank ", group->rank(),
        ": expected the previous iteration's "
        "gradient reduction to have finished before a new forward, but the backward pass after "
        "the last synchronised forward did not complete: ",
        params.size() - missing.size(), " of ", params.size(), " parameters got their gradients (",
        launched, " of ", buckets.size(), " buckets were reduced); these did not: ", names.str(),
        ". This happens when that backward pass threw (see its error; other ranks may have "
        "reduced every bucket, so their collectives no longer match this rank's), or ran over "
        "only part of the graph. Make every output of forward take part in the loss, or "
        "construct DistributedDataParallel with find_unused_parameters = true if some "
        "parameters do not always get gradients. The reducer was reset; the next forward runs "
        "normally"));
  }

  bool any_ready() const {
    for (const auto& p : params) {
      if (p.ready) return true;
    }
    return false;
  }

  // ---- join (Note [DDP join]) ----
  struct JoinRound {
    int with_data = 0;
    std::vector<char> has_data;  // per rank
    bool sync = false, rebuild = false, buffers = false, used_map = false;
    int source = 0;  // lowest rank with data: the buffer broadcast's root
  };
  enum { kSync, kRebuild, kBuffers, kUsedMap, kFlags };

  // The per-iteration all-reduce of join(). A rank with data passes its intentions; a joined
  // rank passes nothing. Throws the same ValueError on every rank if the ranks with data
  // disagree.
  JoinRound join_round(bool has_data, bool sync, bool rebuild, bool buffers, bool used_map) {
    const int n = group->size();
    std::vector<float> v(n + kFlags, 0.0f);
    if (has_data) {
      v[group->rank()] = 1;
      v[n + kSync] = sync;
      v[n + kRebuild] = rebuild;
      v[n + kBuffers] = buffers;
      v[n + kUsedMap] = used_map;
    }
    Tensor t = from_vector(v).to(group->default_device());
    group->allreduce(t, AllreduceOptions{})->wait();
    v = t.to_vector<float>();
    JoinRound r;
    r.has_data.resize(n);
    r.source = -1;
    for (int k = 0; k < n; ++k) {
      r.has_data[k] = v[k] > 0.5f;
      r.with_data += r.has_data[k];
      if (r.has_data[k] && r.source < 0) r.source = k;
    }
    const char* what[] = {
        "run a synchronised backward (the others are under no_sync() or have "
        "grad mode off)",
        "rebuild the buckets", "broadcast buffers (training mode)",
        "all-reduce the used-parameter map"};
    bool* flags[] = {&r.sync, &r.rebuild, &r.buffers, &r.used_map};
    for (int f = 0; f < kFlags; ++f) {
      const int count = static_cast<int>(v[n + f] + 0.5f);
      EMBER_CHECK(count == 0 || count == r.with_data,
                  "[DistributedDataParallel.join] the ranks "
                  "with data disagree: ",
                  count, " of the ", r.with_data,
                  " ranks still training "
                  "in this iteration ",
                  what[f],
                  "; every rank must run the same kind of "
                  "iteration");
      *flags[f] = count > 0;
    }
    return r;
  }

  // A joined rank's part of one iteration of the others: the same collectives, with zeros.
  void shadow(const JoinRound& r, const std::function<void(int)>& broadcast_buffers) {
    if (r.rebuild) rebuild();
    if (r.buffers) broadcast_buffers(r.source);
    if (!r.sync) return;
    armed = true;  // so wait_all()/reset() see the launched buckets as this iteration's
    std::exception_ptr err;
    try {
      for (size_t i = 0; i < buckets.size(); ++i) launch(i, /*shadow=*/true);
    } catch (...) {
      err = std::current_exception();
    }
    Tensor global_used;
    WorkPtr used_work;
    if (!err && r.used_map && group->size() > 1) {
      used_work = allreduce_used_map(std::vector<char>(params.size(), 0), global_used);
    }
    if (!err && deferred) deferred->run_all();
    std::exception_ptr waited = wait_all();
    if (!err) err = waited;
    if (!err && used_work) {
      try {
        used_work->wait();
        // A rank that ran out before its first static_graph iteration adopts the others'
        // used set, so its later iterations match theirs.
        if (options.static_graph && !static_known) {
          const std::vector<float> counts = global_used.to_vector<float>();
          std::vector<char> global(params.size());
          for (size_t i = 0; i < params.size(); ++i) global[i] = counts[i] > 0.5f;
          learn_static_graph(global, global);
        }
      } catch (...) {
        err = std::current_exception();
      }
    }
    ++finalized;
    reset();
    if (err) std::rethrow_exception(err);
  }
};

}  // namespace detail

namespace {

constexpr const char* kOp = "[DistributedDataParallel]";

// One parameter's description, as exchanged at construction.
struct ParamSig {
  int64_t dtype = 0;
  int64_t requires_grad = 0;
  std::vector<int64_t> shape;
  bool operator==(const ParamSig&) const = default;
};

std::string describe(const ParamSig& s) {
  std::ostringstream os;
  os << "shape [";
  for (size_t i = 0; i < s.shape.size(); ++i) os << (i ? ", " : "") << s.shape[i];
  os << "] " << static_cast<Dtype>(s.dtype) << (s.requires_grad ? "" : " (no grad)");
  return os.str();
}

// Parses a signature [count, (dtype, requires_grad, ndim, dims...)*] (padded with -1).
std::vector<ParamSig> decode(const int64_t* v, int64_t len) {
  std::vector<ParamSig> out;
  if (len < 1) return out;
  const int64_t count = v[0];
  int64_t k = 1;
  for (int64_t i = 0; i < count && k + 3 <= len; ++i) {
    ParamSig s;
    s.dtype = v[k];
    s.requires_grad = v[k + 1];
    const int64_t nd = v[k + 2];
    k += 3;
    for (int64_t d = 0; d < nd && k < len; ++d) s.shape.push_back(v[k++]);
    out.push_back(std::move(s));
  }
  return out;
}

// Every rank must hold the same parameters: gathers each rank's signature and throws the same
// ValueError on every rank, naming the first parameter that differs and a rank that differs.
void check_same_parameters(ProcessGroup& pg, const nn::NamedTensors& named) {
  std::vector<int64_t> sig{static_cast<int64_t>(named.size())};
  for (const auto& [name, t] : named) {
    sig.push_back(static_cast<int64_t>(t.dtype()));
    sig.push_back(t.requires_grad() ? 1 : 0);
    sig.push_back(t.dim());
    for (int64_t d : t.shape()) sig.push_back(d);
  }
  const int n = pg.size();
  const Device dev = pg.default_device();
  Tensor len = from_vector(std::vector<int64_t>{static_cast<int64_t>(sig.size())}).to(dev);
  Tensor lens = zeros({n}, TensorOptions(kInt64).device(dev));
  pg.allgather_into_tensor(lens, len)->wait();
  int64_t max_len = 0;
  for (int64_t l : lens.to_vector<int64_t>()) max_len = std::max(max_len, l);
  sig.resize(max_len, -1);
  Tensor mine = from_vector(sig).to(dev);
  Tensor all = zeros({n * max_len}, TensorOptions(kInt64).device(dev));
  pg.allgather_into_tensor(all, mine)->wait();
  const std::vector<int64_t> v = all.to_vector<int64_t>();
  std::vector<std::vector<ParamSig>> sigs;
  for (int r = 0; r < n; ++r) sigs.push_back(decode(v.data() + r * max_len, max_len));
  // The first parameter index at which some rank differs from rank 0, then the first such rank.
  size_t common = sigs[0].size();
  for (const auto& s : sigs) common = std::min(common, s.size());
  for (size_t i = 0; i < common; ++i) {
    for (int r = 1; r < n; ++r) {
      if (sigs[r][i] == sigs[0][i]) continue;
      const std::string name = i < named.size() ? named[i].first : "?";
      throw ValueError(ember::detail::str_cat(
          kOp, " parameter ", i, " ('", name, "' on rank ", pg.rank(),
          ") differs across ranks: rank 0 has ", describe(sigs[0][i]), ", rank ", r, " has ",
          describe(sigs[r][i]), "; every rank must wrap the same model"));
    }
  }
  for (int r = 1; r < n; ++r) {
    EMBER_CHECK(sigs[r].size() == sigs[0].size(), kOp, " rank 0 has ", sigs[0].size(),
                " parameters but rank ", r, " has ", sigs[r].size(),
                "; every rank must wrap the same model");
  }
}

void broadcast_from(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root = 0) {
  if (pg.size() == 1) return;
  NoGradGuard no_grad;
  BroadcastOptions o;
  o.root = root;
  for (const Tensor& t : tensors) {
    Tensor d = t.detach();
    if (d.is_contiguous()) {
      pg.broadcast(d, o)->wait();
    } else {
      Tensor c = d.contiguous();
      pg.broadcast(c, o)->wait();
      d.copy_(c);
    }
  }
}

int64_t log_every_from_env() {
  const char* env = std::getenv("EMBER_DDP_LOG_EVERY");
  if (env == nullptr || *env == '\0') return 100;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  EMBER_CHECK(end != env && *end == '\0' && v > 0,
              "[EMBER_DDP_LOG_EVERY] expected a positive "
              "number of iterations, got '",
              env, "'");
  return v;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  EMBER_CHECK(module_ != nullptr, kOp, " expected a module, got null");
  EMBER_CHECK(options_.bucket_cap_mb > 0, kOp, " bucket_cap_mb must be > 0, got ",
              options_.bucket_cap_mb);
  EMBER_CHECK(options_.first_bucket_cap_mb > 0, kOp, " first_bucket_cap_mb must be > 0, got ",
              options_.first_bucket_cap_mb);
  if (!group_) group_ = default_group();
  const DebugLevel level = debug_level();
  comm_ = level == DebugLevel::Detail ? std::make_shared<CheckedProcessGroup>(group_) : group_;
  register_module("module", module_);

  const nn::NamedTensors named = module_->named_parameters();
  check_same_parameters(*comm_, named);
  broadcast_from(*comm_, module_->parameters());
  broadcast_from(*comm_, module_->buffers());

  auto reducer = std::make_shared<detail::Reducer>();
  reducer->group = comm_;
  reducer->options = options_;
  reducer->info = level != DebugLevel::Off;
  if (reducer->info) reducer->log_every = log_every_from_env();
  for (size_t i = 0; i < named.size(); ++i) {
    if (!named[i].second.requires_grad()) continue;
    detail::Reducer::Param p;
    p.tensor = named[i].second;
    p.name = named[i].first;
    p.index = i;
    reducer->params.push_back(std::move(p));
  }

  // Buckets: parameters in reverse registration order (gradients arrive roughly in that
  // order) until the rebuild (Note [bucket rebuild]).
  std::vector<size_t> reverse(reducer->params.size());
  for (size_t k = 0; k < reverse.size(); ++k) reverse[k] = reverse.size() - 1 - k;
  reducer->apply(reducer->assign(reverse));
  if (reducer->info) reducer->log_layout("at construction (reverse registration order)");
  reducer_ = reducer;

  std::weak_ptr<detail::Reducer> weak = reducer;
  for (size_t k = 0; k < reducer->params.size(); ++k) {
    reducer->params[k].tensor.register_post_accumulate_grad_hook([weak, k](const Tensor&) {
      if (auto r = weak.lock()) r->on_grad_ready(r, k);
    });
  }
}

// A backward pass that threw before its end leaves launched all-reduces behind: let them finish
// (bounded by the group's timeout) before their buffers are reused or freed.
DistributedDataParallel::~DistributedDataParallel() {
  if (reducer_) (void)reducer_->wait_all();
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  detail::Reducer& r = *reducer_;
  if (r.armed && r.any_ready()) r.throw_unfinished();
  (void)r.wait_all();
  r.reset();
  const bool grad = GradMode::is_enabled();
  const bool sync = require_sync_ && grad;
  const bool rebuild = !r.rebuild_done && r.finalized > 0 && grad;
  const bool buffers = options_.broadcast_buffers && is_training();
  int source = 0;
  if (join_) {
    const auto round = r.join_round(true, sync, rebuild, buffers, sync && r.uses_used_map());
    join_->last_with_data = round.has_data;
    if (join_->options.throw_on_early_termination && round.with_data < group_->size()) {
      throw DistError(early_termination_message(round.has_data));
    }
    r.divisor = join_->options.divide_by_initial_world_size || round.with_data == group_->size()
                    ? 0
                    : round.with_data;
    source = round.source;
  }
  if (rebuild) r.rebuild();
  if (buffers) broadcast_from(*comm_, module_->buffers(), source);
  if (r.info) r.forward_start = detail::Reducer::Clock::now();
  Tensor out = module_->forward(input);
  if (r.info) r.forward_end = detail::Reducer::Clock::now();
  r.armed = sync;
  r.finalized_since_forward = false;
  return out;
}

std::string DistributedDataParallel::early_termination_message(
    const std::vector<char>& has_data) const {
  std::ostringstream joined;
  int k = 0;
  for (size_t i = 0; i < has_data.size(); ++i) {
    if (!has_data[i]) joined << (k++ ? ", " : "") << i;
  }
  return ember::detail::str_cat(kOp, " join: rank(s) ", joined.str(), " of ", has_data.size(),
                                " ran out of inputs; "
                                "stopping every rank (throw_on_early_termination = true)");
}

void DistributedDataParallel::join(const std::function<void()>& body, JoinOptions options) {
  EMBER_CHECK(body != nullptr, kOp, " join expects a body, got null");
  EMBER_CHECK(!join_, kOp, " join: already inside join(); it cannot be nested");
  if (!options.enable || group_->size() == 1) {
    body();
    return;
  }
  detail::Reducer& r = *reducer_;
  join_ = std::make_unique<JoinState>();
  join_->options = options;
  struct Leave {
    DistributedDataParallel& ddp;
    ~Leave() {
      ddp.join_.reset();
      ddp.reducer_->divisor = 0;
    }
  } leave{*this};
  body();
  // Out of data: shadow the others until a round finds nobody with data.
  if (r.armed && r.any_ready()) r.throw_unfinished();
  (void)r.wait_all();
  r.reset();
  for (;;) {
    const auto round = r.join_round(false, false, false, false, false);
    if (round.with_data == 0) break;
    join_->last_with_data = round.has_data;
    if (options.throw_on_early_termination)
      throw DistError(early_termination_message(round.has_data));
    r.divisor = options.divide_by_initial_world_size ? 0 : round.with_data;
    r.shadow(round, [this](int source) { broadcast_from(*comm_, module_->buffers(), source); });
  }
  r.divisor = 0;
  // Every rank saw the same rounds, so all agree on the authoritative copy: the highest rank
  // among the last ones with data (torch's tie-break). No round with data: nothing to sync.
  int source = -1;
  for (size_t k = 0; k < join_->last_with_data.size(); ++k) {
    if (join_->last_with_data[k]) source = static_cast<int>(k);
  }
  if (source >= 0) {
    broadcast_from(*comm_, module_->parameters(), source);
    broadcast_from(*comm_, module_->buffers(), source);
  }
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.require_sync_) {
  ddp_.require_sync_ = false;
  ddp_.reducer_->sync_enabled = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  ddp_.require_sync_ = previous_;
  ddp_.reducer_->sync_enabled = previous_;
}

bool DistributedDataParallel::buckets_rebuilt() const { return reducer_->rebuild_done; }

void DistributedDataParallel::register_comm_hook(CommHook hook) {
  EMBER_CHECK(hook != nullptr, kOp, " register_comm_hook expects a hook, got null");
  EMBER_CHECK(!reducer_->hook, kOp,
              " a communication hook is already registered; register_comm_hook can be called "
              "only once");
  EMBER_CHECK(!reducer_->backward_seen, kOp,
              " register_comm_hook must be called before the first backward pass, got a call "
              "after one had run");
  reducer_->hook = std::move(hook);
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : reducer_->buckets) {
    std::vector<size_t> idx;
    for (size_t k : b.params) idx.push_back(reducer_->params[k].index);
    out.push_back(std::move(idx));
  }
  return out;
}

}  // namespace ember::dist
