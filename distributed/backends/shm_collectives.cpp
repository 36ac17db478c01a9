// Note [shared-memory collectives]
// Every collective of ProcessGroupGloo, not only allreduce, goes through the segment of Note
// [shared-memory allreduce] when its ranks share a machine: the same channels, tickets, waits,
// abort word, dead-rank detection and check that the ranks agree (the collective's kind,
// element count, dtype, reduce op and root). Each runs in steps (ShmAllreduce::run_steps), and
// in each step a rank writes slots, waits for every rank (arrive), reads slots and writes its
// part of the result, waits again (reduced), then reads the result. Every byte is copied once
// into shared memory and once out, in pieces of a channel's chunk (large blocks instead copy
// straight between the ranks' buffers: Note [single-copy collectives] in shm_single_copy.cpp):
//   reduce_scatter: the allreduce's steps 1-2 without step 3: rank r puts the pieces of the
//     other ranks' blocks in its slot, then reduces its own block's piece over the ranks in rank
//     order (so all ranks' results are bitwise what one reduction gives) straight into its
//     output.
//   reduce: the allreduce's steps (each share reduced by one rank), and only root copies out.
//   allgather, gather: each rank copies its piece into its slot; then every rank (gather: root)
//     copies every slot out.
//   broadcast: root copies a piece as large as all slots together into them; the others copy
//     it out.
//   scatter: root copies each rank's piece into that rank's slot; each rank copies its own out.
//   alltoall: rank r puts its piece for rank j at place j of its slot; rank j copies place j of
//     every slot out.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <ember/distributed/backends/detail/shm_allreduce.h>
#include <ember/distributed/errors.h>

namespace ember::dist::detail {

namespace {

size_t div_up(size_t a, size_t b) { return (a + b - 1) / b; }

// Elements [first, first + n) of the piece of step k, pieces of `per` elements out of `count`.
struct Piece {
  size_t first;
  size_t n;
};
Piece piece(size_t k, size_t per, size_t count) {
  const size_t first = std::min(count, k * per);
  return {first, std::min(per, count - first)};
}

char* at(void* p, size_t elems, size_t elem) { return static_cast<char*>(p) + elems * elem; }
const char* at(const void* p, size_t elems, size_t elem) {
  return static_cast<const char*>(p) + elems * elem;
}

// memcpy, but a buffer that is its own destination (an in-place allgather's input, which is
// this rank's block of the output) is left as it is: memcpy must not overlap.
void copy(void* dst, const void* src, size_t bytes) {
  if (dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace

void ShmAllreduce::broadcast(uint64_t ticket, void* data, size_t count, Dtype dtype, int root,
                             Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  if (single_copy(count * elem)) {
    return broadcast_direct(ticket, data, count, dtype, root, deadline);
  }
  const size_t per = chunk_ * static_cast<size_t>(size_) / elem;  // all slots, contiguous
  run_steps(ticket, Desc{Kind::Broadcast, dtype, count, ReduceOp::Sum, root},
            div_up(count, per), deadline, [&](Phase phase, size_t k, const Area& area) {
              const Piece p = piece(k, per, count);
              if (phase == Phase::Publish && rank_ == root) {
                std::memcpy(area.slots, at(data, p.first, elem), p.n * elem);
              } else if (phase == Phase::Combine && rank_ != root) {
                std::memcpy(at(data, p.first, elem), area.slots, p.n * elem);
              }
            });
}

void ShmAllreduce::gather(uint64_t ticket, const void* in, const std::vector<void*>& outs,
                          size_t count, Dtype dtype, int root, Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const size_t per = chunk_ / elem;
  const bool collects = root < 0 || root == rank_;
  if (collects && outs.size() != static_cast<size_t>(size_)) {
    throw std::invalid_argument(str_cat("shared-memory gather: ", outs.size(),
                                        " outputs for ", size_, " ranks"));
  }
  if (single_copy(count * elem)) {
    return gather_direct(ticket, in, outs, count, dtype, root, deadline);
  }
  const Kind kind = root < 0 ? Kind::Allgather : Kind::Gather;
  run_steps(ticket, Desc{kind, dtype, count, ReduceOp::Sum, root}, div_up(count, per), deadline,
            [&](Phase phase, size_t k, const Area& area) {
              const Piece p = piece(k, per, count);
              if (phase == Phase::Publish) {
                std::memcpy(area.slot(rank_), at(in, p.first, elem), p.n * elem);
              } else if (phase == Phase::Combine && collects) {
                for (int r = 0; r < size_; ++r) {
                  const void* src = r == rank_ ? at(in, p.first, elem) : area.slot(r);
                  copy(at(outs[static_cast<size_t>(r)], p.first, elem), src, p.n * elem);
                }
              }
            });
}

void ShmAllreduce::scatter(uint64_t ticket, const std::vector<const void*>& ins, void* out,
                           size_t count, Dtype dtype, int root, Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const size_t per = chunk_ / elem;
  if (rank_ == root && ins.size() != static_cast<size_t>(size_)) {
    throw std::invalid_argument(str_cat("shared-memory scatter: ", ins.size(), " inputs for ",
                                        size_, " ranks"));
  }
  if (single_copy(count * elem, true)) {
    return scatter_direct(ticket, ins, out, count, dtype, root, deadline);
  }
  run_steps(ticket, Desc{Kind::Scatter, dtype, count, ReduceOp::Sum, root}, div_up(count, per),
            deadline, [&](Phase phase, size_t k, const Area& area) {
              const Piece p = piece(k, per, count);
              if (phase == Phase::Publish && rank_ == root) {
                for (int r = 0; r < size_; ++r) {
                  void* dst = r == rank_ ? at(out, p.first, elem) : area.slot(r);
                  copy(dst, at(ins[static_cast<size_t>(r)], p.first, elem), p.n * elem);
                }
              } else if (phase == Phase::Combine && rank_ != root) {
                std::memcpy(at(out, p.first, elem), area.slot(rank_), p.n * elem);
              }
            });
}

// The pieces of a collective whose every rank sends one block to each rank (reduce_scatter,
// alltoall): a step moves `per` elements of each block, rank r's piece for rank j at place j
// of r's slot.
size_t ShmAllreduce::block_piece(Dtype dtype) const {
  const size_t per = chunk_ / static_cast<size_t>(itemsize(dtype)) / static_cast<size_t>(size_);
  if (per == 0) {
    throw std::invalid_argument(str_cat("shared-memory collectives: a chunk of ", chunk_,
                                        " bytes is too small for ", size_, " ranks"));
  }
  return per;
}

void ShmAllreduce::reduce_scatter(uint64_t ticket, const std::vector<const void*>& blocks,
                                  void* out, size_t count, Dtype dtype, const Reduction& red,
                                  Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  const size_t per = block_piece(dtype);
  std::vector<const void*> srcs(static_cast<size_t>(size_));
  const Desc desc{Kind::ReduceScatter, dtype, count, red.op, -1};
  const StepFn staged = [&](Phase phase, size_t k, const Area& area) {
              const Piece p = piece(k, per, count);
              if (phase == Phase::Publish) {
                for (int j = 0; j < size_; ++j) {
                  if (j == rank_) continue;
                  std::memcpy(at(area.slot(rank_), per * static_cast<size_t>(j), elem),
                              at(blocks[static_cast<size_t>(j)], p.first, elem), p.n * elem);
                }
              } else if (phase == Phase::Combine) {
                const size_t place = per * static_cast<size_t>(rank_);
                for (int r = 0; r < size_; ++r) {
                  srcs[static_cast<size_t>(r)] =
                      r == rank_ ? at(blocks[static_cast<size_t>(r)], p.first, elem)
                                 : at(area.slot(r), place, elem);
                }
                // Through this rank's part of the result: out may be blocks[rank] itself.
                char* mine = at(area.result, place, elem);
                combine(mine, srcs, p.n, red);
                std::memcpy(at(out, p.first, elem), mine, p.n * elem);
              }
            };
  if (!may_map(count * elem)) return run_steps(ticket, desc, div_up(count, per), deadline, staged);
  // Every rank's blocks in shareable memory: Note [mapped reductions] in shm_mapped.cpp.
  std::vector<Entry> mine;
  for (const void* b : blocks) mine.push_back({b, count * elem});
  run_mapped_or_staged(ticket, desc, mine, div_up(count, per), deadline, staged,
                       [&](const PeerBuffers& peers) {
                         mapped_reduce_scatter(peers, out, dtype, count, red);
                       });
}

void ShmAllreduce::alltoall(uint64_t ticket, const std::vector<const void*>& ins,
                            const std::vector<void*>& outs, size_t count, Dtype dtype,
                            Clock::time_point deadline) {
  const size_t elem = static_cast<size_t>(itemsize(dtype));
  if (single_copy(count * elem, true)) {
    return alltoall_direct(ticket, ins, outs, count, dtype, deadline);
  }
  const size_t per = block_piece(dtype);
  run_steps(ticket, Desc{Kind::Alltoall, dtype, count, ReduceOp::Sum, -1}, div_up(count, per),
            deadline, [&](Phase phase, size_t k, const Area& area) {
              const Piece p = piece(k, per, count);
              for (int j = 0; j < size_; ++j) {
                const auto J = static_cast<size_t>(j);
                if (phase == Phase::Publish) {
                  void* dst = j == rank_ ? at(outs[J], p.first, elem)
                                         : at(area.slot(rank_), per * J, elem);
                  copy(dst, at(ins[J], p.first, elem), p.n * elem);
                } else if (phase == Phase::Combine && j != rank_) {
                  std::memcpy(at(outs[J], p.first, elem),
                              at(area.slot(j), per * static_cast<size_t>(rank_), elem),
                              p.n * elem);
                }
              }
            });
}

}  // namespace ember::dist::detail
