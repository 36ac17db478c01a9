// Collectives a backend does not provide natively, built from the ones every backend has
// (allreduce, broadcast, allgather_into_tensor). Backends override these with native versions
// where they have them; these keep the semantics and the error reporting of the parts.
#include <ember/distributed/process_group.h>

#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

// chain_work's Work: its future is a then() of inner's, so the copy-backs are stream-ordered
// after inner's CUDA work, and wait() orders the caller after the copy-backs. Completion and
// errors also come from inner, whose backend may learn of a failure after its future completed
// (NCCL completes futures when the collective is queued).
class ChainedWork : public Work {
 public:
  ChainedWork(const WorkPtr& inner, const char* name, std::function<std::vector<Tensor>()> finish)
      : Work(detail::str_cat(inner->describe(), " (for ", name, ")"), inner->timeout()),
        inner_(inner) {
    future_ = inner->future()->then([finish = std::move(finish)](Future& f) {
      if (std::exception_ptr e = f.exception()) std::rethrow_exception(e);
      return finish();
    });
    future_->set_description(what_);
  }

  bool wait(std::optional<Duration> timeout) override {
    inner_->wait(timeout);
    future_->wait(timeout.value_or(timeout_));
    return true;
  }
  bool is_completed() const override {
    if (!inner_->is_completed() || !future_->completed()) return false;
    for (const auto& e : future_->ready_events()) {
      if (!e->query()) return false;
    }
    return true;
  }
  std::exception_ptr exception() const override {
    if (std::exception_ptr e = inner_->exception()) return e;
    return future_->exception();
  }

 private:
  WorkPtr inner_;
};

}  // namespace

WorkPtr chain_work(const WorkPtr& inner, const char* name,
                   std::function<std::vector<Tensor>()> finish) {
  return std::make_shared<ChainedWork>(inner, name, std::move(finish));
}

namespace {

void check_list(const char* op, const std::vector<Tensor>& list, size_t n, const Tensor& like,
                const char* what) {
  EMBER_CHECK(list.size() == n, "[", op, "] expected ", n, " ", what, " tensors (one per rank), got ",
              list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    EMBER_CHECK(list[i].defined() && list[i].shape() == like.shape() &&
                    list[i].dtype() == like.dtype() && list[i].device() == like.device(),
                "[", op, "] ", what, "[", i, "] must match the input (shape ", like.shape(), ", ",
                like.dtype(), ", ", like.device(), ")");
  }
}

}  // namespace

Tensor ProcessGroup::pack(const std::vector<Tensor>& list) {
  std::vector<Tensor> flat;
  flat.reserve(list.size());
  for (const Tensor& t : list) flat.push_back(t.reshape({-1}));
  return cat(flat, 0);
}

void check_coalesced(const char* backend, const std::vector<Tensor>& tensors) {
  EMBER_CHECK(!tensors.empty(), "[", backend, "] allreduce_coalesced expects at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    EMBER_CHECK(tensors[i].defined(), "[", backend, "] allreduce_coalesced: tensors[", i,
                "] is undefined");
    EMBER_CHECK(tensors[i].dtype() == tensors[0].dtype() &&
                    tensors[i].device() == tensors[0].device(),
                "[", backend, "] allreduce_coalesced expects one dtype and device, but tensors[0] "
                "is ", tensors[0].dtype(), " on ", tensors[0].device(), " and tensors[", i, "] is ",
                tensors[i].dtype(), " on ", tensors[i].device());
  }
}

Tensor ProcessGroup::zeros_for_collectives(IntList shape, TensorOptions opts) const {
  return zeros(shape, opts);
}

WorkPtr ProcessGroup::allreduce_coalesced(std::vector<Tensor>& tensors,
                                          const AllreduceOptions& opts) {
  check_coalesced(backend_name().c_str(), tensors);
  auto flat = std::make_shared<Tensor>(pack(tensors));
  WorkPtr inner = allreduce(*flat, opts);
  std::vector<Tensor> outs = tensors;
  return chain_work(inner, "allreduce_coalesced", [flat, outs]() mutable {
    int64_t at = 0;
    for (Tensor& t : outs) {
      t.copy_(flat->narrow(0, at, t.numel()).view(t.shape()));
      at += t.numel();
    }
    return outs;
  });
}

WorkPtr ProcessGroup::reduce(Tensor& tensor, const ReduceOptions& opts) {
  check_root("reduce", opts.root);
  // Every rank gets the result; c10d leaves non-root tensors unspecified, so this is valid.
  return allreduce(tensor, AllreduceOptions{opts.op, opts.timeout});
}

namespace {
/// Every rank's input gathered into one [size, *input] buffer, then copied into `outputs`
/// (empty on ranks that want nothing back).
WorkPtr gather_via_allgather(ProcessGroup& pg, const char* name, std::vector<Tensor>& outputs,
                             const Tensor& input, const CollectiveOptions& opts) {
  Shape flat_shape = input.shape();
  flat_shape.insert(0, pg.size());
  auto flat = std::make_shared<Tensor>(empty(flat_shape, input.options()));
  WorkPtr inner = pg.allgather_into_tensor(*flat, input, opts);
  return chain_work(inner, name, [flat, outputs]() mutable {
    for (size_t r = 0; r < outputs.size(); ++r) outputs[r].copy_((*flat)[r]);
    return outputs;
  });
}
}  // namespace

WorkPtr ProcessGroup::allgather(std::vector<Tensor>& outputs, const Tensor& input,
                                const CollectiveOptions& opts) {
  check_list("allgather", outputs, size_, input, "outputs");
  return gather_via_allgather(*this, "allgather", outputs, input, opts);
}

WorkPtr ProcessGroup::gather(std::vector<Tensor>& outputs, const Tensor& input,
                             const GatherOptions& opts) {
  check_root("gather", opts.root);
  if (rank_ == opts.root) {
    check_list("gather", outputs, size_, input, "outputs");
  } else {
    check_only_root_passes("gather", opts.root, outputs.size(), "output");
  }
  return gather_via_allgather(*this, "gather", outputs, input, CollectiveOptions{opts.timeout});
}

WorkPtr ProcessGroup::scatter(Tensor& output, const std::vector<Tensor>& inputs,
                              const ScatterOptions& opts) {
  check_root("scatter", opts.root);
  Shape flat_shape = output.shape();
  flat_shape.insert(0, size_);
  auto flat = std::make_shared<Tensor>();
  if (rank_ == opts.root) {
    check_list("scatter", inputs, size_, output, "inputs");
    *flat = pack(inputs).view(flat_shape);
  } else {
    check_only_root_passes("scatter", opts.root, inputs.size(), "input");
    *flat = empty(flat_shape, output.options());
  }
  WorkPtr inner = broadcast(*flat, BroadcastOptions{opts.root, opts.timeout});
  const int r = rank_;
  return chain_work(inner, "scatter", [flat, output, r]() mutable {
    output.copy_((*flat)[r]);
    return std::vector<Tensor>{output};
  });
}

WorkPtr ProcessGroup::reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                     const ReduceScatterOptions& opts) {
  check_list("reduce_scatter", inputs, size_, output, "inputs");
  Shape flat_shape = output.shape();
  flat_shape.insert(0, size_);
  auto flat = std::make_shared<Tensor>(pack(inputs).view(flat_shape));
  WorkPtr inner = allreduce(*flat, AllreduceOptions{opts.op, opts.timeout});
  const int r = rank_;
  return chain_work(inner, "reduce_scatter", [flat, output, r]() mutable {
    output.copy_((*flat)[r]);
    return std::vector<Tensor>{output};
  });
}

void ProcessGroup::check_reduce_scatter_tensor(const Tensor& output, const Tensor& input) const {
  EMBER_CHECK(output.defined() && input.defined(), "[", backend_name(),
              "] reduce_scatter_tensor: output and input must be defined");
  EMBER_CHECK(input.dtype() == output.dtype() && input.device() == output.device() &&
                  input.numel() == size_ * output.numel(),
              "[", backend_name(), "] reduce_scatter_tensor: input must hold ", size_, " x ",
              output.numel(), " = ", size_ * output.numel(), " elements of ", output.dtype(),
              " on ", output.device(), " (one block per rank), got ", input.numel(), " (shape ",
              input.shape(), ") of ", input.dtype(), " on ", input.device());
}

WorkPtr ProcessGroup::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                            const ReduceScatterOptions& opts) {
  check_reduce_scatter_tensor(output, input);
  const Tensor flat = input.reshape({-1});
  const int64_t m = output.numel();
  std::vector<Tensor> blocks;
  blocks.reserve(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) blocks.push_back(flat.narrow(0, r * m, m).view(output.shape()));
  return reduce_scatter(output, blocks, opts);
}

WorkPtr ProcessGroup::alltoall(std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                               const CollectiveOptions& opts) {
  EMBER_CHECK(!inputs.empty(), "[alltoall] expected ", size_, " input tensors, got none");
  check_list("alltoall", inputs, size_, inputs[0], "inputs");
  check_list("alltoall", outputs, size_, inputs[0], "outputs");
  // Every rank gathers every rank's whole input list, then keeps the parts meant for it: simple
  // and correct, size() times the traffic of a native alltoall.
  Shape in_shape = inputs[0].shape();
  in_shape.insert(0, size_);
  const Tensor mine = pack(inputs).view(in_shape);
  Shape all_shape = in_shape;
  all_shape.insert(0, size_);
  auto all = std::make_shared<Tensor>(empty(all_shape, inputs[0].options()));
  WorkPtr inner = allgather_into_tensor(*all, mine, opts);
  const int me = rank_;
  return chain_work(inner, "alltoall", [all, outputs, me, mine]() mutable {
    for (size_t r = 0; r < outputs.size(); ++r) outputs[r].copy_((*all)[r][me]);
    return outputs;
  });
}

}  // namespace ember::dist
