// Context parallelism (PyTorch's torch.distributed.tensor.experimental.context_parallel): the
// sequence of every activation split over the ranks of a group, so that a context too long for
// one GPU's activations is trained on several. Everything but attention is per token and runs on
// the local part as it is; attention needs every earlier token's keys and values:
//
//   // the batch [B, T] split once: each rank keeps its part of the sequence (load-balanced)
//   Tensor x = dist::context_parallel_shard(tokens, /*dim=*/1, cp->rank(), cp->size());
//   ...                                                  // q, k, v: [B, H, T / cp, D]
//   Tensor y = dist::context_parallel_attention(q, k, v, cp);   // causal by default
//
// By default keys and values are all-gathered (PyTorch's default rotate method, "allgather"),
// each rank attends its queries over them through the fused kernels (cuDNN's flash attention on
// CUDA), and backward reduce-scatters the keys' and values' gradients back to their ranks. With
// options.rotate = Ring (ring attention; PyTorch's "alltoall"), the ranks' key and value blocks
// go round the ring instead, one hop per block, each rank attending over the block it holds
// while the next one arrives: no rank holds more than two blocks, so the memory for keys and
// values stays that of the local part however long the sequence (docs/tensor_parallel.md
// compares the two). Causal attention
// is load-balanced as PyTorch's is: the sequence is cut into 2 x cp chunks and rank r holds chunks
// r and 2 cp - 1 - r, so every rank attends over the same number of keys.
#pragma once

#include <memory>
#include <optional>

#include <ember/distributed/process_group.h>

namespace ember::dist {

/// How context_parallel_attention brings every rank's keys and values to the queries.
enum class ContextParallelRotate {
  /// One all-gather of the keys and one of the values forward (a reduce-scatter of each's
  /// gradient backward): the fewest messages; every rank holds the whole sequence's keys and
  /// values, and keeps them for backward.
  AllGather,
  /// Ring attention: size - 1 hops forward (the blocks) and size - 1 + size backward (the
  /// blocks again, and their gradients home), each overlapping a block's attention; every rank
  /// holds and keeps only its own part.
  Ring,
};

struct ContextParallelOptions {
  bool is_causal = true;        ///< query i sees keys j <= i (the global positions)
  std::optional<double> scale;  ///< default 1 / sqrt(head dim)
  /// The sequence split as context_parallel_shard splits it with the same flag: 2 x cp chunks,
  /// rank r holding r and 2 cp - 1 - r (true), or cp chunks, rank r holding chunk r (false).
  bool load_balance = true;
  ContextParallelRotate rotate = ContextParallelRotate::AllGather;
};

/// Attention of this rank's queries over the whole sequence's keys and values, each rank holding
/// its part of all three along dim -2 (q, k [..., T / cp, E], v [..., T / cp, Ev], the same
/// shapes on every rank, as context_parallel_shard splits them). Returns this rank's part of
/// scaled_dot_product_attention(q_full, k_full, v_full, {}, 0, is_causal, scale): [..., T / cp,
/// Ev]. Differentiable in q, k and v. Collective over `group` (options.rotate: an all-gather of k
/// and v forward and a reduce-scatter of their gradients in backward, or sends and receives round
/// the ring of the group's ranks). No mask or dropout. Throws ValueError for a
/// local length the chunks do not divide, and as scaled_dot_product_attention_forward does.
Tensor context_parallel_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                  std::shared_ptr<ProcessGroup> group,
                                  const ContextParallelOptions& options = {});

/// This rank's part of `t` along `dim` (as context_parallel_attention's options.load_balance
/// says): with load_balance the 2 x `size` chunks `rank` and 2 size - 1 - rank, concatenated;
/// else chunk `rank` of `size`. Not collective. Throws ValueError when the chunks do not divide
/// the dim or the rank is outside [0, size).
Tensor context_parallel_shard(const Tensor& t, int64_t dim, int rank, int size,
                              bool load_balance = true);

/// The whole of a tensor split by context_parallel_shard, from every rank's part (PyTorch's
/// context_parallel_unshard). Collective over `group` (an all-gather); differentiable.
Tensor context_parallel_unshard(const Tensor& local, int64_t dim,
                                std::shared_ptr<ProcessGroup> group, bool load_balance = true);

}  // namespace ember::dist
