#include <ember/distributed/tensor_parallel/loss_parallel.h>

#include <limits>

#include <ember/distributed/functional/collectives.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops.h>

namespace ember::dist::loss_parallel {

namespace {
constexpr const char* kOp = "[loss_parallel::cross_entropy]";
}  // namespace

Tensor cross_entropy(const DTensor& logits, const Tensor& target, const std::string& reduction,
                     int64_t ignore_index) {
  EMBER_CHECK(logits.defined() && target.defined(), kOp, " expected logits and a target");
  const DeviceMesh& mesh = *logits.device_mesh();
  EMBER_CHECK(mesh.ndim() == 1, kOp, " expected logits on a 1-D mesh, got ", mesh.str());
  const Placement& p = logits.placements()[0];
  const int64_t last = logits.dim() - 1;
  EMBER_CHECK(p.is_replicate() || p.is_shard(last), kOp, " expected logits sharded on the ",
              "class dim (Shard(", last, ")) or replicated, got ", to_string(logits.placements()));
  EMBER_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none", kOp,
              " reduction must be mean, sum or none, got '", reduction, "'");
  Shape rows = logits.shape();
  rows.pop_back();
  EMBER_CHECK(target.shape() == rows && !target.is_floating_point(), kOp,
              " expected integer class indices of shape ", rows, " (logits ", logits.shape(),
              "), got ", target.dtype(), " ", target.shape());
  const int64_t vocab = logits.size(-1);
  const bool sharded = p.is_shard();
  const int64_t n = sharded ? mesh.size() : 1, k = sharded ? mesh.get_local_rank() : 0;
  const int64_t lo = shard_offset(vocab, n, k), len = shard_length(vocab, n, k);
  const auto group = mesh.get_group();

  const int64_t rows_n = target.numel();
  // [N, len]: this rank's classes; len is 0 on a trailing rank of an uneven vocabulary
  // (torch.chunk's shards), which still takes part in every collective below.
  const Tensor z = logits.to_local().reshape({rows_n, len});
  const Tensor t = target.reshape({-1}).to(z.device());  // [N]
  const Tensor valid = ne(t, Scalar(ignore_index));
  const Tensor safe_t = where(valid, t, zeros_like(t));
  EMBER_CHECK(all(logical_and(ge(safe_t, Scalar(0)), lt(safe_t, Scalar(vocab)))).item<bool>(),
              kOp, " targets must be in [0, ", vocab, ") or ", ignore_index);
  // The row maximum over every rank's classes (no gradient: the loss does not depend on it).
  Tensor m = len > 0 ? amax(z.detach(), {1})
                     : full({rows_n}, -std::numeric_limits<double>::infinity(), z.options());
  if (sharded) group->allreduce(m, {.op = ReduceOp::Max, .timeout = {}})->wait();
  Tensor sum_exp = exp(z - m.unsqueeze(1)).sum({1});
  // The target's logit lives on one rank; the others contribute zero.
  const Tensor mine = logical_and(logical_and(ge(safe_t, Scalar(lo)), lt(safe_t, Scalar(lo + len))),
                                  valid);
  const Tensor col = where(mine, safe_t - lo, zeros_like(safe_t));
  Tensor picked = len > 0 ? gather(z, 1, col.unsqueeze(1)).squeeze(1) * mine.to(z.dtype())
                          : zeros({rows_n}, z.options());
  if (sharded) {
    sum_exp = functional::reduce_from_group(sum_exp, group);
    picked = functional::reduce_from_group(picked, group);
  }
  Tensor loss = (log(sum_exp) + m - picked) * valid.to(z.dtype());  // [N]
  if (reduction == "none") return loss.reshape(rows);
  if (reduction == "sum") return loss.sum();
  return loss.sum() / valid.to(z.dtype()).sum();
}

}  // namespace ember::dist::loss_parallel
