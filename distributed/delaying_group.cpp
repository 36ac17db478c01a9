// DelayingGroup: see the header. Results go through staging copies so that the caller's
// tensors change only at the delayed write-back: a collective that finishes early (the CPU
// worker of ProcessGroupThreads reduces as soon as the last rank arrives) still cannot make a
// missing wait pass.
#include "distributed/delaying_group.h"

#include <optional>
#include <thread>

#include "tensor/cuda.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace ember::dist {

namespace {

/// A Work whose Future is another one (then()'s), so ready events and errors pass through.
class FutureWork : public Work {
 public:
  FutureWork(std::string what, Duration timeout, std::shared_ptr<Future> f)
      : Work(std::move(what), timeout) {
    future_ = std::move(f);
  }
};

std::optional<int> cuda_index(const std::vector<Tensor>& ts) {
  for (const Tensor& t : ts) {
    if (t.defined() && t.device().is_cuda()) return t.device().index;
  }
  return std::nullopt;
}

/// Keeps the caching allocator from reusing t's memory before what is queued on `s` is done.
void mark_used(const Tensor& t, const cuda::Stream& s) {
  if (!t.defined() || t.numel() == 0 || t.storage()->data() == nullptr) return;
  try {
    cuda::record_stream(t.storage()->data(), s);
  } catch (const ValueError&) {
    // Not the allocator's memory.
  }
}

}  // namespace

DelayingGroup::DelayingGroup(std::shared_ptr<ProcessGroup> inner, DelayOptions options)
    : ProcessGroup(inner ? inner->rank() : 0, inner ? inner->size() : 1,
                   Options{inner ? inner->timeout() : kDefaultCollectiveTimeout}),
      inner_(std::move(inner)),
      options_(options) {
  EMBER_CHECK(inner_ != nullptr, "[DelayingGroup] needs a group to wrap, got null");
  set_global_ranks(inner_->global_ranks());
}

void DelayingGroup::spin(const std::vector<Tensor>& touching) const {
  if (const auto d = cuda_index(touching)) cuda::spin(options_.cycles, cuda::current_stream(*d));
}

std::vector<Tensor> DelayingGroup::stage(const std::vector<Tensor>& outputs) const {
  spin(outputs);
  NoGradGuard no_grad;
  std::vector<Tensor> staged;
  staged.reserve(outputs.size());
  for (const Tensor& t : outputs) staged.push_back(t.clone());
  return staged;
}

// then() runs the callback with the current stream (of the completing thread) already waiting
// for the collective, and records the returned future's events after it: the spin and the
// write-back are queued behind the collective, and whoever waits for the returned Work waits
// for them too.
WorkPtr DelayingGroup::after(const WorkPtr& inner, std::vector<Tensor> outputs,
                             std::vector<Tensor> staged) const {
  const DelayOptions o = options_;
  auto delayed = inner->future()->then([outputs, staged, o](Future& done) {
    std::vector<Tensor> value = done.value();
    const std::optional<int> d = cuda_index(outputs);
    if (d) {
      cuda::spin(o.cycles, cuda::current_stream(*d));
    } else {
      // A delay that widens the window of a missing wait, not synchronisation.
      std::this_thread::sleep_for(o.cpu_delay);
    }
    NoGradGuard no_grad;
    for (size_t i = 0; i < outputs.size(); ++i) {
      Tensor out = outputs[i];
      out.copy_(staged[i]);
      if (o.scale != 1.0 && is_floating(out.dtype())) out.mul_(o.scale);
      if (d) {
        mark_used(staged[i], cuda::current_stream(*d));
        mark_used(out, cuda::current_stream(*d));
      }
    }
    return outputs.empty() ? value : outputs;
  });
  return std::make_shared<FutureWork>(inner->describe() + " (delayed)", inner->timeout(),
                                      std::move(delayed));
}

WorkPtr DelayingGroup::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  std::vector<Tensor> s = stage({tensor});
  return after(inner_->allreduce(s[0], opts), {tensor}, s);
}
WorkPtr DelayingGroup::allreduce_coalesced(std::vector<Tensor>& tensors,
                                           const AllreduceOptions& opts) {
  std::vector<Tensor> s = stage(tensors);
  return after(inner_->allreduce_coalesced(s, opts), tensors, s);
}
WorkPtr DelayingGroup::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  std::vector<Tensor> s = stage({tensor});
  return after(inner_->broadcast(s[0], opts), {tensor}, s);
}
WorkPtr DelayingGroup::reduce(Tensor& tensor, const ReduceOptions& opts) {
  std::vector<Tensor> s = stage({tensor});
  return after(inner_->reduce(s[0], opts), {tensor}, s);
}
WorkPtr DelayingGroup::allgather_into_tensor(Tensor& output, const Tensor& input,
                                             const CollectiveOptions& opts) {
  std::vector<Tensor> s = stage({output});
  return after(inner_->allgather_into_tensor(s[0], input, opts), {output}, s);
}
WorkPtr DelayingGroup::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                 const CollectiveOptions& opts) {
  std::vector<Tensor> s = stage(outputs);
  return after(inner_->allgather(s, input, opts), outputs, s);
}
WorkPtr DelayingGroup::gather(std::vector<Tensor>& outputs, const Tensor& input,
                              const GatherOptions& opts) {
  std::vector<Tensor> s = stage(outputs);
  return after(inner_->gather(s, input, opts), outputs, s);
}
WorkPtr DelayingGroup::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                               const ScatterOptions& opts) {
  std::vector<Tensor> s = stage({output});
  return after(inner_->scatter(s[0], inputs, opts), {output}, s);
}
WorkPtr DelayingGroup::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                      const ReduceScatterOptions& opts) {
  std::vector<Tensor> s = stage({output});
  return after(inner_->reduce_scatter(s[0], inputs, opts), {output}, s);
}
WorkPtr DelayingGroup::alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                                const CollectiveOptions& opts) {
  std::vector<Tensor> s = stage(outputs);
  return after(inner_->alltoall(s, inputs, opts), outputs, s);
}
WorkPtr DelayingGroup::barrier(const CollectiveOptions& opts) {
  return after(inner_->barrier(opts), {}, {});
}
WorkPtr DelayingGroup::send(const Tensor& tensor, int dst, int tag) {
  spin({tensor});
  return after(inner_->send(tensor, dst, tag), {}, {});
}
WorkPtr DelayingGroup::recv(Tensor& tensor, int src, int tag) {
  std::vector<Tensor> s = stage({tensor});
  return after(inner_->recv(s[0], src, tag), {tensor}, s);
}

}  // namespace ember::dist
