// DelayingGroup: see the header. Results go through staging copies so that the caller's
// tensors change only at the delayed write-back: a collective that finishes early (the CPU
// worker of ProcessGroupThreads reduces as soon as the last rank arrives) still cannot make a
// missing wait pass. The write-back never runs on the caller's thread or stream, even when the
// inner collective has completed before the wrapper attached its callback (then a callback
// would run at once on the caller): on the CPU it runs on the group's own delay thread, on
// CUDA it is queued on the group's own stream, after the collective's ready events.
#include <ember/distributed/debug/delaying_group.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

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

}  // namespace

/// The delay thread (CPU write-backs, in order, each at its due time) and the write-back
/// streams (CUDA, one per device). The thread owns a reference, so the Delayer outlives a
/// DelayingGroup destroyed from one of its own callbacks.
class DelayingGroup::Delayer {
 public:
  using Clock = std::chrono::steady_clock;

  static std::shared_ptr<Delayer> start() {
    auto d = std::make_shared<Delayer>();
    d->thread_ = std::thread([d] { d->loop(); });
    return d;
  }

  /// Runs `job` on the delay thread at `due` (at once on this thread after stop()).
  void post(Clock::time_point due, std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stop_) {
        jobs_.push_back({due, std::move(job)});
        cv_.notify_all();
        return;
      }
    }
    std::this_thread::sleep_until(due);
    job();
  }

  cuda::Stream stream(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(device);
    if (it == streams_.end()) it = streams_.emplace(device, cuda::Stream::create(device)).first;
    return it->second;
  }

  /// Lets the queued jobs run, then ends the thread (detached when called on it).
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  struct Job {
    Clock::time_point due;
    std::function<void()> run;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (jobs_.empty()) {
        if (stop_) return;
        cv_.wait(lock);
        continue;
      }
      if (Clock::now() < jobs_.front().due) {
        cv_.wait_until(lock, jobs_.front().due);
        continue;
      }
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job.run();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;  // due times in order: every job waits the same cpu_delay
  std::map<int, cuda::Stream> streams_;
  bool stop_ = false;
  std::thread thread_;
};

DelayingGroup::~DelayingGroup() { delayer_->stop(); }

DelayingGroup::DelayingGroup(std::shared_ptr<ProcessGroup> inner, DelayOptions options)
    : ForwardingProcessGroup(std::move(inner), "DelayingGroup"),
      options_(options),
      delayer_(Delayer::start()) {}

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

WorkPtr DelayingGroup::after(const WorkPtr& inner, std::vector<Tensor> outputs,
                             std::vector<Tensor> staged) const {
  auto outer = std::make_shared<Future>();
  const DelayOptions o = options_;
  auto write_back = [outputs, staged, o] {
    NoGradGuard no_grad;
    for (size_t i = 0; i < outputs.size(); ++i) {
      Tensor out = outputs[i];
      out.copy_(staged[i]);
      if (o.scale != 1.0 && is_floating(out.dtype())) out.mul_(o.scale);
    }
  };
  inner->future()->add_done_callback([d = delayer_, outputs, staged, o, outer,
                                      write_back](Future& done) {
    if (std::exception_ptr e = done.exception()) {
      outer->set_exception(e);
      return;
    }
    const std::optional<int> dev = cuda_index(outputs);
    if (!dev) {
      // A delay that widens the window of a missing wait, not synchronisation. The events
      // (CUDA inputs with nothing to write back: send, barrier) still order the caller after
      // the collective.
      d->post(Delayer::Clock::now() + o.cpu_delay,
              [outputs, outer, write_back, ready = done.ready_events()] {
        try {
          write_back();
          outer->set_value(outputs, ready);
        } catch (...) {
          outer->set_exception(std::current_exception());
        }
      });
      return;
    }
    try {
      cuda::set_device(*dev);
      const cuda::Stream s = d->stream(*dev);
      for (const auto& e : done.ready_events()) e->block(s);
      cuda::StreamGuard guard(s);  // outer's callbacks, too, queue their work after it
      cuda::spin(o.cycles, s);
      write_back();
      for (size_t i = 0; i < outputs.size(); ++i) {
        cuda::record_stream(staged[i], s);
        cuda::record_stream(outputs[i], s);
      }
      auto ready = std::make_shared<cuda::Event>();
      ready->record(s);
      outer->set_value(outputs, {ready});
    } catch (...) {
      outer->set_exception(std::current_exception());
    }
  });
  return std::make_shared<FutureWork>(inner->describe() + " (delayed)", inner->timeout(),
                                      std::move(outer));
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
WorkPtr DelayingGroup::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                             const ReduceScatterOptions& opts) {
  std::vector<Tensor> s = stage({output});
  return after(inner_->reduce_scatter_tensor(s[0], input, opts), {output}, s);
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
