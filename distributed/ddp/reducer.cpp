#include <ember/distributed/ddp/detail/reducer.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include <ember/autograd/engine.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist::detail {

// Note [DDP reducer]: the per-iteration state machine behind DistributedDataParallel.
// forward() arms it (IterationState::Armed); each parameter's post-accumulate-grad hook
// (mark_ready) hands the gradient to its bucket; when the lowest not-yet-launched bucket is
// complete, it and every complete bucket after it are launched (all-reduced, or handed to the
// communication hook); launching strictly in bucket order keeps the collective sequence
// identical on every rank even if gradients arrive in a different order. The first gradient of
// the iteration (Armed -> Reducing) queues an autograd callback, finalize(), that runs once the
// backward pass is over, in stages: parameters that got no gradient, the map of used
// parameters, waiting for the buckets (and the hooks' deferred steps, Note [comm hook
// ordering]), the static-graph check, and the write-back of the averages into grad(); it leaves
// the state Finalized until the next forward. The hooks are removed when DDP is destroyed;
// the queued callback (which cannot be removed) holds a weak_ptr, so it does nothing then.
//
// Note [DDP in place]: when the group all-reduces a list of tensors where they lie
// (coalesced_without_copies(): CPU tensors over gloo with every rank on one machine), a bucket
// without a hook skips its flat buffer: the gradients stay in grad() as they arrive, the bucket
// all-reduces them with allreduce_coalesced, and finalize has nothing to copy back. That saves
// two passes over every gradient (into the bucket, and back). With one rank and no hook, the
// average is each gradient itself, so the buckets are skipped altogether (no copy in, no
// division, no copy back); parameters are still marked ready, so the errors (unused, ready
// twice, static_graph changes) are the same as with more ranks. A bucket falls back to the
// flat buffer (copying what it kept in grad()) if any of its gradients is missing or unusable
// (an unused parameter, a non-contiguous gradient) or join() divides by the ranks with data.
// grad() of a parameter whose bucket has launched is then being averaged during the rest of
// backward (torch: it holds the local gradient until backward ends); after backward, both
// hold the average.
//
// Note [DDP averaging]: the average of a bucket is decided in one place, Averaging. Normally
// the collective averages (ReduceOp::Avg; each backend divides inside the collective). Under
// join() with divide_by_initial_world_size = false, while some ranks have run out, the buckets
// are summed and Averaging::finish divides by the ranks that still have data. A communication
// hook averages as it likes.

namespace {

constexpr const char* kOp = "[DistributedDataParallel]";

// A bucket's reduction on the timeline, on a row of its own ("ddp bucket i"): from the moment it
// was ready (its copy into the flat buffer included) until its future completed, with its bytes.
void trace_bucket(size_t index, int64_t bytes, int64_t ready_us, dist::Future* future) {
  auto record = [=] {
    trace::complete_on_row(1000 + static_cast<int>(index), str_cat("ddp bucket ", index),
                           "bucket allreduce", "ddp", ready_us, trace::now_us() - ready_us,
                           {{"bucket", static_cast<int64_t>(index)}, {"bytes", bytes}});
  };
  if (future == nullptr) return record();
  future->add_done_callback([record](dist::Future&) { record(); });
}

std::string joined(const std::vector<std::string>& items, const char* separator) {
  std::ostringstream os;
  for (size_t k = 0; k < items.size(); ++k) os << (k ? separator : "") << items[k];
  return os.str();
}

}  // namespace

// ---- Averaging --------------------------------------------------------------------------------

Averaging Averaging::for_join(bool over_initial_world_size, int with_data, int size) {
  Averaging a;
  if (!over_initial_world_size && with_data < size) a.divisor_ = with_data;
  return a;
}

dist::ReduceOp Averaging::op() const {
  return divisor_ > 0 ? dist::ReduceOp::Sum : dist::ReduceOp::Avg;
}

void Averaging::finish(const Tensor& flat) const {
  if (divisor_ == 0) return;
  NoGradGuard no_grad;
  Tensor t = flat;
  t.div_(divisor_);
}

// ---- hooks and the iteration's state -----------------------------------------------------------

void Reducer::register_hooks() {
  // The hooks hold the reducer itself: they must never outlive it, and remove_hooks() ends them.
  std::shared_ptr<Reducer> self = shared_from_this();
  for (size_t k = 0; k < params_.size(); ++k) {
    params_[k].hook = params_[k].tensor.register_post_accumulate_grad_hook(
        [self, k](const Tensor&) { self->mark_ready(k); });
  }
}

void Reducer::remove_hooks() {
  for (auto& p : params_) p.tensor.remove_hook(p.hook);
}

bool Reducer::tolerates_unused() const {
  return options_.find_unused_parameters || options_.static_graph;
}

bool Reducer::uses_used_map() const {
  return options_.static_graph ? !static_graph_ : options_.find_unused_parameters;
}

bool Reducer::any_ready() const {
  return std::any_of(params_.begin(), params_.end(), [](const Param& p) { return p.ready; });
}

void Reducer::reset_iteration(IterationState next) {
  state_ = next;
  next_launch_ = 0;
  timings_.launched_any = false;
  violations_.clear();
  for (auto& p : params_) {
    p.ready = false;
    p.in_grad = false;
  }
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.future.reset();
    b.shadow = Tensor();
    b.reduction.reset();
  }
}

void Reducer::prepare_for_forward() {
  if (state_ == IterationState::Reducing && any_ready()) throw_unfinished();
  (void)wait_all();
  reset_iteration(state_ == IterationState::Finalized ? IterationState::Finalized
                                                      : IterationState::Idle);
}

void Reducer::forward_started() { timings_.forward_start = Clock::now(); }

void Reducer::prepare_for_backward(bool sync) {
  timings_.forward_end = Clock::now();
  state_ = sync ? IterationState::Armed : IterationState::Idle;
}

void Reducer::set_comm_hook(dist::CommHook hook, std::string name) {
  EMBER_CHECK(!hook_, kOp,
              " a communication hook is already registered; register_comm_hook can be called "
              "only once");
  EMBER_CHECK(!backward_seen_, kOp,
              " register_comm_hook must be called before the first backward pass, got a call "
              "after one had run");
  hook_ = std::move(hook);
  hook_name_ = std::move(name);
}

// ---- backward ---------------------------------------------------------------------------------

void Reducer::mark_ready(size_t i) {
  backward_seen_ = true;
  Param& p = params_[i];
  switch (state_) {
    case IterationState::Idle:
      p.used_unsynced = true;
      return;
    case IterationState::Finalized:
      EMBER_CHECK(!sync_enabled_, kOp, " rank ", group_->rank(), ": parameter '", p.name,
                  "' (index ", p.index,
                  ") got a gradient in a second backward pass after the synchronised backward "
                  "of the same forward.\n  Its gradient was already averaged over the ranks and this "
                  "backward pass is not synchronised, so the replicas would silently diverge. "
                  "Each synchronised forward takes exactly one backward pass: to accumulate over "
                  "several backward passes, run all but the last forward and backward under "
                  "no_sync() (or call forward again before each backward; do not backward twice "
                  "through one graph with retain_graph); a loss term computed from the "
                  "parameters outside the wrapped module's forward belongs inside it");
      return;
    case IterationState::Armed:
      begin_backward();
      break;
    case IterationState::Reducing:
      break;
  }
  if (static_graph_ && !static_graph_->used[i]) {
    violations_.push_back(
        str_cat("'", p.name, "' got a gradient (it got none in the first iteration)"));
    return;
  }
  EMBER_CHECK(!p.ready, kOp, " rank ", group_->rank(), ": parameter '", p.name, "' (index ",
              p.index,
              ") was marked ready twice in one iteration: its "
              "gradient arrived a second time before its bucket's reduction finished.\n  This "
              "happens when the parameter takes part in several reentrant backward passes "
              "(a backward run inside another one, e.g. activation checkpointing that reuses "
              "it) or when a second backward over the same forward starts before the first "
              "ends. DDP reduces each parameter once per forward: let each parameter get its "
              "gradient once per backward pass, or run the extra backward passes under "
              "no_sync()");
  if (!rebuild_done_ && finalized_ == 0) arrival_.push_back(i);
  take_gradient(p);
  p.ready = true;
  if (--buckets_[p.bucket].pending == 0) launch_ready();
}

// The first gradient of a synchronised backward pass.
void Reducer::begin_backward() {
  state_ = IterationState::Reducing;
  std::weak_ptr<Reducer> weak = weak_from_this();
  autograd::queue_callback([weak] {
    if (auto r = weak.lock()) r->finalize();
  });
  if (!static_graph_) return;
  // static_graph: the parameters the first iteration did not use are ready at once, so their
  // buckets need not wait for the end of backward.
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!static_graph_->used[k]) mark_unused(k);
  }
  launch_ready();
}

// Whether a gradient may stay in grad() rather than be copied into its bucket slot: possible
// only where choose_reduction can then pick LocalOnly or InPlaceCoalesced for its bucket.
bool Reducer::may_stay_in_grad(const Tensor& grad, const Tensor& slot) const {
  if (hook_ || options_.gradient_as_bucket_view) return false;
  if (group_->size() == 1) return true;
  return group_->coalesced_without_copies(slot.device()) && grad.is_contiguous() &&
         grad.dtype() == slot.dtype() && grad.device() == slot.device();
}

void Reducer::take_gradient(Param& p) {
  const Tensor g = p.tensor.grad();
  Tensor s = slot(p);
  NoGradGuard no_grad;
  if (!g.defined()) {
    s.zero_();
  } else if (g.data_ptr() != s.data_ptr()) {  // else a bucket view: already in place
    if (may_stay_in_grad(g, s)) {
      p.in_grad = true;
    } else {
      s.copy_(g);
    }
  }
}

// The one place that decides how a bucket is reduced (Note [DDP in place]). `shadow`: a joined
// rank all-reduces zeros of the bucket's size.
BucketReduction Reducer::choose_reduction(const Bucket& b, bool shadow) const {
  if (hook_) return BucketReduction::Hook;
  if (shadow) return BucketReduction::FlatBuffer;
  const bool all_in_grad =
      std::all_of(b.params.begin(), b.params.end(), [&](size_t k) { return params_[k].in_grad; });
  if (all_in_grad && group_->size() == 1) return BucketReduction::LocalOnly;
  if (all_in_grad && averaging_.in_collective()) return BucketReduction::InPlaceCoalesced;
  return BucketReduction::FlatBuffer;
}

void Reducer::launch(size_t index, bool shadow) {
  Bucket& b = buckets_[index];
  if (!timings_.launched_any) timings_.first_launch = Clock::now();
  timings_.launched_any = true;
  const BucketReduction how = choose_reduction(b, shadow);
  b.reduction = how;
  // Note [DDP bytes]: what this rank sends for the bucket, as a ring all-reduce moves it when
  // DDP reduces, as the hook records it otherwise (-1 until it does).
  const int world = group_->size();
  b.sent->store(how == BucketReduction::Hook        ? -1
                : how == BucketReduction::LocalOnly ? 0
                                                    : dist::ring_allreduce_bytes(b.flat.nbytes(), world));
  if (shadow) b.shadow = zeros({b.flat.numel()}, b.flat.options());
  Tensor& buffer = shadow ? b.shadow : b.flat;
  dist::AllreduceOptions o;
  o.op = averaging_.op();
  switch (how) {
    case BucketReduction::LocalOnly:
      return;
    case BucketReduction::Hook: {
      dist::GradBucket gb(index, buckets_.size(), buffer, b.tensors, b.module_indices, group_,
                          deferred_, b.sent);
      b.future = hook_(gb);
      EMBER_CHECK(b.future != nullptr, kOp,
                  " the communication hook returned a null future for bucket ", index,
                  "; it must return a Future");
      return;
    }
    case BucketReduction::InPlaceCoalesced: {
      std::vector<Tensor> grads;
      for (size_t k : b.params) grads.push_back(params_[k].tensor.grad());
      b.future = group_->allreduce_coalesced(grads, o)->future();
      return;
    }
    case BucketReduction::FlatBuffer: {
      NoGradGuard no_grad;
      for (size_t k : b.params) {
        if (params_[k].in_grad) slot(params_[k]).copy_(params_[k].tensor.grad());
      }
      // One rank (with gradient_as_bucket_view): the buffer already holds the average.
      if (group_->size() > 1) b.future = group_->allreduce(buffer, o)->future();
      return;
    }
  }
}

void Reducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    const int64_t ready_us = trace::enabled() ? trace::now_us() : 0;
    launch(next_launch_++);
    if (ready_us != 0) {
      Bucket& b = buckets_[next_launch_ - 1];
      trace_bucket(next_launch_ - 1, b.flat.nbytes(), ready_us, b.future.get());
    }
  }
}

// Marks parameter i ready with its slot zeroed (it gets no gradient this iteration).
void Reducer::mark_unused(size_t i) {
  Param& p = params_[i];
  NoGradGuard no_grad;
  slot(p).zero_();
  p.ready = true;
  --buckets_[p.bucket].pending;
}

std::exception_ptr Reducer::wait_all() {
  if (deferred_ && !deferred_->empty()) {
    const std::string why = str_cat(
        kOp, " the backward pass ended before the communication hook's deferred steps could run");
    deferred_->abandon(std::make_exception_ptr(dist::DistError(why)));
  }
  std::exception_ptr first;
  for (auto& b : buckets_) {
    if (!b.future) continue;
    try {
      b.future->wait(group_->timeout());
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  return first;
}

// ---- finalize ---------------------------------------------------------------------------------

void Reducer::finalize() {
  if (state_ != IterationState::Reducing) return;
  const Clock::time_point backward_end = Clock::now();
  ++finalized_;
  // Whatever happens, the iteration ends here and the next forward starts clean.
  struct End {
    Reducer& r;
    ~End() { r.reset_iteration(IterationState::Finalized); }
  } end{*this};
  const std::vector<char> locally_used = mark_unused_parameters();
  trace::Span wait_span("wait for communication", "ddp");  // the exposed communication
  const std::vector<char> used_anywhere = wait_for_reductions(locally_used);
  wait_span.finish();
  check_static_graph(locally_used, used_anywhere);
  write_back(used_anywhere);
  unused_last_ = std::count(used_anywhere.begin(), used_anywhere.end(), 0);
  record_bytes();
  record_timings(backward_end, Clock::now());
}

void Reducer::record_bytes() {
  bucket_sent_last_.clear();
  int64_t sent = 0, allreduce = 0;
  bool known = true;
  for (const Bucket& b : buckets_) {
    const int64_t n = b.reduction ? b.sent->load() : 0;
    bucket_sent_last_.push_back(n);
    known = known && n >= 0;
    sent += std::max<int64_t>(n, 0);
    allreduce += dist::ring_allreduce_bytes(b.flat.nbytes(), group_->size());
  }
  if (known) {
    sent_total_ += sent;
    allreduce_total_ += allreduce;
  }
}

// Stage 1: parameters that got no gradient. An error unless tolerated; otherwise each
// contributes zeros, so the buckets still complete in order on every rank. Returns the map of
// locally used parameters (static_graph: the first iteration's).
std::vector<char> Reducer::mark_unused_parameters() {
  std::vector<char> locally_used(params_.size(), 1);
  std::vector<std::string> unused;
  // A parameter that got its gradient under no_sync only has one to contribute: its grad(),
  // taken now as mark_ready takes one.
  bool took = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const bool accumulated = p.used_unsynced && !p.ready && p.tensor.grad().defined();
    p.used_unsynced = false;
    if (!accumulated || (static_graph_ && !static_graph_->used[i])) continue;
    take_gradient(p);
    p.ready = true;
    --buckets_[p.bucket].pending;
    took = true;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].ready) continue;
    locally_used[i] = 0;
    unused.push_back("'" + params_[i].name + "'");
  }
  if (!unused.empty() && !tolerates_unused()) {
    // The launched buckets' deferred hook steps still run, so every rank that launched them
    // issues the same collectives.
    if (deferred_) deferred_->run_all();
    if (std::exception_ptr err = wait_all()) std::rethrow_exception(err);
    throw ValueError(
        str_cat(kOp, " rank ", group_->rank(), ": ", unused.size(),
                " parameter(s) received no gradient in this backward pass: ", joined(unused, ", "),
                ".\n  Every parameter that requires grad must take part in computing the loss; "
                "construct DistributedDataParallel with find_unused_parameters = true if some do "
                "not (or static_graph = true if it is always the same ones)"));
  }
  if (!unused.empty()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].ready) continue;
      if (static_graph_) {
        violations_.push_back(
            str_cat("'", params_[i].name, "' got no gradient (it got one in the first iteration)"));
      }
      mark_unused(i);
    }
  }
  if (took || !unused.empty()) {
    try {
      launch_ready();
    } catch (...) {
      (void)wait_all();
      throw;
    }
  }
  return static_graph_ ? static_graph_->used : locally_used;
}

// With find_unused_parameters (and the first static_graph iteration), a parameter no rank used
// keeps its grad() (as in torch): one more small all-reduce counts the ranks that used each
// parameter. Null work when not needed.
Reducer::UsedMap Reducer::start_used_map(const std::vector<char>& locally_used) const {
  UsedMap m;
  std::vector<float> used(locally_used.begin(), locally_used.end());
  m.counts = (used.empty() ? zeros({0}, kFloat32) : from_vector(used)).to(group_->default_device());
  m.work = group_->allreduce(m.counts, dist::AllreduceOptions{});
  return m;
}

std::vector<char> Reducer::UsedMap::wait() const {
  work->wait();
  const std::vector<float> c = counts.to_vector<float>();
  std::vector<char> out(c.size());
  for (size_t i = 0; i < c.size(); ++i) out[i] = c[i] > 0.5f;
  return out;
}

// Stage 2: the used map's all-reduce, the hooks' later collectives in rounds and bucket order
// (Note [comm hook ordering]), every bucket's reduction. Returns which parameters some rank
// used.
std::vector<char> Reducer::wait_for_reductions(const std::vector<char>& locally_used) {
  std::optional<UsedMap> used_map;
  if (uses_used_map() && group_->size() > 1) used_map = start_used_map(locally_used);
  if (deferred_) deferred_->run_all();
  if (std::exception_ptr err = wait_all()) std::rethrow_exception(err);
  std::vector<char> used_anywhere = used_map        ? used_map->wait()
                                    : static_graph_ ? static_graph_->used_global
                                                    : locally_used;
  if (hook_) take_hook_results();
  return used_anywhere;
}

// A hook's result, checked and copied into its bucket if it lives elsewhere.
void Reducer::take_hook_results() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (!b.future) continue;
    const std::vector<Tensor>& v = b.future->value();
    EMBER_CHECK(!v.empty() && v[0].defined() && v[0].numel() == b.flat.numel(), kOp,
                " the communication hook's future for bucket ", i, " must hold a tensor of ",
                b.flat.numel(), " elements, got ",
                v.empty()         ? std::string("no tensor")
                : !v[0].defined() ? std::string("an undefined tensor")
                                  : std::to_string(v[0].numel()) + " elements");
    if (v[0].data_ptr() != b.flat.data_ptr() || v[0].dtype() != b.flat.dtype()) {
      b.flat.copy_(v[0].reshape({-1}));
    }
  }
}

// static_graph, end of the first iteration: remember who used what; complete rank 0's
// gradient order with the unused parameters so the rebuild sees a permutation.
void Reducer::learn_static_graph(const std::vector<char>& local, const std::vector<char>& global) {
  static_graph_ = StaticGraph{local, global};
  if (!rebuild_done_ && arrival_.size() < params_.size()) {
    for (size_t k = params_.size(); k-- > 0;) {
      if (!local[k]) arrival_.push_back(k);
    }
  }
}

// Stage 3: the first static_graph iteration records the graph; later ones must match it.
void Reducer::check_static_graph(const std::vector<char>& locally_used,
                                 const std::vector<char>& used_anywhere) {
  if (options_.static_graph && !static_graph_) learn_static_graph(locally_used, used_anywhere);
  if (violations_.empty()) return;
  throw ValueError(
      str_cat(kOp, " rank ", group_->rank(), ": static_graph = true, but in iteration ", finalized_,
              " the set of parameters that get gradients differs from the first iteration's: ",
              joined(violations_, "; "),
              ".\n  static_graph promises that every iteration uses the same parameters; if the set "
              "changes from iteration to iteration, construct DistributedDataParallel with "
              "static_graph = false and find_unused_parameters = true. The gradients of this "
              "iteration were not written"));
}

// Stage 4: the averages into grad() of every parameter some rank used.
void Reducer::write_back(const std::vector<char>& used_anywhere) {
  NoGradGuard no_grad;
  for (auto& b : buckets_) {
    if (b.reduction == BucketReduction::FlatBuffer) averaging_.finish(b.flat);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!used_anywhere[i]) continue;
    Param& p = params_[i];
    const BucketReduction how = buckets_[p.bucket].reduction.value();
    Tensor s = slot(p);
    const Tensor g = p.tensor.grad();
    if (options_.gradient_as_bucket_view) {
      if (!g.defined() || g.data_ptr() != s.data_ptr()) p.tensor.set_grad(s);
    } else if (!g.defined()) {
      p.tensor.set_grad(s.clone());
    } else if (how != BucketReduction::LocalOnly && how != BucketReduction::InPlaceCoalesced) {
      Tensor dst = g;
      dst.copy_(s);
    }
  }
}

// Note [DDP timings]: forward = the module's forward; backward = from the end of forward to
// the end of the autograd pass (includes computing the loss); communication = from the first
// bucket launch to the moment every bucket is reduced (as seen by finalize); overlap = the
// part of it before the end of the autograd pass; wait = the time finalize blocks.
Reducer::Phases& Reducer::Phases::operator+=(const Phases& o) {
  forward += o.forward;
  backward += o.backward;
  comm += o.comm;
  wait += o.wait;
  overlap += o.overlap;
  return *this;
}

void Reducer::record_timings(Clock::time_point backward_end, Clock::time_point done) {
  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  Timings& t = timings_;
  Phases p;
  p.forward = ms(t.forward_end - t.forward_start);
  p.backward = ms(backward_end - t.forward_end);
  if (t.launched_any) {
    p.comm = ms(done - t.first_launch);
    p.overlap = std::max(0.0, ms(backward_end - t.first_launch));
  }
  p.wait = ms(done - backward_end);
  t.last = p;
  t.total += p;
  ++t.iterations;
  if (!info_) return;
  t.window += p;
  if (++t.window_iterations < log_every_) return;
  const double n = static_cast<double>(t.window_iterations);
  const Phases& w = t.window;
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(3);
  os << "iterations " << finalized_ - t.window_iterations + 1 << "-" << finalized_
     << " average: forward " << w.forward / n << " ms, backward " << w.backward / n
     << " ms, communication " << w.comm / n << " ms (overlapped with backward " << w.overlap / n
     << " ms), waited at the end of backward " << w.wait / n << " ms";
  log(os.str());
  t.window = Phases{};
  t.window_iterations = 0;
}

void Reducer::fill_stats(dist::DDPStats& s) const {
  s.parameters = static_cast<int64_t>(params_.size());
  s.bucket_bytes.clear();
  for (const Bucket& b : buckets_) s.bucket_bytes.push_back(b.flat.nbytes());
  s.bucket_count = static_cast<int64_t>(buckets_.size());
  s.rebuilds = rebuild_done_ ? 1 : 0;
  s.unused_parameters = unused_last_;
  s.comm_hook = hook_ ? hook_name_ : "";
  s.bucket_bytes_sent = bucket_sent_last_;
  s.bytes_sent = 0;
  s.allreduce_bytes = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const int64_t n = i < bucket_sent_last_.size() ? bucket_sent_last_[i] : 0;
    s.bytes_sent = (s.bytes_sent < 0 || n < 0) ? -1 : s.bytes_sent + n;
    s.allreduce_bytes += dist::ring_allreduce_bytes(buckets_[i].flat.nbytes(), group_->size());
  }
  s.compression_ratio =
      sent_total_ > 0 ? static_cast<double>(allreduce_total_) / static_cast<double>(sent_total_) : 0;
  s.iterations = timings_.iterations;
  const double n = std::max<double>(1, static_cast<double>(timings_.iterations));
  const Phases &last = timings_.last, &total = timings_.total;
  s.forward = {last.forward, total.forward / n};
  s.backward = {last.backward, total.backward / n};
  s.communication = {last.comm, total.comm / n};
  s.overlapped_communication = {last.overlap, total.overlap / n};
  s.exposed_communication = {last.wait, total.wait / n};
}

// forward() found the previous synchronised backward started but not finished (it threw, so
// its finalize callback never ran): waits for what it launched, resets, and explains.
void Reducer::throw_unfinished() {
  std::vector<std::string> missing;
  for (const auto& p : params_) {
    if (!p.ready) missing.push_back("'" + p.name + "'");
  }
  const auto launched = std::count_if(buckets_.begin(), buckets_.end(),
                                      [](const Bucket& b) { return b.reduction.has_value(); });
  (void)wait_all();
  reset_iteration(IterationState::Idle);
  throw ValueError(str_cat(
      kOp, " rank ", group_->rank(),
      ": expected the previous iteration's gradient reduction to have finished before a new "
      "forward, but the backward pass after the last synchronised forward did not complete.\n  ",
      params_.size() - missing.size(), " of ", params_.size(), " parameters got their gradients (",
      launched, " of ", buckets_.size(),
      " buckets were reduced); these did not: ", joined(missing, ", "),
      ".\n  This happens when that backward pass threw (see its error; other ranks may have "
      "reduced every bucket, so their collectives no longer match this rank's), or ran over "
      "only part of the graph. Make every output of forward take part in the loss, or "
      "construct DistributedDataParallel with find_unused_parameters = true if some "
      "parameters do not always get gradients. The reducer was reset; the next forward runs "
      "normally"));
}

}  // namespace ember::dist::detail
