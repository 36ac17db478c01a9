// Fused attention on tensor cores through cuDNN's SDPA graphs (cuDNN's frontend builds them).
//
// Note [Attention through cuDNN]
// Ember's own CUDA attention kernel (attention.cu) is plain SIMT code; at transformer sizes the
// work is two matmuls per tile, which only tensor cores do at speed. cuDNN's flash attention
// (forward and FlashAttention-2 style backward, causal masking inside the kernel) is what
// PyTorch's SDPA also dispatches to on Hopper, so the CUDA forward and backward try it first and
// fall back to Ember's kernel where it does not apply (see attention_cudnn_supported).
// - Operands are the contiguous [batch, rows, cols] the front end lays out for CUDA, described to
//   cuDNN as [batch, 1 head, rows, cols]. Stats is cuDNN's logsumexp of the scaled, masked
//   scores (natural log, float32): the `lse` Ember's kernels save and read, so a forward of one
//   and a backward of the other agree (no dropout here: the two draw different masks).
// - A graph is built per shape, dtype, causality, scale and device, once per thread (the
//   frontend's graphs and cuDNN handles are used by one thread at a time; ranks as threads each
//   get their own), and kept with its workspace size; a shape cuDNN cannot build for is kept as
//   unsupported so the check is not repeated. A build inside a CUDA-graph capture runs in relaxed
//   capture mode (its allocations must not invalidate the capture), and a failure there is not
//   kept: it may be the capture's, not the shape's. A thread keeps at most kMaxPlans graphs: each
//   build costs tens to hundreds of milliseconds, so a loop over ever new lengths (sampling one
//   token at a time) falls back past that many, as for a shape cuDNN lacks, instead of building
//   one per length.
// - Causal is top-left aligned, as in PyTorch and Ember: query i sees keys j <= i.
#include <cudnn_frontend.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>

#include <ember/tensor/ops/attention.h>
#include <ember/tensor/cuda/runtime/check.h>
#include <ember/tensor/cuda/runtime/cudnn_handle.h>
#include <ember/tensor/cuda/runtime/device_pool.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/detail/attention_kernels.h>
#include <ember/tensor/observe/log.h>

namespace ember::detail {

namespace {

namespace fe = cudnn_frontend;

// The variant pack's tensor ids.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// Graphs one thread keeps (Note [Attention through cuDNN]).
constexpr size_t kMaxPlans = 64;

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, bool, uint64_t, bool>;

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;  // null: cuDNN cannot build this one
  int64_t workspace = 0;
};

Key key_of(Dtype dtype, Device device, const AttentionParams& p, bool backward) {
  uint64_t scale_bits = 0;
  static_assert(sizeof(scale_bits) == sizeof(p.scale));
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  return {static_cast<int>(dtype),
          device.index,
          p.batch,
          p.L,
          p.S,
          p.E,
          p.causal,
          scale_bits,
          backward};
}

// [batch, 1, rows, cols], contiguous.
std::shared_ptr<fe::graph::Tensor_attributes> operand(fe::graph::Graph& g, const char* name,
                                                      int64_t uid, const AttentionParams& p,
                                                      int64_t rows) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({p.batch, 1, rows, p.E})
                      .set_stride({rows * p.E, rows * p.E, p.E, 1}));
}

void stats_layout(fe::graph::Tensor_attributes& t, const AttentionParams& p) {
  t.set_uid(kStats)
      .set_dim({p.batch, 1, p.L, 1})
      .set_stride({p.L, p.L, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

void output_layout(fe::graph::Tensor_attributes& t, int64_t uid, const AttentionParams& p,
                   int64_t rows) {
  t.set_output(true)
      .set_uid(uid)
      .set_dim({p.batch, 1, rows, p.E})
      .set_stride({rows * p.E, rows * p.E, p.E, 1});
}

std::shared_ptr<fe::graph::Graph> new_graph(Dtype dtype) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(dtype == kBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// A graph of the dtype and its three inputs.
struct QkvGraph {
  std::shared_ptr<fe::graph::Graph> g;
  std::shared_ptr<fe::graph::Tensor_attributes> q, k, v;
};
QkvGraph qkv_graph(Dtype dtype, const AttentionParams& p) {
  QkvGraph r;
  r.g = new_graph(dtype);
  r.q = operand(*r.g, "Q", kQ, p, p.L);
  r.k = operand(*r.g, "K", kK, p, p.S);
  r.v = operand(*r.g, "V", kV, p, p.S);
  return r;
}

std::shared_ptr<fe::graph::Graph> forward_graph(Dtype dtype, const AttentionParams& p) {
  auto [g, q, k, v] = qkv_graph(dtype, p);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("ember_sdpa")
                     .set_generate_stats(true)
                     .set_causal_mask(p.causal)
                     .set_attn_scale(static_cast<float>(p.scale));
  auto [o, stats] = g->sdpa(q, k, v, options);
  output_layout(*o, kO, p, p.L);
  stats->set_output(true);
  stats_layout(*stats, p);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(Dtype dtype, const AttentionParams& p) {
  auto [g, q, k, v] = qkv_graph(dtype, p);
  auto o = operand(*g, "O", kO, p, p.L);
  auto dout = operand(*g, "dO", kDO, p, p.L);
  auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("Stats"));
  stats_layout(*stats, p);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("ember_sdpa_backward")
                     .set_causal_mask(p.causal)
                     .set_attn_scale(static_cast<float>(p.scale));
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
  output_layout(*dq, kDQ, p, p.L);
  output_layout(*dk, kDK, p, p.S);
  output_layout(*dv, kDV, p, p.S);
  return g;
}

// This thread's plan for the call, built on first use.
const Plan& plan_for(Dtype dtype, Device device, const AttentionParams& p, bool backward) {
  thread_local std::map<Key, Plan> plans;
  const Key key = key_of(dtype, device, p, backward);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  static const Plan kNone;
  if (plans.size() >= kMaxPlans) {
    logging::debug("scaled_dot_product_attention: this thread keeps ", kMaxPlans, " cuDNN graphs ",
                   "already; falling back for batch ", p.batch, ", L ", p.L, ", S ", p.S);
    return kNone;
  }
  const bool capturing = cuda::is_current_stream_capturing();
  Plan plan;
  try {
    cuda::detail::DeviceGuard guard(device.index);
    cuda::detail::RelaxedCaptureMode relaxed;
    cudnnHandle_t handle = cudnn_handle(device, "scaled_dot_product_attention");
    auto g = backward ? backward_graph(dtype, p) : forward_graph(dtype, p);
    fe::error_t st = g->build(handle, {fe::HeurMode_t::A});
    if (st.is_good()) st = g->get_workspace_size(plan.workspace);
    if (st.is_good()) {
      plan.graph = std::move(g);
    } else {
      logging::debug("scaled_dot_product_attention: cuDNN has no ",
                     backward ? "backward" : "forward", " kernel for batch ", p.batch, ", L ", p.L,
                     ", S ", p.S, ", E ", p.E, " (", st.get_message(),
                     "): Ember's kernel runs instead");
    }
  } catch (const ember::Error&) {
    throw;  // Ember's own (a handle it could not make): not a shape cuDNN lacks
  } catch (const std::exception& e) {
    // The frontend's cudnnException, or a library it could not load.
    logging::debug("scaled_dot_product_attention: cuDNN's frontend failed (", e.what(),
                   "): Ember's kernel runs instead");
  }
  if (plan.graph == nullptr && capturing) return kNone;
  return plans.emplace(key, std::move(plan)).first->second;
}

// What cuDNN's fused kernels take, before asking it to build a graph. A GPU before compute
// capability 8.0 is cuDNN's own refusal at build time (then cached like any shape it lacks).
bool shape_applies(Dtype dtype, Device device, const AttentionParams& p, bool has_mask) {
  return cudnn_sdp_enabled() && (dtype == kBFloat16 || dtype == kFloat16) && device.is_cuda() &&
         !has_mask && p.dropout_p == 0.0 && p.E == p.Ev && p.E % 8 == 0 && p.E <= 128 &&
         p.batch > 0 && p.L > 0 && p.S > 0;
}

// This thread's plan for the call when cuDNN takes it, else null.
const Plan* plan_if_applies(Dtype dtype, Device device, const AttentionParams& p, bool has_mask,
                            bool backward) {
  if (!shape_applies(dtype, device, p, has_mask)) return nullptr;
  const Plan& plan = plan_for(dtype, device, p, backward);
  return plan.graph != nullptr ? &plan : nullptr;
}

// cuDNN's kernels load 16 bytes at a time and refuse other operands at execute (the frontend's
// INVALID_VARIANT_PACK); views offset by whole rows of a multiple of 8 elements always pass, so
// a miss falls back rather than failing.
bool aligned(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  }
  return true;
}

void execute(const Plan& plan, Device device, std::unordered_map<int64_t, void*>& pack) {
  Tensor workspace = make_empty({std::max<int64_t>(plan.workspace, 1)}, kUInt8, device);
  cudnnHandle_t handle = cudnn_handle(device, "scaled_dot_product_attention");
  fe::error_t st = plan.graph->execute(handle, pack, workspace.data_ptr());
  if (!st.is_good()) {
    throw CudaError(
        str_cat("[scaled_dot_product_attention] cuDNN failed to run its attention "
                "graph: ",
                st.get_message()));
  }
}

}  // namespace

bool attention_cudnn_supported(Dtype dtype, Device device, const AttentionParams& p,
                               bool has_mask) {
  return plan_if_applies(dtype, device, p, has_mask, /*backward=*/false) != nullptr;
}

bool attention_cudnn_backward_supported(Dtype dtype, Device device, const AttentionParams& p) {
  return plan_if_applies(dtype, device, p, /*has_mask=*/false, /*backward=*/true) != nullptr;
}

bool attention_cudnn_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, const AttentionParams& p) {
  const Device device = q.device();
  const Plan* plan = plan_if_applies(q.dtype(), device, p, /*has_mask=*/false, /*backward=*/false);
  if (plan == nullptr || !aligned({&out, &lse, &q, &k, &v})) return false;
  cuda::detail::DeviceGuard guard(device.index);
  std::unordered_map<int64_t, void*> pack = {{kQ, q.data_ptr()},
                                             {kK, k.data_ptr()},
                                             {kV, v.data_ptr()},
                                             {kO, out.data_ptr()},
                                             {kStats, lse.data_ptr()}};
  execute(*plan, device, pack);
  return true;
}

bool attention_cudnn_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, const AttentionParams& p) {
  const Device device = q.device();
  const Plan* plan = plan_if_applies(q.dtype(), device, p, /*has_mask=*/false, /*backward=*/true);
  if (plan == nullptr || !aligned({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse})) return false;
  cuda::detail::DeviceGuard guard(device.index);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q.data_ptr()},   {kK, k.data_ptr()},     {kV, v.data_ptr()},
      {kO, out.data_ptr()}, {kDO, dout.data_ptr()}, {kStats, lse.data_ptr()},
      {kDQ, dq.data_ptr()}, {kDK, dk.data_ptr()},   {kDV, dv.data_ptr()}};
  execute(*plan, device, pack);
  return true;
}

}  // namespace ember::detail
