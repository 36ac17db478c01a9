// Pipeline parallelism for examples/gpt's model (gpt_model.h): the GPT cut into stages of whole
// blocks, the first stage with the embeddings in front, the last with the final LayerNorm and
// the tied head behind. Every part keeps the GPT's parameter names (wte.weight,
// blocks.<i>.qkv.weight, ...), so a checkpoint of the parts is one of the GPT, loadable at any
// other pipeline degree.
//
// The head is tied to the token embedding, which the first and the last stage both need: each
// holds its own copy of wte (equal at the start: every rank builds the same seeded GPT), and
// the two copies' gradients are summed across the pipeline before every update
// (sum_tied_embedding_grad), so the copies stay equal, as Megatron-LM does.
// Header-only beside gpt_model.h; needs ember_distributed.
#pragma once

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/dtensor/dtensor.h>
#include <ember/distributed/process_group.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/tensor_parallel/clip_grad.h>
#include <ember/distributed/tensor_parallel/parallelize.h>
#include <ember/nn/clip_grad.h>
#include <ember/tensor/ops/creation.h>
#include "examples/gpt_model.h"

namespace ember::examples {

/// Some of a GPT's blocks under their names in it ("<i>"): a part's "blocks" child.
class BlockSet : public nn::Module {
 public:
  BlockSet(const GPT& gpt, const std::vector<int64_t>& indices) {
    for (int64_t i : indices) blocks_.push_back(register_module(std::to_string(i), gpt.blocks.at(i)));
  }
  std::string name() const override { return "BlockSet"; }
  Tensor forward(const Tensor&) override {
    throw ValueError("[BlockSet] is a container; its GPTPart runs the blocks");
  }
  const std::vector<std::shared_ptr<Block>>& blocks() const { return blocks_; }

 private:
  std::vector<std::shared_ptr<Block>> blocks_;
};

/// Part of a GPT: the blocks `indices` in order, after the embeddings when `embed` (tokens in),
/// and before ln_f and the head when `head` (logits out). As a pipeline stage the blocks are a
/// contiguous run; as everything one rank holds (several stages of an interleaved schedule) it
/// is the root of that rank's checkpoint and optimizer. The modules are the GPT's own.
class GPTPart : public nn::Module {
 public:
  GPTPart(std::shared_ptr<GPT> gpt, const std::vector<int64_t>& indices, bool embed, bool head)
      : gpt_(std::move(gpt)), embed_(embed), head_(head) {
    auto child = [&](const std::string& name) {
      for (auto& [n, m] : gpt_->named_children()) {
        if (n == name) return register_module(name, m);
      }
      throw ValueError("[GPTPart] the GPT has no module '" + name + "'");
    };
    // The head's weight is wte's: a part with the head holds wte too (for its optimizer and
    // checkpoint), without using its lookup.
    if (embed || head) child("wte");
    if (embed) {
      child("wpe");
      child("drop");
    }
    blocks_ = register_module("blocks", std::make_shared<BlockSet>(*gpt_, indices));
    if (head) {
      child("ln_f");
      child("lm_head");
    }
  }
  std::string name() const override { return "GPTPart"; }

  /// tokens [B, T] (embed) or activations [B, T, C] -> activations, or logits (head)
  Tensor forward(const Tensor& input) override {
    Tensor x = embed_ ? gpt_->embed(input) : input;
    for (const auto& block : blocks_->blocks()) x = gpt_->run_block(block, x, is_training());
    return head_ ? gpt_->head(x) : x;
  }
  bool has_embedding() const { return embed_; }
  const std::vector<std::shared_ptr<Block>>& blocks() const { return blocks_->blocks(); }
  bool has_head() const { return head_; }
  /// The token embedding's weight (the head's too); undefined in a part with neither.
  Tensor tied_weight() const {
    for (const auto& [name, p] : named_parameters()) {
      if (name == "wte.weight") return p;
    }
    return {};
  }

 private:
  std::shared_ptr<GPT> gpt_;
  bool embed_, head_;
  std::shared_ptr<BlockSet> blocks_;
};

/// The blocks of stage `stage` of `num_stages` equal stages; throws ValueError naming both
/// numbers when the layers do not divide.
inline std::vector<int64_t> stage_blocks(const GPT& gpt, int stage, int num_stages) {
  const int64_t layers = gpt.config.layers;
  if (num_stages < 1 || layers % num_stages != 0) {
    throw ValueError("[gpt pipeline] " + std::to_string(layers) + " layers do not divide into " +
                     std::to_string(num_stages) + " stages of whole blocks");
  }
  std::vector<int64_t> out;
  const int64_t per = layers / num_stages;
  for (int64_t i = stage * per; i < (stage + 1) * per; ++i) out.push_back(i);
  return out;
}

/// Stage `stage` of `num_stages`.
inline std::shared_ptr<GPTPart> gpt_stage(const std::shared_ptr<GPT>& gpt, int stage, int num_stages) {
  return std::make_shared<GPTPart>(gpt, stage_blocks(*gpt, stage, num_stages), stage == 0,
                                   stage == num_stages - 1);
}

/// Everything the stages `stages` (this rank's) hold, as one module.
inline std::shared_ptr<GPTPart> gpt_stages(const std::shared_ptr<GPT>& gpt,
                                           const std::vector<int>& stages, int num_stages) {
  std::vector<int64_t> indices;
  bool embed = false, head = false;
  for (int s : stages) {
    for (int64_t i : stage_blocks(*gpt, s, num_stages)) indices.push_back(i);
    embed = embed || s == 0;
    head = head || s == num_stages - 1;
  }
  return std::make_shared<GPTPart>(gpt, indices, embed, head);
}

/// `plan` (gpt_tensor_parallel_plan's) without the entries naming modules `part` lacks (a middle
/// stage has no embeddings and no head), for parallelize_module on one stage.
inline dist::ParallelizePlan stage_plan(const GPTPart& part, const dist::ParallelizePlan& plan) {
  dist::ParallelizePlan out;
  for (const auto& e : plan) {
    bool present = e.path.rfind("blocks.", 0) == 0;
    for (const auto& [name, m] : part.named_children()) present = present || name == e.path;
    if (present) out.push_back(e);
  }
  return out;
}

/// Sums the tied embedding's gradient over the pipeline ranks `pp` (collective): the first
/// stage's rank holds the embedding's share, the last stage's the head's; a rank with neither
/// adds zeros. `part` is this rank's gpt_stages(); under tensor parallelism over `tp` ranks each
/// holds vocab / tp rows of it, the same rows at the same tensor-parallel rank of every stage.
inline void sum_tied_embedding_grad(const GPTPart& part, dist::ProcessGroup& pp, const GPTConfig& c,
                                    Device device, int64_t tp = 1) {
  const Tensor w = part.tied_weight();
  Tensor g = w.defined() && w.grad().defined()
                 ? w.grad()
                 : zeros({c.vocab / tp, c.dim}, TensorOptions(kFloat32).device(device));
  pp.allreduce(g)->wait();
  if (w.defined() && !w.grad().defined()) Tensor(w).set_grad(g);
}

namespace detail {
/// Scales the gradients of `params` by min(1, max_norm / (total + 1e-6)), total the square root
/// of `share`'s square (undefined: 0) summed over `group`; returns total.
inline Tensor clip_by_summed_norm(const std::vector<Tensor>& params, const Tensor& share,
                                  double max_norm, dist::ProcessGroup& group) {
  Tensor sq = share.defined() ? share.to(kCPU).pow(2.0).to(kFloat32) : zeros({}, TensorOptions(kFloat32));
  sq = sq.reshape({1}).to(group.default_device());
  group.allreduce(sq)->wait();
  const Tensor total = sq.to(kCPU).reshape({}).sqrt();
  nn::clip_grads_with_norm_(params, max_norm, total);
  return total;
}
}  // namespace detail

/// clip_grad_norm_ over a pipeline: the norm of the whole model's gradient, each rank adding
/// its parts' squares (the tied embedding counted on the first stage's rank only) and one
/// all-reduce over `pp` summing them; every gradient of `part` scaled by
/// min(1, max_norm / (norm + 1e-6)). Returns the norm, equal on every pipeline rank. With `tp`
/// (the stages laid out by parallelize_module over it) each rank's share is the norm over the
/// tensor-parallel ranks (dist::clip_grad_norm_'s: shards counted once each, replicas once).
inline Tensor clip_pipeline_grad_norm_(const GPTPart& part, double max_norm, dist::ProcessGroup& pp,
                                       const dist::DeviceMesh* tp = nullptr) {
  std::vector<Tensor> params = part.parameters(), counted;
  const Tensor tied = part.tied_weight();
  for (const Tensor& p : params) {
    if (!p.grad().defined()) continue;
    if (!part.has_embedding() && tied.defined() && p.is_same(tied)) continue;
    counted.push_back(p);
  }
  Tensor share;
  if (tp != nullptr) {
    // An infinite bound scales nothing: the norm alone, summed over the tp ranks.
    share = dist::clip_grad_norm_(counted, std::numeric_limits<double>::infinity(), *tp);
  } else if (!counted.empty()) {
    std::vector<Tensor> grads;
    for (const Tensor& p : counted) grads.push_back(p.grad());
    share = nn::get_total_norm(grads);
  }
  return detail::clip_by_summed_norm(params, share, max_norm, pp);
}

/// The two for stages fully_shard-ed over the dp ranks (one stage per rank, `part` the stage):
/// each rank holds a piece, elements [begin, end), of its stage's copy of the tied embedding,
/// at offsets that differ between the first and the last stage (their flat buffers hold other
/// parameters beside it). The pieces' gradients (already averaged over dp) are placed in a
/// whole-size buffer and summed over every rank of `world`: the first and the last stage's
/// pieces each tile it once, so the sum is the two copies' gradients added, and each rank takes
/// its piece of it back. Under HSDP every replica holds the same pieces: only the ranks with
/// `counted` (the first replica's) place theirs, so each piece is added once. Under tensor
/// parallelism over `tp` ranks each holds vocab / tp rows, the same rows at the same tp rank of
/// every stage: `world` is then the ranks at this rank's tp position.
inline void sum_tied_embedding_grad_sharded(const GPTPart& part, dist::ProcessGroup& world,
                                            const GPTConfig& c, Device device, bool counted,
                                            int64_t tp = 1) {
  Tensor whole = zeros({c.vocab / tp * c.dim}, TensorOptions(kFloat32).device(device));
  std::optional<dist::LocalShard> mine;
  for (auto& s : dist::local_shards(part)) {
    if (s.name == "wte.weight" && s.data.defined()) mine = s;
  }
  if (counted && mine && mine->data.grad().defined()) {
    whole.narrow(0, mine->begin, mine->end - mine->begin).copy_(mine->data.grad());
  }
  world.allreduce(whole)->wait();
  if (!mine) return;
  const Tensor sum = whole.narrow(0, mine->begin, mine->end - mine->begin);
  if (mine->data.grad().defined()) {
    mine->data.grad().copy_(sum);
  } else {
    mine->data.set_grad(sum.clone());
  }
}

/// clip over fully_shard-ed stages: every rank's pieces' squares (the last stage's piece of the
/// tied embedding left out) summed over `world`; under HSDP the first replica's only (`counted`).
/// With `tp` (the stages laid out over it before fully_shard) a piece of a parameter replicated
/// over the tp ranks is on each of them, so it counts 1 / tp on each.
inline Tensor clip_sharded_pipeline_grad_norm_(const GPTPart& part, double max_norm,
                                               dist::ProcessGroup& world, bool counted,
                                               const dist::ProcessGroup* tp = nullptr) {
  std::map<std::string, Tensor> by_name;
  for (const auto& [name, p] : part.named_parameters()) by_name[name] = p;
  std::vector<Tensor> params, once, on_every_tp_rank;  // the gradients, by how often they count
  for (const auto& s : dist::local_shards(part)) {
    if (!s.data.defined()) continue;
    params.push_back(s.data);
    if (!counted || !s.data.grad().defined()) continue;
    if (s.name == "wte.weight" && !part.has_embedding()) continue;
    const std::optional<dist::DTensor> d = dist::as_dtensor(by_name.at(s.name));
    const bool copied = tp != nullptr && !(d && d->placements()[0].is_shard());
    (copied ? on_every_tp_rank : once).push_back(s.data.grad());
  }
  auto square = [](const std::vector<Tensor>& gs) {
    return gs.empty() ? 0.0 : std::pow(nn::get_total_norm(gs).item<double>(), 2);
  };
  double sq = square(once);
  if (tp != nullptr) sq += square(on_every_tp_rank) / static_cast<double>(tp->size());
  return detail::clip_by_summed_norm(params, full({}, std::sqrt(sq), TensorOptions(kFloat32)),
                                     max_norm, world);
}

}  // namespace ember::examples
