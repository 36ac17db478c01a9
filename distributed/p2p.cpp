// Batched point-to-point and sends with a shape header (p2p.h).
#include <ember/distributed/p2p.h>

#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>

namespace ember::dist {

namespace {
// The header: dtype, number of dimensions, then the sizes (unused ones 0).
constexpr int64_t kHeaderLength = 2 + kMaxP2pDims;
}  // namespace

std::vector<WorkPtr> ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) {
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops) {
    if (op.op == P2POp::Kind::Send) {
      works.push_back(send(op.tensor, op.peer, op.tag));
    } else {
      Tensor t = op.tensor;
      works.push_back(recv(t, op.peer, op.tag));
    }
  }
  return works;
}

std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops) {
  EMBER_CHECK(!ops.empty(), "[batch_isend_irecv] expected at least one P2POp, got none");
  std::shared_ptr<ProcessGroup> group = ops[0].group ? ops[0].group : default_group();
  for (size_t i = 1; i < ops.size(); ++i) {
    const ProcessGroup* g = ops[i].group ? ops[i].group.get() : default_group().get();
    EMBER_CHECK(g == group.get(), "[batch_isend_irecv] every P2POp must use the same group: op ",
                i, " names another group than op 0");
  }
  return group->batch_isend_irecv(ops);
}

WorkPtr send_with_shape(ProcessGroup& group, const Tensor& tensor, int dst, int tag) {
  EMBER_CHECK(tensor.defined(), "[send_with_shape] expected a tensor, got an undefined one");
  EMBER_CHECK(tensor.dim() <= kMaxP2pDims, "[send_with_shape] expected at most ", kMaxP2pDims,
              " dimensions, got a tensor of shape ", tensor.shape());
  std::vector<int64_t> h(kHeaderLength, 0);
  h[0] = static_cast<int64_t>(tensor.dtype());
  h[1] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) h[2 + d] = tensor.size(d);
  const Tensor header = from_vector(h).to(group.default_device());
  // The header's Work completes with the data's on every backend (one tag, in order); the
  // header tensor lives in the Work until then.
  group.send(header, dst, tag);
  return group.send(tensor.contiguous(), dst, tag);
}

Tensor recv_with_shape(ProcessGroup& group, int src, int tag, const Device& device) {
  Tensor header = zeros({kHeaderLength}, TensorOptions(kInt64).device(group.default_device()));
  group.recv(header, src, tag)->wait();
  const std::vector<int64_t> h = header.to(kCPU).to_vector<int64_t>();
  EMBER_CHECK(h[1] >= 0 && h[1] <= kMaxP2pDims, "[recv_with_shape] rank ", src, " sent a header of ",
              h[1], " dimensions on tag ", tag, ": not a send_with_shape");
  // The dtype and sizes too: a plain send on the tag would otherwise pick a dtype past the
  // table's end (read out of bounds) or a negative size.
  EMBER_CHECK(h[0] >= 0 && h[0] < kNumDtypes, "[recv_with_shape] rank ", src,
              " sent a header with dtype code ", h[0], " on tag ", tag, ": not a send_with_shape");
  Shape shape;
  for (int64_t d = 0; d < h[1]; ++d) {
    EMBER_CHECK(h[2 + d] >= 0, "[recv_with_shape] rank ", src, " sent a header with size ",
                h[2 + d], " at dim ", d, " on tag ", tag, ": not a send_with_shape");
    shape.push_back(h[2 + d]);
  }
  Tensor out = empty(shape, TensorOptions(static_cast<Dtype>(h[0])).device(device));
  group.recv(out, src, tag)->wait();
  return out;
}

}  // namespace ember::dist
