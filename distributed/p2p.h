// Batched point-to-point (torch.distributed's P2POp and batch_isend_irecv), and sends whose
// receiver learns the tensor's shape and dtype from a small header first.
//
//   std::vector<dist::P2POp> ops = {dist::P2POp::isend(activation, next),
//                                   dist::P2POp::irecv(grad, next)};
//   for (auto& w : dist::batch_isend_irecv(ops)) w->wait();
//
// Every operation of a batch is issued before any is waited for, so two ranks that each send
// to and receive from the other complete whatever order each lists them in. NCCL launches the
// batch as one group (ncclGroupStart/End); gloo, MPI and the threads group issue sends and
// receives that never block their caller, one after another. A receive whose size disagrees
// with its send fails on both ranks naming the peers and both sizes (gloo, threads; MPI
// reports a truncation on the receiver).
#pragma once

#include <memory>
#include <vector>

#include <ember/distributed/process_group.h>

namespace ember::dist {

/// Sends whose shape the receiver learns carry at most this many dimensions.
constexpr int kMaxP2pDims = 8;

/// Sends `tensor` to `dst` with a header (dtype and shape) first, on `tag`, for a receiver that
/// does not know its shape (recv_with_shape). The header is a small int64 tensor on the group's
/// default device. Returns the data's Work; throws ValueError naming the op for a tensor of
/// more than kMaxP2pDims dimensions.
WorkPtr send_with_shape(ProcessGroup& group, const Tensor& tensor, int dst, int tag = 0);
/// Receives what send_with_shape sent from `src` on `tag`: waits for the header (within the
/// group's timeout), then receives into a new tensor on `device`, which it returns once
/// received. Receive one peer's sends in the order they were sent: gloo moves one rank's
/// sends one after another, so waiting here for a later send's header while an earlier one
/// still waits for its receive blocks both until the timeout.
Tensor recv_with_shape(ProcessGroup& group, int src, int tag = 0, const Device& device = kCPU);

/// Issues every operation of `ops` and returns their Works in the same order (the same Work
/// may serve several under NCCL). All must name the same group (null: the default group).
/// Throws ValueError naming the op for an empty list, or operations on different groups.
std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops);

}  // namespace ember::dist
