// How examples/gpt lays its model out over the ranks: the (pp, dp, tp) mesh, DDP, ZeRO,
// fully_shard, tensor parallelism and pipeline stages, the optimizer's decay groups and the lr
// schedule. Only examples/gpt.cpp includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ember/distributed/environment.h>
#include <ember/distributed/mesh/device_mesh.h>
#include <ember/distributed/pipelining/pipeline.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/distributed/sharding/zero_hook.h>
#include <ember/distributed/tensor_parallel/context_parallel.h>
#include <ember/distributed/tensor_parallel/expert_parallel.h>
#include <ember/nn/functional.h>
#include <ember/nn/optim/lr_scheduler.h>
#include "examples/gpt_args.h"
#include "examples/gpt_model.h"
#include "examples/gpt_parallel.h"
#include "examples/gpt_pipeline.h"

namespace ember::examples::gpt {

namespace pipelining = ember::dist::pipelining;

inline constexpr int64_t kWarmupSteps = 50;

// The next-token loss over the vocabulary (a pipeline's last stage scores with it too).
inline Tensor lm_loss(const Tensor& logits, const Tensor& y) {
  return nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

// The lr schedule: linear warm-up over the first 50 steps (from a 50th of the peak), then a
// cosine from the peak down to a tenth of it at the last step (PyTorch's SequentialLR of LinearLR
// and CosineAnnealingLR).
inline nn::optim::SequentialLR make_schedule(nn::optim::Optimizer& opt, double peak_lr, int64_t steps) {
  using namespace nn::optim;
  const int64_t warmup = std::min(kWarmupSteps, steps);
  auto ramp = std::make_shared<LinearLR>(opt, 1.0 / static_cast<double>(warmup), 1.0,
                                         std::max<int64_t>(1, warmup - 1));
  auto decay = std::make_shared<CosineAnnealingLR>(opt, std::max<int64_t>(1, steps - warmup),
                                                   0.1 * peak_lr);
  return SequentialLR(opt, {ramp, decay}, {warmup});
}

// AdamW with weight decay on the matrices (2-D weights: Linear weights and the embeddings) and
// none on biases and LayerNorm parameters.
inline std::vector<nn::optim::ParamGroup> decay_groups(std::vector<Tensor> decay,
                                                std::vector<Tensor> no_decay) {
  return {nn::optim::ParamGroup(std::move(decay), {{"weight_decay", 0.1}}),
          nn::optim::ParamGroup(std::move(no_decay), {{"weight_decay", 0.0}})};
}
inline std::vector<nn::optim::ParamGroup> decay_groups(const std::vector<Tensor>& params) {
  std::vector<Tensor> decay, no_decay;
  for (const Tensor& p : params) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  return decay_groups(std::move(decay), std::move(no_decay));
}

// The same over this rank's pieces of a fully_shard-ed model: the pieces are 1-D, so the full
// parameter's shape decides the group.
inline std::vector<nn::optim::ParamGroup> sharded_decay_groups(const nn::Module& root) {
  std::vector<Tensor> decay, no_decay;
  for (const auto& s : dist::local_shards(root)) {
    if (s.data.defined()) (s.shape.size() >= 2 ? decay : no_decay).push_back(s.data);
  }
  return decay_groups(std::move(decay), std::move(no_decay));
}

inline nn::optim::AdamWOptions adamw_options(const Args& a) {
  return {.lr = a.lr,
          .betas = {0.9, 0.95},
          .eps = 1e-8,
          .weight_decay = 0.1,
          .capturable = a.cuda_graph};
}

// --tp: the ranks as a (dp, tp) mesh. Each row of tp ranks holds one model, laid out by
// gpt_tensor_parallel_plan (with sequence and loss parallelism); DDP, ZeRO or FSDP work across
// the rows, over the dp group. Without --tp the mesh is (world, 1) and dp is the world.
// --pp: the ranks as a (pp, dp) mesh, or (pp, dp, tp) with --tp: each column of pp ranks runs
// one model's stages (the pipeline ranks outermost, so that with ranks numbered node by node a
// pipeline crosses the nodes, and tensor parallelism, the most talkative, innermost); DDP works
// across the columns, over the dp group.
// --shard hsdp: the dp dimension split in two, (replicate, shard), the shard ranks inside a node
// (next to tp's): (replicate, shard), (replicate, shard, tp), (pp, replicate, shard) and so on.
// --cp: a cp dimension inside dp (or shard), outside tp; FSDP shards over dp and cp together (each
// cp rank holds the whole model's work for its tokens), on a second mesh in which the two are one
// dimension: (dp x cp, tp), (replicate, shard x cp[, tp]).
struct MeshLayout {
  MeshLayout(const RunContext& run, const Args& a) {
    const int64_t tp = a.tp, pp = a.pp, cp = a.cp;
    const bool hsdp = a.shard == "hsdp";
    same_tp = run.pg;
    if (tp <= 1 && pp <= 1 && cp <= 1 && !hsdp) {
      dp = grads = run.pg;
      return;
    }
    std::vector<std::string> flags;  // the flags that split the world, for the messages
    for (auto [n, flag] : {std::pair{pp, "--pp"}, std::pair{cp, "--cp"}, std::pair{tp, "--tp"}}) {
      if (n <= 1) continue;
      flags.push_back(std::string(flag) + " " + std::to_string(n));
      if (run.world % n != 0) {
        throw ember::ValueError("gpt: " + flags.back() + " must divide the world size " +
                                std::to_string(run.world));
      }
    }
    if (run.world % (pp * cp * tp) != 0) {
      std::string all;
      for (const std::string& f : flags) all += (all.empty() ? "" : " x ") + f;
      throw ember::ValueError("gpt: " + all + " must divide the world size " +
                              std::to_string(run.world));
    }
    const int64_t n_dp = run.world / (pp * cp * tp);
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    auto dim = [&](int64_t size, const char* name) {
      shape.push_back(size);
      names.emplace_back(name);
    };
    if (pp > 1) dim(pp, "pp");
    if (hsdp) {
      const int64_t n = hsdp_shard_size(a, *run.pg, run.device, n_dp);
      dim(n_dp / n, "replicate");
      dim(n, "shard");
    } else {
      dim(n_dp, "dp");
    }
    if (cp > 1) dim(cp, "cp");
    if (tp > 1) dim(tp, "tp");
    mesh = dist::init_device_mesh(run.device.is_cpu() ? "cpu" : "cuda", shape, names);
    if (pp > 1) pp_group = mesh->get_group("pp");
    if (tp > 1) tp_mesh = (*mesh)["tp"];
    if (hsdp) {
      hsdp_mesh = mesh->slice({"replicate", "shard"});
      // The data-parallel ranks, for the data: every rank when there is no other dimension,
      // else one group per (pp, tp) position (collective).
      dp = tp <= 1 && pp <= 1 && cp <= 1 ? run.pg : hsdp_mesh->flatten("dp")->get_group();
      first_replica = hsdp_mesh->get_local_rank("replicate") == 0;
    } else {
      dp = mesh->get_group("dp");
    }
    grads = dp;
    if (cp > 1) {
      cp_group = mesh->get_group("cp");
      // Every rank's gradient is of its own tokens: DDP averages over the (dp, cp) ranks at this
      // rank's tp position (collective), every rank without --tp.
      if (hsdp || (tp > 1 && a.shard == "fsdp")) {
        // The same ranks in the same order with cp merged into the dimension before it (cp
        // follows it in the row-major layout), so that fully_shard and the 2-D norm see one
        // data-parallel dimension (collective).
        std::vector<int64_t> merged_shape;
        std::vector<std::string> merged_names;
        for (size_t i = 0; i < names.size(); ++i) {
          if (names[i] == "cp") {
            merged_shape.back() *= cp;
            continue;
          }
          merged_shape.push_back(shape[i]);
          merged_names.push_back(names[i]);
        }
        shard_mesh = dist::init_device_mesh(run.device.is_cpu() ? "cpu" : "cuda", merged_shape,
                                            merged_names);
        if (hsdp) hsdp_mesh = shard_mesh->slice({"replicate", "shard"});
      }
      grads = hsdp                 ? hsdp_mesh->flatten("dp_cp")->get_group()  // fully_shard's
              : tp <= 1 && pp <= 1 ? run.pg
              : shard_mesh         ? shard_mesh->get_group("dp")
                                   : mesh->slice({"dp", "cp"})->flatten("dp_cp")->get_group();
    }
    if (tp > 1 && pp > 1 && (hsdp || a.shard == "fsdp")) {
      // The ranks at this rank's tp position, which hold the same rows of the tied embedding in
      // every stage (collective).
      names.pop_back();
      same_tp = mesh->slice(names)->flatten("same_tp")->get_group();
    }
  }

  /// fully_shard's options over the data-parallel ranks: the dp group (with --cp every rank),
  /// or under --shard hsdp the (replicate, shard) mesh.
  dist::FullyShardOptions shard_options() const {
    if (hsdp_mesh) return {.mesh = hsdp_mesh};
    return {.group = grads};  // --cp: every rank (each holds the whole model's other tokens)
  }
  /// The (dp, tp) mesh clip_grad_norm_ sums a fully_shard-ed, tensor-parallel model's norm over;
  /// under hsdp the shard ranks stand for dp (the replicas hold the same pieces).
  std::shared_ptr<dist::DeviceMesh> shard_tp_mesh() const {
    return (shard_mesh ? shard_mesh : mesh)->slice({hsdp_mesh ? "shard" : "dp", "tp"});
  }

  std::shared_ptr<dist::DeviceMesh> mesh;             // null without --tp, --pp or hsdp
  std::shared_ptr<dist::DeviceMesh> tp_mesh;          // null without --tp
  std::shared_ptr<dist::DeviceMesh> hsdp_mesh;        // (replicate, shard): --shard hsdp only
  // --cp with --shard hsdp, or fsdp with --tp: `mesh` with cp merged into dp (or shard).
  std::shared_ptr<dist::DeviceMesh> shard_mesh;
  std::shared_ptr<dist::ProcessGroup> dp;             // the data-parallel ranks (the data's)
  std::shared_ptr<dist::ProcessGroup> grads;          // the ranks DDP and ZeRO average over
  std::shared_ptr<dist::ProcessGroup> cp_group;       // --cp: a sequence's ranks (else null)
  std::shared_ptr<dist::ProcessGroup> pp_group;       // null without --pp
  // --pp with --shard fsdp|hsdp: the ranks at this rank's tp position (every rank without --tp).
  std::shared_ptr<dist::ProcessGroup> same_tp;
  // Under HSDP, whether this rank is in the first copy of the shards (the one whose pieces stand
  // for all copies where the copies are summed); true otherwise.
  bool first_replica = true;

 private:
  // --shard hsdp: the shard group's size, --hsdp-shard or the node's data-parallel ranks (its
  // ranks over --tp and --cp, at most the n_dp there are), so that gathers and reduce-scatters
  // (over shard x cp ranks with --cp) stay inside a node and only each shard's gradient
  // all-reduce crosses nodes. Collective over the world.
  static int64_t hsdp_shard_size(const Args& a, dist::ProcessGroup& world, ember::Device device,
                                 int64_t n_dp) {
    const int64_t n =
        a.hsdp_shard > 0
            ? a.hsdp_shard
            : std::clamp<int64_t>(dist::local_world_size().value_or(world.size()) / (a.tp * a.cp),
                                  1, n_dp);
    // Every rank must lay out the same mesh: nodes reporting other numbers of local ranks would
    // make groups that do not match (one small all-reduce of [n, -n] with max gives both bounds).
    Tensor bounds = from_vector(std::vector<int64_t>{n, -n}, {2}, device);
    world.allreduce(bounds, {.op = dist::ReduceOp::Max})->wait();
    const std::vector<int64_t> b = bounds.cpu().to_vector<int64_t>();
    if (b[0] != -b[1]) {
      throw ember::ValueError("gpt: --shard hsdp needs the same shard size on every rank, got " +
                              std::to_string(-b[1]) + " to " + std::to_string(b[0]) +
                              " (the nodes' LOCAL_WORLD_SIZE differ: pass --hsdp-shard)");
    }
    if (n_dp % n != 0) {
      throw ember::ValueError("gpt: --shard hsdp shards over " + std::to_string(n) +
                              " ranks (--hsdp-shard, else the node's), which must divide the " +
                              std::to_string(n_dp) + " data-parallel ranks (the world size " +
                              std::to_string(world.size()) + " over --tp, --pp and --cp)");
    }
    return n;
  }
};

// --shard: where the model's state lives. none: DDP, every rank holds everything; zero: DDP and
// a ZeroRedundancyOptimizer (each rank holds 1/N of AdamW's moments); fsdp: every block and the
// root fully_shard-ed (parameters, gradients and moments 1/N per rank); hsdp: the same within
// each node (1/ranks per node), replicated across nodes.
// --pp: this rank's stages, DDP around each over the dp ranks (when there are several), and
// the schedule that runs them.
struct Pipeline {
  std::shared_ptr<GPTPart> part;  // everything this rank's stages hold, as one module
  std::vector<std::shared_ptr<dist::DistributedDataParallel>> ddp;
  std::unique_ptr<pipelining::PipelineSchedule> schedule;
  bool first = false, last = false;  // this rank runs stage 0, the last stage
  bool sharded = false;              // --shard fsdp|hsdp: the stages are fully_shard-ed
  int last_rank = 0;                 // the pipeline rank with the last stage
};

struct Parallel {
  std::shared_ptr<dist::DistributedDataParallel> ddp;   // none, zero (without --pp)
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;  // zero
  std::unique_ptr<nn::optim::AdamW> adamw;              // none, fsdp
  std::unique_ptr<Pipeline> pipe;                       // --pp
  std::shared_ptr<dist::DeviceMesh> ep_mesh;            // --ep: the ranks the experts span
  /// The optimizer LR schedules and the grad scaler drive (zero: this rank's local one).
  nn::optim::Optimizer& optimizer() { return zero ? zero->optimizer() : *adamw; }
};

// --shard zero: AdamW (decay groups) over `params`, its state split over `pg`'s ranks;
// `overlap`: stepped inside DDP's hook (--zero-overlap).
inline std::unique_ptr<dist::ZeroRedundancyOptimizer> make_zero(
    const Args& a, const std::vector<Tensor>& params,
    const std::shared_ptr<dist::ProcessGroup>& pg, bool overlap) {
  return std::make_unique<dist::ZeroRedundancyOptimizer>(
      decay_groups(params),
      [o = adamw_options(a)](std::vector<nn::optim::ParamGroup> g) {
        return std::make_unique<nn::optim::AdamW>(std::move(g), o);
      },
      pg, dist::ZeroOptions{.overlap_with_ddp = overlap});
}

// --pp: this rank's stages of `model` (every rank built the whole, seeded model; each keeps its
// stages' modules), each laid out over the tp ranks with --tp and in DDP over `grads` (the dp
// ranks, with --cp the dp and cp ranks) when it has several ranks, run by --schedule.
inline std::unique_ptr<Pipeline> make_pipeline(const Args& a, const std::shared_ptr<GPT>& model,
                                        const MeshLayout& layout, ember::Device device) {
  auto pipe = std::make_unique<Pipeline>();
  const pipelining::ScheduleKind kind = pipelining::parse_schedule(a.schedule);
  const int p = static_cast<int>(a.pp), S = p * pipelining::default_stages_per_rank(kind);
  const int rank = layout.pp_group->rank();
  std::vector<std::shared_ptr<pipelining::PipelineStage>> stages;
  std::vector<int> mine;
  std::vector<std::shared_ptr<GPTPart>> parts;  // the stages' modules (inside DDP or not)
  for (int s = 0; s < S; ++s) {
    if (pipelining::stage_rank(kind, s, S, p) != rank) continue;
    mine.push_back(s);
    std::shared_ptr<GPTPart> part = parts.emplace_back(gpt_stage(model, s, S));
    if (layout.tp_mesh) {
      // Sequence parallel, the logits whole (the pipeline merges plain tensors).
      dist::parallelize_module(part, layout.tp_mesh,
                               stage_plan(*part, gpt_tensor_parallel_plan(
                                                     /*sequence_parallel=*/true,
                                                     /*loss_parallel=*/false, a.tp_overlap)));
    }
    std::shared_ptr<nn::Module> m = part;
    if (a.shard == "fsdp" || a.shard == "hsdp") {  // each block, then the stage
      for (const auto& block : part->blocks()) dist::fully_shard(block, layout.shard_options());
      dist::fully_shard(part, layout.shard_options());
      pipe->sharded = true;
    } else if (layout.grads->size() > 1) {
      pipe->ddp.push_back(std::make_shared<dist::DistributedDataParallel>(m, layout.grads));
      m = pipe->ddp.back();
    }
    stages.push_back(std::make_shared<pipelining::PipelineStage>(m, s, S, device, layout.pp_group));
  }
  // One stage: the stage itself (fully_shard's root, for the optimizer and the checkpoint).
  pipe->part = parts.size() == 1 ? parts[0] : gpt_stages(model, mine, S);
  pipe->first = pipe->part->has_embedding();
  pipe->last = pipe->part->has_head();
  pipe->last_rank = pipelining::stage_rank(kind, S - 1, S, p);
  pipe->schedule = std::make_unique<pipelining::PipelineSchedule>(
      stages, static_cast<int>(a.microbatches), kind,
      pipelining::ScheduleOptions{.loss_fn = lm_loss});
  return pipe;
}

inline Parallel make_parallel(const Args& a, const std::shared_ptr<GPT>& model,
                       const MeshLayout& layout, ember::Device device) {
  Parallel p;
  const std::shared_ptr<dist::ProcessGroup>& pg = layout.grads;
  if (a.pp > 1) {
    p.pipe = make_pipeline(a, model, layout, device);
    if (a.shard == "zero") {  // AdamW's state of this rank's stages split over the dp ranks
      p.zero = make_zero(a, p.pipe->part->parameters(), pg, /*overlap=*/false);
    } else if (a.shard == "fsdp" || a.shard == "hsdp") {
      p.adamw = std::make_unique<nn::optim::AdamW>(sharded_decay_groups(*p.pipe->part),
                                                   adamw_options(a));
    } else {
      p.adamw = std::make_unique<nn::optim::AdamW>(decay_groups(p.pipe->part->parameters()),
                                                   adamw_options(a));
    }
    return p;
  }
  if (a.shard == "fsdp" || a.shard == "hsdp") {
    const dist::FullyShardOptions o = layout.shard_options();
    for (const auto& block : model->blocks) dist::fully_shard(block, o);
    dist::fully_shard(model, o);
    p.adamw = std::make_unique<nn::optim::AdamW>(sharded_decay_groups(*model), adamw_options(a));
    return p;
  }
  if (a.cuda_graph && pg->size() == 1) {  // nothing to reduce
    p.adamw =
        std::make_unique<nn::optim::AdamW>(decay_groups(model->parameters()), adamw_options(a));
    return p;
  }
  // Across ranks the capture holds DDP's NCCL collectives (Note [NCCL in a CUDA graph]); gloo's
  // and MPI's stage through the host, which a capture cannot hold.
  EMBER_CHECK(!a.cuda_graph || pg->backend_name() == "nccl", "--cuda-graph across ", pg->size(),
              " ranks needs --backend nccl, got ", pg->backend_name(),
              " (docs/tensor.md, CUDA graphs)");
  dist::DDPOptions ddp_options;
  if (a.ep) {  // every block's experts split over the ranks; DDP averages the rest
    EMBER_CHECK(a.experts % pg->size() == 0, "--ep: the ", pg->size(),
                " ranks must divide --experts ", a.experts);
    for (const auto& block : model->blocks) dist::parallelize_experts(block->moe(), pg);
    ddp_options.ignored_parameters = dist::expert_parameter_names(*model);
    p.ep_mesh = dist::DeviceMesh::from_group({pg}, device.is_cuda() ? "cuda" : "cpu");
  }
  p.ddp = std::make_shared<dist::DistributedDataParallel>(model, layout.grads, ddp_options);
  if (a.shard == "zero") {
    p.zero = make_zero(a, p.ddp->parameters(), layout.grads, a.zero_overlap);
    // Each bucket's partition is stepped as soon as the bucket is reduced, during backward.
    if (a.zero_overlap) {
      p.ddp->register_comm_hook(dist::hook_with_zero_step(dist::allreduce_hook, *p.ddp, *p.zero));
    }
  } else {
    p.adamw = std::make_unique<nn::optim::AdamW>(decay_groups(p.ddp->parameters()),
                                                 adamw_options(a));
  }
  return p;
}


// The model laid out over the tensor-parallel ranks (--tp), or as it is.
inline std::shared_ptr<GPT> tensor_parallel(std::shared_ptr<GPT> model, const MeshLayout& layout,
                                     int64_t overlap_chunks) {
  if (layout.tp_mesh) {
    dist::parallelize_module(model, layout.tp_mesh,
                             gpt_tensor_parallel_plan(/*sequence_parallel=*/true,
                                                      /*loss_parallel=*/true, overlap_chunks));
  }
  return model;
}

// --cp: every block attends through context_parallel_attention over the sequence's ranks, and the
// embedding places this rank's tokens at their chunks' positions (load-balanced, as Trainer::local
// splits the batch).
inline std::shared_ptr<GPT> context_parallel(std::shared_ptr<GPT> model, const MeshLayout& layout,
                                             const Args& a, ember::Device device) {
  if (!layout.cp_group) return model;
  std::shared_ptr<dist::ProcessGroup> cp = layout.cp_group;
  const dist::ContextParallelOptions options{
      .rotate = a.cp_rotate == "ring" ? dist::ContextParallelRotate::Ring
                                      : dist::ContextParallelRotate::AllGather};
  model->set_context_parallel(
      [cp, options](const Tensor& q, const Tensor& k, const Tensor& v) {
        return dist::context_parallel_attention(q, k, v, cp, options);
      },
      dist::context_parallel_shard(ember::arange(0, a.context, 1, {ember::kInt64}), 0, cp->rank(),
                                   cp->size())
          .to(device));
  return model;
}

inline std::shared_ptr<GPT> seeded_model(const Args& a, ember::Device device) {
  ember::manual_seed(a.seed);  // the same weights on every rank (DDP broadcasts rank 0's anyway)
  auto model = std::make_shared<GPT>(GPTConfig{.vocab = a.vocab,
                                               .layers = a.layers,
                                               .heads = a.heads,
                                               .dim = a.dim,
                                               .context = a.positions > 0 ? a.positions : a.context,
                                               .dropout = a.dropout,
                                               .checkpoint_activations = a.checkpoint_activations,
                                               .experts = a.experts,
                                               .top_k = a.top_k});
  if (!a.init_from_hf.empty()) {  // every rank reads the same weights
    model->load_state_dict(from_gpt2_tensors(nn::load_hf_checkpoint(a.init_from_hf).tensors));
  }
  model->to(device);
  return model;
}

}  // namespace ember::examples::gpt
