// distribute_module: a module's parameters laid out over a DeviceMesh, and functions around its
// forward (torch.distributed.tensor.distribute_module), for layouts the parallel styles of
// tensor_parallel/ do not cover.
//
//   dist::distribute_module(mlp, mesh,
//       [](const std::string& name, nn::Module& m, const auto& mesh) {   // each submodule
//         if (name == "fc1")
//           dist::distribute_parameter(dynamic_cast<nn::Linear&>(m).weight, mesh, {dist::Shard(0)});
//         ...
//       },
//       [](nn::Module&, const Tensor& x, const auto& mesh) {             // before forward
//         return dist::functional::copy_to_group(x, mesh->get_group()); },
//       [](nn::Module&, const Tensor& y, const auto& mesh) {             // after forward
//         return dist::functional::reduce_from_group(y, mesh->get_group()); });
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/nn/module.h>

namespace ember::dist {

/// Lays the module parameter `param` out as `placements` in place (distribute_tensor of its
/// value; the module keeps its handle, now holding this rank's part, as PyTorch's
/// `param.data = ...`) and records it (as_dtensor finds it: clip_grad_norm_ and
/// save_model_checkpoint read the record). src_data_rank as distribute_tensor's. Throws
/// ValueError for a parameter already distributed.
void distribute_parameter(const Tensor& param, const std::shared_ptr<DeviceMesh>& mesh,
                          const Placements& placements, int src_data_rank = 0);

/// Called for root and every submodule, with its name as named_modules() gives it ("" for
/// root): lays out the module's own parameters (distribute_parameter).
using PartitionFn = std::function<void(const std::string& name, nn::Module& module,
                                       const std::shared_ptr<DeviceMesh>& mesh)>;
/// Replaces root's input (before forward) or output (after forward).
using ModuleIoFn = std::function<Tensor(nn::Module& module, const Tensor& t,
                                        const std::shared_ptr<DeviceMesh>& mesh)>;

/// PyTorch's distribute_module: runs partition_fn on root and every submodule (without one:
/// every parameter no one has laid out yet is replicated over the mesh, from each mesh
/// dimension's first rank), then replicates every parameter partition_fn left alone, and
/// registers input_fn as a forward pre-hook and output_fn as a forward hook of root (each on
/// every tensor input or output; either may be empty). Call the module as (*module)(x).
/// Returns module. Throws ValueError for a null module or mesh.
std::shared_ptr<nn::Module> distribute_module(std::shared_ptr<nn::Module> module,
                                              std::shared_ptr<DeviceMesh> mesh,
                                              PartitionFn partition_fn = {},
                                              ModuleIoFn input_fn = {}, ModuleIoFn output_fn = {});

}  // namespace ember::dist
