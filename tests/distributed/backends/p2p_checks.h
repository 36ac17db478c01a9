// Batched point-to-point and shape-learning sends, checked on any group (threads_test.cpp,
// gloo_test.cpp).
#pragma once

#include <string>
#include <vector>

#include <ember/distributed/p2p.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/store/store_test_util.h"

namespace ember::test {

/// Every rank exchanges with both neighbours in one batch: even ranks list their receives
/// first, odd ranks their sends, two tags. Then shapes the receiver learns: rank r sends a
/// [r + 1, 2] float64 and a [2, 1, r + 2] int64 tensor to the next rank.
inline void check_batch_p2p(dist::ProcessGroup& pg, int rank, int n) {
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const std::string who = "rank " + std::to_string(rank);
  Tensor to_next = full({5}, rank * 10.0 + 1), to_prev = full({3}, rank * 10.0 + 2);
  Tensor from_prev = zeros({5}), from_next = zeros({3});
  std::vector<dist::P2POp> ops = {dist::P2POp::isend(to_next, next, 1),
                                  dist::P2POp::isend(to_prev, prev, 2),
                                  dist::P2POp::irecv(from_prev, prev, 1),
                                  dist::P2POp::irecv(from_next, next, 2)};
  if (rank % 2 == 0) std::swap(ops[0], ops[2]), std::swap(ops[1], ops[3]);
  const std::vector<dist::WorkPtr> works = pg.batch_isend_irecv(ops);
  require(works.size() == 4, who + ": one Work per op");
  for (const dist::WorkPtr& w : works) w->wait();
  require(from_prev.to_vector<float>() == std::vector<float>(5, prev * 10.0f + 1),
          who + ": tag 1 from the previous rank");
  require(from_next.to_vector<float>() == std::vector<float>(3, next * 10.0f + 2),
          who + ": tag 2 from the next rank");

  const Tensor a = arange(2.0 * (rank + 1)).reshape({rank + 1, 2}).to(kFloat64) + rank;
  const Tensor b = arange(2.0 * (rank + 2)).reshape({2, 1, rank + 2}).to(kInt64);
  dist::WorkPtr sa = dist::send_with_shape(pg, a, next, 5);
  dist::WorkPtr sb = dist::send_with_shape(pg, b, next, 6);
  const Tensor got_a = dist::recv_with_shape(pg, prev, 5);
  const Tensor got_b = dist::recv_with_shape(pg, prev, 6);
  sa->wait();
  sb->wait();
  require(got_a.shape() == Shape({prev + 1, 2}) && got_a.dtype() == kFloat64,
          ember::detail::str_cat(who, ": learned shape ", got_a.shape()));
  require(got_a.to_vector<double>() ==
              (arange(2.0 * (prev + 1)).to(kFloat64) + prev).to_vector<double>(),
          who + ": values of the float64 tensor");
  require(got_b.shape() == Shape({2, 1, prev + 2}) && got_b.dtype() == kInt64,
          ember::detail::str_cat(who, ": learned int64 shape ", got_b.shape()));
  require(got_b.to_vector<int64_t>() == arange(2.0 * (prev + 2)).to(kInt64).to_vector<int64_t>(),
          who + ": values of the int64 tensor");
}

}  // namespace ember::test
