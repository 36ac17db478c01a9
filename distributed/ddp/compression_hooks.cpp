#include <ember/distributed/ddp/compression_hooks.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>

#include <ember/distributed/ddp/detail/state_entries.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/observe/trace.h>

namespace ember::dist {

namespace {

constexpr const char* kOp = "[CompressionState]";

// ---- bucket plumbing ---------------------------------------------------------------------------

// Where each of the bucket's parameters sits in the hook's working vector: in order of parameter
// index, not of the bucket. DDP's first iteration and the iterations after its bucket rebuild may
// order one bucket's parameters differently (its key, the sorted indices, stays), and a restart
// begins with the first order again: the chunks, their owners and the residuals must not move.
struct Canonical {
  struct Piece {
    int64_t bucket_offset, offset, numel;
  };
  std::vector<Piece> pieces;

  explicit Canonical(const GradBucket& bucket) {
    const auto& params = bucket.parameters();
    const auto& indices = bucket.parameter_indices();
    std::vector<size_t> order(params.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return indices[a] < indices[b]; });
    std::vector<int64_t> bucket_offset(params.size());
    int64_t at = 0;
    for (size_t k = 0; k < params.size(); ++k) {
      bucket_offset[k] = at;
      at += params[k].numel();
    }
    int64_t offset = 0;
    for (size_t k : order) {
      pieces.push_back({bucket_offset[k], offset, params[k].numel()});
      offset += params[k].numel();
    }
  }
};

// `flat` (a bucket's layout) as a float32 tensor of `padded` elements in canonical order (zeros
// past the bucket), a new copy.
Tensor canonical_copy(const Canonical& layout, const Tensor& flat, int64_t padded) {
  Tensor x = empty({padded}, kFloat32);  // every element written once: the pieces, then zeros
  int64_t end = 0;
  for (const Canonical::Piece& p : layout.pieces) {
    x.narrow(0, p.offset, p.numel).copy_(flat.narrow(0, p.bucket_offset, p.numel));
    end = std::max(end, p.offset + p.numel);
  }
  if (end < padded) x.narrow(0, end, padded - end).zero_();
  return x;
}

// The buckets the compressing hooks take: floating point, on the CPU.
void check_bucket(const char* hook, const Tensor& buffer) {
  EMBER_CHECK(buffer.is_cpu(), "[", hook, "] expects a CPU bucket, got one on ",
              buffer.device().str(),
              " (the compressing hooks run on CPU; on GPUs use fp16/bf16 or PowerSGD)");
  EMBER_CHECK(is_floating(buffer.dtype()), "[", hook,
              "] expects a floating-point bucket, got ", dtype_name(buffer.dtype()));
}

// The bucket as a float32 CPU tensor of `padded` elements in canonical order (zeros past the
// bucket), a new copy.
Tensor padded_input(const char* hook, const GradBucket& bucket, int64_t padded) {
  check_bucket(hook, bucket.buffer());
  return canonical_copy(Canonical(bucket), bucket.buffer(), padded);
}

// Writes `result` (canonical order) into the bucket's buffer and returns it.
std::vector<Tensor> into_bucket(const Canonical& layout, Tensor buffer, const Tensor& result) {
  NoGradGuard no_grad;
  for (const Canonical::Piece& p : layout.pieces) {
    buffer.narrow(0, p.bucket_offset, p.numel).copy_(result.narrow(0, p.offset, p.numel));
  }
  return {buffer};
}

// Writes `sum` (canonical order) divided by `world` into the bucket's buffer and returns it: a
// contiguous float32 bucket in the same pass, another one through `sum`.
std::vector<Tensor> average_into_bucket(const Canonical& layout, Tensor buffer, Tensor sum,
                                        int world) {
  const auto w = static_cast<float>(world);
  float* s = sum.data<float>();
  if (buffer.dtype() == kFloat32 && buffer.is_contiguous()) {
    float* out = buffer.data<float>();
    for (const Canonical::Piece& p : layout.pieces) {
      for (int64_t k = 0; k < p.numel; ++k) out[p.bucket_offset + k] = s[p.offset + k] / w;
    }
    return {buffer};
  }
  for (int64_t i = 0; i < sum.numel(); ++i) s[i] /= w;
  return into_bucket(layout, buffer, sum);
}

// What a ring all-reduce of `numel` float32 elements sends from one of `world` ranks.
int64_t float32_allreduce_bytes(int64_t numel, int world) {
  return ring_allreduce_bytes(numel * 4, world);
}

uint8_t* bytes_of(const Tensor& t) { return t.data<uint8_t>(); }

}  // namespace

// ---- CompressionState --------------------------------------------------------------------------

CompressionState::CompressionState(CompressionOptions options) : options_(options) {
  EMBER_CHECK(options_.start_iter >= 0, kOp, " start_iter must be >= 0, got ",
              options_.start_iter);
  EMBER_CHECK(options_.channel_size >= 1, kOp, " channel_size must be >= 1, got ",
              options_.channel_size);
  EMBER_CHECK(options_.sign_block >= 8 && options_.sign_block % 8 == 0, kOp,
              " sign_block must be a positive multiple of 8, got ", options_.sign_block);
  EMBER_CHECK(options_.topk_ratio > 0 && options_.topk_ratio <= 1, kOp,
              " topk_ratio must be in (0, 1], got ", options_.topk_ratio);
  EMBER_CHECK(options_.momentum >= 0 && options_.momentum < 1, kOp,
              " momentum must be in [0, 1), got ", options_.momentum);
  EMBER_CHECK(!options_.momentum_masking || options_.momentum > 0, kOp,
              " momentum_masking masks the velocity and needs momentum > 0, got momentum ",
              options_.momentum);
  const int exchange = static_cast<int>(options_.exchange);
  EMBER_CHECK(exchange >= 0 && exchange <= 2, kOp,
              " exchange must be kAuto (0), kTwoPhase (1) or kAllGather (2), got ", exchange);
}

bool exchanges_by_allgather(CompressedExchange how, int world) {
  return how == CompressedExchange::kAllGather || (how == CompressedExchange::kAuto && world == 2);
}

CompressionState::Stats CompressionState::stats() const {
  Stats s = stats_;
  s.ratio = s.bytes_sent > 0 ? static_cast<double>(s.allreduce_bytes) / s.bytes_sent : 0.0;
  return s;
}

Tensor CompressionState::residual(const std::string& key) const {
  auto it = worker_.find(key);
  return it == worker_.end() ? Tensor() : it->second;
}

bool CompressionState::warming_up(const GradBucket& bucket) {
  const bool warm = iter_ < options_.start_iter;
  if (bucket.is_last()) ++iter_;
  return warm;
}

namespace {
Tensor& residual_in(std::map<std::string, Tensor>& map, const std::string& key, int64_t numel) {
  Tensor& t = map[key];
  if (!t.defined() || t.numel() != numel) t = zeros({numel}, kFloat32);
  return t;
}
}  // namespace

Tensor& CompressionState::worker_residual(const std::string& key, int64_t numel) {
  return residual_in(worker_, key, numel);
}

Tensor& CompressionState::server_residual(const std::string& key, int64_t numel) {
  return residual_in(server_, key, numel);
}

Tensor& CompressionState::velocity(const std::string& key, int64_t numel) {
  return residual_in(velocity_, key, numel);
}

void CompressionState::count(int64_t bytes_sent, int64_t allreduce_bytes) {
  ++stats_.buckets;
  stats_.bytes_sent += bytes_sent;
  stats_.allreduce_bytes += allreduce_bytes;
}

nn::NamedTensors CompressionState::state_dict() const {
  using detail::float_entry;
  using detail::int_entry;
  nn::NamedTensors out;
  out.emplace_back("iteration", int_entry(iter_));
  out.emplace_back("buckets", int_entry(stats_.buckets));
  out.emplace_back("bytes_sent", int_entry(stats_.bytes_sent));
  out.emplace_back("allreduce_bytes", int_entry(stats_.allreduce_bytes));
  out.emplace_back("option.error_feedback", int_entry(options_.error_feedback ? 1 : 0));
  out.emplace_back("option.start_iter", int_entry(options_.start_iter));
  out.emplace_back("option.channel_size", int_entry(options_.channel_size));
  out.emplace_back("option.sign_block", int_entry(options_.sign_block));
  out.emplace_back("option.topk_ratio", float_entry(options_.topk_ratio));
  out.emplace_back("option.momentum", float_entry(options_.momentum));
  out.emplace_back("option.momentum_masking", int_entry(options_.momentum_masking ? 1 : 0));
  out.emplace_back("option.exchange", int_entry(static_cast<int>(options_.exchange)));
  for (const auto& [k, t] : worker_) out.emplace_back("residual." + k, t.clone());
  for (const auto& [k, t] : server_) out.emplace_back("server_residual." + k, t.clone());
  for (const auto& [k, t] : velocity_) out.emplace_back("velocity." + k, t.clone());
  return out;
}

void CompressionState::load_state_dict(const nn::NamedTensors& state) {
  auto read_int = [](const std::string& name, const Tensor& t) {
    return detail::read_int(kOp, name, t);
  };
  CompressionOptions o = options_;
  Stats stats;
  std::map<std::string, Tensor> worker, server, velocity;
  int64_t iter = -1;
  const std::string kResidual = "residual.", kServer = "server_residual.", kVelocity = "velocity.";
  for (const auto& [name, t] : state) {
    if (name == "iteration") {
      iter = read_int(name, t);
    } else if (name == "buckets") {
      stats.buckets = read_int(name, t);
    } else if (name == "bytes_sent") {
      stats.bytes_sent = read_int(name, t);
    } else if (name == "allreduce_bytes") {
      stats.allreduce_bytes = read_int(name, t);
    } else if (name == "option.error_feedback") {
      o.error_feedback = read_int(name, t) != 0;
    } else if (name == "option.start_iter") {
      o.start_iter = read_int(name, t);
    } else if (name == "option.channel_size") {
      o.channel_size = read_int(name, t);
    } else if (name == "option.sign_block") {
      o.sign_block = read_int(name, t);
    } else if (name == "option.topk_ratio") {
      o.topk_ratio = detail::read_float(kOp, name, t);
    } else if (name == "option.momentum") {
      o.momentum = detail::read_float(kOp, name, t);
    } else if (name == "option.momentum_masking") {
      o.momentum_masking = read_int(name, t) != 0;
    } else if (name == "option.exchange") {
      o.exchange = static_cast<CompressedExchange>(read_int(name, t));
    } else if (name.rfind(kResidual, 0) == 0 && t.defined()) {
      worker[name.substr(kResidual.size())] = t.to(kFloat32, /*copy=*/true).reshape({-1});
    } else if (name.rfind(kServer, 0) == 0 && t.defined()) {
      server[name.substr(kServer.size())] = t.to(kFloat32, /*copy=*/true).reshape({-1});
    } else if (name.rfind(kVelocity, 0) == 0 && t.defined()) {
      velocity[name.substr(kVelocity.size())] = t.to(kFloat32, /*copy=*/true).reshape({-1});
    } else {
      EMBER_CHECK(false, kOp, " load_state_dict: unexpected entry '", name,
                  "'; expected iteration, buckets, bytes_sent, allreduce_bytes, option.*, "
                  "residual.<key>, server_residual.<key> or velocity.<key>");
    }
  }
  EMBER_CHECK(iter >= 0, kOp, " load_state_dict: expected an 'iteration' entry >= 0, got ",
              iter < 0 ? "none" : std::to_string(iter));
  (void)CompressionState(o);  // validates the options
  options_ = o;
  iter_ = iter;
  stats_ = stats;
  worker_ = std::move(worker);
  server_ = std::move(server);
  velocity_ = std::move(velocity);
}

}  // namespace ember::dist

// ---- hooks -------------------------------------------------------------------------------------

namespace ember::dist {

namespace {

// A codec as the hooks use it: message size, encode, decode-and-add.
struct Codec {
  const char* hook;
  std::function<int64_t(int64_t m)> bytes;
  std::function<void(const float* x, int64_t m, uint8_t* out, float* residual)> encode;
  std::function<void(const uint8_t* in, int64_t m, float* acc)> decode_add;
  std::function<void(const uint8_t* in, int64_t m, int64_t first, int64_t count, float* out)>
      decode_range;
};

Codec int8_codec(const char* hook, int64_t channel) {
  return {hook, [channel](int64_t m) { return codec::int8_bytes(m, channel); },
          [channel](const float* x, int64_t m, uint8_t* out, float* residual) {
            codec::int8_encode(x, m, channel, out, residual);
          },
          [channel](const uint8_t* in, int64_t m, float* acc) {
            codec::int8_decode_add(in, m, channel, acc);
          },
          [channel](const uint8_t* in, int64_t m, int64_t first, int64_t count, float* out) {
            codec::int8_decode_range(in, m, channel, first, count, out);
          }};
}

Codec sign_codec(int64_t block) {
  return {"sign_compress_hook", [block](int64_t m) { return codec::sign_bytes(m, block); },
          [block](const float* x, int64_t m, uint8_t* out, float* residual) {
            codec::sign_encode(x, m, block, out, residual);
          },
          [block](const uint8_t* in, int64_t m, float* acc) {
            codec::sign_decode_add(in, m, block, acc);
          },
          [block](const uint8_t* in, int64_t m, int64_t first, int64_t count, float* out) {
            codec::sign_decode_range(in, m, block, first, count, out);
          }};
}

// torch's quantization hooks: each rank's whole bucket encoded, all-gathered, decoded and
// averaged in rank order.
std::shared_ptr<Future> allgather_quantized(GradBucket& bucket, const Codec& c) {
  ProcessGroup& pg = bucket.process_group();
  const int world = pg.size();
  const int64_t n = bucket.buffer().numel();
  const Tensor x = padded_input(c.hook, bucket, n);
  const int64_t msg = c.bytes(n);
  Tensor mine = empty({msg}, kUInt8);
  c.encode(x.data<float>(), n, bytes_of(mine), nullptr);
  Tensor all = empty({world * msg}, kUInt8);
  bucket.record_bytes_sent((world - 1) * msg);
  auto work = pg.allgather_into_tensor(all, mine);
  return work->future()->then([c, all, n, msg, world, layout = Canonical(bucket),
                               buffer = bucket.buffer()](Future&) {
    Tensor sum = zeros({n}, kFloat32);
    for (int r = 0; r < world; ++r) c.decode_add(bytes_of(all) + r * msg, n, sum.data<float>());
    return average_into_bucket(layout, buffer, sum, world);
  });
}

// A warm-up iteration: a plain all-reduce. With momentum the velocity follows the averaged
// gradient and is what the bucket gets, the step the optimizer's momentum would have made.
std::shared_ptr<Future> warm_up(CompressionState& state, GradBucket& bucket, const char* hook) {
  const float momentum = static_cast<float>(state.options().momentum);
  if (momentum == 0) return allreduce_hook(bucket);
  const std::string key = bucket.key();
  const int64_t n = bucket.buffer().numel();
  check_bucket(hook, bucket.buffer());
  // Looked up (made, the first time) here on DDP's thread: the callback runs on whichever thread
  // completes the all-reduce, and two buckets' callbacks must not insert into the state's map at
  // once.
  Tensor u = state.velocity(key, n);
  return allreduce_hook(bucket)->then([u, n, momentum, layout = Canonical(bucket)](Future& f) {
    NoGradGuard no_grad;
    Tensor buffer = f.value().at(0);
    Tensor avg = canonical_copy(layout, buffer, n);
    float* up = u.data<float>();
    const float* a = avg.data<float>();
    for (int64_t i = 0; i < n; ++i) up[i] = momentum * up[i] + a[i];
    return into_bucket(layout, buffer, u);
  });
}

// What a compressing hook encodes, built in one pass over each of the bucket's pieces: x = the
// bucket in canonical order (zeros past its n elements, up to `padded`); with momentum, this
// rank's velocity u = momentum u + x and x = u (the first n elements); with error feedback,
// x += the worker residual (all `padded`). The same float operations in the same order as
// copying, then adding each term in a pass of its own, without the separate passes.
struct CompressionInput {
  Tensor x;
  float* velocity = nullptr;   // null without momentum
  Tensor* residual = nullptr;  // null without error feedback
};

CompressionInput compression_input(CompressionState& state, const GradBucket& bucket,
                                   const char* hook, const std::string& key, int64_t padded) {
  check_bucket(hook, bucket.buffer());
  const int64_t n = bucket.buffer().numel();
  const float momentum = static_cast<float>(state.options().momentum);
  CompressionInput in;
  if (momentum != 0) in.velocity = state.velocity(key, n).data<float>();
  if (state.options().error_feedback) in.residual = &state.worker_residual(key, padded);
  const float* r = in.residual ? in.residual->data<float>() : nullptr;
  float* u = in.velocity;
  const Canonical layout(bucket);
  // A float32 bucket is read in place; another dtype is converted first and updated in place.
  const Tensor& buffer = bucket.buffer();
  const bool direct = buffer.dtype() == kFloat32 && buffer.is_contiguous();
  in.x = direct ? empty({padded}, kFloat32) : canonical_copy(layout, buffer, padded);
  float* x = in.x.data<float>();
  const float* g0 = direct ? buffer.data<float>() : nullptr;
  // x[o, o + len) from g (null: zeros), u and r at the same canonical offsets.
  auto fill = [&](int64_t o, const float* g, int64_t len) {
    float* xs = x + o;
    float* us = u && o < n ? u + o : nullptr;  // the velocity covers the first n only
    const float* rs = r ? r + o : nullptr;
    if (us && rs) {
      for (int64_t j = 0; j < len; ++j) {
        us[j] = momentum * us[j] + g[j];
        xs[j] = us[j] + rs[j];
      }
    } else if (us) {
      for (int64_t j = 0; j < len; ++j) xs[j] = us[j] = momentum * us[j] + g[j];
    } else if (rs) {
      if (g) {
        for (int64_t j = 0; j < len; ++j) xs[j] = g[j] + rs[j];
      } else {
        std::memcpy(xs, rs, static_cast<size_t>(len) * sizeof(float));  // 0 + r is r
      }
    } else if (g != xs) {
      if (g) {
        std::memcpy(xs, g, static_cast<size_t>(len) * sizeof(float));
      } else {
        std::fill_n(xs, len, 0.0f);
      }
    }
  };
  int64_t end = 0;
  for (const Canonical::Piece& p : layout.pieces) {
    fill(p.offset, direct ? g0 + p.bucket_offset : x + p.offset, p.numel);
    end = std::max(end, p.offset + p.numel);
  }
  if (end < padded) {
    if (direct) {
      fill(end, nullptr, padded - end);
    } else if (r) {
      for (int64_t i = end; i < padded; ++i) x[i] += r[i];  // canonical_copy zeroed the tail
    }
  }
  return in;
}

// The ranks' messages `all` (chunk r of m canonical elements at r * msg) decoded straight into
// `out` (contiguous float32, bucket order), piece by piece: the same values as decoding into a
// canonical tensor and copying it into the bucket, without that tensor's zeroing and copy.
void decode_into_bucket(const Codec& c, const Canonical& layout, const Tensor& out_tensor,
                        const Tensor& all, int64_t m, int64_t msg) {
  float* out = out_tensor.data<float>();
  for (const Canonical::Piece& p : layout.pieces) {
    for (int64_t at = p.offset; at < p.offset + p.numel;) {  // the piece's part in each chunk
      const int64_t r = at / m, first = at - r * m;
      const int64_t count = std::min(p.offset + p.numel - at, m - first);
      c.decode_range(bytes_of(all) + r * msg, m, first, count,
                     out + p.bucket_offset + (at - p.offset));
      at += count;
    }
  }
}

// The all-gather exchange (file comment of compression_hooks.h): `mine` holds this rank's W
// compressed chunks; every rank decodes all of them, chunk by chunk in rank order, and averages.
std::shared_ptr<Future> allgather_chunks(CompressionState& state, GradBucket& bucket,
                                         const Codec& c, const Tensor& mine, int64_t m,
                                         int64_t msg) {
  std::shared_ptr<ProcessGroup> group = bucket.process_group_ptr();
  const int world = group->size();
  const int64_t sent = (world - 1) * world * msg;
  state.count(sent, float32_allreduce_bytes(bucket.buffer().numel(), world));
  bucket.record_bytes_sent(sent);
  Tensor all = empty({world * world * msg}, kUInt8);
  auto work = group->allgather_into_tensor(all, mine);
  return work->future()->then(
      [c, all, m, msg, world, layout = Canonical(bucket), buffer = bucket.buffer()](Future&) {
        trace::Span span("decompress", "comm hook");
        NoGradGuard no_grad;
        Tensor sum = empty({world * m}, kFloat32);
        float* s = sum.data<float>();
        const uint8_t* in = bytes_of(all);  // chunk r of rank q at (q W + r) msg
        for (int r = 0; r < world; ++r) {
          c.decode_range(in + r * msg, m, 0, m, s + r * m);
          for (int q = 1; q < world; ++q) c.decode_add(in + (q * world + r) * msg, m, s + r * m);
        }
        return average_into_bucket(layout, buffer, sum, world);
      });
}

// The compressed all-reduce of int8_compress_hook and sign_compress_hook, in two phases or one
// all-gather (file comment of compression_hooks.h).
std::shared_ptr<Future> compressed_allreduce(CompressionState& state, GradBucket& bucket,
                                             const Codec& c) {
  if (state.warming_up(bucket)) return warm_up(state, bucket, c.hook);
  NoGradGuard no_grad;
  std::shared_ptr<ProcessGroup> group = bucket.process_group_ptr();
  const int world = group->size();
  const int64_t n = bucket.buffer().numel();
  const int64_t m = (n + world - 1) / world;  // chunk c of every rank goes to rank c
  const bool feedback = state.options().error_feedback;
  const std::string key = bucket.key();
  const CompressionInput in = compression_input(state, bucket, c.hook, key, m * world);
  const Tensor& x = in.x;
  float* residual = in.residual ? in.residual->data<float>() : nullptr;
  const int64_t msg = c.bytes(m);
  trace::Span compress_span("compress", "comm hook", {{"bucket", bucket.index()}});
  Tensor mine = empty({world * msg}, kUInt8);  // chunk r's message at r * msg
  for (int r = 0; r < world; ++r) {
    c.encode(x.data<float>() + r * m, m, bytes_of(mine) + r * msg,
             residual ? residual + r * m : nullptr);
  }
  compress_span.finish();
  if (exchanges_by_allgather(state.options().exchange, world)) {
    return allgather_chunks(state, bucket, c, mine, m, msg);
  }
  std::vector<Tensor> inputs, outputs;
  for (int r = 0; r < world; ++r) {
    inputs.push_back(mine.narrow(0, r * msg, msg));
    outputs.push_back(empty({msg}, kUInt8));
  }
  state.count(2 * (world - 1) * msg, float32_allreduce_bytes(n, world));
  bucket.record_bytes_sent(2 * (world - 1) * msg);
  auto exchanged = group->alltoall(outputs, inputs)->future();
  // Phase two issues a collective after the first completes: on DDP's thread (defer).
  return bucket.defer(exchanged, [&state, c, group, outputs, inputs, key, m, msg, world, feedback,
                                  layout = Canonical(bucket), buffer = bucket.buffer()](Future&) {
    NoGradGuard no_grad;
    trace::Span span("decompress, average, compress", "comm hook");
    Tensor avg = empty({m}, kFloat32);  // the first message decoded into it (0 + v), the rest added
    float* a = avg.data<float>();
    c.decode_range(bytes_of(outputs[0]), m, 0, m, a);
    for (int r = 1; r < world; ++r) c.decode_add(bytes_of(outputs[r]), m, a);
    const auto w = static_cast<float>(world);
    float* server = nullptr;
    if (feedback) {  // the average plus the server's residual, in one pass
      server = state.server_residual(key, m).data<float>();
      for (int64_t i = 0; i < m; ++i) a[i] = a[i] / w + server[i];
    } else {
      for (int64_t i = 0; i < m; ++i) a[i] /= w;
    }
    Tensor mine = empty({msg}, kUInt8);
    c.encode(a, m, bytes_of(mine), server);
    Tensor all = empty({world * msg}, kUInt8);
    span.finish();
    auto work = group->allgather_into_tensor(all, mine);
    return work->future()->then([c, all, mine, m, msg, layout, buffer](Future&) {
      trace::Span decompress_span("decompress", "comm hook");
      NoGradGuard no_grad;
      // Another dtype (or a strided bucket) is decoded into a float32 copy in bucket order first.
      Tensor bucket_buffer = buffer;
      const bool direct = buffer.dtype() == kFloat32 && buffer.is_contiguous();
      Tensor out = direct ? bucket_buffer : empty({buffer.numel()}, kFloat32);
      decode_into_bucket(c, layout, out, all, m, msg);
      if (!direct) bucket_buffer.copy_(out);
      return std::vector<Tensor>{bucket_buffer};
    });
  });
}

}  // namespace

std::shared_ptr<Future> quantization_pertensor_hook(GradBucket& bucket) {
  const int64_t n = std::max<int64_t>(bucket.buffer().numel(), 1);
  return allgather_quantized(bucket, int8_codec("quantization_pertensor_hook", n));
}

std::shared_ptr<Future> quantization_perchannel_hook(GradBucket& bucket) {
  return allgather_quantized(bucket, int8_codec("quantization_perchannel_hook", 512));
}

std::shared_ptr<Future> int8_compress_hook(CompressionState& state, GradBucket& bucket) {
  return compressed_allreduce(state, bucket,
                              int8_codec("int8_compress_hook", state.options().channel_size));
}

std::shared_ptr<Future> sign_compress_hook(CompressionState& state, GradBucket& bucket) {
  return compressed_allreduce(state, bucket, sign_codec(state.options().sign_block));
}

std::shared_ptr<Future> topk_compress_hook(CompressionState& state, GradBucket& bucket) {
  if (state.warming_up(bucket)) return warm_up(state, bucket, "topk_compress_hook");
  NoGradGuard no_grad;
  ProcessGroup& pg = bucket.process_group();
  const int world = pg.size();
  const int64_t n = bucket.buffer().numel();
  const std::string key = bucket.key();
  const CompressionInput in = compression_input(state, bucket, "topk_compress_hook", key, n);
  const Tensor& x = in.x;
  float* xp = x.data<float>();
  float* velocity = in.velocity;
  Tensor* residual = in.residual;
  const int64_t k = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil(state.options().topk_ratio * static_cast<double>(n))), 1,
      std::max<int64_t>(n, 1));
  const std::vector<int32_t> order = n > 0 ? codec::topk_indices(xp, n, k) : std::vector<int32_t>{};
  const auto sent_count = static_cast<int64_t>(order.size());
  const int64_t msg = sent_count * static_cast<int64_t>(sizeof(int32_t) + sizeof(float));
  Tensor mine = empty({msg}, kUInt8);
  uint8_t* out = bytes_of(mine);
  std::memcpy(out, order.data(), order.size() * sizeof(int32_t));
  float* values = reinterpret_cast<float*>(out + sent_count * sizeof(int32_t));
  for (int64_t j = 0; j < sent_count; ++j) values[j] = xp[order[static_cast<size_t>(j)]];
  if (residual != nullptr) {
    // What was not sent: x everywhere but the sent entries, which were sent exactly. x is this
    // call's own tensor, so it becomes the residual without a copy.
    *residual = x;
    for (int32_t i : order) xp[i] = 0;
  }
  if (velocity != nullptr && state.options().momentum_masking) {
    for (int32_t i : order) velocity[i] = 0;
  }
  state.count((world - 1) * msg, float32_allreduce_bytes(n, world));
  bucket.record_bytes_sent((world - 1) * msg);
  Tensor all = empty({world * msg}, kUInt8);
  auto work = pg.allgather_into_tensor(all, mine);
  return work->future()->then([all, k = sent_count, n, msg, world, layout = Canonical(bucket),
                               buffer = bucket.buffer()](Future&) {
    trace::Span span("decompress", "comm hook");
    NoGradGuard no_grad;
    // Each rank's (index, value) pairs, its indices increasing.
    auto index_of = [&](int r, int64_t j) {
      int32_t index;
      std::memcpy(&index, bytes_of(all) + r * msg + j * sizeof(int32_t), sizeof index);
      return index;
    };
    auto value_of = [&](int r, int64_t j) {
      float value;
      std::memcpy(&value, bytes_of(all) + r * msg + k * sizeof(int32_t) + j * sizeof(float),
                  sizeof value);
      return value;
    };
    // Every index is checked once, before any is used: a rank with another model or other
    // options would otherwise write outside the bucket.
    for (int r = 0; r < world; ++r) {
      int64_t prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = index_of(r, j);
        EMBER_CHECK(i > prev && i < n, "[topk_compress_hook] rank ", r, " sent index ", i,
                    " at position ", j, ": expected increasing indices below the bucket's ", n,
                    " elements (do all ranks run the same model and hook options?)");
        prev = i;
      }
    }
    const auto w = static_cast<float>(world);
    if (buffer.dtype() != kFloat32 || !buffer.is_contiguous()) {
      Tensor sum = zeros({n}, kFloat32);
      float* s = sum.data<float>();
      for (int r = 0; r < world; ++r) {
        for (int64_t j = 0; j < k; ++j) s[index_of(r, j)] += value_of(r, j);
      }
      return average_into_bucket(layout, buffer, sum, world);
    }
    // Straight into the bucket: zeros, each rank's values added in rank order at their bucket
    // offsets, then every entry sent divided once by W (the rest stay 0, as 0 / W). The bits of
    // summing into a zero canonical vector, dividing it and copying it into the bucket.
    Tensor bucket_buffer = buffer;
    float* o = bucket_buffer.data<float>();
    std::fill_n(o, n, 0.0f);
    // fn(r, j, b) for rank r's entry j at bucket offset b; the indices increase, and so do the
    // pieces' canonical offsets.
    auto each_entry = [&](const auto& fn) {
      for (int r = 0; r < world; ++r) {
        size_t piece = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t i = index_of(r, j);
          while (i >= layout.pieces[piece].offset + layout.pieces[piece].numel) ++piece;
          const Canonical::Piece& p = layout.pieces[piece];
          fn(r, j, p.bucket_offset + (i - p.offset));
        }
      }
    };
    each_entry([&](int r, int64_t j, int64_t b) { o[b] += value_of(r, j); });
    std::vector<bool> divided(static_cast<size_t>(n), false);
    each_entry([&](int, int64_t, int64_t b) {
      if (!divided[static_cast<size_t>(b)]) {
        divided[static_cast<size_t>(b)] = true;
        o[b] /= w;
      }
    });
    return std::vector<Tensor>{bucket_buffer};
  });
}

CommHook compress_across_nodes(CommHook inner, std::shared_ptr<ProcessGroup> local,
                               std::shared_ptr<ProcessGroup> leaders) {
  constexpr const char* kWrap = "[compress_across_nodes]";
  EMBER_CHECK(inner != nullptr, kWrap, " expected a hook to wrap, got null");
  EMBER_CHECK(local != nullptr, kWrap, " expected this rank's node group, got null");
  const bool leader = local->rank() == 0;
  EMBER_CHECK(leader == (leaders != nullptr), kWrap, " rank ", local->rank(),
              " of its node group ", leader ? "leads its node and needs" : "is not a leader and takes no",
              " the leaders' group, got ", leaders ? "one" : "null");
  // Nodes of unequal size: the leaders' hook averages node means, so each leader first weighs
  // its node's mean by (its ranks) * (leaders) / (all ranks), which makes that average the mean
  // over every rank. All ranks are counted once, by the leaders, on the first bucket.
  auto weight = std::make_shared<std::optional<double>>();
  return [inner = std::move(inner), local = std::move(local), leaders = std::move(leaders),
          weight](GradBucket& bucket) -> std::shared_ptr<Future> {
    Tensor buffer = bucket.buffer();
    // Only the leader needs the node's average (the others take the broadcast): a reduce to it,
    // not an all-reduce, which would also copy the average out on every other rank.
    ReduceOptions o;
    o.root = 0;
    o.op = ReduceOp::Avg;
    bucket.record_bytes_sent(ring_allreduce_bytes(buffer.nbytes(), local->size()) / 2);
    auto node_average = local->reduce(buffer, o)->future();
    // The leaders' hook, then the broadcast inside the node, each after the step before: on
    // DDP's thread (defer), as they issue collectives.
    auto between_nodes =
        bucket.defer(node_average, [inner, local, leaders, weight, bucket](Future&) {
          if (!leaders) return completed_future({bucket.buffer()});
          NoGradGuard no_grad;
          if (!weight->has_value()) {
            Tensor ranks = full({1}, static_cast<double>(local->size()),
                                TensorOptions(kFloat64).device(bucket.buffer().device()));
            leaders->allreduce(ranks)->wait();
            *weight =
                static_cast<double>(local->size()) * leaders->size() / ranks.cpu().item<double>();
          }
          if (**weight != 1.0) Tensor(bucket.buffer()).mul_(**weight);
          GradBucket over_leaders = bucket.with_group(leaders);
          return inner(over_leaders);
        });
    return bucket.defer(between_nodes, [local, buffer, bucket](Future& f) mutable {
      Tensor result = buffer;
      if (local->rank() == 0) {
        NoGradGuard no_grad;
        result.copy_(f.value().at(0).reshape({-1}));
        bucket.record_bytes_sent((local->size() - 1) * result.nbytes());
      }
      return local->broadcast(result)->future();  // from rank 0, the leader
    });
  };
}

}  // namespace ember::dist
