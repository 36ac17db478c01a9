// Sequence parallelism's collectives fused with the Linear next to them (Note [fused sequence-
// parallel linears] in fused_linear.cpp). Internal to the parallel styles.
#pragma once

#include <memory>

#include <ember/distributed/process_group.h>

namespace ember::dist::detail {

/// y = linear(all_gather(x along `dim` over `group`), weight, bias): a column-parallel Linear
/// whose input is sharded on the sequence. Saves x's shard, not the gathered input (backward
/// gathers it again). `chunks` pieces along dim 0, each piece's all-gather in flight while the
/// previous piece's matmul runs. Differentiable in x, weight and bias; x's gradient is
/// reduce-scattered back to its shard.
Tensor all_gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                         std::shared_ptr<ProcessGroup> group, int64_t dim, int64_t chunks);

/// reduce_scatter(linear(x, weight, bias on the group's first rank only) along `dim`): a
/// row-parallel Linear whose output is sharded on the sequence, the bias added once. `chunks`
/// pieces along dim 0, each piece's reduce-scatter in flight while the next piece's matmul
/// runs. Differentiable in x, weight and bias (the bias's gradient is the whole one on every
/// rank).
Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             std::shared_ptr<ProcessGroup> group, int64_t dim, int64_t chunks);

}  // namespace ember::dist::detail
