#include <ember/distributed/forwarding_process_group.h>

namespace ember::dist {

namespace {
ProcessGroup::Options options_of(const ProcessGroup* g) {
  ProcessGroup::Options o;
  if (g != nullptr) o.timeout = g->timeout();
  return o;
}
}  // namespace

ForwardingProcessGroup::ForwardingProcessGroup(std::shared_ptr<ProcessGroup> inner,
                                               const char* wrapper)
    : ProcessGroup(inner ? inner->rank() : 0, inner ? inner->size() : 1, options_of(inner.get())),
      inner_(std::move(inner)) {
  EMBER_CHECK(inner_ != nullptr, "[", wrapper, "] expected a process group to wrap, got null");
  set_global_ranks(inner_->global_ranks());
}

ForwardingProcessGroup::ForwardingProcessGroup(ProcessGroup& inner)
    : ForwardingProcessGroup(std::shared_ptr<ProcessGroup>(&inner, [](ProcessGroup*) {})) {}

WorkPtr ForwardingProcessGroup::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  return inner_->allreduce(tensor, opts);
}
WorkPtr ForwardingProcessGroup::allreduce_coalesced(std::vector<Tensor>& tensors,
                                                    const AllreduceOptions& opts) {
  return inner_->allreduce_coalesced(tensors, opts);
}
WorkPtr ForwardingProcessGroup::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  return inner_->broadcast(tensor, opts);
}
WorkPtr ForwardingProcessGroup::reduce(Tensor& tensor, const ReduceOptions& opts) {
  return inner_->reduce(tensor, opts);
}
WorkPtr ForwardingProcessGroup::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                          const CollectiveOptions& opts) {
  return inner_->allgather(outputs, input, opts);
}
WorkPtr ForwardingProcessGroup::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                      const CollectiveOptions& opts) {
  return inner_->allgather_into_tensor(output, input, opts);
}
WorkPtr ForwardingProcessGroup::gather(std::vector<Tensor>& outputs, const Tensor& input,
                                       const GatherOptions& opts) {
  return inner_->gather(outputs, input, opts);
}
WorkPtr ForwardingProcessGroup::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                        const ScatterOptions& opts) {
  return inner_->scatter(output, inputs, opts);
}
WorkPtr ForwardingProcessGroup::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                               const ReduceScatterOptions& opts) {
  return inner_->reduce_scatter(output, inputs, opts);
}
WorkPtr ForwardingProcessGroup::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                      const ReduceScatterOptions& opts) {
  return inner_->reduce_scatter_tensor(output, input, opts);
}
WorkPtr ForwardingProcessGroup::alltoall(std::vector<Tensor>& outputs,
                                         const std::vector<Tensor>& inputs,
                                         const CollectiveOptions& opts) {
  return inner_->alltoall(outputs, inputs, opts);
}
WorkPtr ForwardingProcessGroup::barrier(const CollectiveOptions& opts) {
  return inner_->barrier(opts);
}
WorkPtr ForwardingProcessGroup::send(const Tensor& tensor, int dst, int tag) {
  return inner_->send(tensor, dst, tag);
}
WorkPtr ForwardingProcessGroup::recv(Tensor& tensor, int src, int tag) {
  return inner_->recv(tensor, src, tag);
}
std::vector<WorkPtr> ForwardingProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) {
  return inner_->batch_isend_irecv(ops);
}

}  // namespace ember::dist
