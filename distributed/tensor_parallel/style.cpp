#include <ember/distributed/tensor_parallel/style.h>

#include <ember/distributed/tensor_parallel/detail/fused_linear.h>
#include <ember/distributed/dtensor/detail/dtensor_impl.h>
#include <ember/distributed/dtensor/distribute_module.h>
#include <ember/distributed/dtensor/ops.h>
#include <ember/nn/layers/dropout.h>
#include <ember/nn/layers/embedding.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/layers/norm.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[parallelize_module]";

// The input `x` as a DTensor: the one a style left it as (use_local_output = false), else laid
// out as `layout` says, with even shards.
DTensor input_of(const Tensor& x, const Placement& layout, const std::shared_ptr<DeviceMesh>& mesh) {
  if (auto d = as_dtensor(x); d && *d->device_mesh() == *mesh) return *d;
  return DTensor::from_local(x, mesh, {layout});
}

// A module's output: its local tensor, recorded as `d` unless use_local.
Tensor output_of(const DTensor& d, bool use_local) {
  Tensor t = d.to_local();
  if (!use_local) register_dtensor(t, DTensor::make(t, d.device_mesh(), d.placements(), d.shape()));
  return t;
}

// Lays parameter `p` out as `placement` in place (the module keeps its handle) and records it;
// with `chunks` > 1, dim 0 is that many blocks, each sharded on its own.
void distribute_param(const Tensor& p, const std::shared_ptr<DeviceMesh>& mesh,
                      const Placement& placement, int src, int64_t chunks = 1) {
  if (!p.defined()) return;
  EMBER_CHECK(chunks == 1 || !as_dtensor(p), kOp, " the parameter is already distributed as ",
              as_dtensor(p) ? as_dtensor(p)->str() : "", "; a module is parallelized once");
  if (chunks == 1) {
    distribute_parameter(p, mesh, {placement}, src);
    return;
  }
  // [chunks * m, ...] viewed as [chunks, m, ...], sharded on the blocks' dim 1.
  Shape blocks = p.shape();
  blocks[0] /= chunks;
  blocks.insert(0, chunks);
  const DTensor d = distribute_tensor(p.reshape(blocks), mesh, {Shard(1)}, src);
  Shape local = p.shape();
  local[0] = d.local().size(0) * d.local().size(1);
  nn::set_data(p, d.local().reshape(local));
  register_dtensor(p, DTensor::make(p.view(d.local().shape()), mesh, {Shard(1)}, blocks));
}

void check_divisible(const std::string& style, const std::string& path, const std::string& what,
                     int64_t size, int64_t n) {
  EMBER_CHECK(size % n == 0, kOp, " ", style, " at '", path, "': ", what, " (", size,
              ") is not divisible by the mesh's ", n, " ranks");
}

DTensor param(const Tensor& p) {
  std::optional<DTensor> d = as_dtensor(p);
  EMBER_INTERNAL_ASSERT(d.has_value(), "a parallelized module's parameter has no placements");
  return *d;
}

template <typename M>
M* as(nn::Module& m) {
  return dynamic_cast<M*>(&m);
}

}  // namespace

void ColwiseParallel::apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                            const std::string& path, int src) const {
  const int64_t n = mesh->size();
  const int64_t chunks = o_.output_chunks;
  EMBER_CHECK(chunks >= 1, kOp, " ColwiseParallel at '", path, "': output_chunks must be >= 1, got ",
              chunks);
  EMBER_CHECK(chunks == 1 || (o_.use_local_output && !o_.output_layouts), kOp,
              " ColwiseParallel at '", path, "': output_chunks > 1 leaves each rank its part of "
              "every block, which no placement describes: it needs use_local_output and the "
              "default output layout");
  int64_t global_out = 0;  // 0: the output's last dim times the mesh size
  if (auto* lin = as<nn::Linear>(module)) {
    EMBER_CHECK(lin->out_features % chunks == 0, kOp, " ColwiseParallel at '", path,
                "': out_features (", lin->out_features, ") is not divisible by output_chunks (",
                chunks, ")");
    check_divisible(name(), path, "out_features / output_chunks", lin->out_features / chunks, n);
    distribute_param(lin->weight, mesh, Shard(0), src, chunks);
    distribute_param(lin->bias, mesh, Shard(0), src, chunks);
    global_out = lin->out_features;
  } else if (auto* emb = as<nn::Embedding>(module)) {
    EMBER_CHECK(chunks == 1, kOp, " ColwiseParallel at '", path, "': output_chunks is for Linear");
    check_divisible(name(), path, "embedding_dim", emb->embedding_dim, n);
    distribute_param(emb->weight, mesh, Shard(1), src);
    global_out = emb->embedding_dim;
  }
  const Placement in = o_.input_layouts.value_or(Replicate());
  const Placement out = o_.output_layouts.value_or(Shard(-1));
  const bool use_local = o_.use_local_output;
  const int64_t overlap = as<nn::Linear>(module) != nullptr ? o_.overlap_chunks : 0;
  module.set_forward_override([=](nn::Module& m, const Tensor& x) {
    const DTensor din = input_of(x, in, mesh);
    const Placement& p = din.placements()[0];
    Tensor y;
    // The fused all-gather takes even shards; uneven ones (an odd sequence length) go the
    // padded way through redistribute.
    if (overlap > 0 && p.is_shard() && p.dim() > 0 && p.dim() < din.dim() - 1 &&
        din.size(p.dim()) % n == 0) {
      auto& l = static_cast<nn::Linear&>(m);
      y = detail::all_gather_linear(din.local(), l.weight, l.bias, mesh->get_group(), p.dim(),
                                    overlap);
    } else {
      const DTensor dx = din.redistribute({Replicate()});
      // The input meets a sharded computation: its gradient's parts are summed (f), unless the
      // all-gather that made it reduce-scatters them already.
      y = m.forward(detail::local_for(dx, {Shard(0)}));
    }
    if (chunks > 1) return y;
    Shape shape = y.shape();
    shape.back() = global_out > 0 ? global_out : y.size(-1) * n;
    const DTensor dy = DTensor::make(y, mesh, {Shard(y.dim() - 1)}, shape).redistribute({out});
    return output_of(dy, use_local);
  });
}

void RowwiseParallel::apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                            const std::string& path, int src) const {
  const int64_t n = mesh->size();
  const Placement out = o_.output_layouts.value_or(Replicate());
  const bool use_local = o_.use_local_output;
  if (auto* lin = as<nn::Linear>(module)) {
    check_divisible(name(), path, "in_features", lin->in_features, n);
    distribute_param(lin->weight, mesh, Shard(1), src);
    distribute_param(lin->bias, mesh, Replicate(), src);
    const Placement in = o_.input_layouts.value_or(Shard(-1));
    const int64_t overlap = o_.overlap_chunks;
    module.set_forward_override([=](nn::Module& m, const Tensor& x) {
      auto& l = static_cast<nn::Linear&>(m);
      const DTensor dx = input_of(x, in, mesh).redistribute({Shard(-1)});
      if (overlap > 0 && out.is_shard() && out.dim() > 0 && out.dim() < dx.dim() - 1 &&
          dx.size(out.dim()) % n == 0) {
        const Tensor y = detail::linear_reduce_scatter(dx.local(), l.weight, l.bias,
                                                       mesh->get_group(), out.dim(), overlap);
        Shape shape = dx.shape();
        shape.back() = l.out_features;
        return output_of(DTensor::make(y, mesh, {out}, shape), use_local);
      }
      const DTensor y = linear(dx, param(l.weight), l.bias.defined() ? param(l.bias) : DTensor());
      return output_of(y.redistribute({out}), use_local);  // Partial: all-reduce or reduce-scatter
    });
  } else if (auto* emb = as<nn::Embedding>(module)) {
    check_divisible(name(), path, "num_embeddings", emb->num_embeddings, n);
    EMBER_CHECK(!emb->padding_idx, kOp, " RowwiseParallel at '", path, "': an Embedding with "
                "padding_idx is not supported");
    distribute_param(emb->weight, mesh, Shard(0), src);
    const Placement in = o_.input_layouts.value_or(Replicate());
    module.set_forward_override([=](nn::Module& m, const Tensor& ids) {
      auto& e = static_cast<nn::Embedding&>(m);
      const DTensor di = input_of(ids, in, mesh).redistribute({Replicate()});
      return output_of(embedding(di, param(e.weight)).redistribute({out}), use_local);
    });
  } else {
    throw ValueError(detail::str_cat(kOp, " RowwiseParallel at '", path,
                                     "' supports Linear and Embedding, got ", module.name()));
  }
}

void SequenceParallel::apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                             const std::string& path, int src) const {
  const Placement seq = Shard(o_.sequence_dim);
  const bool use_local = o_.use_local_output;
  if (auto* ln = as<nn::LayerNorm>(module)) {
    distribute_param(ln->weight, mesh, Replicate(), src);
    distribute_param(ln->bias, mesh, Replicate(), src);
    module.set_forward_override([=](nn::Module& m, const Tensor& x) {
      auto& l = static_cast<nn::LayerNorm&>(m);
      const DTensor dx = input_of(x, seq, mesh).redistribute({seq});
      const DTensor y = layer_norm(dx, l.normalized_shape,
                                   l.weight.defined() ? param(l.weight) : DTensor(),
                                   l.bias.defined() ? param(l.bias) : DTensor(), l.options.eps);
      return output_of(y, use_local);
    });
  } else if (as<nn::Dropout>(module) != nullptr) {
    module.set_forward_override([=](nn::Module& m, const Tensor& x) {
      auto& d = static_cast<nn::Dropout&>(m);
      const DTensor dx = input_of(x, seq, mesh).redistribute({seq});
      return output_of(dropout(dx, d.p, d.is_training()), use_local);
    });
  } else {
    throw ValueError(detail::str_cat(kOp, " SequenceParallel at '", path,
                                     "' supports LayerNorm and Dropout, got ", module.name()));
  }
}

namespace {
// Lays `tensors` out: those with a layout become DTensors of it, redistributed to the desired
// layout where one is given. `what` ("input", "output") names them in errors.
void lay_out(std::vector<Tensor>& tensors, const Layouts& from, const Layouts& to,
             const std::shared_ptr<DeviceMesh>& mesh, bool use_local, const std::string& what,
             const std::string& path) {
  EMBER_CHECK(from.size() >= tensors.size(), kOp, " Prepare at '", path, "': ", tensors.size(),
              " ", what, "s but only ", from.size(), " ", what, "_layouts");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!from[i]) continue;
    DTensor d = input_of(tensors[i], *from[i], mesh);
    if (i < to.size() && to[i]) d = d.redistribute({*to[i]});
    tensors[i] = output_of(d, use_local);
  }
}

void check_lengths(const std::string& style, const std::string& path, const Layouts& a,
                   const Layouts& b, const char* names) {
  EMBER_CHECK(a.size() == b.size(), kOp, " ", style, " at '", path, "': ", names,
              " must have one entry each, got ", a.size(), " and ", b.size());
}
}  // namespace

void PrepareModuleInput::apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                               const std::string& path, int) const {
  check_lengths(name(), path, o_.input_layouts, o_.desired_input_layouts,
                "input_layouts and desired_input_layouts");
  const PrepareModuleInputOptions o = o_;
  module.register_forward_pre_hook([o, mesh, path](nn::Module&, std::vector<Tensor>& inputs) {
    lay_out(inputs, o.input_layouts, o.desired_input_layouts, mesh, o.use_local_output, "input",
            path);
  });
}

void PrepareModuleOutput::apply(nn::Module& module, const std::shared_ptr<DeviceMesh>& mesh,
                                const std::string& path, int) const {
  check_lengths(name(), path, o_.output_layouts, o_.desired_output_layouts,
                "output_layouts and desired_output_layouts");
  const PrepareModuleOutputOptions o = o_;
  module.register_forward_hook(
      [o, mesh, path](nn::Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
        lay_out(outputs, o.output_layouts, o.desired_output_layouts, mesh, o.use_local_output,
                "output", path);
      });
}

}  // namespace ember::dist
