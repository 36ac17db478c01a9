// parallelize_module (torch.distributed.tensor.parallel.parallelize_module): applies a tensor-
// parallel plan, parallel styles by submodule path, to a model over a 1-D mesh.
//
//   auto tp = (*mesh)["tp"];
//   dist::parallelize_module(block, tp, {
//       {"attn.qkv", dist::ColwiseParallel({.output_chunks = 3})},
//       {"attn.proj", dist::RowwiseParallel()},
//       {"mlp.fc", dist::ColwiseParallel()},
//       {"mlp.proj", dist::RowwiseParallel()}});
//
// Paths are dotted names of named_modules() ("blocks.0.qkv"); a "*" component matches any one
// component ("blocks.*.qkv"). Collective over the mesh (parameters are broadcast from
// src_data_rank's copy, so every rank starts from the same weights as one process would). Build
// the optimizer afterwards: it must see the sharded parameters.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ember/distributed/tensor_parallel/style.h>

namespace ember::dist {

/// One entry of a plan: a path (with "*" components) and the style for the modules it names.
struct PlanEntry {
  template <typename Style>
  PlanEntry(std::string p, Style s)  // NOLINT: {"fc", ColwiseParallel()}
      : path(std::move(p)), style(std::make_shared<Style>(std::move(s))) {}
  PlanEntry(std::string p, std::shared_ptr<const ParallelStyle> s)
      : path(std::move(p)), style(std::move(s)) {}
  std::string path;
  std::shared_ptr<const ParallelStyle> style;
};
using ParallelizePlan = std::vector<PlanEntry>;

/// Applies `plan` to `module`'s submodules over the 1-D `mesh` and returns `module`. Throws
/// ValueError naming the path when a path matches no module (listing the modules at the
/// deepest part of it that exists), when `mesh` is not 1-D (slice it: mesh["tp"]), and the
/// styles' errors (a module a style does not support, a width not divisible by the mesh).
std::shared_ptr<nn::Module> parallelize_module(std::shared_ptr<nn::Module> module,
                                               const std::shared_ptr<DeviceMesh>& mesh,
                                               const ParallelizePlan& plan,
                                               int src_data_rank = 0);
/// Applies one style to `module` itself.
std::shared_ptr<nn::Module> parallelize_module(std::shared_ptr<nn::Module> module,
                                               const std::shared_ptr<DeviceMesh>& mesh,
                                               const ParallelStyle& style,
                                               int src_data_rank = 0);

}  // namespace ember::dist
