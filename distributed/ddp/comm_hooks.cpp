#include <ember/distributed/ddp/comm_hooks.h>

#include <algorithm>
#include <iterator>
#include <sstream>

#include <ember/distributed/detail/half_kernels.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[GradBucket]";

// A future completed with `error`.
std::shared_ptr<Future> failed_future(std::exception_ptr error) {
  auto f = std::make_shared<Future>();
  f->set_exception(std::move(error));
  return f;
}

// Completes `result` with whatever `from` completes with.
void forward_to(const std::shared_ptr<Future>& from, std::shared_ptr<Future> result) {
  from->add_done_callback([result = std::move(result)](Future& f) {
    if (auto e = f.exception()) {
      result->set_exception(e);
    } else {
      result->set_value(f.value(), f.ready_events());  // still stream-ordered
    }
  });
}

// Runs `step` on a completed, successful `after`; a throwing or null-returning step becomes a
// failed future.
std::shared_ptr<Future> run_step(const GradBucket::DeferredStep& step, Future& after) {
  try {
    auto next = step(after);
    EMBER_CHECK(next != nullptr, kOp, " a deferred step must return a future, got null");
    return next;
  } catch (...) {
    return failed_future(std::current_exception());
  }
}

// torch's fp16/bf16 compression: the bucket cast to `dtype` and pre-divided by the world size
// (so the sum cannot overflow where the average would not), summed, cast back in place.
std::shared_ptr<Future> compress_hook(GradBucket& bucket, Dtype dtype) {
  ProcessGroup& pg = bucket.process_group();
  Tensor buffer = bucket.buffer();
  Tensor compressed;
  // float32 to float16 on the CPU: the cast and the division in one pass of the CPU's own
  // conversions (half_kernels.h), the same bits as the two tensor ops.
  const bool half_loops = dtype == kFloat16 && buffer.is_cpu() &&
                          buffer.dtype() == kFloat32 && buffer.is_contiguous();
  {
    NoGradGuard no_grad;
    if (half_loops) {
      compressed = empty(buffer.shape(), kFloat16);
      detail::float_to_half_divided(buffer.data<float>(), static_cast<uint16_t*>(compressed.data_ptr()),
                                    static_cast<size_t>(buffer.numel()),
                                    static_cast<float>(pg.size()));
    } else {
      compressed = buffer.to(dtype, /*copy=*/true);
      compressed.div_(pg.size());
    }
  }
  AllreduceOptions o;
  o.op = ReduceOp::Sum;
  bucket.record_bytes_sent(ring_allreduce_bytes(compressed.nbytes(), pg.size()));
  auto work = pg.allreduce(compressed, o);
  // Decompression is local work, so it may run on the backend thread (no collective here).
  return work->future()->then([buffer, half_loops](Future& f) mutable {
    NoGradGuard no_grad;
    const Tensor sum = f.value()[0];
    if (half_loops && sum.is_contiguous() && sum.dtype() == kFloat16) {
      detail::half_to_float(static_cast<const uint16_t*>(sum.data_ptr()), buffer.data<float>(),
                            static_cast<size_t>(buffer.numel()));
    } else {
      buffer.copy_(sum);
    }
    return std::vector<Tensor>{buffer};
  });
}

CommHook compress_wrapper(CommHook hook, Dtype dtype) {
  EMBER_CHECK(hook != nullptr, "[compress_wrapper] expected a hook to wrap, got null");
  return [hook = std::move(hook), dtype](GradBucket& bucket) {
    Tensor original = bucket.buffer();
    Tensor compressed;
    {
      NoGradGuard no_grad;
      compressed = original.to(dtype, /*copy=*/true);
    }
    bucket.set_buffer(compressed);
    std::shared_ptr<Future> inner;
    try {
      inner = hook(bucket);
    } catch (...) {
      bucket.set_buffer(original);
      throw;
    }
    bucket.set_buffer(original);
    EMBER_CHECK(inner != nullptr, "[compress_wrapper] the wrapped hook returned null");
    return inner->then([original](Future& f) mutable {
      NoGradGuard no_grad;
      original.copy_(f.value().at(0).reshape({-1}));
      return std::vector<Tensor>{original};
    });
  };
}

}  // namespace

// ---- GradBucket -------------------------------------------------------------------------------

GradBucket::GradBucket(size_t index, size_t num_buckets, Tensor buffer,
                       std::vector<Tensor> parameters, std::vector<size_t> parameter_indices,
                       std::shared_ptr<ProcessGroup> group,
                       std::shared_ptr<dist::detail::DeferredSteps> deferred,
                       std::shared_ptr<std::atomic<int64_t>> bytes_sent)
    : index_(index),
      num_buckets_(num_buckets),
      buffer_(std::move(buffer)),
      parameters_(std::move(parameters)),
      parameter_indices_(std::move(parameter_indices)),
      group_(std::move(group)),
      deferred_(std::move(deferred)),
      bytes_sent_(std::move(bytes_sent)) {
  EMBER_CHECK(group_ != nullptr, kOp, " expected a process group, got null");
  EMBER_CHECK(index_ < num_buckets_, kOp, " index ", index_, " must be < num_buckets ",
              num_buckets_);
  EMBER_CHECK(buffer_.defined() && buffer_.dim() == 1, kOp, " expected a 1-d buffer, got ",
              buffer_.defined() ? std::to_string(buffer_.dim()) + "-d" : "undefined");
  EMBER_CHECK(parameter_indices_.size() == parameters_.size(), kOp, " ", parameters_.size(),
              " parameters but ", parameter_indices_.size(), " parameter indices");
  int64_t numel = 0;
  for (const Tensor& p : parameters_) numel += p.numel();
  EMBER_CHECK(numel == buffer_.numel(), kOp, " the parameters hold ", numel,
              " elements but the buffer has ", buffer_.numel());
}

void GradBucket::set_buffer(const Tensor& buffer) {
  EMBER_CHECK(buffer.defined() && buffer.dim() == 1 && buffer.numel() == buffer_.numel(), kOp,
              " set_buffer expects a 1-d tensor of ", buffer_.numel(), " elements, got ",
              buffer.defined() ? buffer.shape() : Shape{});
  buffer_ = buffer;
}

std::vector<Tensor> GradBucket::gradients() const {
  std::vector<Tensor> out;
  out.reserve(parameters_.size());
  int64_t offset = 0;
  for (const Tensor& p : parameters_) {
    out.push_back(buffer_.narrow(0, offset, p.numel()).view(p.shape()));
    offset += p.numel();
  }
  return out;
}

std::string GradBucket::key() const {
  std::vector<size_t> sorted = parameter_indices_;
  std::sort(sorted.begin(), sorted.end());
  std::ostringstream os;
  for (size_t i = 0; i < sorted.size(); ++i) os << (i ? "_" : "") << sorted[i];
  return os.str();
}

std::shared_ptr<Future> GradBucket::defer(std::shared_ptr<Future> after, DeferredStep step) const {
  EMBER_CHECK(after != nullptr && step != nullptr, kOp,
              " defer expects a future and a step, got null");
  auto result = std::make_shared<Future>();
  if (deferred_) {
    deferred_->push(index_, std::move(after), std::move(step), result);
    return result;
  }
  try {
    after->wait(group_->timeout());
  } catch (...) {
    return failed_future(std::current_exception());
  }
  return run_step(step, *after);
}

void GradBucket::record_bytes_sent(int64_t bytes) const {
  if (!bytes_sent_) return;
  int64_t old = bytes_sent_->load();
  while (!bytes_sent_->compare_exchange_weak(old, std::max<int64_t>(old, 0) + bytes)) {
  }
}

int64_t ring_allreduce_bytes(int64_t bytes, int world) {
  return world > 1 ? 2 * (world - 1) * bytes / world : 0;
}

GradBucket GradBucket::with_group(std::shared_ptr<ProcessGroup> group) const {
  EMBER_CHECK(group != nullptr, kOp, " with_group expects a process group, got null");
  GradBucket copy = *this;
  copy.group_ = std::move(group);
  return copy;
}

std::shared_ptr<Future> completed_future(std::vector<Tensor> value) {
  auto f = std::make_shared<Future>();
  f->set_value(std::move(value));
  return f;
}

// ---- built-in hooks ---------------------------------------------------------------------------

std::shared_ptr<Future> allreduce_hook(GradBucket& bucket) {
  Tensor buffer = bucket.buffer();
  AllreduceOptions o;
  o.op = ReduceOp::Avg;
  bucket.record_bytes_sent(ring_allreduce_bytes(buffer.nbytes(), bucket.process_group().size()));
  return bucket.process_group().allreduce(buffer, o)->future();
}

std::shared_ptr<Future> fp16_compress_hook(GradBucket& bucket) {
  return compress_hook(bucket, kFloat16);
}

std::shared_ptr<Future> bf16_compress_hook(GradBucket& bucket) {
  return compress_hook(bucket, kBFloat16);
}

CommHook fp16_compress_wrapper(CommHook hook) { return compress_wrapper(std::move(hook), kFloat16); }

CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(std::move(hook), kBFloat16);
}

std::shared_ptr<Future> noop_hook(GradBucket& bucket) {
  bucket.record_bytes_sent(0);
  return completed_future({bucket.buffer()});
}

}  // namespace ember::dist

// ---- DeferredSteps ----------------------------------------------------------------------------

namespace ember::dist::detail {

using dist::forward_to;
using dist::run_step;

DeferredSteps::DeferredSteps(size_t num_buckets, dist::Duration timeout)
    : queues_(num_buckets), timeout_(timeout) {}

void DeferredSteps::push(size_t bucket, std::shared_ptr<dist::Future> after,
                         dist::GradBucket::DeferredStep step,
                         std::shared_ptr<dist::Future> result) {
  EMBER_INTERNAL_ASSERT(bucket < queues_.size(), "deferred step for bucket ", bucket, " of ",
                        queues_.size());
  Item item{std::move(after), std::move(step), std::move(result)};
  if (bucket == running_) {
    nested_.push_back(std::move(item));
  } else {
    queues_[bucket].push_back(std::move(item));
  }
}

void DeferredSteps::run(Item& item) {
  try {
    item.after->wait(timeout_);
  } catch (...) {
    item.result->set_exception(std::current_exception());
    return;
  }
  forward_to(run_step(item.step, *item.after), item.result);
}

void DeferredSteps::run_all() {
  for (bool any = true; any;) {
    any = false;
    for (auto& queue : queues_) {
      if (queue.empty()) continue;
      Item item = std::move(queue.front());
      queue.pop_front();
      running_ = static_cast<size_t>(&queue - queues_.data());
      run(item);  // may queue more steps, for this bucket (nested_) or another
      running_ = kNone;
      queue.insert(queue.begin(), std::make_move_iterator(nested_.begin()),
                   std::make_move_iterator(nested_.end()));
      nested_.clear();
      any = true;
    }
  }
}

void DeferredSteps::abandon(const std::exception_ptr& error) {
  for (auto& queue : queues_) {
    for (auto& item : queue) item.result->set_exception(error);
    queue.clear();
  }
}

bool DeferredSteps::empty() const {
  return std::all_of(queues_.begin(), queues_.end(), [](const auto& q) { return q.empty(); });
}

}  // namespace ember::dist::detail
