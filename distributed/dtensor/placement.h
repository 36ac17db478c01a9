// Placements: how a distributed tensor lies along one dimension of a device mesh
// (torch.distributed.tensor.placement_types): Shard(dim), Replicate(), Partial(op).
//
//   dist::Placements p{dist::Shard(0), dist::Replicate()};   // one per mesh dimension
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

/// The tensor is split along tensor dimension `dim` over the ranks of the mesh dimension, as
/// torch.chunk splits it: pieces of ceil(size / n), the last ones shorter or empty.
struct Shard {
  explicit Shard(int64_t d) : dim(d) {}
  int64_t dim;
};
/// Every rank of the mesh dimension holds the whole tensor.
struct Replicate {};
/// Every rank holds a part whose reduction by `op` over the mesh dimension is the tensor
/// (pending reduction).
struct Partial {
  explicit Partial(ReduceOp o = ReduceOp::Sum) : op(o) {}
  ReduceOp op;
};

/// One of Shard, Replicate, Partial.
class Placement {
 public:
  enum class Kind : uint8_t { Replicate, Shard, Partial };
  Placement(Replicate) {}  // NOLINT: made from its kinds, as {Shard(0), Replicate()}
  Placement(Shard s) : kind_(Kind::Shard), dim_(s.dim) {}          // NOLINT
  Placement(Partial p) : kind_(Kind::Partial), op_(p.op) {}        // NOLINT

  Kind kind() const { return kind_; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_shard() const { return kind_ == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind_ == Kind::Shard && dim_ == d; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  /// Shard's tensor dimension (as given: may be negative until a DTensor wraps it).
  int64_t dim() const { return dim_; }
  /// Partial's reduction.
  ReduceOp op() const { return op_; }
  bool operator==(const Placement& o) const {
    return kind_ == o.kind_ && (kind_ != Kind::Shard || dim_ == o.dim_) &&
           (kind_ != Kind::Partial || op_ == o.op_);
  }
  /// "Shard(0)", "Replicate()", "Partial(sum)".
  std::string str() const;

 private:
  Kind kind_ = Kind::Replicate;
  int64_t dim_ = 0;
  ReduceOp op_ = ReduceOp::Sum;
};

/// One placement per mesh dimension.
using Placements = std::vector<Placement>;
/// "(Shard(0), Replicate())".
std::string to_string(const Placements& p);

/// Where piece `i` of `n` starts when a dimension of `size` is split as torch.chunk splits it
/// (pieces of ceil(size / n); the last may be shorter or empty), and how long it is.
int64_t shard_offset(int64_t size, int64_t n, int64_t i);
int64_t shard_length(int64_t size, int64_t n, int64_t i);

}  // namespace ember::dist
