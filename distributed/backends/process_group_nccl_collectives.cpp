// ProcessGroupNccl's collectives and send/recv, one function each: each checks its tensors, then
// hands the NCCL calls to Impl::launch (detail/process_group_nccl_impl.h), which queues them on
// the group's stream and watches them. Built only with CUDA and NCCL.
#include <algorithm>
#include <vector>

#include <ember/distributed/backends/detail/process_group_nccl_impl.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

bool supported(Dtype d) {
  switch (d) {
    case Dtype::Float32:
    case Dtype::Float64:
    case Dtype::Float16:
    case Dtype::BFloat16:
    case Dtype::Int32:
    case Dtype::Int64:
    case Dtype::UInt8:
      return true;
    default:
      return false;
  }
}

ncclDataType_t nccl_dtype(Dtype d) {
  switch (d) {
    case Dtype::Float32:
      return ncclFloat32;
    case Dtype::Float64:
      return ncclFloat64;
    case Dtype::Float16:
      return ncclFloat16;
    case Dtype::BFloat16:
      return ncclBfloat16;
    case Dtype::Int32:
      return ncclInt32;
    case Dtype::Int64:
      return ncclInt64;
    case Dtype::UInt8:
      return ncclUint8;
    default:
      break;
  }
  EMBER_INTERNAL_ASSERT(false, "[nccl] unsupported dtype ", d, " passed validation");
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;  // integers: truncating division (NCCL's SumPostDiv)
    case ReduceOp::Product:
      return ncclProd;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Max:
      return ncclMax;
  }
  return ncclSum;
}

void check_tensor(const char* op, const Tensor& t, int device, const char* what = "tensor") {
  EMBER_CHECK(t.defined(), "[nccl] ", op, ": ", what, " is undefined");
  EMBER_CHECK(t.device() == cuda_device(device), "[nccl] ", op, " expects CUDA tensors on ",
              cuda_device(device), " (the group's device), got ", what, " on ", t.device());
  EMBER_CHECK(t.is_contiguous(), "[nccl] ", op, " expects contiguous tensors, got a ",
              "non-contiguous ", what, " (shape ", t.shape(), ")");
  EMBER_CHECK_TYPE(TypeError, supported(t.dtype()), "[nccl] ", op,
                   " supports float32, float64, float16, bfloat16, int32, int64 and uint8, got ",
                   what, " of dtype ", t.dtype());
}

}  // namespace

WorkPtr ProcessGroupNccl::allreduce(Tensor& tensor, const AllreduceOptions& opts) {
  check_tensor("allreduce", tensor, device());
  void* p = tensor.data_ptr();
  const size_t n = static_cast<size_t>(tensor.numel());
  const ncclDataType_t dt = nccl_dtype(tensor.dtype());
  const ncclRedOp_t op = nccl_op(opts.op);
  return record_flight(
      impl_->launch(next_op_label("allreduce"), timeout_of(opts.timeout), {tensor}, {},
                    [=](ncclComm_t c, cudaStream_t s) {
                      return n == 0 ? ncclSuccess : ncclAllReduce(p, p, n, dt, op, c, s);
                    }),
      {tensor});
}

WorkPtr ProcessGroupNccl::broadcast(Tensor& tensor, const BroadcastOptions& opts) {
  check_tensor("broadcast", tensor, device());
  check_root("broadcast", opts.root);
  void* p = tensor.data_ptr();
  const size_t n = static_cast<size_t>(tensor.numel());
  const ncclDataType_t dt = nccl_dtype(tensor.dtype());
  const int root = opts.root;
  return record_flight(
      impl_->launch(next_op_label("broadcast"), timeout_of(opts.timeout), {tensor}, {},
                    [=](ncclComm_t c, cudaStream_t s) {
                      return n == 0 ? ncclSuccess : ncclBroadcast(p, p, n, dt, root, c, s);
                    }),
      {tensor});
}

WorkPtr ProcessGroupNccl::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check_tensor("reduce", tensor, device());
  check_root("reduce", opts.root);
  void* p = tensor.data_ptr();
  const size_t n = static_cast<size_t>(tensor.numel());
  const ncclDataType_t dt = nccl_dtype(tensor.dtype());
  const ncclRedOp_t op = nccl_op(opts.op);
  const int root = opts.root;
  return record_flight(
      impl_->launch(next_op_label("reduce"), timeout_of(opts.timeout), {tensor}, {},
                    [=](ncclComm_t c, cudaStream_t s) {
                      return n == 0 ? ncclSuccess : ncclReduce(p, p, n, dt, op, root, c, s);
                    }),
      {tensor});
}

WorkPtr ProcessGroupNccl::allgather_into_tensor(Tensor& output, const Tensor& input,
                                                const CollectiveOptions& opts) {
  check_tensor("allgather_into_tensor", input, device(), "input");
  check_tensor("allgather_into_tensor", output, device(), "output");
  EMBER_CHECK(output.dtype() == input.dtype() && output.numel() == size_ * input.numel(),
              "[nccl] allgather_into_tensor expects an output of ", size_, " x ", input.numel(),
              " = ", size_ * input.numel(), " elements of dtype ", input.dtype(), ", got ",
              output.numel(), " elements (shape ", output.shape(), ") of dtype ", output.dtype());
  const void* in = input.data_ptr();
  void* out = output.data_ptr();
  const size_t n = static_cast<size_t>(input.numel());
  const ncclDataType_t dt = nccl_dtype(input.dtype());
  return record_flight(impl_->launch(next_op_label("allgather_into_tensor"),
                                     timeout_of(opts.timeout), {output}, {input},
                                     [=](ncclComm_t c, cudaStream_t s) {
                                       return n == 0 ? ncclSuccess
                                                     : ncclAllGather(in, out, n, dt, c, s);
                                     }),
                       {output, input});
}

WorkPtr ProcessGroupNccl::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                         const ReduceScatterOptions& opts) {
  check_tensor("reduce_scatter", output, device(), "output");
  EMBER_CHECK(static_cast<int>(inputs.size()) == size_, "[nccl] reduce_scatter expected ", size_,
              " input tensors (one per rank), got ", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EMBER_CHECK(inputs[i].defined() && inputs[i].shape() == output.shape() &&
                    inputs[i].dtype() == output.dtype() && inputs[i].device() == output.device(),
                "[nccl] reduce_scatter: inputs[", i, "] must match the output (shape ",
                output.shape(), ", ", output.dtype(), ", ", output.device(), ")");
  }
  // NCCL's reduce-scatter takes one buffer of size() consecutive chunks. The packing copies run
  // on the caller's stream, which the collective waits for.
  std::vector<Tensor> flat;
  flat.reserve(inputs.size());
  for (const Tensor& t : inputs) flat.push_back(t.reshape({-1}));
  const Tensor packed = cat(flat, 0);
  const void* in = packed.data_ptr();
  void* out = output.data_ptr();
  const size_t n = static_cast<size_t>(output.numel());
  const ncclDataType_t dt = nccl_dtype(output.dtype());
  const ncclRedOp_t op = nccl_op(opts.op);
  return record_flight(
      impl_->launch(next_op_label("reduce_scatter"), timeout_of(opts.timeout), {output}, {packed},
                    [=](ncclComm_t c, cudaStream_t s) {
                      return n == 0 ? ncclSuccess : ncclReduceScatter(in, out, n, dt, op, c, s);
                    }),
      {output, packed});
}

WorkPtr ProcessGroupNccl::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                const ReduceScatterOptions& opts) {
  check_tensor("reduce_scatter_tensor", output, device(), "output");
  check_tensor("reduce_scatter_tensor", input, device(), "input");
  check_reduce_scatter_tensor(output, input);
  const void* in = input.data_ptr();
  void* out = output.data_ptr();
  const size_t n = static_cast<size_t>(output.numel());
  const ncclDataType_t dt = nccl_dtype(output.dtype());
  const ncclRedOp_t op = nccl_op(opts.op);
  return record_flight(impl_->launch(next_op_label("reduce_scatter_tensor"),
                                     timeout_of(opts.timeout), {output}, {input},
                                     [=](ncclComm_t c, cudaStream_t s) {
                                       return n == 0 ? ncclSuccess
                                                     : ncclReduceScatter(in, out, n, dt, op, c, s);
                                     }),
                       {output, input});
}

WorkPtr ProcessGroupNccl::alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                                   const CollectiveOptions& opts) {
  EMBER_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "[nccl] alltoall expected ", size_, " input and ", size_,
              " output tensors (one per rank), got ", inputs.size(), " and ", outputs.size());
  struct Part {
    void* ptr;
    size_t count;
  };
  std::vector<Part> sends, recvs;
  for (int r = 0; r < size_; ++r) {
    check_tensor("alltoall", inputs[r], device(), "input");
    check_tensor("alltoall", outputs[r], device(), "output");
    EMBER_CHECK(inputs[r].dtype() == inputs[0].dtype() && outputs[r].dtype() == inputs[0].dtype(),
                "[nccl] alltoall expects one dtype (", inputs[0].dtype(), "), got inputs[", r,
                "] of ", inputs[r].dtype(), " and outputs[", r, "] of ", outputs[r].dtype());
    sends.push_back({inputs[r].data_ptr(), static_cast<size_t>(inputs[r].numel())});
    recvs.push_back({outputs[r].data_ptr(), static_cast<size_t>(outputs[r].numel())});
  }
  const ncclDataType_t dt = nccl_dtype(inputs[0].dtype());
  // Zero-sized parts are skipped on both sides (rank a's send to b has b's receive's size).
  return record_flight(
      impl_->launch(next_op_label("alltoall"), timeout_of(opts.timeout), outputs, inputs,
                    [=](ncclComm_t c, cudaStream_t s) {
                      ncclResult_t r = ncclGroupStart();
                      if (r != ncclSuccess) return r;
                      ncclResult_t first = ncclSuccess;
                      auto note = [&](ncclResult_t x) {
                        if (first == ncclSuccess && x != ncclSuccess && x != ncclInProgress) {
                          first = x;
                        }
                      };
                      for (int peer = 0; peer < static_cast<int>(sends.size()); ++peer) {
                        if (sends[peer].count > 0) {
                          note(ncclSend(sends[peer].ptr, sends[peer].count, dt, peer, c, s));
                        }
                        if (recvs[peer].count > 0) {
                          note(ncclRecv(recvs[peer].ptr, recvs[peer].count, dt, peer, c, s));
                        }
                      }
                      const ncclResult_t e = ncclGroupEnd();
                      return first != ncclSuccess ? first : e;
                    }),
      inputs);
}

WorkPtr ProcessGroupNccl::barrier(const CollectiveOptions& opts) {
  Tensor one = zeros({1}, TensorOptions(kFloat32).device(cuda_device(device())));
  void* p = one.data_ptr();
  return record_flight(impl_->launch(
                           next_op_label("barrier"), timeout_of(opts.timeout), {}, {one},
                           [=](ncclComm_t c, cudaStream_t s) {
                             return ncclAllReduce(p, p, 1, ncclFloat32, ncclSum, c, s);
                           },
                           /*blocking=*/true),
                       {one});
}

WorkPtr ProcessGroupNccl::send(const Tensor& tensor, int dst, int /*tag*/) {
  check_tensor("send", tensor, device());
  EMBER_CHECK(dst >= 0 && dst < size_ && dst != rank_, "[nccl] send: dst ", dst,
              " must be another rank of this group of size ", size_, " (this is rank ", rank_, ")");
  const void* p = tensor.data_ptr();
  const size_t n = static_cast<size_t>(tensor.numel());
  const ncclDataType_t dt = nccl_dtype(tensor.dtype());
  return record_flight(impl_->launch(next_p2p_label("send"), timeout_of({}), {tensor}, {},
                                     [=](ncclComm_t c, cudaStream_t s) {
                                       return n == 0 ? ncclSuccess : ncclSend(p, n, dt, dst, c, s);
                                     }),
                       {tensor});
}

WorkPtr ProcessGroupNccl::recv(Tensor& tensor, int src, int /*tag*/) {
  check_tensor("recv", tensor, device());
  EMBER_CHECK(src >= 0 && src < size_ && src != rank_, "[nccl] recv: src ", src,
              " must be another rank of this group of size ", size_, " (this is rank ", rank_, ")");
  void* p = tensor.data_ptr();
  const size_t n = static_cast<size_t>(tensor.numel());
  const ncclDataType_t dt = nccl_dtype(tensor.dtype());
  return record_flight(impl_->launch(next_p2p_label("recv"), timeout_of({}), {tensor}, {},
                                     [=](ncclComm_t c, cudaStream_t s) {
                                       return n == 0 ? ncclSuccess : ncclRecv(p, n, dt, src, c, s);
                                     }),
                       {tensor});
}

std::vector<WorkPtr> ProcessGroupNccl::batch_isend_irecv(const std::vector<P2POp>& ops) {
  EMBER_CHECK(!ops.empty(), "[nccl] batch_isend_irecv: expected at least one P2POp, got none");
  struct Part {
    bool send;
    void* ptr;
    size_t count;
    ncclDataType_t dt;
    int peer;
  };
  std::vector<Part> parts;
  std::vector<Tensor> outputs, keep;
  for (const P2POp& op : ops) {
    const bool send = op.op == P2POp::Kind::Send;
    check_tensor(send ? "send" : "recv", op.tensor, device());
    EMBER_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_,
                "[nccl] batch_isend_irecv: ", send ? "send to " : "recv from ", op.peer,
                " must name another rank of this group of size ", size_, " (this is rank ", rank_,
                ")");
    parts.push_back({send, op.tensor.data_ptr(), static_cast<size_t>(op.tensor.numel()),
                     nccl_dtype(op.tensor.dtype()), op.peer});
    (send ? keep : outputs).push_back(op.tensor);
  }
  WorkPtr w = record_flight(
      impl_->launch(next_p2p_label("batch_isend_irecv"), timeout_of({}), outputs, keep,
                    [=](ncclComm_t c, cudaStream_t s) {
                      ncclResult_t r = ncclGroupStart();
                      if (r != ncclSuccess) return r;
                      ncclResult_t first = ncclSuccess;
                      for (const Part& p : parts) {
                        if (p.count == 0) continue;
                        const ncclResult_t x = p.send
                                                   ? ncclSend(p.ptr, p.count, p.dt, p.peer, c, s)
                                                   : ncclRecv(p.ptr, p.count, p.dt, p.peer, c, s);
                        if (first == ncclSuccess && x != ncclSuccess && x != ncclInProgress) {
                          first = x;
                        }
                      }
                      const ncclResult_t e = ncclGroupEnd();
                      return first != ncclSuccess ? first : e;
                    }),
      keep);
  return std::vector<WorkPtr>(ops.size(), w);
}

}  // namespace ember::dist
