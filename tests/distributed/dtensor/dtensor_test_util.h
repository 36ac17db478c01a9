// Helpers of the DTensor and tensor-parallel tests.
#pragma once

#include <ember/distributed/dtensor/dtensor.h>

namespace ember::test {

/// This rank's part of `full` laid out as `p` on `mesh`: its chunk along every Shard dimension
/// (torch.chunk's, as distribute_tensor cuts); Replicate and Partial leave it whole.
inline Tensor shard_of(const Tensor& full, const dist::DeviceMesh& mesh,
                       const dist::Placements& p) {
  Tensor t = full;
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!p[i].is_shard()) continue;
    const int64_t d = p[i].dim() < 0 ? p[i].dim() + full.dim() : p[i].dim();
    const int64_t n = mesh.size(i), k = mesh.get_local_rank(i);
    t = t.narrow(d, dist::shard_offset(full.size(d), n, k), dist::shard_length(full.size(d), n, k));
  }
  return t;
}

}  // namespace ember::test
