#include <ember/distributed/tensor_parallel/clip_grad.h>

#include <cmath>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/tensor/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, const DeviceMesh& mesh,
                       double norm_type) {
  constexpr const char* kOp = "[dist::clip_grad_norm_]";
  EMBER_CHECK(max_norm >= 0, kOp, " expected max_norm >= 0, got ", max_norm);
  EMBER_CHECK(norm_type > 0, kOp, " expected norm_type > 0, got ", norm_type);
  EMBER_CHECK(mesh.ndim() == 1, kOp, " expected the 1-D tensor-parallel mesh, got ", mesh.str());
  const bool inf = std::isinf(norm_type);
  const double n = static_cast<double>(mesh.size());
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  // |g|^p summed over this rank's pieces, a replicated parameter's divided by the mesh size so
  // that the sum over the mesh counts it once; or the largest |g|.
  double acc = 0;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    const double v = norm(g, norm_type).item<double>();
    if (inf) {
      acc = std::max(acc, v);
      continue;
    }
    const std::optional<DTensor> d = as_dtensor(p);
    const bool on_mesh = d && d->device_mesh()->ndim() == 1 &&
                         d->device_mesh()->get_group() == mesh.get_group();
    const bool replicated = !on_mesh || !d->placements()[0].is_shard();
    acc += std::pow(v, norm_type) / (replicated ? n : 1.0);
  }
  Tensor total = full({1}, acc, TensorOptions(kFloat64).device(mesh.device()));
  mesh.get_group()->allreduce(total, {.op = inf ? ReduceOp::Max : ReduceOp::Sum, .timeout = {}})
      ->wait();
  const double norm_all = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm_all + 1e-6);
  if (coef < 1) {
    for (Tensor& g : grads) g.mul_(coef);
  }
  return full({}, norm_all, TensorOptions(kFloat32));
}

}  // namespace ember::dist
