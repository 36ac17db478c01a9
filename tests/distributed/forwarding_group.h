// A process group that forwards what every backend must provide (allreduce, broadcast,
// allgather_into_tensor, barrier, send, recv) to another group, so that everything else runs
// ProcessGroup's composites. Tests derive from it to count or observe collectives.
#pragma once

#include <memory>
#include <string>

#include <ember/distributed/process_group.h>

namespace ember::test {

class ForwardingGroup : public dist::ProcessGroup {
 public:
  explicit ForwardingGroup(std::shared_ptr<dist::ProcessGroup> inner)
      : ProcessGroup(inner->rank(), inner->size(), Options{inner->timeout()}),
        inner_(std::move(inner)) {}
  /// Does not own `inner`, which must outlive this group.
  explicit ForwardingGroup(dist::ProcessGroup& inner)
      : ForwardingGroup(std::shared_ptr<dist::ProcessGroup>(&inner, [](dist::ProcessGroup*) {})) {}

  std::string backend_name() const override { return inner_->backend_name(); }
  dist::WorkPtr allreduce(Tensor& t, const dist::AllreduceOptions& o) override {
    return inner_->allreduce(t, o);
  }
  dist::WorkPtr broadcast(Tensor& t, const dist::BroadcastOptions& o) override {
    return inner_->broadcast(t, o);
  }
  dist::WorkPtr allgather_into_tensor(Tensor& out, const Tensor& in,
                                      const dist::CollectiveOptions& o) override {
    return inner_->allgather_into_tensor(out, in, o);
  }
  dist::WorkPtr barrier(const dist::CollectiveOptions& o) override { return inner_->barrier(o); }
  dist::WorkPtr send(const Tensor& t, int dst, int tag) override {
    return inner_->send(t, dst, tag);
  }
  dist::WorkPtr recv(Tensor& t, int src, int tag) override { return inner_->recv(t, src, tag); }

 protected:
  std::shared_ptr<dist::ProcessGroup> inner_;
};

}  // namespace ember::test
