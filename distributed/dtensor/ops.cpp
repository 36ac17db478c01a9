// The DTensor ops' sharding rules (the table is in ops.h). Each op decides every mesh
// dimension's output placement from its arguments' placements, prepares each argument's local
// tensor for it (Note [gradient conventions] in dtensor.cpp), and runs the plain op locally.
#include <ember/distributed/dtensor/ops.h>

#include <algorithm>
#include <optional>

#include <ember/autograd/function.h>
#include <ember/distributed/dtensor/detail/dtensor_impl.h>
#include <ember/nn/functional.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops.h>
#include <ember/tensor/ops/random.h>

namespace ember::dist {

namespace {

// "x (Shard(0),), weight (Replicate(),)" for errors.
std::string describe(std::initializer_list<std::pair<const char*, const DTensor*>> args) {
  std::string s;
  for (const auto& [name, d] : args) {
    if (d == nullptr || !d->defined()) continue;
    s += (s.empty() ? "" : ", ") + std::string(name) + " " + to_string(d->placements());
  }
  return s;
}

[[noreturn]] void no_rule(const char* op, int mesh_dim,
                          std::initializer_list<std::pair<const char*, const DTensor*>> args,
                          const char* hint = "") {
  throw ValueError(detail::str_cat("[dist::", op, "] no sharding rule for ", describe(args),
                                   " on mesh dimension ", mesh_dim,
                                   *hint ? "\n  " : "", hint,
                                   *hint ? "" : "\n  Redistribute the arguments first"));
}

const DeviceMesh& mesh_of(const char* op, std::initializer_list<const DTensor*> args) {
  const DTensor* first = nullptr;
  for (const DTensor* d : args) {
    if (d == nullptr || !d->defined()) continue;
    if (first == nullptr) {
      first = d;
      continue;
    }
    EMBER_CHECK(*d->device_mesh() == *first->device_mesh(), "[dist::", op,
                "] the arguments are on different meshes: ", first->device_mesh()->str(), " and ",
                d->device_mesh()->str());
  }
  EMBER_CHECK(first != nullptr, "[dist::", op, "] expected DTensors, got undefined ones");
  return *first->device_mesh();
}

// A Replicate operand `t` of `a` (right-aligned to `out_ndim` dims) narrowed to this rank's
// part along every output dimension that `out` shards and that `a` does not broadcast.
Tensor narrowed_to(const Tensor& t, const DTensor& a, const Placements& out, int64_t out_ndim,
                   const Shape& out_shape) {
  Tensor r = t;
  const DeviceMesh& mesh = *a.device_mesh();
  const int64_t offset = out_ndim - a.dim();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!out[i].is_shard() || !a.placements()[i].is_replicate()) continue;
    const int64_t d = out[i].dim() - offset;
    if (d < 0 || a.size(d) == 1) continue;
    const int64_t n = mesh.size(i), k = mesh.get_local_rank(i);
    r = r.narrow(d, shard_offset(out_shape[out[i].dim()], n, k),
                 shard_length(out_shape[out[i].dim()], n, k));
  }
  return r;
}

// Replicate -> Partial for a summand that must be added once (rowwise linear's bias): the
// first rank keeps it; its gradient, the whole one, reaches every rank.
struct FirstRankOnlyFn : autograd::Function<FirstRankOnlyFn> {
  static Tensor forward(autograd::Context*, const Tensor& t, bool first) {
    return first ? t : zeros_like(t);
  }
  static autograd::TensorList backward(autograd::Context*, autograd::TensorList g) {
    return {g[0]};
  }
};

// A linear op commutes with the reduction of Partial(sum) and Partial(avg) parts, not with max,
// min or product: a + b of two Partial(max)s is not the max of the parts' sums.
bool linear_partial(const Placement& p) {
  return p.op() == ReduceOp::Sum || p.op() == ReduceOp::Avg;
}

enum class Binary { Add, Sub, Mul, Div };
const char* name_of(Binary op) {
  switch (op) {
    case Binary::Add: return "add";
    case Binary::Sub: return "sub";
    case Binary::Mul: return "mul";
    case Binary::Div: return "div";
  }
  return "?";
}

DTensor binary(Binary op, const DTensor& a, const DTensor& b) {
  const char* name = name_of(op);
  const DeviceMesh& mesh = mesh_of(name, {&a, &b});
  const Shape shape = broadcast_shapes(name, a.shape(), b.shape());
  const int64_t n = shape.size();
  const int64_t oa = n - a.dim(), ob = n - b.dim();
  Placements out;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& pa = a.placements()[i];
    const Placement& pb = b.placements()[i];
    auto aligned = [&](const Placement& p, int64_t off) {
      return p.is_shard() ? Placement(Shard(p.dim() + off)) : p;
    };
    const Placement qa = aligned(pa, oa), qb = aligned(pb, ob);
    if (qa == qb && !qa.is_partial()) {
      out.push_back(qa);
    } else if (qa.is_shard() && qb.is_replicate()) {
      out.push_back(qa);
    } else if (qb.is_shard() && qa.is_replicate()) {
      out.push_back(qb);
    } else if (qa.is_partial() && qb.is_partial() && qa == qb && linear_partial(qa) &&
               (op == Binary::Add || op == Binary::Sub)) {
      out.push_back(qa);
    } else if (qa.is_partial() && qa.op() == ReduceOp::Sum && qb.is_replicate() &&
               (op == Binary::Mul || op == Binary::Div)) {
      out.push_back(qa);
    } else if (qb.is_partial() && qb.op() == ReduceOp::Sum && qa.is_replicate() &&
               op == Binary::Mul) {
      out.push_back(qb);
    } else {
      no_rule(name, i, {{"a", &a}, {"b", &b}});
    }
  }
  const Tensor la = narrowed_to(detail::local_for(a, out), a, out, n, shape);
  const Tensor lb = narrowed_to(detail::local_for(b, out), b, out, n, shape);
  Tensor y;
  switch (op) {
    case Binary::Add: y = la + lb; break;
    case Binary::Sub: y = la - lb; break;
    case Binary::Mul: y = la * lb; break;
    case Binary::Div: y = la / lb; break;
  }
  return DTensor::make(y, a.device_mesh(), out, shape);
}

int64_t wrap(const char* op, int64_t d, int64_t n) {
  EMBER_CHECK(d >= -n && d < n, "[dist::", op, "] dim ", d, " is out of range for ", n, " dims");
  return d < 0 ? d + n : d;
}

// Where each old dim goes in a reshape from `from` to `to` (both fully known): groups of old
// dims whose product equals that of a group of new dims.
struct Group {
  std::vector<int64_t> old_dims, new_dims;
};
std::vector<Group> reshape_groups(const Shape& from, const Shape& to) {
  std::vector<Group> groups;
  int64_t i = 0, j = 0;
  while (i < from.size() || j < to.size()) {
    Group g;
    int64_t pa = 1, pb = 1;
    if (i < from.size()) pa *= from[i], g.old_dims.push_back(i++);
    if (j < to.size()) pb *= to[j], g.new_dims.push_back(j++);
    while (pa != pb) {
      if (pa < pb && i < from.size()) {
        pa *= from[i];
        g.old_dims.push_back(i++);
      } else if (j < to.size()) {
        pb *= to[j];
        g.new_dims.push_back(j++);
      } else {
        break;
      }
    }
    // Trailing size-1 dims join the group they follow.
    while (i < from.size() && from[i] == 1 && pa == pb && j >= to.size()) g.old_dims.push_back(i++);
    while (j < to.size() && to[j] == 1 && pa == pb && i >= from.size()) g.new_dims.push_back(j++);
    groups.push_back(g);
  }
  return groups;
}

}  // namespace

DTensor add(const DTensor& a, const DTensor& b) { return binary(Binary::Add, a, b); }
DTensor sub(const DTensor& a, const DTensor& b) { return binary(Binary::Sub, a, b); }
DTensor mul(const DTensor& a, const DTensor& b) { return binary(Binary::Mul, a, b); }
DTensor div(const DTensor& a, const DTensor& b) { return binary(Binary::Div, a, b); }

DTensor map(const DTensor& x, const std::function<Tensor(const Tensor&)>& fn, const char* name,
            bool linear) {
  const DeviceMesh& mesh = mesh_of(name, {&x});
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = x.placements()[i];
    if (p.is_partial() && !(linear && linear_partial(p))) {
      no_rule(name, i, {{"x", &x}},
              "A Partial cannot go through an op that is not linear, and "
              "only a Partial(sum) or Partial(avg) goes through a linear one: redistribute it to "
              "Replicate or Shard first");
    }
  }
  return DTensor::make(fn(detail::local_for(x, x.placements())), x.device_mesh(), x.placements(),
                       x.shape());
}

DTensor linear(const DTensor& x, const DTensor& w, const DTensor& b) {
  const DeviceMesh& mesh = mesh_of("linear", {&x, &w, &b});
  EMBER_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1), "[dist::linear] expected x ",
              "[..., in] and weight [out, in], got ", x.shape(), " and ", w.shape());
  const int64_t last = x.dim() - 1;
  Placements out;
  std::vector<bool> bias_once(mesh.ndim(), false);
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& px = x.placements()[i];
    const Placement& pw = w.placements()[i];
    const bool has_b = b.defined();
    const Placement pb = has_b ? b.placements()[i] : Placement(Replicate());
    const bool b_rep = pb.is_replicate();
    if (px.is_replicate() && pw.is_replicate() && b_rep) {
      out.push_back(Replicate());
    } else if (px.is_replicate() && pw.is_shard(0) && (!has_b || pb.is_shard(0))) {
      out.push_back(Shard(last));  // column parallel
    } else if (px.is_shard(last) && pw.is_shard(1) && b_rep) {
      out.push_back(Partial());  // row parallel: the bias goes in once
      bias_once[i] = true;
    } else if (px.is_shard() && px.dim() < last && pw.is_replicate() && b_rep) {
      out.push_back(px);
    } else if (px.is_partial() && px.op() == ReduceOp::Sum && pw.is_replicate() && b_rep) {
      out.push_back(px);
      bias_once[i] = true;
    } else {
      no_rule("linear", i, {{"x", &x}, {"weight", &w}, {"bias", &b}});
    }
  }
  Tensor bias;
  if (b.defined()) {
    // A bias added once into a Partial gets the whole gradient on every rank (FirstRankOnlyFn's
    // backward), so it needs no f there.
    Placements bias_out = out;
    for (int i = 0; i < mesh.ndim(); ++i) {
      if (bias_once[i]) bias_out[i] = Replicate();
    }
    bias = detail::local_for(b, bias_out);
    for (int i = 0; i < mesh.ndim(); ++i) {
      if (bias_once[i]) bias = FirstRankOnlyFn::apply(bias, mesh.get_local_rank(i) == 0);
    }
  }
  Tensor y = nn::functional::linear(detail::local_for(x, out), detail::local_for(w, out), bias);
  Shape shape = x.shape();
  shape[last] = w.size(0);
  return DTensor::make(y, x.device_mesh(), out, shape);
}

DTensor matmul(const DTensor& a, const DTensor& b) {
  const DeviceMesh& mesh = mesh_of("matmul", {&a, &b});
  EMBER_CHECK(a.dim() >= 2 && a.dim() == b.dim() && a.size(-1) == b.size(-2),
              "[dist::matmul] expected [..., m, k] and [..., k, n] of the same rank, got ",
              a.shape(), " and ", b.shape());
  const int64_t n = a.dim(), row = n - 2, col = n - 1;
  Shape batch_a = a.shape(), batch_b = b.shape();
  batch_a.resize(row);
  batch_b.resize(row);
  Shape shape = broadcast_shapes("dist::matmul", batch_a, batch_b);
  shape.push_back(a.size(row));
  shape.push_back(b.size(col));
  // A sharded batch dim must be the output's whole dim, not one that a broadcasts.
  auto whole = [&](const Placement& p, const DTensor& x) {
    return p.dim() >= row || x.size(p.dim()) == shape[p.dim()];
  };
  Placements out;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& pa = a.placements()[i];
    const Placement& pb = b.placements()[i];
    if (pa.is_replicate() && pb.is_replicate()) {
      out.push_back(Replicate());
    } else if (pa.is_shard() && pa.dim() != col && pb.is_replicate() && whole(pa, a)) {
      out.push_back(pa);  // rows or a batch dim of a
    } else if (pa.is_replicate() && pb.is_shard(col)) {
      out.push_back(Shard(col));
    } else if (pa.is_shard(col) && pb.is_shard(row)) {
      out.push_back(Partial());
    } else if (pa.is_shard() && pa == pb && pa.dim() < row && whole(pa, a) && whole(pb, b)) {
      out.push_back(pa);  // a batch dim sharded alike
    } else if (pa.is_partial() && pa.op() == ReduceOp::Sum && pb.is_replicate()) {
      out.push_back(pa);
    } else if (pb.is_partial() && pb.op() == ReduceOp::Sum && pa.is_replicate()) {
      out.push_back(pb);
    } else {
      no_rule("matmul", i, {{"a", &a}, {"b", &b}});
    }
  }
  // b replicated where a's batch dim is sharded: this rank's batches of b, unless b broadcasts
  // that dim.
  Tensor lb = detail::local_for(b, out);
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!out[i].is_shard() || out[i].dim() >= row || !b.placements()[i].is_replicate()) continue;
    const int64_t d = out[i].dim();
    if (b.size(d) == 1) continue;
    const int64_t m = mesh.size(i), k = mesh.get_local_rank(i);
    lb = lb.narrow(d, shard_offset(shape[d], m, k), shard_length(shape[d], m, k));
  }
  return DTensor::make(ember::matmul(detail::local_for(a, out), lb), a.device_mesh(), out, shape);
}

DTensor embedding(const DTensor& ids, const DTensor& w) {
  const DeviceMesh& mesh = mesh_of("embedding", {&ids, &w});
  EMBER_CHECK(w.dim() == 2, "[dist::embedding] expected weight [V, D], got ", w.shape());
  const int64_t last = ids.dim();
  Placements out;
  bool vocab_parallel = false;
  int vocab_dim = -1;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& pi = ids.placements()[i];
    const Placement& pw = w.placements()[i];
    if (pw.is_replicate() && !pi.is_partial()) {
      out.push_back(pi);
    } else if (pw.is_shard(1) && pi.is_replicate()) {
      out.push_back(Shard(last));
    } else if (pw.is_shard(0) && pi.is_replicate() && !vocab_parallel) {
      out.push_back(Partial());
      vocab_parallel = true;
      vocab_dim = i;
    } else {
      no_rule("embedding", i, {{"indices", &ids}, {"weight", &w}});
    }
  }
  Tensor idx = ids.local();
  if (vocab_parallel) {
    // Rows [lo, lo + len) live here: look up those, zeros for the others (their owners add them).
    const int64_t v = w.size(0), n = mesh.size(vocab_dim), k = mesh.get_local_rank(vocab_dim);
    const int64_t lo = shard_offset(v, n, k), len = shard_length(v, n, k);
    const Tensor mine = logical_and(ge(idx, Scalar(lo)), lt(idx, Scalar(lo + len)));
    idx = where(mine, idx - lo, zeros_like(idx));
    Tensor y = nn::functional::embedding(idx, detail::local_for(w, out));
    y = y * mine.unsqueeze(-1).to(y.dtype());
    Shape shape = ids.shape();
    shape.push_back(w.size(1));
    return DTensor::make(y, ids.device_mesh(), out, shape);
  }
  Shape shape = ids.shape();
  shape.push_back(w.size(1));
  return DTensor::make(nn::functional::embedding(idx, detail::local_for(w, out)), ids.device_mesh(), out,
                       shape);
}

DTensor layer_norm(const DTensor& x, IntList normalized_shape, const DTensor& w, const DTensor& b,
                   double eps) {
  const DeviceMesh& mesh = mesh_of("layer_norm", {&x, &w, &b});
  const int64_t first_normalized = x.dim() - static_cast<int64_t>(normalized_shape.size());
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& px = x.placements()[i];
    const bool params_rep = (!w.defined() || w.placements()[i].is_replicate()) &&
                            (!b.defined() || b.placements()[i].is_replicate());
    if (!params_rep || px.is_partial() || (px.is_shard() && px.dim() >= first_normalized)) {
      no_rule("layer_norm", i, {{"x", &x}, {"weight", &w}, {"bias", &b}},
              "layer_norm needs x sharded outside the normalized dims (or replicated) and "
              "replicated weight and bias");
    }
  }
  const Placements& out = x.placements();
  const Tensor y = ember::layer_norm(detail::local_for(x, out), normalized_shape,
                                     w.defined() ? detail::local_for(w, out) : Tensor(),
                                     b.defined() ? detail::local_for(b, out) : Tensor(), eps);
  return DTensor::make(y, x.device_mesh(), out, x.shape());
}

DTensor dropout(const DTensor& x, double p, bool training) {
  const DeviceMesh& mesh = mesh_of("dropout", {&x});
  bool sharded = false;
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (x.placements()[i].is_partial()) no_rule("dropout", i, {{"x", &x}});
    sharded = sharded || x.placements()[i].is_shard();
  }
  const Tensor in = detail::local_for(x, x.placements());
  if (!training || p == 0.0 || !sharded) {
    // Replicated: every rank draws the same mask from its generator, as a single process would.
    return DTensor::make(nn::functional::dropout(in, p, training), x.device_mesh(),
                         x.placements(), x.shape());
  }
  EMBER_CHECK(p > 0.0 && p < 1.0, "[dist::dropout] p must be in [0, 1], got ", p);
  // The whole tensor's mask, drawn as nn::functional::dropout draws it, then this rank's part.
  Tensor mask = empty(x.shape(), in.options());
  bernoulli_(mask, 1.0 - p);
  mask.div_(1.0 - p);
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (!x.placements()[i].is_shard()) continue;
    const int64_t d = x.placements()[i].dim(), n = mesh.size(i), k = mesh.get_local_rank(i);
    mask = mask.narrow(d, shard_offset(x.size(d), n, k), shard_length(x.size(d), n, k));
  }
  return DTensor::make(in * mask, x.device_mesh(), x.placements(), x.shape());
}

DTensor softmax(const DTensor& x, int64_t dim) {
  const DeviceMesh& mesh = mesh_of("softmax", {&x});
  const int64_t d = wrap("softmax", dim, x.dim());
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = x.placements()[i];
    if (p.is_partial() || p.is_shard(d)) {
      no_rule("softmax", i, {{"x", &x}},
              "softmax over a sharded or partial dim needs its whole row: redistribute it first "
              "(for a cross-entropy over vocabulary-sharded logits, use loss_parallel)");
    }
  }
  return DTensor::make(ember::softmax(detail::local_for(x, x.placements()), d), x.device_mesh(),
                       x.placements(), x.shape());
}

DTensor sum(const DTensor& x, IntList dims_in, bool keepdim) {
  const DeviceMesh& mesh = mesh_of("sum", {&x});
  std::vector<int64_t> dims;
  for (int64_t d : dims_in) dims.push_back(wrap("sum", d, x.dim()));
  if (dims.empty()) {
    for (int64_t d = 0; d < x.dim(); ++d) dims.push_back(d);
  }
  auto summed = [&](int64_t d) { return std::find(dims.begin(), dims.end(), d) != dims.end(); };
  Placements out;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = x.placements()[i];
    if (p.is_shard() && summed(p.dim())) {
      out.push_back(Partial());
    } else if (p.is_shard() && !keepdim) {
      out.push_back(Shard(p.dim() - std::count_if(dims.begin(), dims.end(),
                                                  [&](int64_t d) { return d < p.dim(); })));
    } else if (p.is_partial() && p.op() != ReduceOp::Sum) {
      no_rule("sum", i, {{"x", &x}});
    } else {
      out.push_back(p);
    }
  }
  Shape shape;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!summed(d)) {
      shape.push_back(x.size(d));
    } else if (keepdim) {
      shape.push_back(1);
    }
  }
  return DTensor::make(ember::sum(detail::local_for(x, out), dims, keepdim), x.device_mesh(), out, shape);
}

DTensor transpose(const DTensor& x, int64_t dim0, int64_t dim1) {
  const int64_t a = wrap("transpose", dim0, x.dim()), b = wrap("transpose", dim1, x.dim());
  Placements out = x.placements();
  for (Placement& p : out) {
    if (p.is_shard(a)) {
      p = Shard(b);
    } else if (p.is_shard(b)) {
      p = Shard(a);
    }
  }
  Shape shape = x.shape();
  std::swap(shape[a], shape[b]);
  return DTensor::make(detail::local_for(x, out).transpose(a, b), x.device_mesh(), out, shape);
}

DTensor reshape(const DTensor& x, IntList shape_in) {
  const DeviceMesh& mesh = mesh_of("reshape", {&x});
  // -1 inferred from the global size.
  Shape shape(shape_in);
  int64_t known = 1, infer = -1;
  for (int64_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == -1) {
      infer = d;
    } else {
      known *= shape[d];
    }
  }
  if (infer >= 0) shape[infer] = known == 0 ? 0 : x.shape().numel() / known;
  EMBER_CHECK(shape.numel() == x.shape().numel(), "[dist::reshape] cannot reshape ", x.shape(),
              " into ", Shape(shape_in));
  const std::vector<Group> groups = reshape_groups(x.shape(), shape);
  Placements out;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = x.placements()[i];
    if (!p.is_shard()) {
      out.push_back(p);
      continue;
    }
    const int64_t n = mesh.size(i);
    std::optional<Placement> q;
    for (const Group& g : groups) {
      if (g.old_dims.empty() || g.new_dims.empty()) continue;
      // The sharded dim must lead its group, and the group's leading new dim takes the shard,
      // evenly (so the local pieces stay contiguous).
      if (g.old_dims.front() == p.dim()) {
        const int64_t e = g.new_dims.front();
        const bool one_to_one = g.old_dims.size() == 1 && g.new_dims.size() == 1;
        if (one_to_one || (x.size(p.dim()) % n == 0 && shape[e] % n == 0)) q = Placement(Shard(e));
      }
    }
    if (!q) {
      no_rule("reshape", i, {{"x", &x}},
              detail::str_cat("reshaping ", x.shape(), " to ", shape, " splits or merges the "
                              "sharded dim unevenly or not at its outer end").c_str());
    }
    out.push_back(*q);
  }
  const Shape local = local_shape(shape, mesh, out);
  return DTensor::make(detail::local_for(x, out).reshape(local), x.device_mesh(), out, shape);
}

}  // namespace ember::dist
