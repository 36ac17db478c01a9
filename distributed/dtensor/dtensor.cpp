// Note [gradient conventions]
// Autograd runs on each rank's local tensors, so what a local tensor's gradient means has to be
// agreed per placement: a Shard's local gradient is the gradient of its shard, a Partial's is the
// whole gradient (each part enters the sum linearly), and a Replicate's is, by default, the
// whole gradient, identical on every rank, as when every rank runs the same computation on it
// (Megatron's replicated regions). Where a Replicate tensor meets a sharded computation, each
// rank's backward gives only its part of the gradient, and something must sum the parts:
//  - a Replicate made by all-gathering a Shard (redistribute) is marked partial_grad: its
//    all-gather's backward reduce-scatters, which sums the parts and takes the shard in one
//    collective (Megatron's sequence-parallel gather), so sharded consumers use it as is;
//  - any other Replicate (a parameter, an all-reduce's result) entering a sharded computation is
//    wrapped by the op in copy_to_group (Megatron's f: identity forward, all-reduce backward);
//  - a partial_grad Replicate used by a replicated computation (or by to_local(), whose user code
//    is replicated) goes through keep_first_grad: every rank's backward gives the whole
//    gradient, so only the mesh dimension's first rank passes it on and the rest pass zeros, and
//    the reduce-scatter's sum is then exact.
// So a tensor-parallel block moves what Megatron's does: all-reduces without sequence
// parallelism, all-gathers and reduce-scatters with it.
#include <ember/distributed/dtensor/dtensor.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>

#include <ember/autograd/function.h>
#include <ember/distributed/dtensor/detail/dtensor_impl.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[DTensor]";

// The record of register_dtensor: weak keys, so a dead tensor's impl address reused by another
// tensor is never taken for it; the layout without the local tensor, which the record must not
// keep alive.
struct Record {
  std::weak_ptr<TensorImpl> impl;
  std::shared_ptr<DeviceMesh> mesh;
  Placements placements;
  Shape shape;  // global
  Shape local;  // the local tensor's shape as the DTensor sees it (a fused projection's blocks)
};
struct Registry {
  std::mutex mu;
  std::map<const TensorImpl*, Record> records;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: tensors may outlive statics
  return *r;
}

}  // namespace

Placements detail::normalized(const char* op, Placements p, const DeviceMesh& mesh,
                              int64_t ndim) {
  EMBER_CHECK(static_cast<int>(p.size()) == mesh.ndim(), "[", op, "] expected one placement per ",
              "mesh dimension (", mesh.ndim(), "), got ", p.size(), ": ", to_string(p));
  std::vector<int64_t> sharded;
  for (Placement& q : p) {
    if (!q.is_shard()) continue;
    const int64_t d = q.dim() < 0 ? q.dim() + ndim : q.dim();
    EMBER_CHECK(d >= 0 && d < ndim, "[", op, "] ", q.str(), " is out of range for a tensor of ",
                ndim, " dims");
    EMBER_CHECK(std::find(sharded.begin(), sharded.end(), d) == sharded.end(), "[", op,
                "] placements ", to_string(p), " shard tensor dimension ", d,
                " over two mesh dimensions, which is not supported");
    sharded.push_back(d);
    q = Shard(d);
  }
  return p;
}

Shape local_shape(const Shape& shape, const DeviceMesh& mesh, const Placements& placements) {
  Shape s = shape;
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].dim();
    s[d] = shard_length(shape[d], mesh.size(i), mesh.get_local_rank(i));
  }
  return s;
}

DTensor DTensor::make(Tensor local, std::shared_ptr<DeviceMesh> mesh, Placements placements,
                      Shape shape, std::vector<bool> partial_grad) {
  DTensor d;
  d.placements_ = detail::normalized("DTensor", std::move(placements), *mesh, shape.size());
  const Shape want = local_shape(shape, *mesh, d.placements_);
  EMBER_CHECK(local.shape() == want, kOp, " the local tensor has shape ", local.shape(),
              " but this rank's part of ", shape, " placed ", to_string(d.placements_), " at ",
              mesh->str(), " is ", want);
  d.local_ = std::move(local);
  d.mesh_ = std::move(mesh);
  d.shape_ = shape;
  d.partial_grad_ = partial_grad.empty() ? std::vector<bool>(d.placements_.size(), false)
                                         : std::move(partial_grad);
  return d;
}

DTensor DTensor::from_local(Tensor local, std::shared_ptr<DeviceMesh> mesh, Placements placements,
                            std::optional<Shape> shape, bool run_check) {
  EMBER_CHECK(local.defined(), "[DTensor.from_local] expected a tensor, got an undefined one");
  EMBER_CHECK(mesh != nullptr, "[DTensor.from_local] expected a mesh, got null");
  placements = detail::normalized("DTensor.from_local", std::move(placements), *mesh, local.dim());
  Shape global = local.shape();
  if (shape) {
    global = *shape;
  } else {
    for (int i = 0; i < mesh->ndim(); ++i) {
      if (placements[i].is_shard()) global[placements[i].dim()] *= mesh->size(i);
    }
  }
  EMBER_CHECK(global.size() == local.dim(), "[DTensor.from_local] shape ", global, " has ",
              global.size(), " dims but the local tensor has ", local.dim());
  // With run_check the ranks compare shapes first, so that a wrong one throws on every rank.
  if (run_check) local = detail::check_and_sync(local, *mesh, placements, global);
  const Shape want = local_shape(global, *mesh, placements);
  EMBER_CHECK(local.shape() == want, "[DTensor.from_local] the local tensor has shape ",
              local.shape(), " but this rank's part of ", global, " placed ", to_string(placements),
              " at ", mesh->str(), " is ", want);
  return make(std::move(local), std::move(mesh), std::move(placements), global);
}

Tensor DTensor::to_local() const {
  Tensor t = local_;
  for (int i = 0; i < static_cast<int>(placements_.size()); ++i) {
    if (placements_[i].is_replicate() && partial_grad_[i]) t = detail::keep_first_grad(t, *mesh_, i);
  }
  return t;
}

Tensor DTensor::full_tensor() const {
  return redistribute(Placements(placements_.size(), Replicate())).to_local();
}

int64_t DTensor::size(int64_t d) const {
  const int64_t n = dim();
  EMBER_CHECK(d >= -n && d < n, kOp, " dim ", d, " is out of range for ", n, " dims");
  return shape_[d < 0 ? d + n : d];
}

DTensor& DTensor::requires_grad_(bool on) {
  local_.requires_grad_(on);
  return *this;
}

DTensor DTensor::grad() const {
  const Tensor g = local_.grad();
  if (!g.defined()) return {};
  return make(g, mesh_, placements_, shape_);
}

std::string DTensor::str() const {
  if (!defined()) return "DTensor(undefined)";
  std::ostringstream os;
  os << "DTensor(" << dtype() << " " << shape_ << ", " << to_string(placements_) << " on "
     << mesh_->str() << ", local " << local_.shape() << ")";
  return os.str();
}

DTensor distribute_tensor(const Tensor& full, std::shared_ptr<DeviceMesh> mesh,
                          const Placements& placements, int src_data_rank) {
  EMBER_CHECK(full.defined(), "[distribute_tensor] expected a tensor, got an undefined one");
  EMBER_CHECK(mesh != nullptr, "[distribute_tensor] expected a mesh, got null");
  EMBER_CHECK(src_data_rank >= -1, "[distribute_tensor] src_data_rank must be a rank or -1, got ",
              src_data_rank);
  const Placements p = detail::normalized("distribute_tensor", placements, *mesh, full.dim());
  NoGradGuard no_grad;
  Tensor data = full.detach().to(mesh->device());
  if (src_data_rank >= 0) {
    data = data.contiguous().clone();
    for (int i = 0; i < mesh->ndim(); ++i) mesh->get_group(i)->broadcast(data)->wait();
  }
  Tensor local = data;
  for (int i = 0; i < mesh->ndim(); ++i) {
    if (!p[i].is_shard()) continue;
    const int64_t d = p[i].dim();
    local = local.narrow(d, shard_offset(full.size(d), mesh->size(i), mesh->get_local_rank(i)),
                         shard_length(full.size(d), mesh->size(i), mesh->get_local_rank(i)));
  }
  for (int i = 0; i < mesh->ndim(); ++i) {
    if (!p[i].is_partial()) continue;
    detail::check_partition("distribute_tensor", p[i].op(), i);
    // Partial(sum) keeps the value on the mesh dimension's first rank, so the parts sum to it
    // exactly; avg, max and min keep it on every rank.
    if (p[i].op() == ReduceOp::Sum && mesh->get_local_rank(i) != 0) local = zeros_like(local);
  }
  local = local.contiguous().clone();
  if (full.requires_grad()) local.requires_grad_();
  return DTensor::make(local, std::move(mesh), p, full.shape());
}

void register_dtensor(const Tensor& local, const DTensor& d) {
  EMBER_CHECK(local.defined() && d.defined(), "[register_dtensor] expected defined tensors");
  EMBER_CHECK(local.numel() == d.local().numel(), "[register_dtensor] the tensor has shape ",
              local.shape(), " but the DTensor's local part has ", d.local().shape());
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.records.begin(); it != r.records.end();) {
    it = it->second.impl.expired() ? r.records.erase(it) : std::next(it);
  }
  r.records[local.impl()] =
      Record{local.impl_ptr(), d.device_mesh(), d.placements(), d.shape(), d.local().shape()};
}

std::optional<DTensor> as_dtensor(const Tensor& t) {
  if (!t.defined()) return std::nullopt;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.records.find(t.impl());
  if (it == r.records.end() || it->second.impl.lock() != t.impl_ptr()) return std::nullopt;
  const Record& d = it->second;
  const Tensor local = t.shape() == d.local ? t : t.view(d.local);
  return DTensor::make(local, d.mesh, d.placements, d.shape);
}

}  // namespace ember::dist
