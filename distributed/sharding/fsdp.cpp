// fully_shard: the sharding of a module and the hooks that drive a step (fsdp.h). The state
// functions (fsdp_parameters, clipping, state dicts) are in fsdp_state.cpp.
//
// Note [FSDP arenas]
// A sharded module's parameter tensors keep their handles (modules hold them as members, the
// autograd graph saves them for backward, the user may hold them), so releasing the gathered
// parameters cannot swap in new tensors or new storages: a view saved for backward would keep
// the old memory alive, and a handle would go stale. Each flat group therefore lives in an
// arena (detail/fsdp_arena.h), a fixed address range whose memory is mapped on gather and given
// back on release: on the CPU a HostArena (madvise + PROT_NONE), on a CUDA device a CudaArena
// (CUDA's virtual memory management, Note [CUDA arenas] in fsdp_cuda_arena.cpp). Every view of
// it, saved ones included, sees the gathered values again after the next gather, and nothing
// else holds the memory in between. The collectives write through a second tensor over the same
// memory with its own Storage object, so the gathers do not bump the version of the storage the
// graph's saved tensors check.
//
// Note [FSDP and the host cache]
// The host allocator hands a request any cached block up to twice its size (tensor/allocator.cpp)
// and counts the whole block as allocated. Sharding frees each module's unsharded parameters into
// that cache, and a shard is smaller than the parameters it comes from: left there, the blocks of
// one module's parameters (and of the temporaries that built the model) would be taken by the next
// module's shards, and later by activations, and stay half used for the whole run, on every rank.
// So on the host fully_shard empties the cache before it makes the shards (they get blocks of
// their own size) and again after (the unsharded parameters' blocks are freed, not kept for
// smaller tensors to half fill). It costs the first step some page faults; no block in use is
// touched.
#include <ember/distributed/sharding/fsdp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <ember/autograd/engine.h>
#include <ember/distributed/init.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/distributed/sharding/detail/fsdp_unit.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>

namespace ember::dist {
namespace detail {
namespace {

constexpr const char* kOp = "fully_shard";

std::mutex g_mu;
std::vector<std::weak_ptr<FsdpUnit>> g_units;
std::unordered_map<const TensorImpl*, std::weak_ptr<FsdpUnit>> g_params;
std::unordered_map<const ProcessGroup*, std::weak_ptr<FsdpContext>> g_contexts;

std::atomic<int64_t> g_sharded_bytes{0}, g_unsharded_bytes{0}, g_peak_unsharded{0},
    g_full_bytes{0};

void count_unsharded(int64_t delta) {
  const int64_t now = g_unsharded_bytes.fetch_add(delta) + delta;
  int64_t peak = g_peak_unsharded.load();
  while (now > peak && !g_peak_unsharded.compare_exchange_weak(peak, now)) {
  }
}

std::shared_ptr<FsdpContext> context_for(const std::shared_ptr<ProcessGroup>& pg) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& slot = g_contexts[pg.get()];
  auto ctx = slot.lock();
  if (!ctx || ctx->group != pg) {
    ctx = std::make_shared<FsdpContext>();
    ctx->group = pg;
    slot = ctx;
  }
  return ctx;
}

int64_t index_of(const std::vector<std::weak_ptr<FsdpUnit>>& order, const FsdpUnit* u) {
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i].lock().get() == u) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

std::shared_ptr<FsdpUnit> unit_of(const nn::Module& module) {
  // The references taken here are dropped after g_mu is released: another thread may drop a
  // unit's (or its module's) other owners meanwhile, and the last reference runs ~FsdpUnit,
  // which takes g_mu.
  std::vector<std::shared_ptr<FsdpUnit>> live;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    live.reserve(g_units.size());
    for (const auto& w : g_units) {
      if (auto u = w.lock()) live.push_back(std::move(u));
    }
  }
  for (auto& u : live) {
    if (u->module.lock().get() == &module) return u;
  }
  return nullptr;
}

std::vector<std::shared_ptr<FsdpUnit>> units_under(const nn::Module& root) {
  std::vector<std::shared_ptr<FsdpUnit>> out;
  // modules() is not const (it hands out shared_ptrs); the walk itself changes nothing.
  auto& r = const_cast<nn::Module&>(root);
  if (auto u = unit_of(r)) out.push_back(u);
  for (const auto& m : r.modules()) {
    if (m.get() == &root) continue;
    if (auto u = unit_of(*m)) out.push_back(u);
  }
  return out;
}

std::shared_ptr<FsdpUnit> unit_holding(const Tensor& t) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_params.find(t.impl());
  return it == g_params.end() ? nullptr : it->second.lock();
}

// ---- gathering and releasing ------------------------------------------------------------------

void FsdpUnit::unshard(bool wait) {
  for (FlatGroup& g : groups) {
    if (g.gathered) continue;
    g.gathered = true;
    g.arena->commit();
    count_unsharded(static_cast<int64_t>(g.arena->nbytes()));
    Tensor in = g.shard.detach();
    if (g.compute_dtype != g.dtype) in = in.to(g.compute_dtype);
    pending.push_back({group->allgather_into_tensor(g.full, in), in});
  }
  if (wait) wait_unshard();
}

void timed_wait(FsdpContext& ctx, const WorkPtr& work) {
  const auto t0 = std::chrono::steady_clock::now();
  work->wait();
  ctx.wait_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
}

void FsdpUnit::wait_unshard() {
  for (auto& p : pending) timed_wait(*ctx, p.first);
  pending.clear();
}

void FsdpUnit::reshard(bool trainable_only) {
  wait_unshard();
  for (FlatGroup& g : groups) {
    if (!g.gathered || (trainable_only && !g.requires_grad)) continue;
    g.arena->release();
    g.gathered = false;
    count_unsharded(-static_cast<int64_t>(g.arena->nbytes()));
  }
}

FsdpUnit::~FsdpUnit() {
  for (FlatGroup& g : groups) {
    if (g.gathered) count_unsharded(-static_cast<int64_t>(g.arena->nbytes()));
    g_sharded_bytes -= g.shard.nbytes();
    g_full_bytes -= static_cast<int64_t>(g.arena->nbytes());
  }
  std::lock_guard<std::mutex> lock(g_mu);
  for (const FlatGroup& g : groups) {
    for (const Tensor& p : g.params) g_params.erase(p.impl());
  }
}

// ---- gradients --------------------------------------------------------------------------------

namespace {

// Adds a finished reduction's output to its group's pieces' gradients.
void add_to_pieces(const PendingReduce& r) {
  NoGradGuard no_grad;
  const FlatGroup& g = *r.group;
  const Tensor add = r.out.dtype() == g.dtype ? r.out : r.out.to(g.dtype);
  for (size_t i = 0; i < g.pieces.size(); ++i) {
    const Tensor& piece = g.pieces[i];
    if (!piece.defined()) continue;
    const Tensor part = add.narrow(0, g.piece_at[i], piece.numel());
    // A parameter no rank used keeps no gradient, so the optimizer skips it instead of decaying
    // it or moving it with its momentum. The ranks' flags are not exchanged: a parameter this
    // rank did not use is taken as used elsewhere unless its reduced piece is exactly zero (every
    // rank sent zeros), so ranks that disagree (input-dependent use) still give every piece of
    // it the average. Only for parameters unused here: one read of a flag per such piece.
    if (!r.used[i] && !any(ne(part, 0)).item<bool>()) continue;
    Tensor grad = piece.grad();
    if (grad.defined()) {
      grad.add_(part);
    } else {
      piece.set_grad(part);  // a view of this reduce's output: no copy
    }
  }
}

// Waits for the oldest reduce-scatter. Under HSDP its output (this rank's shard of the gradient,
// averaged over the shard group) then goes on to be averaged across the replicas: that
// all-reduce is left in flight, holding only the shard, and the module's full gradient is let go.
void finish_reduce(FsdpContext& ctx) {
  PendingReduce r = std::move(ctx.reduces.front());
  ctx.reduces.pop_front();
  timed_wait(ctx, r.work);
  if (!ctx.replicate) {
    add_to_pieces(r);
    return;
  }
  r.input = Tensor();
  r.work = ctx.replicate->allreduce(r.out, {.op = ReduceOp::Avg});
  ctx.replica_reduces.push_back(std::move(r));
}

void finish_replica_reduces(FsdpContext& ctx) {
  while (!ctx.replica_reduces.empty()) {
    PendingReduce r = std::move(ctx.replica_reduces.front());
    ctx.replica_reduces.pop_front();
    timed_wait(ctx, r.work);
    add_to_pieces(r);
  }
}

// At most this many reduce-scatters in flight: each holds a module's full gradients, so waiting
// for the older ones bounds the memory while the newest still overlaps the backward of the next
// module. More would overlap more and hold one more module's gradients each.
constexpr size_t kMaxReducesInFlight = 1;

}  // namespace

void FsdpUnit::reduce_grads() {
  reduced = true;
  FsdpContext& c = *ctx;
  if (!c.sync) {  // no_sync: keep the full gradients; the next synced backward reduces the sum
    reshard(/*trainable_only=*/true);
    return;
  }
  NoGradGuard no_grad;
  for (FlatGroup& g : groups) {
    if (!g.requires_grad) continue;
    // The gradients were accumulated into views of grad_flat (prepare_grads, run by the
    // pre-backward hook); one that is not (its handle was cleared and replaced during backward)
    // is copied in.
    Tensor flat = g.grad_flat;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const Tensor grad = g.params[i].grad();
      if (!grad.defined()) continue;
      if (grad.storage() != flat.storage()) {
        flat.narrow(0, g.offsets[i], grad.numel()).copy_(grad.reshape({-1}));
      }
      g.params[i].set_grad(Tensor());
    }
    g.grad_flat = Tensor();
    Tensor input = flat.dtype() == g.reduce_dtype ? flat : flat.to(g.reduce_dtype);
    Tensor out = empty({g.shard_size}, TensorOptions(g.reduce_dtype).device(g.device));
    WorkPtr work = group->reduce_scatter_tensor(out, input, {.op = ReduceOp::Avg});
    c.reduces.push_back({std::move(work), std::move(input), std::move(out), &g, g.used});
    std::fill(g.used.begin(), g.used.end(), 0);
  }
  // Frozen groups may still be read by nodes that compute input gradients; they are released
  // when the whole backward is done.
  reshard(/*trainable_only=*/true);
  while (c.reduces.size() > kMaxReducesInFlight) finish_reduce(c);
}

// The parameters' gradients become views of one flat buffer per group (what the reduce-scatter
// sends), so backward accumulates into it in place: no copy, and no second module-sized buffer
// beside the gradients. Kept across backwards without sync (no_sync accumulates into it).
void FsdpUnit::prepare_grads() {
  NoGradGuard no_grad;
  for (FlatGroup& g : groups) {
    if (!g.requires_grad) continue;
    if (!g.grad_flat.defined()) {
      g.grad_flat = zeros({group->size() * g.shard_size},
                          TensorOptions(g.compute_dtype).device(g.device));
    }
    for (size_t i = 0; i < g.params.size(); ++i) {
      Tensor& p = g.params[i];
      const Tensor grad = p.grad();
      if (grad.defined() && grad.storage() == g.grad_flat.storage()) continue;
      Tensor view = g.grad_flat.narrow(0, g.offsets[i], p.numel()).view(p.shape());
      if (grad.defined()) view.copy_(grad);  // accumulated outside the buffer: bring it in
      p.set_grad(view);
    }
  }
}

void FsdpUnit::on_grad_ready(size_t group, size_t i) {
  groups[group].used[i] = 1;
  if (!in_backward || reduced) return;  // a backward that did not come through the outputs
  if (++ready == trainable) reduce_grads();
}

namespace {

void average_replicated(FsdpContext& ctx) {
  if (ctx.replicated.empty()) return;
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : ctx.replicated) {
    Tensor g = p.grad();
    if (!g.defined()) {  // unused here: zeros, so every rank sends the same tensors
      g = zeros(p.shape(), p.options());
      p.set_grad(g);
    }
    grads.push_back(g);
  }
  timed_wait(ctx, ctx.group->allreduce_coalesced(grads, {.op = ReduceOp::Avg}));
  // Both groups' sizes are the same on every rank, so the mean of the means is the mean.
  if (ctx.replicate) {
    timed_wait(ctx, ctx.replicate->allreduce_coalesced(grads, {.op = ReduceOp::Avg}));
  }
}

// Runs once after every backward that reached a sharded module (queued by the first pre-backward
// hook): reduces what the hooks did not (modules with parameters that got no gradient), waits
// for the reduce-scatters, averages the replicated gradients and releases every gathered module.
void finish_backward(FsdpContext& ctx) {
  ctx.callback_queued = false;
  // Every unit, not only this step's forward order: a module called twice in one forward
  // restarts the order at its second call (pre_forward), and a unit left out here kept
  // in_backward set and was never reduced again.
  std::erase_if(ctx.units, [](const std::weak_ptr<FsdpUnit>& w) { return w.expired(); });
  std::vector<std::shared_ptr<FsdpUnit>> all;
  for (auto it = ctx.order.rbegin(); it != ctx.order.rend(); ++it) {
    if (auto u = it->lock()) all.push_back(u);
  }
  for (const auto& w : ctx.units) {
    auto u = w.lock();
    if (u && std::find(all.begin(), all.end(), u) == all.end()) all.push_back(u);
  }
  for (const auto& u : all) {
    if (u->in_backward && !u->reduced && u->trainable > 0) u->reduce_grads();
  }
  while (!ctx.reduces.empty()) finish_reduce(ctx);
  finish_replica_reduces(ctx);
  if (ctx.sync) average_replicated(ctx);
  // Every unit is released, one prefetched but not run in this step too, so no gather is left
  // in flight while the optimizer writes the shards.
  for (const auto& u : all) {
    u->reshard(/*trainable_only=*/false);
    u->in_backward = false;
  }
}

}  // namespace

void FsdpUnit::pre_backward() {
  if (in_backward) return;
  in_backward = true;
  reduced = false;
  ready = 0;
  if (!ctx->callback_queued) {
    ctx->callback_queued = true;
    autograd::queue_callback([c = ctx] { finish_backward(*c); });
  }
  unshard(/*wait=*/true);
  prepare_grads();
  if (!options.prefetch) return;
  // The module before this one in the forward runs its backward next.
  for (int64_t i = index_of(ctx->order, this) - 1; i >= 0; --i) {
    auto prev = ctx->order[i].lock();
    if (!prev || prev->in_backward) continue;
    prev->unshard(/*wait=*/false);
    break;
  }
}

// ---- forward hooks ----------------------------------------------------------------------------

void FsdpUnit::pre_forward(std::vector<Tensor>& inputs) {
  FsdpContext& c = *ctx;
  // The arenas are released when the host sees an event pass, which a capture cannot hold.
  EMBER_CHECK(!cuda::thread_is_capturing(), "[", kOp,
              "] forward cannot be captured in a CUDA graph yet: FSDP frees its gathered "
              "parameters once the host sees the GPU is done with them. Capture DDP over nccl, "
              "or run FSDP eagerly");
  if (autograd::in_backward()) {  // recomputation under activation checkpointing
    unshard(/*wait=*/true);
  } else {
    if (index_of(c.order, this) >= 0) {  // a new step (or another forward) begins
      c.last_order = std::move(c.order);
      c.order.clear();
      c.depth = 0;
    }
    outermost = c.depth == 0;
    ++c.depth;
    c.order.push_back(weak_from_this());
    unshard(/*wait=*/true);
    if (options.prefetch) {
      const int64_t i = index_of(c.last_order, this);
      if (i >= 0 && i + 1 < static_cast<int64_t>(c.last_order.size())) {
        if (auto next = c.last_order[i + 1].lock()) next->unshard(/*wait=*/false);
      }
    }
  }
  const auto& mp = options.mp_policy;
  if (mp.param_dtype && mp.cast_forward_inputs) {
    for (Tensor& x : inputs) {
      if (x.defined() && x.is_floating_point() && x.dtype() != *mp.param_dtype) {
        x = x.to(*mp.param_dtype);
      }
    }
  }
}

void FsdpUnit::post_forward(std::vector<Tensor>& outputs) {
  const bool recompute = autograd::in_backward();
  if (!recompute) --ctx->depth;
  bool hooked = false;
  if (GradMode::is_enabled()) {
    std::weak_ptr<FsdpUnit> self = weak_from_this();
    for (const Tensor& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      out.register_hook([self](const Tensor&) {
        if (auto u = self.lock()) u->pre_backward();
        return Tensor();
      });
      hooked = true;
    }
  }
  if (recompute) return;  // its backward follows at once
  if (!hooked || (options.reshard_after_forward && !outermost)) reshard(/*trainable_only=*/false);
}

// ---- fully_shard ------------------------------------------------------------------------------

namespace {

// The parameters `module` shards: its own and its submodules', except those a sharded
// submodule holds. A parameter held by any other unit is refused.
nn::NamedTensors params_to_shard(nn::Module& module, const std::string& label) {
  std::unordered_set<const TensorImpl*> inner;
  std::unordered_set<const nn::Module*> in_units;  // sharded submodules and what they hold
  for (const auto& m : module.modules()) {
    if (m.get() == &module) continue;
    if (auto u = unit_of(*m)) {
      for (const FlatGroup& g : u->groups) {
        for (const Tensor& p : g.params) inner.insert(p.impl());
      }
      for (const auto& sub : m->modules()) in_units.insert(sub.get());
    }
  }
  // A parameter a sharded submodule holds but another module of this one also uses as its own
  // (a tied weight: an LM head sharing the embedding's) would be read after that submodule's
  // forward released it; refused here, where the names are known, rather than failing there.
  for (const auto& [path, m] : module.named_modules()) {
    if (in_units.count(m.get()) != 0) continue;
    for (const auto& [name, p] : m->named_parameters(/*recurse=*/false)) {
      EMBER_CHECK(inner.count(p.impl()) == 0, "[", kOp, "] ", label, ": parameter '",
                  path.empty() ? name : path + "." + name,
                  "' is the same tensor as a parameter "
                  "of a sharded submodule (a weight tied across modules), which frees it after "
                  "its own forward: shard the module that holds both uses, or untie the weight");
    }
  }
  nn::NamedTensors out;
  for (auto& [name, p] : module.named_parameters()) {
    if (inner.count(p.impl()) != 0) continue;
    EMBER_CHECK(unit_holding(p) == nullptr, "[", kOp, "] ", label, ": parameter '", name,
                "' is already sharded by another module (a weight tied across sharded modules, "
                "or an enclosing module sharded first: shard submodules before their parents)");
    EMBER_CHECK_TYPE(NotImplementedError, p.is_cpu() || p.is_cuda(), "[", kOp, "] ", label,
                     ": parameter '", name, "' is on ", p.device().str(), "; fully_shard shards "
                     "parameters on the CPU or a CUDA device (docs/sharding.md)");
    if (!out.empty()) {
      const auto& [first, q] = out.front();
      EMBER_CHECK_TYPE(NotImplementedError, p.device() == q.device(), "[", kOp, "] ", label,
                       ": parameter '", name, "' is on ", p.device().str(), " but '", first,
                       "' is on ", q.device().str(), "; a sharded module's parameters must be "
                       "on one device (move the module with ->to(device) first)");
    }
    out.emplace_back(name, p);
  }
  return out;
}

// Fills the group's shard with this rank's elements of the flattened parameters, then makes each
// parameter a view of the arena (Note [FSDP arenas]).
void build_group(FlatGroup& g, int rank, int n, const std::string& label) {
  NoGradGuard no_grad;
  int64_t total = 0;
  for (const Tensor& p : g.params) {
    g.offsets.push_back(total);
    total += p.numel();
  }
  g.total = total;
  g.shard_size = (total + n - 1) / n;
  Tensor flat = zeros({g.shard_size * n}, TensorOptions(g.dtype).device(g.device));
  for (size_t i = 0; i < g.params.size(); ++i) {
    flat.narrow(0, g.offsets[i], g.params[i].numel()).copy_(g.params[i].detach().reshape({-1}));
  }
  g.shard = flat.narrow(0, rank * g.shard_size, g.shard_size).clone();
  const int64_t lo = rank * g.shard_size, hi = lo + g.shard_size;
  for (size_t i = 0; i < g.params.size(); ++i) {
    const int64_t off = g.offsets[i], numel = g.params[i].numel();
    const int64_t begin = std::clamp<int64_t>(lo - off, 0, numel);
    const int64_t end = std::clamp<int64_t>(hi - off, 0, numel);
    g.piece_begin.push_back(begin);
    g.piece_at.push_back(std::max<int64_t>(off + begin - lo, 0));
    Tensor piece;
    if (end > begin) {
      piece = g.shard.narrow(0, g.piece_at.back(), end - begin).detach();
      if (g.requires_grad) piece.requires_grad_();
    }
    g.pieces.push_back(piece);
  }
  const size_t elt = static_cast<size_t>(itemsize(g.compute_dtype));
  const size_t nbytes = static_cast<size_t>(g.shard_size * n) * elt;
  g.arena = make_fsdp_arena(g.device, nbytes, label);
  // The storage the parameters share owns the arena, so the memory outlives every view of it.
  auto storage = std::make_shared<Storage>(g.arena->data(), nbytes, g.device,
                                           [arena = g.arena](void*) {});
  g.full = from_blob(g.arena->data(), {g.shard_size * n},
                     TensorOptions(g.compute_dtype).device(g.device));
  for (size_t i = 0; i < g.params.size(); ++i) {
    Tensor& p = g.params[i];
    p.set_grad(Tensor());
    TensorImpl* impl = p.impl();
    impl->storage = storage;
    impl->offset = g.offsets[i];
    impl->dtype = g.compute_dtype;
    impl->strides = contiguous_strides(impl->sizes);
    impl->refresh();
  }
}

// The shard group and HSDP's replicate group (null: none) the options name.
std::pair<std::shared_ptr<ProcessGroup>, std::shared_ptr<ProcessGroup>> groups_of(
    const FullyShardOptions& o, const std::string& label) {
  std::shared_ptr<ProcessGroup> shard, replicate;
  if (o.mesh) {
    EMBER_CHECK(!o.group && !o.replicate_group, "[", kOp, "] ", label,
                ": pass either a mesh or "
                "groups (group, replicate_group), not both");
    const int nd = o.mesh->ndim();
    EMBER_CHECK(nd == 1 || nd == 2, "[", kOp, "] ", label,
                ": expected a 1-D mesh (FSDP) or a "
                "2-D mesh (HSDP: dimension 0 replicates, dimension 1 shards), got ",
                o.mesh->str());
    shard = o.mesh->get_group(nd - 1);
    if (nd == 2) replicate = o.mesh->get_group(0);
  } else {
    shard = o.group ? o.group : default_group();
    replicate = o.replicate_group;
  }
  EMBER_CHECK(shard != nullptr, "[", kOp, "] ", label,
              ": no process group (pass options.group or call init_process_group first)");
  // Nothing to average over one rank (a 1 x N mesh, or 1 x 1, whose two dimensions are both
  // the one-rank world's group).
  if (replicate && replicate->size() == 1) replicate = nullptr;
  EMBER_CHECK(replicate != shard, "[", kOp, "] ", label,
              ": the replicate group is the shard group; HSDP replicates over the ranks that "
              "hold the same shard (one per copy of the shard group)");
  return {shard, replicate};
}

// The first unit of a context fixes its replicate group; the others must name the same. Under
// HSDP every member of the replicate group must hold this rank's shard: the same place in a
// shard group of the same size. Checked once, collectively over the replicate group, so a
// replicate group across shard ranks (the whole world beside shard groups of 2, say) is refused
// on each of its ranks instead of averaging different shards. (A 2-D mesh passes whichever
// dimension its caller meant to shard: both layouts hold one shard per replicate group, as
// PyTorch, which takes the dimensions by position, also accepts.)
void join_context(FsdpContext& ctx, const std::shared_ptr<ProcessGroup>& replicate, Device device,
                  const std::string& label) {
  if (ctx.configured) {
    EMBER_CHECK(
        ctx.replicate == replicate, "[", kOp, "] ", label,
        ": modules sharded over one "
        "group must all replicate over the same group (or none): this one ",
        replicate ? "replicates over a group of " + std::to_string(replicate->size()) + " ranks"
                  : std::string("does not replicate"),
        ", an earlier one ",
        ctx.replicate ? "over a group of " + std::to_string(ctx.replicate->size()) + " ranks"
                      : std::string("does not"));
    return;
  }
  ctx.configured = true;
  ctx.replicate = replicate;
  if (!replicate) return;
  const int64_t me[2] = {ctx.group->rank(), ctx.group->size()};
  Tensor mine = from_vector(std::vector<int64_t>{me[0], me[1]}, {2}, device);
  Tensor all = empty({2 * replicate->size()}, TensorOptions(kInt64).device(device));
  replicate->allgather_into_tensor(all, mine)->wait();
  all = all.cpu();
  const int64_t* a = all.data<int64_t>();
  for (int r = 0; r < replicate->size(); ++r) {
    EMBER_CHECK(a[2 * r] == me[0] && a[2 * r + 1] == me[1], "[", kOp, "] ", label, ": rank ", r,
                " of the replicate group is rank ", a[2 * r], " of ", a[2 * r + 1],
                " in its shard group, but rank ", replicate->rank(), " is rank ", me[0], " of ",
                me[1],
                "; the ranks of a replicate group must hold the same shard (a 2-D mesh is "
                "(replicate, shard): dimension 0 replicates)");
  }
}

}  // namespace

}  // namespace detail

std::shared_ptr<nn::Module> fully_shard(std::shared_ptr<nn::Module> module,
                                        FullyShardOptions options) {
  using namespace detail;
  EMBER_CHECK(module != nullptr, "[", kOp, "] expected a module, got null");
  const std::string label = std::string(kOp) + "(" + module->name() + ")";
  EMBER_CHECK(unit_of(*module) == nullptr, "[", kOp, "] ", label, " is already sharded");
  const auto [pg, replicate] = groups_of(options, label);
  nn::NamedTensors params = params_to_shard(*module, label);
  EMBER_CHECK(!params.empty(), "[", kOp, "] ", label, " has no parameters of its own to shard "
              "(all are in sharded submodules); leave it unsharded");

  auto unit = std::make_shared<FsdpUnit>();
  unit->module = module;
  unit->label = label;
  unit->options = options;
  unit->group = pg;
  unit->ctx = context_for(pg);
  join_context(*unit->ctx, replicate, params.front().second.device(), label);
  unit->ctx->units.push_back(unit);
  const auto& mp = options.mp_policy;
  for (auto& [name, p] : params) {
    const bool rg = p.requires_grad();
    auto it = std::find_if(unit->groups.begin(), unit->groups.end(), [&](const FlatGroup& g) {
      return g.dtype == p.dtype() && g.requires_grad == rg;
    });
    if (it == unit->groups.end()) {
      FlatGroup g;
      g.dtype = p.dtype();
      g.requires_grad = rg;
      g.device = p.device();
      const bool floating = is_floating(p.dtype());
      g.compute_dtype = floating && mp.param_dtype ? *mp.param_dtype : p.dtype();
      g.reduce_dtype = floating && mp.reduce_dtype ? *mp.reduce_dtype : g.compute_dtype;
      unit->groups.push_back(std::move(g));
      it = std::prev(unit->groups.end());
    }
    it->params.push_back(p);
    it->names.push_back(name);
    if (rg) ++unit->trainable;
  }
  // Note [FSDP and the host cache]: the shards are made with nothing cached, and the unsharded
  // parameters' blocks are freed, not cached.
  const bool on_host = params.front().second.is_cpu();
  if (on_host) cpu_empty_cache();
  for (FlatGroup& g : unit->groups) {
    build_group(g, pg->rank(), pg->size(), label);
    g_sharded_bytes += g.shard.nbytes();
    g_full_bytes += static_cast<int64_t>(g.arena->nbytes());
  }
  if (on_host) cpu_empty_cache();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::erase_if(g_units, [](const auto& w) { return w.expired(); });
    g_units.push_back(unit);
    for (const FlatGroup& g : unit->groups) {
      for (const Tensor& p : g.params) g_params[p.impl()] = unit;
    }
  }
  std::weak_ptr<FsdpUnit> weak = unit;
  for (size_t gi = 0; gi < unit->groups.size(); ++gi) {
    FlatGroup& g = unit->groups[gi];
    if (!g.requires_grad) continue;
    g.used.assign(g.params.size(), 0);
    for (size_t i = 0; i < g.params.size(); ++i) {
      g.params[i].register_post_accumulate_grad_hook([weak, gi, i](const Tensor&) {
        if (auto u = weak.lock()) u->on_grad_ready(gi, i);
      });
    }
  }
  // The module's hooks own the unit: it lives as long as the module.
  module->register_forward_pre_hook(
      [unit](nn::Module&, std::vector<Tensor>& in) { unit->pre_forward(in); });
  module->register_forward_hook([unit](nn::Module&, const std::vector<Tensor>&,
                                       std::vector<Tensor>& out) { unit->post_forward(out); });
  return module;
}

bool is_fully_sharded(const nn::Module& module) { return detail::unit_of(module) != nullptr; }

FsdpMemoryStats fsdp_memory_stats() {
  using namespace detail;
  return {g_sharded_bytes.load(), g_unsharded_bytes.load(), g_peak_unsharded.load(),
          g_full_bytes.load()};
}

FsdpCommStats fsdp_comm_stats(const nn::Module& root) {
  std::unordered_set<const detail::FsdpContext*> seen;
  int64_t ns = 0;
  for (const auto& u : detail::units_under(root)) {
    if (seen.insert(u->ctx.get()).second) ns += u->ctx->wait_ns.load();
  }
  return {.wait_ms = static_cast<double>(ns) / 1e6};
}

std::vector<std::shared_ptr<ProcessGroup>> fsdp_process_groups(const nn::Module& root) {
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  for (const auto& u : detail::units_under(root)) {
    for (const auto& g : {u->group, u->ctx->replicate}) {
      if (g != nullptr && std::find(groups.begin(), groups.end(), g) == groups.end()) {
        groups.push_back(g);
      }
    }
  }
  return groups;
}

void reset_fsdp_peak_memory_stats() {
  detail::g_peak_unsharded.store(detail::g_unsharded_bytes.load());
}

}  // namespace ember::dist
