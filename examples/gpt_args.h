// examples/gpt's command line: its settings (Args), its options, and the combinations it
// refuses before any process group forms. Only examples/gpt.cpp includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <ember/distributed/pipelining/schedule.h>
#include <ember/nn/data/token_stream.h>
#include <ember/tensor/gpu/cuda.h>
#include "examples/example_util.h"
#include "examples/gpt_model.h"

namespace ember::examples::gpt {

namespace pipelining = ember::dist::pipelining;

/// --data's name for uniformly random tokens (nn::data::prepare_synthetic_token_file).
inline constexpr const char* kSyntheticData = "synthetic";
/// GPT-2's vocabulary of 50257 padded to a multiple of 128 (llm.c's padded_vocab_size): --vocab's
/// default for llm.c's token files, which hold GPT-2 tokens.
inline constexpr int64_t kGpt2PaddedVocab = 50304;

struct Args {
  std::string data = nn::data::kKjvBible;
  std::string cache_dir;  // empty: $XDG_CACHE_HOME/ember, else ~/.cache/ember
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t dim = 128;
  int64_t context = 128;
  int64_t vocab = kByteVocab;  // the model's; --init-from-hf takes its config's, else default_vocab
  int64_t positions = 0;       // the model's longest sequence (0: --context)
  int64_t batch_size = 16;
  int64_t steps = 1000;
  double lr = 1e-3;
  double grad_clip = 1.0;  // 0: no clipping
  double dropout = 0;
  uint64_t seed = 0;
  std::string amp = "off";
  bool checkpoint_activations = false;
  bool cuda_graph = false;  // capture the step once, replay it (Note [CUDA graphs])
  std::string backend = "gloo";
  std::string device = "cpu";
  std::string comm_hook = "none";
  std::vector<std::string> comm_hook_plugins;
  std::string shard = "none";  // none (DDP), zero (DDP + ZeroRedundancyOptimizer), fsdp, hsdp
  int64_t hsdp_shard = 0;      // --shard hsdp: ranks per shard group (0: the node's)
  int64_t tp = 1;              // tensor-parallel ranks; the others are data parallel
  int64_t tp_overlap = 1;      // --tp's collectives fused with their matmuls in this many pieces
  bool zero_overlap = false;   // --shard zero: step inside DDP's hook (overlap_with_ddp)
  int64_t pp = 1;              // pipeline stages' ranks; each rank runs its stages of the model
  int64_t cp = 1;              // context-parallel ranks: each holds a part of every sequence
  std::string cp_rotate = "allgather";  // --cp: keys and values all-gathered, or round a ring
  int64_t experts = 0;                  // > 0: each block's MLP a mixture of this many experts
  int64_t top_k = 2;                    // --experts: experts per token
  bool ep = false;                      // --experts: shard the experts over every rank
  double aux_loss = 0.01;               // --experts: the balance loss's weight in the training loss
  int64_t microbatches = 4;    // --pp: micro-batches per step
  std::string schedule = "1f1b";  // --pp: gpipe, 1f1b, interleaved-1f1b or zero-bubble
  int64_t warmup_steps = 0;       // this run's first steps, left out of tokens_per_s
  double peak_tflops = 0;         // one rank's dense peak in the precision trained (0: unknown)
  bool allow_tf32 = false;        // float32 matmuls on CUDA may use TF32 tensor cores
  int64_t eval_every = 100;  // 0: only at the end
  int64_t eval_batches = 8;
  int64_t log_every = 0;     // 0: twenty progress lines per run
  std::string metrics;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // 0: at each evaluation
  bool async_checkpoint = false;
  bool resume = false;
  std::string save_weights;
  std::string init_from_hf;  // a GPT-2 model in Hugging Face's layout to start from
  std::string export_hf;     // where to write the final model in that layout
  int64_t sample = 0;
  double temperature = 0;  // 0: greedy
  std::string prompt = "In the beginning";
  int timeout_s = 0;
  bool continue_on_nan = false;  // keep training when a step's loss is not finite
  int64_t stop_at_step = 0;  // testing aid: stop (as if interrupted) after this step
  int64_t hang_at_step = -1;  // testing aid: SIGSTOP rank 1 at this step, first run only
  int64_t fail_at_step = -1;  // testing aid: SIGKILL rank 1 at this step, first run only
};

// Whether --data names tokens in llm.c's format (GPT-2 tokens), not bytes.
inline bool llmc_data(const std::string& data) {
  return data == kSyntheticData || nn::data::is_llmc_token_file(data);
}

// --vocab's default: GPT-2's padded vocabulary for llm.c's token files, else one per byte.
inline int64_t default_vocab(const std::string& data) {
  return llmc_data(data) ? kGpt2PaddedVocab : kByteVocab;
}

// One GPU's dense peak TFLOPS in the precision the run trains in, looked up by the device's
// name (SXM parts, as docs/quickstart.md's table); 0 (unknown) for a PCIe or NVL part, another
// GPU, or the CPU.
inline double table_peak_tflops(const Args& a, const Device& device) {
  if (!device.is_cuda()) return 0;
  const std::string name = cuda::get_device_name(device.index);
  if (name.find("PCIe") != std::string::npos || name.find("NVL") != std::string::npos) return 0;
  struct Peak {
    const char* part;
    double low, tf32, fp32;  // bf16/fp16, float32 on TF32, float32
  };
  for (const Peak& p : {Peak{"H100", 989.4, 494.7, 67}, Peak{"H200", 989.4, 494.7, 67},
                        Peak{"A100", 312, 156, 19.5}}) {
    if (name.find(p.part) != std::string::npos) {
      return a.amp != "off" ? p.low : a.allow_tf32 ? p.tf32 : p.fp32;
    }
  }
  return 0;
}

// float16 autocast is CUDA's (on the CPU PyTorch disables it and Ember's guard refuses it).
inline std::string unavailable(const Args& a) {
  if (a.amp == "fp16" && a.device.rfind("cuda", 0) != 0) {
    return "--amp fp16 needs --device cuda (on the CPU use --amp bf16)";
  }
  if (a.shard != "none" && (a.comm_hook != "none" || a.amp == "fp16")) {
    return "--shard " + a.shard + " takes neither --comm-hook nor --amp fp16 (got --comm-hook " +
           a.comm_hook + ", --amp " + a.amp + ")";
  }
  if (a.cp > 1 && (a.cuda_graph || a.dropout > 0)) {
    return "--cp takes neither --cuda-graph nor --dropout (attention dropout) yet "
           "(docs/tensor_parallel.md, context parallelism)";
  }
  if (a.cp > 1 && a.context % (2 * a.cp) != 0) {
    return "--cp " + std::to_string(a.cp) + " needs a --context that divides into " +
           std::to_string(2 * a.cp) + " chunks (two per rank, load-balanced), got " +
           std::to_string(a.context);
  }
  if (a.tp > 1 && (!a.save_weights.empty() || a.sample > 0 || !a.export_hf.empty())) {
    return "--tp takes neither --save-weights, --export-hf nor --sample yet: write a checkpoint "
           "(--checkpoint-dir) and continue or sample from it without --tp "
           "(docs/tensor_parallel.md)";
  }
  if (a.pp > 1 && (a.shard == "fsdp" || a.shard == "hsdp") && a.schedule != "gpipe" &&
      a.schedule != "1f1b") {
    return "--pp with --shard " + a.shard + " takes one stage per rank yet (--schedule gpipe or " +
           "1f1b, got " + a.schedule + ")";
  }
  if (a.pp > 1 && (a.amp != "off" || a.comm_hook != "none")) {
    return "--pp runs in float32 with DDP's plain all-reduce only yet (got --amp " + a.amp +
           ", --comm-hook " + a.comm_hook + ")";
  }
  if (a.pp > 1 && (!a.save_weights.empty() || a.sample > 0 || !a.export_hf.empty())) {
    return "--pp takes neither --save-weights, --export-hf nor --sample yet: write a checkpoint "
           "(--checkpoint-dir) and continue or sample from it without --pp "
           "(docs/pipeline_parallel.md)";
  }
  if (a.sample > 0 && llmc_data(a.data)) {
    // The prompt goes in as bytes and the sample comes out as bytes: there is no GPT-2
    // tokenizer here.
    return "--sample writes bytes, so it needs byte-level data (got --data " + a.data +
           ", llm.c's tokens)";
  }
  if (a.experts > 0 && (a.tp > 1 || a.pp > 1 || a.cp > 1 || a.cuda_graph ||
                        !a.init_from_hf.empty() || !a.export_hf.empty())) {
    return "--experts takes none of --tp, --pp, --cp, --cuda-graph, --init-from-hf and "
           "--export-hf yet (docs/tensor_parallel.md, expert parallelism)";
  }
  if (a.ep && (a.experts == 0 || a.shard != "none" || a.sample > 0 || !a.save_weights.empty())) {
    return "--ep shards --experts over the ranks under DDP: it needs --experts and takes neither "
           "--shard, --sample nor --save-weights yet (write a checkpoint and sample from it "
           "without --ep)";
  }
  if (a.hsdp_shard != 0 && a.shard != "hsdp") {
    return "--hsdp-shard needs --shard hsdp (got --shard " + a.shard + ")";
  }
  if (a.zero_overlap && a.shard != "zero") {
    return "--zero-overlap needs --shard zero (got --shard " + a.shard + ")";
  }
  if (a.cuda_graph && (a.device.rfind("cuda", 0) != 0 || a.tp > 1 || a.pp > 1 ||
                       a.shard != "none" || a.comm_hook != "none" || a.checkpoint_activations)) {
    return "--cuda-graph captures a plain step on a GPU yet: it needs --device cuda and takes no "
           "--tp, --pp, --shard, --comm-hook or --checkpoint-activations (docs/tensor.md, CUDA "
           "graphs)";
  }
  if (a.zero_overlap && a.grad_clip > 0) {
    // The update happens inside backward, before any norm over all gradients exists.
    return "--zero-overlap steps during backward, so it cannot clip gradients: pass --grad-clip 0";
  }
  return "";
}

// The model's shape must make sense before any process group is formed.
inline std::string bad_shape(const Args& a) {
  if (a.data == kSyntheticData && a.vocab > 65536) {
    return "--vocab " + std::to_string(a.vocab) +
           " is past what --data synthetic draws: its "
           "tokens are uint16, so at most 65536 (llm.c's format)";
  }
  if (a.experts > 0 && a.top_k > a.experts) {
    return "--top-k " + std::to_string(a.top_k) + " is more than the " + std::to_string(a.experts) +
           " --experts";
  }
  if (a.dim % a.heads != 0) {
    return "--dim " + std::to_string(a.dim) + " must be a multiple of --heads " +
           std::to_string(a.heads);
  }
  if (a.tp > 1 && (a.heads % a.tp != 0 || a.vocab % a.tp != 0)) {
    return "--tp " + std::to_string(a.tp) + " must divide --heads " + std::to_string(a.heads) +
           " and the vocabulary (" + std::to_string(a.vocab) + "): each rank takes heads/tp "
           "heads and vocabulary/tp rows of the embedding";
  }
  if (a.pp > 1) {
    const int64_t per_rank =
        pipelining::default_stages_per_rank(pipelining::parse_schedule(a.schedule));
    if (a.layers % (a.pp * per_rank) != 0) {
      return "--layers " + std::to_string(a.layers) + " do not divide into " +
             std::to_string(a.pp * per_rank) + " pipeline stages of whole blocks (--pp " +
             std::to_string(a.pp) + ", " + std::to_string(per_rank) + " stage" +
             (per_rank > 1 ? "s" : "") + " per rank with --schedule " + a.schedule + ")";
    }
    if (a.batch_size % a.microbatches != 0) {
      return "--batch-size " + std::to_string(a.batch_size) + " does not divide into --microbatches " +
             std::to_string(a.microbatches);
    }
  }
  if (a.warmup_steps >= a.steps) {
    return "--warmup-steps " + std::to_string(a.warmup_steps) + " must be below --steps " +
           std::to_string(a.steps) + " (the steps left are the ones timed)";
  }
  if (a.resume && a.checkpoint_dir.empty()) return "--resume needs --checkpoint-dir";
  if ((a.checkpoint_every > 0 || a.async_checkpoint) && a.checkpoint_dir.empty()) {
    return "--checkpoint-every and --async-checkpoint need --checkpoint-dir";
  }
  if (a.positions > 0 && a.context > a.positions) {
    return "--context " + std::to_string(a.context) + " is longer than the model's " +
           std::to_string(a.positions) + " positions (--init-from-hf's n_positions)";
  }
  return "";
}

inline void add_options(CLI::App& app, Args& a) {
  // A flag given twice takes its last value (a script's defaults, then the user's overrides).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", a.data,
                 "what to train on: prose (a text file, or bible-kjv-text's KJV), a token file in "
                 "llm.c's format (uint16 GPT-2 tokens, used as it is), or 'synthetic': uniformly "
                 "random tokens from --seed, made once in --cache-dir (llm.c's format; the banner "
                 "names the file), for speed runs")
      ->capture_default_str();
  app.add_option("--cache-dir", a.cache_dir,
                 "where the token file goes (default $XDG_CACHE_HOME/ember or ~/.cache/ember)");
  app.add_option("--layers", a.layers, "decoder blocks")->check(kPositive)->capture_default_str();
  app.add_option("--heads", a.heads, "attention heads")->check(kPositive)->capture_default_str();
  app.add_option("--dim", a.dim, "model width")->check(kPositive)->capture_default_str();
  app.add_option("--context", a.context, "tokens per sequence")->check(kPositive)->capture_default_str();
  app.add_option("--vocab", a.vocab,
                 "the model's vocabulary; every token must be below it (default: 50304, GPT-2's "
                 "padded to a multiple of 128, for llm.c's token files and synthetic; else 256, "
                 "bytes; --init-from-hf: its config's)")
      ->check(kPositive);
  app.add_option("--batch-size", a.batch_size, "sequences per rank per step")
      ->check(kPositive)->capture_default_str();
  app.add_option("--steps", a.steps, "optimizer steps")->check(kPositive)->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW's peak learning rate (50 warm-up steps, cosine to a tenth)")
      ->check(kPositive)->capture_default_str();
  app.add_option("--grad-clip", a.grad_clip, "max gradient norm (0: no clipping)")
      ->check(kNonNegative)->capture_default_str();
  app.add_option("--dropout", a.dropout, "dropout probability")
      ->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_option("--seed", a.seed, "weights, data windows and sampling")->capture_default_str();
  app.add_option("--amp", a.amp, "mixed precision: off, bf16 or fp16")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}))->capture_default_str();
  app.add_flag("--checkpoint-activations", a.checkpoint_activations,
               "recompute each block's activations in backward");
  app.add_flag("--cuda-graph", a.cuda_graph,
               "capture the training step as a CUDA graph after 3 eager steps and replay it "
               "(--device cuda; across ranks --backend nccl)");
  app.add_option("--backend", a.backend, "gloo, mpi or nccl")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl"}))->capture_default_str();
  app.add_option("--device", a.device, "cpu, cuda (the local rank's GPU) or cuda:N")
      ->check(kDeviceName)
      ->capture_default_str();
  app.add_option("--comm-hook", a.comm_hook,
                 "gradient communication: none or a registered hook, NAME[:key=value,...] "
                 "(see docs/ddp.md)")
      ->capture_default_str();
  app.add_option("--comm-hook-plugin", a.comm_hook_plugins,
                 "a shared library that registers comm hooks (repeatable)");
  app.add_option("--shard", a.shard,
                 "none (DDP), zero (DDP + ZeroRedundancyOptimizer), fsdp (fully_shard) or hsdp "
                 "(fully_shard within each node, replicated across nodes)")
      ->check(CLI::IsMember({"none", "zero", "fsdp", "hsdp"}))
      ->capture_default_str();
  app.add_option("--hsdp-shard", a.hsdp_shard,
                 "with --shard hsdp: ranks per shard group, which must divide the data-parallel "
                 "ranks (0: a node's, LOCAL_WORLD_SIZE over --tp)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--tp", a.tp,
                 "tensor-parallel ranks per model, with sequence and loss parallelism; the other "
                 "ranks are data parallel (docs/tensor_parallel.md)")
      ->check(kPositive)->capture_default_str();
  app.add_option("--cp", a.cp,
                 "context-parallel ranks per model: each holds a part of every sequence, "
                 "attention gathers the keys and values; the other ranks are data parallel "
                 "(docs/tensor_parallel.md)")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--cp-rotate", a.cp_rotate,
                 "with --cp: how keys and values reach every rank's queries: allgather (the "
                 "fewest messages) or ring (ring attention: each rank holds two ranks' keys and "
                 "values at most, for sequences whose whole keys and values do not fit)")
      ->check(CLI::IsMember({"allgather", "ring"}))
      ->capture_default_str();
  app.add_option("--tp-overlap", a.tp_overlap,
                 "with --tp: the sequence-parallel collectives fused with their matmuls in this "
                 "many pieces of the batch, each overlapping the next piece's matmul (1: fused, "
                 "no overlap; 0: unfused)")
      ->check(kNonNegative)->capture_default_str();
  app.add_option("--pp", a.pp,
                 "pipeline-parallel ranks per model: the blocks cut into equal stages, one or two "
                 "per rank by --schedule; the other ranks are data parallel "
                 "(docs/pipeline_parallel.md)")
      ->check(kPositive)->capture_default_str();
  app.add_option("--experts", a.experts,
                 "> 0: each block's MLP is a mixture of this many SwiGLU experts (hidden 4 x "
                 "--dim), each token routed to --top-k of them (0: the dense MLP)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--top-k", a.top_k, "with --experts: experts per token")
      ->check(kPositive)
      ->capture_default_str();
  app.add_flag("--ep", a.ep,
               "with --experts: expert parallelism, each rank holding experts / ranks of every "
               "block's experts, tokens sent to their experts' ranks (docs/tensor_parallel.md)");
  app.add_option("--aux-loss", a.aux_loss,
                 "with --experts: the weight of the experts' balance loss in the training loss")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--microbatches", a.microbatches, "with --pp: micro-batches per step")
      ->check(kPositive)->capture_default_str();
  app.add_option("--schedule", a.schedule, "with --pp: the pipeline schedule")
      ->check(CLI::IsMember(
          {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv"}))
      ->capture_default_str();
  app.add_flag("--zero-overlap", a.zero_overlap,
               "with --shard zero: step each bucket's partition inside DDP's communication hook, "
               "overlapping the optimizer with backward (torch's overlap_with_ddp; needs --grad-clip 0)");
  app.add_option("--warmup-steps", a.warmup_steps,
                 "this run's first steps, left out of tokens_per_s and mfu (a GPU's first steps "
                 "build kernels and plans)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--peak-tflops", a.peak_tflops,
                 "one rank's dense peak TFLOPS in the precision trained (--amp bf16/fp16, else "
                 "float32), for the final mfu= line (default: looked up by the GPU's name for "
                 "H100/H200 SXM (989.4 bf16, 494.7 TF32, 67 float32) and A100 (312, 156, 19.5); "
                 "elsewhere the run prints mfu=unknown)")
      ->check(kNonNegative);
  app.add_flag("--allow-tf32", a.allow_tf32,
               "let float32 matmuls on CUDA use TF32 tensor cores (PyTorch's "
               "torch.backends.cuda.matmul.allow_tf32; off by default, as there)");
  app.add_option("--eval-every", a.eval_every, "steps between validations (0: only at the end)")
      ->check(kNonNegative)->capture_default_str();
  app.add_option("--eval-batches", a.eval_batches, "validation batches per rank")
      ->check(kPositive)->capture_default_str();
  app.add_option("--log-every", a.log_every, "steps between progress lines (0: 20 per run)")
      ->check(kNonNegative);
  app.add_option("--metrics", a.metrics, "append one JSON line per progress line and evaluation");
  app.add_option("--checkpoint-dir", a.checkpoint_dir,
                 "write the run's checkpoint here (every rank its part; docs/checkpoints.md) at "
                 "each evaluation");
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "checkpoint every N steps (and at the last) instead of at each evaluation")
      ->check(kNonNegative);
  app.add_flag("--async-checkpoint", a.async_checkpoint,
               "write checkpoints in the background: a step waits only for the copy to memory");
  app.add_flag("--resume", a.resume, "continue from the checkpoint in --checkpoint-dir if there is one");
  app.add_option("--save-weights", a.save_weights, "write the final weights to FILE.safetensors");
  app.add_option("--init-from-hf", a.init_from_hf,
                 "start from a GPT-2 model in Hugging Face's layout (config.json and safetensors "
                 "weights); its config sets --layers, --heads, --dim and the vocabulary");
  app.add_option("--export-hf", a.export_hf,
                 "write the final model into DIR in Hugging Face's GPT-2 layout "
                 "(transformers' GPT2LMHeadModel.from_pretrained reads it)");
  app.add_option("--sample", a.sample, "print N generated bytes at the end")->check(kNonNegative);
  app.add_option("--temperature", a.temperature, "sampling temperature (0: greedy)")
      ->check(kNonNegative)->capture_default_str();
  app.add_option("--prompt", a.prompt, "the text the sample continues")->capture_default_str();
  app.add_option("--timeout", a.timeout_s, "seconds a collective may wait (0: EMBER_PG_TIMEOUT or 30 min)")
      ->check(kNonNegative);
  app.add_flag("--continue-on-nan", a.continue_on_nan,
               "keep training when the loss is NaN or infinite (default: stop with an error)");
  app.add_option("--stop-at-step", a.stop_at_step,
                 "testing aid: stop after this step, as an interrupted run would")
      ->check(kNonNegative)
      ->group("");
  add_fault_options(app, a.fail_at_step, a.hang_at_step);
}

}  // namespace ember::examples::gpt
