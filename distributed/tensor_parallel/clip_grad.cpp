#include <ember/distributed/tensor_parallel/clip_grad.h>

#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[dist::clip_grad_norm_]";

// A group's ranks in the world (a group made with none listed is the world's ranks in order).
std::vector<int> world_ranks(const ProcessGroup& g) {
  if (!g.global_ranks().empty()) return g.global_ranks();
  std::vector<int> all(static_cast<size_t>(g.size()));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

// Whether `p` is replicated over the tensor-parallel group `tp` (laid out there as Replicate, or
// not laid out at all).
bool replicated_over(const Tensor& p, const ProcessGroup& tp) {
  const std::optional<DTensor> d = as_dtensor(p);
  if (!d || d->device_mesh()->ndim() != 1) return true;
  // The same ranks, not only the same group: a layout may build a second mesh over them (one
  // that merges other dimensions, say), whose groups are other objects.
  const ProcessGroup& g = *d->device_mesh()->get_group();
  const bool on_mesh = &g == &tp || world_ranks(g) == world_ranks(tp);
  return !on_mesh || !d->placements()[0].is_shard();
}

// |g|^p, or |g|'s largest element for the infinity norm.
double power(const Tensor& g, double norm_type) {
  const double v = norm(g, norm_type).item<double>();
  return std::isinf(norm_type) ? v : std::pow(v, norm_type);
}

void check_args(double max_norm, double norm_type) {
  EMBER_CHECK(max_norm >= 0, kOp, " expected max_norm >= 0, got ", max_norm);
  EMBER_CHECK(norm_type > 0, kOp, " expected norm_type > 0, got ", norm_type);
}

// Sums (or takes the largest of) `acc` over each group, then scales `grads` by
// min(1, max_norm / (total + 1e-6)); returns the total.
Tensor finish(double acc, const std::vector<ProcessGroup*>& groups, Device device,
              std::vector<Tensor>& grads, double max_norm, double norm_type) {
  const bool inf = std::isinf(norm_type);
  Tensor total = full({1}, acc, TensorOptions(kFloat64).device(device));
  for (ProcessGroup* g : groups) {
    g->allreduce(total, {.op = inf ? ReduceOp::Max : ReduceOp::Sum, .timeout = {}})->wait();
  }
  const double t = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (t + 1e-6);
  if (coef < 1) {
    for (Tensor& g : grads) g.mul_(coef);
  }
  // A total past float32's range is inf there, as PyTorch's float32 norm is.
  return full({}, static_cast<double>(static_cast<float>(t)), TensorOptions(kFloat32));
}

}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, const DeviceMesh& mesh,
                       double norm_type) {
  check_args(max_norm, norm_type);
  EMBER_CHECK(mesh.ndim() == 1, kOp, " expected the 1-D tensor-parallel mesh, got ", mesh.str());
  const bool inf = std::isinf(norm_type);
  const double n = static_cast<double>(mesh.size());
  ProcessGroup& tp = *mesh.get_group();
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  // A replicated parameter's share is divided by the mesh size, so that the sum over the mesh
  // counts it once.
  double acc = 0;
  for (const Tensor& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    const double v = power(p.grad(), norm_type);
    acc = inf ? std::max(acc, v) : acc + v / (replicated_over(p, tp) ? n : 1.0);
  }
  return finish(acc, {&tp}, mesh.device(), grads, max_norm, norm_type);
}

Tensor clip_grad_norm_(const nn::Module& root, double max_norm, const DeviceMesh& mesh,
                       double norm_type) {
  check_args(max_norm, norm_type);
  EMBER_CHECK(mesh.ndim() == 2, kOp, " expected the (dp, tp) mesh, got ", mesh.str());
  const bool inf = std::isinf(norm_type);
  ProcessGroup& dp = *mesh.get_group(0);
  ProcessGroup& tp = *mesh.get_group(1);
  const double n_dp = static_cast<double>(dp.size()), n_tp = static_cast<double>(tp.size());
  NoGradGuard no_grad;
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, p] : root.named_parameters()) by_name[name] = p;
  std::vector<Tensor> grads;
  std::set<std::string> sharded;
  double acc = 0;
  auto add = [&](const Tensor& g, const Tensor& param, double copies) {
    grads.push_back(g);
    const double v = power(g, norm_type);
    acc = inf ? std::max(acc, v) : acc + v / copies / (replicated_over(param, tp) ? n_tp : 1.0);
  };
  // fully_shard's pieces: disjoint over dp.
  for (const LocalShard& s : local_shards(root)) {
    sharded.insert(s.name);
    if (s.data.defined() && s.data.grad().defined()) add(s.data.grad(), by_name.at(s.name), 1.0);
  }
  // Parameters outside every sharded module: the same on every dp rank.
  for (const auto& [name, p] : by_name) {
    if (!sharded.count(name) && p.grad().defined()) add(p.grad(), p, n_dp);
  }
  return finish(acc, {&dp, &tp}, mesh.device(), grads, max_norm, norm_type);
}

}  // namespace ember::dist
