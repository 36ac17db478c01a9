// A group that forwards to another only what every backend must provide (allreduce, broadcast,
// allgather_into_tensor, barrier, send, recv) and runs ProcessGroup's composites for the rest,
// as a backend with nothing more would. Tests derive from it to count the primitives a
// collective or DDP issues, and gloo_test runs the composites through it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/forwarding_process_group.h>

namespace ember::test {

class CompositeGroup : public dist::ForwardingProcessGroup {
 public:
  using ForwardingProcessGroup::ForwardingProcessGroup;
  using WorkPtr = dist::WorkPtr;

  Device default_device() const override { return ProcessGroup::default_device(); }
  bool coalesced_without_copies(const Device& d) const override {
    return ProcessGroup::coalesced_without_copies(d);
  }
  Tensor zeros_for_collectives(IntList shape, TensorOptions opts) const override {
    return ProcessGroup::zeros_for_collectives(shape, opts);
  }
  WorkPtr allreduce_coalesced(std::vector<Tensor>& ts, const dist::AllreduceOptions& o) override {
    return ProcessGroup::allreduce_coalesced(ts, o);
  }
  WorkPtr reduce(Tensor& t, const dist::ReduceOptions& o) override {
    return ProcessGroup::reduce(t, o);
  }
  WorkPtr allgather(std::vector<Tensor>& out, const Tensor& in,
                    const dist::CollectiveOptions& o) override {
    return ProcessGroup::allgather(out, in, o);
  }
  WorkPtr gather(std::vector<Tensor>& out, const Tensor& in,
                 const dist::GatherOptions& o) override {
    return ProcessGroup::gather(out, in, o);
  }
  WorkPtr scatter(Tensor& out, const std::vector<Tensor>& in,
                  const dist::ScatterOptions& o) override {
    return ProcessGroup::scatter(out, in, o);
  }
  WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& in,
                         const dist::ReduceScatterOptions& o) override {
    return ProcessGroup::reduce_scatter(out, in, o);
  }
  WorkPtr reduce_scatter_tensor(Tensor& out, const Tensor& in,
                                const dist::ReduceScatterOptions& o) override {
    return ProcessGroup::reduce_scatter_tensor(out, in, o);
  }
  WorkPtr alltoall(std::vector<Tensor>& out, const std::vector<Tensor>& in,
                   const dist::CollectiveOptions& o) override {
    return ProcessGroup::alltoall(out, in, o);
  }
};

}  // namespace ember::test
