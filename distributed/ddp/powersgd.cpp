// PowerSGD hooks. Note [PowerSGD stages]: torch chains the Q all-reduce in a Future::then
// callback, i.e. on the backend thread, whenever the P all-reduce happens to finish; meanwhile
// the backward thread launches the next bucket's all-reduces, so ranks can issue them in
// different orders (a hang or garbage over gloo). Here each bucket runs three stages, all on
// DDP's thread:
//   1. at launch: add the error, P = M Q, one all-reduce of [uncompressed tensors | all Ps];
//   2. deferred (end of backward, bucket order): average the uncompressed tensors, orthogonalise
//      each P, Q = M^T P, all-reduce the Qs;
//   3. deferred (next round): M = P Q^T / world, error = M_in - M, keep Q for the warm start.
// Stage 3 issues no collective but mutates the state, so it stays on DDP's thread too.
// Over NCCL the stages are chained on the stream (Note [NCCL stream-ordered work]): a deferred
// step's wait for the previous all-reduce orders DDP's current stream after it, and nothing in
// the stages reads a value back to the host, so no round blocks the CPU.
#include <ember/distributed/ddp/powersgd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <ember/distributed/ddp/detail/state_entries.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/linalg.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/ops/reduce.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[PowerSGDState]";

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a: a hash of a string that is the same in every process and build.
uint64_t stable_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

// CPU matmul supports float32/float64 only: half-precision buckets (fp16_compress_wrapper) are
// multiplied in float32 and rounded once.
Tensor matmul2d(const Tensor& a, const Tensor& b) {
  const Dtype d = a.dtype();
  if (a.is_cpu() && (d == kFloat16 || d == kBFloat16)) {
    return mm(a.to(kFloat32), b.to(kFloat32)).to(d);
  }
  return mm(a, b);
}

// Gram-Schmidt on the columns of m ([n, r]), in place. A zero column stays zero (torch's
// epsilon = 0 would produce NaNs there). The norm and the division are in float32: in half
// precision (under fp16_compress_wrapper) the squares of entries below about 1e-4 underflow to
// zero and a norm above 256 overflows, and either zeroed the column.
void orthogonalize(Tensor m, double eps) {
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    Tensor col = m.narrow(1, i, 1);  // [n, 1]
    const Tensor c = col.to(kFloat32);
    const Tensor norm = sqrt(sum(c * c, {0}, /*keepdim=*/true));  // [1, 1]
    col.copy_(c * where(gt(norm, 0.0), reciprocal(norm + eps), 0.0));
    if (i + 1 < r) {
      Tensor rest = m.narrow(1, i + 1, r - i - 1);  // [n, r - i - 1]
      rest.sub_(sum(col * rest, {0}, /*keepdim=*/true) * col);
    }
  }
}

// The initial Q of one matrix, identical on every rank: drawn from a generator seeded by the
// state's seed, the matrix's key and (without warm start, where Q is fresh every iteration) the
// iteration.
Tensor random_q(int64_t rows, int64_t rank, const Tensor& like, uint64_t seed, uint64_t key,
                uint64_t iteration) {
  Generator gen(splitmix64(seed ^ splitmix64(key ^ splitmix64(iteration))));
  // Drawn on like's device (CPU and CUDA draw the same values for a seed): a copy from the host
  // would block the CPU until the stream reaches it.
  return randn({rows, rank}, TensorOptions(kFloat32).device(like.device()), &gen)
      .to(like.dtype());
}

// `map[key]` converted to `like`'s dtype and device if it has `shape`, else undefined.
Tensor lookup(const std::map<std::string, Tensor>& map, const std::string& key, const Shape& shape,
              const Tensor& like) {
  auto it = map.find(key);
  if (it == map.end() || it->second.shape() != shape) return {};
  return it->second.to(like.device()).to(like.dtype());
}

// One gradient compressed as an [n, m] matrix.
struct Compressed {
  std::string key;
  uint64_t seed_key = 0;
  Tensor matrix;    // [n, m], a view into the bucket buffer
  Tensor original;  // [n, m], the input after error feedback (for the new error)
  Tensor p;         // [n, r], a view into the P all-reduce buffer
  Tensor q;         // [m, r], a view into the Q all-reduce buffer
};

}  // namespace

// ---- PowerSGDState ----------------------------------------------------------------------------

PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(options) {
  EMBER_CHECK(options_.matrix_approximation_rank >= 1, kOp,
              " matrix_approximation_rank must be >= 1, got ", options_.matrix_approximation_rank);
  EMBER_CHECK(options_.start_powerSGD_iter >= 0, kOp, " start_powerSGD_iter must be >= 0, got ",
              options_.start_powerSGD_iter);
  EMBER_CHECK(options_.min_compression_rate >= 0, kOp, " min_compression_rate must be >= 0, got ",
              options_.min_compression_rate);
  EMBER_CHECK(options_.orthogonalization_epsilon >= 0, kOp,
              " orthogonalization_epsilon must be >= 0, got ", options_.orthogonalization_epsilon);
}

void PowerSGDState::end_bucket(const GradBucket& bucket) {
  if (bucket.is_last()) ++iter_;
}

PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats s;
  s.numel_before = numel_before_;
  s.numel_after = numel_after_;
  s.rate = numel_after_ > 0 ? static_cast<double>(numel_before_) / numel_after_ : 0.0;
  return s;
}

namespace {
using detail::float_entry;
using detail::int_entry;
int64_t read_int(const std::string& name, const Tensor& t) {
  return detail::read_int(kOp, name, t);
}
double read_float(const std::string& name, const Tensor& t) {
  return detail::read_float(kOp, name, t);
}
}  // namespace

nn::NamedTensors PowerSGDState::state_dict() const {
  nn::NamedTensors out;
  out.emplace_back("iteration", int_entry(iter_));
  out.emplace_back("numel_before", int_entry(numel_before_));
  out.emplace_back("numel_after", int_entry(numel_after_));
  const PowerSGDOptions& o = options_;
  out.emplace_back("option.matrix_approximation_rank", int_entry(o.matrix_approximation_rank));
  out.emplace_back("option.start_powerSGD_iter", int_entry(o.start_powerSGD_iter));
  out.emplace_back("option.min_compression_rate", float_entry(o.min_compression_rate));
  out.emplace_back("option.use_error_feedback", int_entry(o.use_error_feedback ? 1 : 0));
  out.emplace_back("option.warm_start", int_entry(o.warm_start ? 1 : 0));
  out.emplace_back("option.orthogonalization_epsilon", float_entry(o.orthogonalization_epsilon));
  int64_t seed_bits = 0;
  std::memcpy(&seed_bits, &o.random_seed, sizeof seed_bits);
  out.emplace_back("option.random_seed", int_entry(seed_bits));
  for (const auto& [k, t] : error_) out.emplace_back("error." + k, t.clone());
  for (const auto& [k, t] : q_) out.emplace_back("q." + k, t.clone());
  return out;
}

void PowerSGDState::load_state_dict(const nn::NamedTensors& state) {
  PowerSGDOptions o = options_;
  std::map<std::string, Tensor> error, q;
  int64_t iter = -1, before = 0, after = 0;
  for (const auto& [name, t] : state) {
    if (name == "iteration") {
      iter = read_int(name, t);
    } else if (name == "numel_before") {
      before = read_int(name, t);
    } else if (name == "numel_after") {
      after = read_int(name, t);
    } else if (name == "option.matrix_approximation_rank") {
      o.matrix_approximation_rank = read_int(name, t);
    } else if (name == "option.start_powerSGD_iter") {
      o.start_powerSGD_iter = read_int(name, t);
    } else if (name == "option.min_compression_rate") {
      o.min_compression_rate = read_float(name, t);
    } else if (name == "option.use_error_feedback") {
      o.use_error_feedback = read_int(name, t) != 0;
    } else if (name == "option.warm_start") {
      o.warm_start = read_int(name, t) != 0;
    } else if (name == "option.orthogonalization_epsilon") {
      o.orthogonalization_epsilon = read_float(name, t);
    } else if (name == "option.random_seed") {
      const int64_t bits = read_int(name, t);
      std::memcpy(&o.random_seed, &bits, sizeof bits);
    } else if (name.rfind("error.", 0) == 0 && t.defined()) {
      error[name.substr(6)] = t.clone();
    } else if (name.rfind("q.", 0) == 0 && t.defined()) {
      q[name.substr(2)] = t.clone();
    } else {
      throw ValueError(dist::detail::str_cat(
          kOp, " load_state_dict: unexpected entry '", name,
          "'; expected iteration, numel_before, numel_after, option.*, error.<key> or q.<key>"));
    }
  }
  EMBER_CHECK(iter >= 0, kOp, " load_state_dict: expected an 'iteration' entry >= 0, got ",
              iter < 0 ? "none" : std::to_string(iter));
  (void)PowerSGDState(o);  // validates the options
  options_ = o;
  iter_ = iter;
  numel_before_ = before;
  numel_after_ = after;
  error_ = std::move(error);
  q_ = std::move(q);
}

// ---- powersgd_hook ----------------------------------------------------------------------------

std::shared_ptr<Future> powersgd_hook(PowerSGDState& state, GradBucket& bucket) {
  if (state.iter_ < state.options_.start_powerSGD_iter) {
    state.end_bucket(bucket);
    return allreduce_hook(bucket);
  }
  NoGradGuard no_grad;
  const PowerSGDOptions& o = state.options_;
  const Tensor input = bucket.buffer();
  const std::vector<Tensor> grads = bucket.gradients();
  const std::vector<size_t>& indices = bucket.parameter_indices();

  // Stage 1: split into matrices worth compressing and the rest (vectors and small matrices).
  std::vector<Tensor> uncompressed;
  std::vector<Compressed> mats;
  std::vector<int64_t> ranks;
  int64_t numel_u = 0, numel_p = 0, numel_q = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const Tensor& g = grads[k];
    state.numel_before_ += g.numel();
    if (g.dim() >= 2 && g.numel() > 0) {
      const int64_t n = g.size(0), m = g.numel() / n;
      const int64_t r = std::min({n, m, o.matrix_approximation_rank});
      if (static_cast<double>((n + m) * r) * o.min_compression_rate < static_cast<double>(n * m)) {
        Compressed c;
        c.key = std::to_string(indices[k]);
        c.seed_key = indices[k];
        c.matrix = g.view({n, m});
        mats.push_back(std::move(c));
        ranks.push_back(r);
        numel_p += n * r;
        numel_q += m * r;
        continue;
      }
    }
    uncompressed.push_back(g);
    numel_u += g.numel();
  }
  state.numel_after_ += numel_u + numel_p + numel_q;

  // One all-reduce carries the uncompressed tensors and every P; one more carries the Qs.
  Tensor up = empty({numel_u + numel_p}, input.options());
  Tensor qs = empty({numel_q}, input.options());
  int64_t off = 0;
  for (const Tensor& u : uncompressed) {
    up.narrow(0, off, u.numel()).copy_(u.reshape({-1}));
    off += u.numel();
  }
  int64_t qoff = 0;
  for (size_t j = 0; j < mats.size(); ++j) {
    Compressed& c = mats[j];
    const int64_t n = c.matrix.size(0), m = c.matrix.size(1), r = ranks[j];
    if (o.use_error_feedback) {
      Tensor e = lookup(state.error_, c.key, c.matrix.shape(), c.matrix);
      if (e.defined()) c.matrix.add_(e);
      c.original = c.matrix.clone();
    }
    c.q = qs.narrow(0, qoff, m * r).view({m, r});
    qoff += m * r;
    Tensor warm = o.warm_start ? lookup(state.q_, c.key, c.q.shape(), c.q) : Tensor();
    c.q.copy_(warm.defined() ? warm
                             : random_q(m, r, c.q, o.random_seed, c.seed_key,
                                        o.warm_start ? 0 : static_cast<uint64_t>(state.iter_) + 1));
    orthogonalize(c.q, o.orthogonalization_epsilon);
    c.p = up.narrow(0, off, n * r).view({n, r});
    off += n * r;
    c.p.copy_(matmul2d(c.matrix, c.q));
  }
  std::shared_ptr<ProcessGroup> pg = bucket.process_group_ptr();
  AllreduceOptions sum;
  sum.op = ReduceOp::Sum;
  bucket.record_bytes_sent(ring_allreduce_bytes(up.nbytes(), pg->size()));
  auto first = pg->allreduce(up, sum);
  state.end_bucket(bucket);

  PowerSGDState* st = &state;  // the CommHook that called us keeps the state alive
  auto shared = std::make_shared<std::vector<Compressed>>(std::move(mats));
  GradBucket b = bucket;
  return bucket.defer(first->future(), [=](Future&) mutable {
    // Stage 2.
    NoGradGuard no_grad;
    const int world = pg->size();
    int64_t uoff = 0;
    for (const Tensor& u : uncompressed) {
      Tensor dst = u;
      dst.copy_(up.narrow(0, uoff, u.numel()).view(u.shape()) / world);
      uoff += u.numel();
    }
    for (Compressed& c : *shared) {
      orthogonalize(c.p, st->options_.orthogonalization_epsilon);
      c.q.copy_(matmul2d(c.matrix.t(), c.p));
    }
    b.record_bytes_sent(ring_allreduce_bytes(qs.nbytes(), world));
    auto second = pg->allreduce(qs, sum);
    return b.defer(second->future(), [=](Future&) mutable {
      // Stage 3.
      NoGradGuard no_grad;
      qs.div_(world);
      for (Compressed& c : *shared) {
        c.matrix.copy_(matmul2d(c.p, c.q.t()));
        if (st->options_.use_error_feedback) st->error_[c.key] = c.original.sub_(c.matrix);
        if (st->options_.warm_start) st->q_[c.key] = c.q.clone();
      }
      return completed_future({input});
    });
  });
}

// ---- batched_powersgd_hook --------------------------------------------------------------------

std::shared_ptr<Future> batched_powersgd_hook(PowerSGDState& state, GradBucket& bucket) {
  if (state.iter_ < state.options_.start_powerSGD_iter) {
    state.end_bucket(bucket);
    return allreduce_hook(bucket);
  }
  NoGradGuard no_grad;
  const PowerSGDOptions& o = state.options_;
  const Tensor input = bucket.buffer();
  const int64_t total = input.numel();
  int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  while (side * side < total) ++side;  // guard against rounding in sqrt
  while (side > 0 && (side - 1) * (side - 1) >= total) --side;
  const int64_t r = std::min(side, o.matrix_approximation_rank);
  state.numel_before_ += total;
  state.numel_after_ += 2 * side * r;
  if (total == 0) {
    state.end_bucket(bucket);
    return completed_future({input});
  }

  const std::string key = "bucket." + bucket.key();
  Tensor padded = zeros({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);
  Tensor original;
  if (o.use_error_feedback) {
    Tensor e = lookup(state.error_, key, padded.shape(), padded);
    if (e.defined()) padded.add_(e);
    original = padded.clone();
  }
  Tensor matrix = padded.view({side, side});
  Tensor q = empty({side, r}, input.options());
  Tensor warm = o.warm_start ? lookup(state.q_, key, q.shape(), q) : Tensor();
  q.copy_(warm.defined() ? warm
                         : random_q(side, r, q, o.random_seed, stable_hash(key),
                                    o.warm_start ? 0 : static_cast<uint64_t>(state.iter_) + 1));
  orthogonalize(q, o.orthogonalization_epsilon);
  Tensor p = matmul2d(matrix, q).contiguous();  // [side, r]
  std::shared_ptr<ProcessGroup> pg = bucket.process_group_ptr();
  AllreduceOptions sum;
  sum.op = ReduceOp::Sum;
  bucket.record_bytes_sent(ring_allreduce_bytes(p.nbytes(), pg->size()));
  auto first = pg->allreduce(p, sum);
  state.end_bucket(bucket);

  PowerSGDState* st = &state;
  GradBucket b = bucket;
  return bucket.defer(first->future(), [=](Future&) mutable {
    NoGradGuard no_grad;
    orthogonalize(p, st->options_.orthogonalization_epsilon);
    q.copy_(matmul2d(matrix.t(), p));
    b.record_bytes_sent(ring_allreduce_bytes(q.nbytes(), pg->size()));
    auto second = pg->allreduce(q, sum);
    return b.defer(second->future(), [=](Future&) mutable {
      NoGradGuard no_grad;
      q.div_(pg->size());
      matrix.copy_(matmul2d(p, q.t()));
      if (st->options_.use_error_feedback) st->error_[key] = original.sub_(padded);
      if (st->options_.warm_start) st->q_[key] = q.clone();
      Tensor out = input;
      out.copy_(padded.narrow(0, 0, total));
      return completed_future({input});
    });
  });
}

}  // namespace ember::dist
