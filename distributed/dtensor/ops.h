// The ops DTensor has sharding rules for: what tensor and sequence parallelism need. Each looks
// at the placements of its arguments on every mesh dimension, runs the op on the local tensors
// (inserting the collectives its gradient needs, Note [gradient conventions] in dtensor.cpp) and
// returns the result's placements; for placements it has no rule for it throws ValueError naming
// the op and every argument's placements, and never gathers on its own (redistribute first).
//
//   DTensor y = dist::linear(x, w, b);   // x Replicate, w Shard(0): y Shard(-1) (column parallel)
//                                         // x Shard(-1), w Shard(1): y Partial (row parallel)
//
// Rules, per mesh dimension (R = Replicate, S(d) = Shard(d), P = Partial(sum)):
//   linear(x, w, b)       R,R,R -> R; R,S(0),S(0) -> S(-1); S(-1),S(1),R -> P (b added once);
//                          S(k),R,R -> S(k) for a batch dim k; P,R,- -> P
//   matmul(a, b)          R,R -> R; S(row),R -> S(row); R,S(col) -> S(col); S(k of a),S(k of b)
//                          -> P; a batch dim sharded alike in both, or in a with b replicated
//                          (b's batches narrowed locally) -> that dim
//   add/sub(a, b)         alike -> alike (P+P -> P for sum and avg); S(d) with R -> S(d); R,R -> R
//   mul/div(a, b)         as add, but P only with an R other operand (mul) or divisor (div)
//   map(x, fn)            placement kept (P(sum), P(avg) only for a linear fn)
//   embedding(ids, w)     R,S(0) -> P (vocabulary parallel); R,S(1) -> S(-1); ids',R -> ids'
//   layer_norm(x, ...)    S(k) outside the normalized dims -> S(k); R -> R
//   dropout(x, p)         kept; a sharded x draws the whole tensor's mask and keeps its part, so
//                          every rank's mask is the one a single process would draw
//   softmax(x, d)         kept when d is not sharded
//   sum(x, dims)          summing a sharded dim gives P; others kept (dims renumbered)
//   reshape, transpose    a sharded dim kept as it is, or split (its outer part sharded) / merged
#pragma once

#include <functional>
#include <vector>

#include <ember/distributed/dtensor/dtensor.h>

namespace ember::dist {

/// nn::functional::linear on DTensors (bias may be undefined).
DTensor linear(const DTensor& x, const DTensor& weight, const DTensor& bias = {});
/// Matrix product of the last two dims (batch dims broadcast as ember::matmul's).
DTensor matmul(const DTensor& a, const DTensor& b);
DTensor add(const DTensor& a, const DTensor& b);
DTensor sub(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, const DTensor& b);
DTensor div(const DTensor& a, const DTensor& b);
/// `fn` (an element-wise op: one output element from the input element at the same position)
/// on the local tensor, placements kept; `linear`: fn(a + b) = fn(a) + fn(b), so a Partial(sum)
/// or Partial(avg) may pass (max, min and product never do). `name` goes into errors.
DTensor map(const DTensor& x, const std::function<Tensor(const Tensor&)>& fn, const char* name,
            bool linear = false);
/// Rows of weight for int64 indices (nn::functional::embedding).
DTensor embedding(const DTensor& indices, const DTensor& weight);
DTensor layer_norm(const DTensor& x, IntList normalized_shape, const DTensor& weight = {},
                   const DTensor& bias = {}, double eps = 1e-5);
DTensor dropout(const DTensor& x, double p, bool training = true);
DTensor softmax(const DTensor& x, int64_t dim);
DTensor sum(const DTensor& x, IntList dims, bool keepdim = false);
DTensor reshape(const DTensor& x, IntList shape);
DTensor transpose(const DTensor& x, int64_t dim0, int64_t dim1);

}  // namespace ember::dist
