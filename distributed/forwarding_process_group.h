// ForwardingProcessGroup: a process group that passes every call to another (the base of
// c10d's wrapper groups). Wrappers that check, delay, record or count collectives derive from it
// and override only what they change:
//
//   class Counting : public dist::ForwardingProcessGroup {
//    public:
//     using ForwardingProcessGroup::ForwardingProcessGroup;
//     WorkPtr allreduce(Tensor& t, const AllreduceOptions& o) override {
//       ++count;
//       return inner()->allreduce(t, o);
//     }
//     int count = 0;
//   };
//
// So a method added to ProcessGroup is forwarded by every wrapper without touching it
// (CheckedProcessGroup and DelayingGroup in debug/ derive from it). A wrapper has the inner
// group's rank, size, timeout, global ranks and backend name; its own sequence_number() counts
// only what it issues itself (the inner group numbers the forwarded collectives). Same
// threading rules as the inner group.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

class ForwardingProcessGroup : public ProcessGroup {
 public:
  /// Throws ValueError naming `wrapper` (the derived class, for messages) if `inner` is null.
  explicit ForwardingProcessGroup(std::shared_ptr<ProcessGroup> inner,
                                  const char* wrapper = "ForwardingProcessGroup");
  /// Does not own `inner`, which must outlive this group.
  explicit ForwardingProcessGroup(ProcessGroup& inner);

  const std::shared_ptr<ProcessGroup>& inner() const { return inner_; }

  std::string backend_name() const override { return inner_->backend_name(); }
  Device default_device() const override { return inner_->default_device(); }
  bool supports_graph_capture() const override { return inner_->supports_graph_capture(); }
  bool abort(const std::string& reason) override { return inner_->abort(reason); }
  bool coalesced_without_copies(const Device& device) const override {
    return inner_->coalesced_without_copies(device);
  }
  Tensor zeros_for_collectives(IntList shape, TensorOptions opts) const override {
    return inner_->zeros_for_collectives(shape, opts);
  }

  WorkPtr allreduce(Tensor& tensor, const AllreduceOptions& opts = {}) override;
  WorkPtr allreduce_coalesced(std::vector<Tensor>& tensors,
                              const AllreduceOptions& opts = {}) override;
  WorkPtr broadcast(Tensor& tensor, const BroadcastOptions& opts = {}) override;
  WorkPtr reduce(Tensor& tensor, const ReduceOptions& opts = {}) override;
  WorkPtr allgather(std::vector<Tensor>& outputs, const Tensor& input,
                    const CollectiveOptions& opts = {}) override;
  WorkPtr allgather_into_tensor(Tensor& output, const Tensor& input,
                                const CollectiveOptions& opts = {}) override;
  WorkPtr gather(std::vector<Tensor>& outputs, const Tensor& input,
                 const GatherOptions& opts = {}) override;
  WorkPtr scatter(Tensor& output, const std::vector<Tensor>& inputs,
                  const ScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                         const ReduceScatterOptions& opts = {}) override;
  WorkPtr reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                const ReduceScatterOptions& opts = {}) override;
  WorkPtr alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                   const CollectiveOptions& opts = {}) override;
  WorkPtr barrier(const CollectiveOptions& opts = {}) override;
  WorkPtr send(const Tensor& tensor, int dst, int tag = 0) override;
  WorkPtr recv(Tensor& tensor, int src, int tag = 0) override;
  std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops) override;

 protected:
  std::shared_ptr<ProcessGroup> inner_;
};

}  // namespace ember::dist
