// found_inf_allreduce (distributed/ddp/amp.h).
#include <ember/distributed/ddp/amp.h>

#include <ember/distributed/init.h>

namespace ember::dist {

nn::amp::FoundInfSync found_inf_allreduce(std::shared_ptr<ProcessGroup> group) {
  return [group = std::move(group)](Tensor& found_inf) {
    const std::shared_ptr<ProcessGroup> pg = group ? group : default_group();
    AllreduceOptions opts;
    opts.op = ReduceOp::Max;
    pg->allreduce(found_inf, opts)->wait();
  };
}

}  // namespace ember::dist
