#include <ember/distributed/ddp/sync_batch_norm.h>

#include <typeinfo>
#include <utility>
#include <vector>

#include <ember/autograd/function.h>
#include <ember/distributed/init.h>
#include <ember/nn/layers/container.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

// The reduction dims of input [N, C, *]: all but the channel dim.
std::vector<int64_t> stat_dims(const Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [1, C, 1, ...] to broadcast a per-channel [C] tensor over x.
Shape channel_shape(const Tensor& x) {
  Shape s = Shape::filled(x.dim(), 1);
  s[1] = x.size(1);
  return s;
}

// What the function needs besides its differentiable inputs (Tensors inside a struct are not
// counted as inputs by autograd::Function).
struct SyncConfig {
  std::shared_ptr<ProcessGroup> group;
  Tensor running_mean, running_var;  // undefined: not tracking
  double momentum;                   // the averaging factor, unless `batches` is defined
  Tensor batches;  // num_batches_tracked for a cumulative average: factor 1 / batches
  double eps;
};

// Global per-channel statistics of the batch all ranks hold together. On the input's device:
// Note [SyncBatchNorm without host waits].
struct GlobalStats {
  Tensor mean, invstd;  // float64 [C]
  Tensor count;         // float64 [1]: values per channel over all ranks
};

// Note [SyncBatchNorm without host waits]: nothing reads a statistic back to the host (the
// global count and the cumulative-average factor stay tensors), so over NCCL, whose waits only
// order the stream, a training step never blocks the CPU here. The one check that needs the
// global count (more than one value per channel) is made only where reading it is free: on CPU
// tensors. On CUDA, as PyTorch's SyncBatchNorm (which checks only the local batch), a global
// count of 1 or 0 is not detected: the statistics come out inf or NaN.
void check_count(const Tensor& total, const Tensor& x, int world) {
  if (!total.is_cpu()) return;
  const double n = total.item<double>();
  // Every rank sees the same total, so all of them throw (after the collective: none hangs).
  EMBER_CHECK(n > 1, "[SyncBatchNorm] expected more than 1 value per channel when training, got ",
              n, " over the ", world, " ranks of the group (local input shape ", x.shape(), ")");
}

// running = (1 - factor) * running + factor * batch, factor a number or a 0-d tensor.
void blend(Tensor running, const Tensor& batch, const SyncConfig& cfg) {
  if (cfg.batches.defined()) {
    const Tensor f = reciprocal(cfg.batches.to(kFloat64)).to(running.dtype());
    running.copy_(running * (1.0 - f) + batch.to(running.dtype()) * f);
  } else {
    running.copy_(running * (1.0 - cfg.momentum) + batch.to(running.dtype()) * cfg.momentum);
  }
}

// Note [SyncBatchNorm statistics]: ranks may hold different batch sizes (some none), so a plain
// allreduce of means would be wrong and one of sums of squares loses precision (var = E[x^2] -
// mean^2 cancels when |mean| >> std). Each rank contributes [n_r, mean_r (C), M2_r (C)] in
// float64, M2_r being its sum of squared deviations; after one allgather every rank merges them
// the same way (Chan et al.): mean = sum n_r mean_r / n, M2 = sum M2_r + n_r (mean_r - mean)^2.
// Empty ranks contribute zeros and drop out of both sums.
GlobalStats gather_stats(const Tensor& x, const SyncConfig& cfg) {
  const int64_t channels = x.size(1);
  const int64_t n = x.numel() / channels;
  const TensorOptions f64 = TensorOptions(kFloat64).device(x.device());
  Tensor local = zeros({1 + 2 * channels}, f64);
  if (n > 0) {
    const std::vector<int64_t> dims = stat_dims(x);
    local.narrow(0, 0, 1).fill_(static_cast<double>(n));
    local.narrow(0, 1, channels).copy_(x.mean(dims).to(kFloat64));
    local.narrow(0, 1 + channels, channels)
        .copy_(ember::var(x, dims, /*correction=*/0).to(kFloat64) * static_cast<double>(n));
  }
  const int world = cfg.group->size();
  Tensor all = empty({world, 1 + 2 * channels}, f64);
  cfg.group->allgather_into_tensor(all, local)->wait();

  const Tensor counts = all.narrow(1, 0, 1);                 // [W, 1]
  const Tensor means = all.narrow(1, 1, channels);           // [W, C]
  const Tensor m2s = all.narrow(1, 1 + channels, channels);  // [W, C]
  const Tensor total = counts.sum({0});                      // [1]
  check_count(total, x, world);
  GlobalStats s;
  s.count = total;
  s.mean = (means * counts).sum({0}) / total;
  const Tensor m2 = m2s.sum({0}) + (counts * square(means - s.mean)).sum({0});
  s.invstd = rsqrt(m2 / total + cfg.eps);
  if (cfg.running_mean.defined()) {
    // As BatchNorm, with the unbiased variance.
    blend(cfg.running_mean, s.mean, cfg);
    blend(cfg.running_var, m2 / (total - 1.0), cfg);
  }
  return s;
}

// Forward: y = x * scale + shift per channel, scale = weight * invstd, shift = bias - mean *
// scale (the form BatchNorm uses), with the global mean and invstd.
// Backward, for the whole batch of n values per channel (sums over all ranks):
//   dx = weight * invstd * (dy - sum(dy) / n - (x - mean) * invstd^2 * sum(dy * (x - mean)) / n)
// so the two per-channel sums are all-reduced (float64) and the rest is local. dweight =
// invstd * sum(dy * (x - mean)) and dbias = sum(dy) over the local batch only.
// What backward needs besides x and weight: the global statistics, the group, bias's dtype.
struct SyncBatchNormState {
  Tensor mean, invstd, count;  // [C], [C] float64; [1] the whole batch's values per channel
  std::shared_ptr<ProcessGroup> group;
  Dtype bias_dtype = kFloat32;
};

struct SyncBatchNormFunction : autograd::Function<SyncBatchNormFunction> {
  static Tensor forward(autograd::Context* ctx, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, const SyncConfig& cfg) {
    const GlobalStats s = gather_stats(x, cfg);
    Tensor scale = weight.defined() ? s.invstd * weight.to(kFloat64) : s.invstd;
    Tensor shift = bias.defined() ? bias.to(kFloat64) - s.mean * scale : -(s.mean * scale);
    const Shape bshape = channel_shape(x);
    Tensor y = x * scale.to(x.dtype()).view(bshape) + shift.to(x.dtype()).view(bshape);

    ctx->save_for_backward(weight.defined() ? std::vector<Tensor>{x, weight}
                                            : std::vector<Tensor>{x});
    ctx->state<SyncBatchNormState>() = {s.mean, s.invstd, s.count, cfg.group,
                                        bias.defined() ? bias.dtype() : x.dtype()};
    return y;
  }

  static autograd::TensorList backward(autograd::Context* ctx, autograd::TensorList grads) {
    EMBER_CHECK_TYPE(NotImplementedError, !GradMode::is_enabled(),
                     "[SyncBatchNorm] double backward (create_graph=true) is not supported");
    const autograd::TensorList saved = ctx->saved();
    const Tensor& x = saved[0];
    const Tensor weight = saved.size() > 1 ? saved[1] : Tensor();
    const SyncBatchNormState& st = ctx->state<SyncBatchNormState>();
    const Tensor &mean = st.mean, &invstd = st.invstd, &count = st.count;
    const auto& group = st.group;
    const Dtype bias_dtype = st.bias_dtype;

    const int64_t channels = x.size(1);
    const Shape bshape = channel_shape(x);
    const Tensor& dy = grads[0];  // [N, C, *]
    const Tensor xmu = x - mean.to(x.dtype()).view(bshape);
    Tensor sums = zeros({2 * channels}, TensorOptions(kFloat64).device(x.device()));
    if (x.numel() > 0) {
      const std::vector<int64_t> dims = stat_dims(x);
      sums.narrow(0, 0, channels).copy_(dy.sum(dims).to(kFloat64));
      sums.narrow(0, channels, channels).copy_((dy * xmu).sum(dims).to(kFloat64));
    }
    const Tensor sum_dy = sums.narrow(0, 0, channels).clone();
    const Tensor sum_dy_xmu = sums.narrow(0, channels, channels).clone();

    Tensor dx, dweight, dbias;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      dweight = (sum_dy_xmu * invstd).to(weight.dtype());
    }
    if (ctx->needs_input_grad(2)) dbias = sum_dy.to(bias_dtype);
    if (ctx->needs_input_grad(0)) {
      group->allreduce(sums)->wait();  // whole-batch sums, in place
      const Tensor mean_dy = sums.narrow(0, 0, channels) / count;
      const Tensor mean_dy_xmu = sums.narrow(0, channels, channels) / count;
      const Tensor a = weight.defined() ? invstd * weight.to(kFloat64) : invstd;
      const Tensor b = -(a * invstd * invstd * mean_dy_xmu);
      const Tensor c = -(a * mean_dy);
      dx = dy * a.to(x.dtype()).view(bshape) + xmu * b.to(x.dtype()).view(bshape) +
           c.to(x.dtype()).view(bshape);
    }
    return {dx, dweight, dbias};
  }
};

// Nodes of the tree that convert_sync_batchnorm can rebuild with a new child list.
bool is_plain_sequence(const nn::Module& m) {
  return typeid(m) == typeid(nn::Sequential) || typeid(m) == typeid(nn::ModuleList);
}

bool contains_batch_norm(nn::Module& m) {
  for (const auto& sub : m.modules()) {
    if (dynamic_cast<nn::BatchNorm*>(sub.get()) != nullptr) return true;
  }
  return false;
}

std::shared_ptr<nn::Module> convert(const std::shared_ptr<nn::Module>& module,
                                    const std::shared_ptr<ProcessGroup>& group,
                                    const std::string& path) {
  if (auto bn = std::dynamic_pointer_cast<nn::BatchNorm>(module)) {
    auto sync = std::make_shared<SyncBatchNorm>(bn->num_features, bn->options, group);
    // Point the new module's slots (what parameters()/state_dict() read) and its named members
    // at the original tensors.
    Tensor nn::BatchNorm::*const members[] = {
        &nn::BatchNorm::weight, &nn::BatchNorm::bias, &nn::BatchNorm::running_mean,
        &nn::BatchNorm::running_var, &nn::BatchNorm::num_batches_tracked};
    const char* const names[] = {"weight", "bias", "running_mean", "running_var",
                                 "num_batches_tracked"};
    for (size_t i = 0; i < std::size(names); ++i) {
      const Tensor& original = (*bn).*members[i];
      if (!original.defined()) continue;
      sync->tensor(names[i]) = original;
      (*sync).*members[i] = original;
    }
    sync->train(bn->is_training());
    return sync;
  }
  if (!contains_batch_norm(*module)) return module;
  const std::string where = path.empty() ? std::string("<root>") : path;
  EMBER_CHECK(is_plain_sequence(*module), "[convert_sync_batchnorm] cannot replace the BatchNorm ",
              "layers inside '", where, "' (a ", module->name(), ")\n  Only Sequential and ",
              "ModuleList are rebuilt with converted children, since nn::Module cannot swap a ",
              "child in place; convert its BatchNorm members yourself, or build it from ",
              "Sequential");
  std::vector<std::shared_ptr<nn::Module>> children;
  for (const auto& [name, child] : module->named_children()) {
    children.push_back(convert(child, group, path.empty() ? name : path + "." + name));
  }
  // Every module below keeps its own mode: snapshot them, set the new container's, restore
  // (depth-first order, so each module is restored after its parent).
  std::vector<std::pair<std::shared_ptr<nn::Module>, bool>> modes;
  for (const auto& c : children) {
    for (const auto& m : c->modules()) modes.emplace_back(m, m->is_training());
  }
  std::shared_ptr<nn::Module> out;
  if (typeid(*module) == typeid(nn::Sequential)) {
    out = std::make_shared<nn::Sequential>(std::move(children));
  } else {
    out = std::make_shared<nn::ModuleList>(std::move(children));
  }
  out->train(module->is_training());
  for (const auto& [m, on] : modes) {
    if (m->is_training() != on) m->train(on);
  }
  return out;
}

}  // namespace

SyncBatchNorm::SyncBatchNorm(int64_t num_features, const nn::BatchNormOptions& options,
                             std::shared_ptr<ProcessGroup> group)
    : nn::BatchNorm(num_features, options), group_(std::move(group)) {}

void SyncBatchNorm::check_input_dim(const Tensor& input) const {
  EMBER_CHECK(input.dim() >= 2, "[SyncBatchNorm] expected at least 2D input [N, C, *], got ",
              input.dim(), "D input of shape ", input.shape());
}

Tensor SyncBatchNorm::forward(const Tensor& input) {
  detail::check_defined("SyncBatchNorm", input, "input");
  check_input_dim(input);
  EMBER_CHECK(input.size(1) == num_features, "[SyncBatchNorm] expected input with ", num_features,
              " channels (dim 1), got ", input.size(1), " channels in input of shape ",
              input.shape());
  // As torch: only training mode synchronises; eval mode is BatchNorm (running statistics, or
  // the local batch's when not tracking).
  if (!is_training()) return nn::BatchNorm::forward(input);
  std::shared_ptr<ProcessGroup> group = group_;
  if (!group) {
    EMBER_CHECK(is_initialized(),
                "[SyncBatchNorm] training mode needs a process group: none was given and the "
                "default group is not initialized (call init_process_group, pass a group, or "
                "use eval())");
    group = default_group();
  }
  if (group->size() == 1) return nn::BatchNorm::forward(input);
  EMBER_CHECK_TYPE(TypeError, input.is_floating_point(),
                   "[SyncBatchNorm] expected a floating-point input, got ", input.dtype());

  // BatchNorm's averaging factor: momentum, or 1 / num_batches_tracked for a cumulative average
  // (a tensor: Note [SyncBatchNorm without host waits]).
  Tensor batches;
  if (options.track_running_stats) {
    NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    if (!options.momentum) batches = num_batches_tracked;
  }
  return SyncBatchNormFunction::apply(input, weight, bias,
                                      SyncConfig{group, running_mean, running_var,
                                                 options.momentum.value_or(0.0), batches,
                                                 options.eps});
}

std::shared_ptr<nn::Module> convert_sync_batchnorm(std::shared_ptr<nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group) {
  EMBER_CHECK(module != nullptr, "[convert_sync_batchnorm] expected a module, got null");
  return convert(module, group, "");
}

}  // namespace ember::dist
