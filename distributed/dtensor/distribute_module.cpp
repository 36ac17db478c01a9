#include <ember/distributed/dtensor/distribute_module.h>

namespace ember::dist {

void distribute_parameter(const Tensor& param, const std::shared_ptr<DeviceMesh>& mesh,
                          const Placements& placements, int src_data_rank) {
  EMBER_CHECK(param.defined(), "[distribute_parameter] expected a parameter, got an undefined "
              "tensor");
  // A second layout would treat this rank's part as the whole (two plan entries matching one
  // module): refused rather than silently sharding a shard.
  const std::optional<DTensor> already = as_dtensor(param);
  EMBER_CHECK(!already, "[distribute_parameter] the parameter is already distributed as ",
              already ? already->str() : "",
              "; a parameter is distributed once (does more than "
              "one plan entry, or more than one parallelize_module call, reach its module?)");
  const DTensor d = distribute_tensor(param, mesh, placements, src_data_rank);
  const Shape global = param.shape();
  nn::set_data(param, d.local());
  register_dtensor(param, DTensor::make(param, mesh, d.placements(), global));
}

std::shared_ptr<nn::Module> distribute_module(std::shared_ptr<nn::Module> module,
                                              std::shared_ptr<DeviceMesh> mesh,
                                              PartitionFn partition_fn, ModuleIoFn input_fn,
                                              ModuleIoFn output_fn) {
  EMBER_CHECK(module != nullptr, "[distribute_module] expected a module, got null");
  EMBER_CHECK(mesh != nullptr, "[distribute_module] expected a mesh, got null");
  if (partition_fn) {
    for (const auto& [name, m] : module->named_modules()) partition_fn(name, *m, mesh);
  }
  // What no one laid out is replicated, as PyTorch's default partition does for everything.
  const Placements replicate(static_cast<size_t>(mesh->ndim()), Replicate());
  for (const auto& [name, p] : module->named_parameters()) {
    if (!as_dtensor(p)) distribute_parameter(p, mesh, replicate);
  }
  if (input_fn) {
    module->register_forward_pre_hook([mesh, input_fn](nn::Module& m, std::vector<Tensor>& in) {
      for (Tensor& t : in) {
        if (t.defined()) t = input_fn(m, t, mesh);
      }
    });
  }
  if (output_fn) {
    module->register_forward_hook([mesh, output_fn](nn::Module& m, const std::vector<Tensor>&,
                                                    std::vector<Tensor>& out) {
      for (Tensor& t : out) {
        if (t.defined()) t = output_fn(m, t, mesh);
      }
    });
  }
  return module;
}

}  // namespace ember::dist
