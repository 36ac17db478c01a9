// A GPT-2-style byte-level language model trained data-parallel (DistributedDataParallel, or
// with --shard zero|fsdp|hsdp sharded: ZeroRedundancyOptimizer or fully_shard, over every rank
// or, hsdp, within each node and replicated across nodes), and with --tp N
// tensor parallel over N ranks at a time (docs/tensor_parallel.md), with --pp N pipeline parallel
// over N stages of whole blocks (docs/pipeline_parallel.md), on
// prose a Debian package ships (the King James Bible of bible-kjv-text by default). Each rank
// draws its own random context windows per step (nn/data/token_stream.h); gradients are averaged
// across ranks during backward; rank 0 prints progress, evaluates and writes checkpoints.
//
//   emberrun --nproc-per-node 2 build/examples/gpt --steps 1000
//   mpirun -np 2 build/examples/gpt --backend mpi
//   build/examples/gpt --layers 1 --dim 32 --context 32 --steps 30 --sample 200
//   emberrun --nproc-per-node 4 build/examples/gpt --tp 2 --shard fsdp
//   emberrun --nnodes 2 --nproc-per-node 4 ... build/examples/gpt --shard hsdp
//   emberrun --nnodes 2 --nproc-per-node 8 ... build/examples/gpt --shard hsdp --tp 2
//   emberrun --nproc-per-node 2 build/examples/gpt --pp 2 --microbatches 8 --schedule 1f1b
//   emberrun --nproc-per-node 2 build/examples/gpt --experts 8 --top-k 2 --ep  (mixture of experts)
//   build/examples/gpt --device cuda --amp bf16 --layers 12 --heads 12 --dim 768
//       --context 1024 --data synthetic --warmup-steps 10 --peak-tflops 989.4  (GPT-2 124M, MFU)
//
// benchmarks/vs_pytorch/gpt_torch.py is the same model, data and optimizer in PyTorch; see
// docs/quickstart.md for the flags and what a run prints.
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include <ember/distributed/ddp/amp.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/pipelining/pipeline.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/distributed/sharding/zero_hook.h>
#include <ember/distributed/tensor_parallel/clip_grad.h>
#include <ember/distributed/tensor_parallel/loss_parallel.h>
#include "examples/example_util.h"
#include "examples/gpt_args.h"
#include "examples/gpt_hf.h"
#include "examples/gpt_layout.h"
#include "examples/gpt_model.h"
#include "examples/gpt_parallel.h"
#include "examples/gpt_pipeline.h"
#include "examples/run_checkpoint.h"
#include <ember/nn/amp/autocast.h>
#include <ember/nn/data/token_stream.h>
#include <ember/nn/nn.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/allocator.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda_graph.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/indexing.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/ops/reduce.h>
#include <ember/tensor/threading.h>

namespace nn = ember::nn;
namespace dist = ember::dist;
namespace F = ember::nn::functional;
namespace pipelining = ember::dist::pipelining;
using ember::Tensor;
using namespace ember::examples;       // NOLINT: the examples' shared helpers
using namespace ember::examples::gpt;  // NOLINT: gpt's command line and layouts

namespace {




std::string default_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/ember";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return std::string(h) + "/.cache/ember";
  }
  return (std::filesystem::temp_directory_path() / "ember-cache").string();
}

// ---- training ----

// --amp's low precision (the guard is disabled for off).
ember::Dtype amp_dtype(const std::string& amp) {
  return amp == "fp16" ? ember::Dtype::Float16 : ember::Dtype::BFloat16;
}

class Trainer {
 public:
  explicit Trainer(const Args& a);
  // Trains from the start (or the checkpoint) to --steps, evaluating every --eval-every steps;
  // returns the final validation loss.
  double train();
  // Rank 0: the sample, the weights and the result lines.
  void report(double val_loss);

 private:
  double train_step(int64_t step);
  float graph_step(const nn::data::Batch& b);
  double pipeline_step(const nn::data::Batch& b);
  double evaluate();
  void log_progress(LogWindow& window);
  double comm_wait_ms();
  Tensor local(const Tensor& t) const;
  void after_eval(double val_loss);
  ckpt::State checkpoint_state();
  void save_checkpoint();
  int64_t maybe_resume();
  std::string generate(nn::Module& model);
  void print_banner() const;
  std::string layout_text() const;
  void measure_peak_memory();
  double lr() { return par_.optimizer().param_groups().front().lr(); }
  void zero_grad() {
    if (par_.zero) {
      par_.zero->zero_grad();
    } else {
      par_.adamw->zero_grad();
    }
  }
  // What this rank's checkpoint holds: the model, or with --pp its stages.
  nn::Module& checkpoint_root() {
    if (par_.pipe) return *par_.pipe->part;
    return *model_;
  }

  // The loss of `logits`: loss-parallel when tensor parallelism left them vocabulary-sharded.
  Tensor loss_of(const Tensor& logits, const Tensor& y) const;

  const Args& a_;
  const RunContext run_;
  const MeshLayout layout_;
  std::shared_ptr<GPT> model_;
  nn::data::TokenStream data_;
  Parallel par_;
  double pipeline_compute_s_ = 0, pipeline_wall_s_ = 0;  // --pp: this run's steps on this rank
  double pipeline_bubble_ = 0;                            // --pp: over every rank
  dist::MadeCommHook hook_;  // --comm-hook's (empty for none, or without DDP)
  nn::optim::SequentialLR schedule_;
  nn::amp::GradScaler scaler_;  // a pass-through unless --amp fp16
  std::unique_ptr<RunCheckpoint> checkpoint_;  // null without --checkpoint-dir
  bool hook_restored_ = false;                 // the checkpoint had this world's hook state
  const int64_t log_every_;
  const int64_t start_step_;
  int64_t step_;               // steps trained, this run's and before
  int64_t timed_steps_ = 0;    // this run's steps after --warmup-steps
  double train_seconds_ = 0;   // their time only (no evaluation, no logging)
  dist::StepTimes run_times_;  // this run's totals over the logged windows (ms)
  int64_t run_steps_ = 0;
  double peak_rss_mb_ = 0, peak_allocated_mb_ = 0;  // the largest over the ranks
  int64_t peak_memory_bytes_ = 0;                     // this rank's allocator high-water mark
  Metrics metrics_;
  // The last step's gradient norm before clipping (--grad-clip), read when a line is logged
  // (reading it each step would wait for the GPU); undefined without clipping.
  Tensor grad_norm_;
  double fsdp_wait_ms_ = 0;  // fsdp_comm_stats' reading after the last step
  // --cuda-graph: the captured step, its static batch and loss, and the eager steps before it.
  ember::cuda::CUDAGraph graph_;
  Tensor graph_x_, graph_y_, graph_loss_;
  int64_t graph_warmup_ = 0;
};

// --data synthetic's length: the run's training windows back to back (steps x batch x context
// per data-parallel rank) and a tenth more for the validation split, rounded up to a whole MiB
// of tokens so that runs of about one length share a file; at least 2^22 tokens, at most what
// llm.c's header can count (a longer run then draws its windows again, epoch after epoch).
int64_t synthetic_tokens(const Args& a, int64_t dp_world) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  const int64_t train = a.steps * a.batch_size * a.context * dp_world + a.context + 1;
  const int64_t n = train + train / 9 + a.context + 1;
  const int64_t rounded = (n + kMiB - 1) / kMiB * kMiB;
  return std::clamp<int64_t>(rounded, int64_t{1} << 22, (int64_t{1} << 31) - kMiB);
}

nn::data::TokenStream make_stream(const Args& a, const dist::ProcessGroup& pg) {
  const std::string cache = a.cache_dir.empty() ? default_cache_dir() : a.cache_dir;
  const std::string path = a.data == kSyntheticData
                               ? nn::data::prepare_synthetic_token_file(
                                     cache, a.vocab, synthetic_tokens(a, pg.size()), a.seed)
                               : nn::data::prepare_token_file(a.data, cache);
  auto tokens = std::make_shared<const nn::data::TokenFile>(path);
  return nn::data::TokenStream(tokens, {.context = a.context,
                                        .batch_size = a.batch_size,
                                        .world_size = pg.size(),
                                        .rank = pg.rank(),
                                        .seed = a.seed,
                                        .vocab = a.vocab});
}

Trainer::Trainer(const Args& a)
    : a_(a),
      run_("gpt", a.backend, a.timeout_s, a.device),
      layout_(run_, a),
      model_(a.pp > 1 ? context_parallel(seeded_model(a, run_.device), layout_, a,
                                         run_.device)  // the stages are laid out one by one
                      : context_parallel(
                            tensor_parallel(seeded_model(a, run_.device), layout_, a.tp_overlap),
                            layout_, a, run_.device)),
      data_(make_stream(a, *layout_.dp)),
      par_(make_parallel(a, model_, layout_, run_.device)),
      hook_(par_.ddp ? register_comm_hook(*par_.ddp, a.comm_hook, a.comm_hook_plugins,
                                          /*powersgd_rank=*/2, /*powersgd_start=*/10)
                     : dist::MadeCommHook{}),
      schedule_(make_schedule(par_.optimizer(), a.lr, a.steps)),
      // DDP's exact average gives every rank the same gradients; a compressing hook may not, so
      // then the ranks agree on skipping a step.
      scaler_({.enabled = a.amp == "fp16",
               .found_inf_sync = a.comm_hook == "none" || a.comm_hook == "allreduce"
                                     ? nullptr
                                     : dist::found_inf_allreduce(run_.pg),
               .capturable = a.cuda_graph}),
      checkpoint_(a.checkpoint_dir.empty()
                      ? nullptr
                      : std::make_unique<RunCheckpoint>(a.checkpoint_dir, run_.pg,
                                                        a.async_checkpoint, run_.leader)),
      log_every_(a.log_every > 0 ? a.log_every : std::max<int64_t>(1, a.steps / 20)),
      start_step_(maybe_resume()),
      step_(start_step_),
      metrics_(run_.leader ? a.metrics : "", "", start_step_ > 0) {
  // Draws the epoch's window order now, so that tokens/s measures training steps only.
  data_.train_offsets(start_step_);
  if (run_.leader) print_banner();
}

std::string Trainer::layout_text() const {
  const std::string cp_rotation = a_.cp_rotate == "ring" ? ", ring attention" : "";
  if (par_.pipe) {
    return "; pipeline parallel over " + layout_.mesh->str() + " (" + a_.schedule + ", " +
           std::to_string(par_.pipe->schedule->rank_of_stage().size()) + " stages, " +
           std::to_string(a_.microbatches) + " micro-batches" +
           (layout_.tp_mesh ? "; tensor and sequence parallel stages" : "") +
           (layout_.cp_group ? "; context parallel, load-balanced" + cp_rotation : "") + ")";
  }
  if (layout_.tp_mesh) {
    return std::string("; tensor") + (layout_.cp_group ? " and context" : "") + " parallel over " +
           layout_.mesh->str() + " (sequence and loss parallel" +
           (layout_.cp_group ? "; load-balanced" + cp_rotation + ")" : ")");
  }
  if (layout_.hsdp_mesh) {
    return "; sharded over " + layout_.mesh->str() +
           (layout_.cp_group ? " (context parallel, load-balanced" + cp_rotation + ")" : "");
  }
  if (layout_.cp_group)
    return "; context parallel over " + layout_.mesh->str() + " (load-balanced" + cp_rotation + ")";
  if (a_.experts > 0) {
    return "; " + std::to_string(a_.experts) + " experts per block, top " +
           std::to_string(a_.top_k) +
           (par_.ep_mesh ? ", expert parallel over " + std::to_string(run_.world) + " ranks" : "");
  }
  return "";
}

void Trainer::print_banner() const {
  // Synthetic tokens: the file's path, to give PyTorch's side (gpt_torch.py --tokens) the same.
  const std::string data =
      a_.data == kSyntheticData ? a_.data + " " + data_.tokens().path() : a_.data;
  std::printf(
      "gpt: world size %d, backend %s, device %s, %lld parameters (layers %lld, heads %lld, dim "
      "%lld, context %lld), batch %lld per rank, %lld steps, AdamW lr %g, amp %s%s, comm hook %s, "
      "%d threads per rank%s; data %s: %lld training and %lld validation tokens, vocab %lld\n",
      run_.world, run_.pg->backend_name().c_str(), run_.device.str().c_str(),
      static_cast<long long>(parameter_count(model_->config)), static_cast<long long>(a_.layers),
      static_cast<long long>(a_.heads), static_cast<long long>(a_.dim),
      static_cast<long long>(a_.context), static_cast<long long>(a_.batch_size),
      static_cast<long long>(a_.steps), a_.lr, a_.amp.c_str(),
      a_.checkpoint_activations ? ", checkpointed blocks" : "", a_.comm_hook.c_str(),
      ember::get_num_threads(), layout_text().c_str(), data.c_str(),
      static_cast<long long>(data_.train_tokens()),
      static_cast<long long>(data_.validation_tokens()), static_cast<long long>(a_.vocab));
  std::fflush(stdout);
}

double Trainer::train() {
  const int64_t end = a_.stop_at_step > 0 ? std::min(a_.stop_at_step, a_.steps) : a_.steps;
  if (run_.leader && step_ >= end) {
    std::printf("resume: the checkpoint is at step %lld, at or past the end (%lld): nothing "
                "to train\n", static_cast<long long>(step_), static_cast<long long>(end));
  }
  double val_loss = std::numeric_limits<double>::quiet_NaN();
  bool evaluated = false;
  LogWindow window;
  while (step_ < end) {
    const bool timed = step_ - start_step_ >= a_.warmup_steps;
    const auto t0 = Clock::now();
    const double loss = train_step(step_);
    stop_self_if_asked("gpt", run_.rank, run_.world, step_, a_.fail_at_step, a_.hang_at_step,
                       [this] {
                         if (checkpoint_) checkpoint_->finish();
                       });
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (timed) {
      train_seconds_ += dt;
      ++timed_steps_;
    }
    window.comm_wait_ms += comm_wait_ms();
    window.add(loss);
    // Every rank joins the straggler report's gather at the same steps.
    if (step_ % log_every_ == 0 || step_ == end) log_progress(window);
    evaluated = a_.eval_every > 0 && step_ % a_.eval_every == 0;
    if (evaluated) {
      after_eval(val_loss = evaluate());
      comm_wait_ms();  // evaluation's FSDP gathers are not the next step's wait
    }
    if (checkpoint_) {
      checkpoint_->report_failures();
      if (a_.checkpoint_every > 0 && (step_ % a_.checkpoint_every == 0 || step_ == end)) {
        save_checkpoint();
      }
    }
  }
  if (!evaluated) after_eval(val_loss = evaluate());
  if (checkpoint_) checkpoint_->finish();
  if (run_.world > 1 && run_steps_ > 0) {
    const double n = static_cast<double>(run_steps_);
    const auto ranks = dist::gather_step_times(
        *run_.pg, {run_times_.step_ms / n, run_times_.data_ms / n, run_times_.comm_wait_ms / n});
    if (run_.leader) std::printf("whole run: %s\n", dist::straggler_report(ranks).c_str());
  }
  if (par_.pipe) {
    // The bubble: the share of the ranks' step time spent waiting (not in a forward or a
    // backward), over the whole run.
    Tensor t = ember::from_vector(std::vector<double>{pipeline_compute_s_, pipeline_wall_s_});
    run_.pg->allreduce(t)->wait();
    const std::vector<double> v = t.to_vector<double>();
    pipeline_bubble_ = v[1] > 0 ? 1.0 - v[0] / v[1] : 0;
  }
  measure_peak_memory();
  return val_loss;
}

// One optimizer step on this rank's windows of `step`; returns the loss.
double Trainer::train_step(int64_t step) {
  const nn::data::Batch b = data_.train_batch(step);
  if (par_.pipe) {
    const double value = pipeline_step(b);
    schedule_.step();
    ++step_;
    check_loss_is_finite(static_cast<float>(value), "step", step_, run_.rank, a_.continue_on_nan);
    return value;
  }
  if (a_.cuda_graph) {
    const float value = graph_step(b);
    schedule_.step();  // a capturable AdamW writes the new rate before the next replay
    ++step_;
    check_loss_is_finite(value, "step", step_, run_.rank, a_.continue_on_nan);
    return value;
  }
  Tensor x = local(b.data).to(run_.device), y = local(b.target).to(run_.device);
  // A checkpoint being staged in the background reads the live state: a hook's error feedback
  // and --zero-overlap's parameters change during backward, everything else at the step.
  if (checkpoint_ && (hook_.state_dict || a_.zero_overlap)) checkpoint_->wait_until_staged();
  zero_grad();
  Tensor loss;
  {
    const nn::amp::autocast amp(run_.device, amp_dtype(a_.amp), a_.amp != "off");
    Tensor logits = par_.ddp ? par_.ddp->forward(x) : (*model_)(x);  // [B, T, vocab]
    loss = loss_of(logits, y);
  }
  // --experts: the experts' balance loss joins the training loss (the printed loss is the
  // model's alone).
  const Tensor trained =
      a_.experts > 0 && a_.aux_loss > 0 ? loss + a_.aux_loss * model_->aux_loss() : loss;
  scaler_.scale(trained).backward();
  if (a_.grad_clip > 0) {
    scaler_.unscale_(par_.optimizer());
    if (par_.ep_mesh) {  // each expert's shards counted once over the ranks
      grad_norm_ = dist::clip_grad_norm_(par_.ddp->parameters(), a_.grad_clip, *par_.ep_mesh);
    } else if (par_.ddp && layout_.tp_mesh) {
      grad_norm_ = dist::clip_grad_norm_(par_.ddp->parameters(), a_.grad_clip, *layout_.tp_mesh);
    } else if (par_.ddp) {
      grad_norm_ = nn::clip_grad_norm_(par_.ddp->parameters(), a_.grad_clip);
    } else if (layout_.tp_mesh) {  // over dp and tp
      grad_norm_ = dist::clip_grad_norm_(*model_, a_.grad_clip, *layout_.shard_tp_mesh());
    } else {  // the norm over every rank's shards
      grad_norm_ = dist::clip_grad_norm_(*model_, a_.grad_clip);
    }
  }
  if (checkpoint_) checkpoint_->wait_until_staged();
  if (par_.zero) {
    par_.zero->step();  // collective: every rank gets every rank's updated parameters
  } else {
    scaler_.step(par_.optimizer());
  }
  if (hook_.after_step) hook_.after_step(par_.ddp->parameters());  // model averaging
  scaler_.update();
  schedule_.step();
  ++step_;
  const float value = loss.item<float>();
  check_loss_is_finite(value, "step", step_, run_.rank, a_.continue_on_nan);
  return value;
}

// --cuda-graph: the step's work on static batch tensors (Note [CUDA graphs]), eagerly for the
// first steps (the optimizer's state, cuDNN's plans and the caches must exist before a capture),
// then captured once and replayed; returns the loss.
float Trainer::graph_step(const nn::data::Batch& b) {
  if (!graph_x_.defined()) {
    graph_x_ = b.data.to(run_.device);
    graph_y_ = b.target.to(run_.device);
  } else {
    graph_x_.copy_(b.data);
    graph_y_.copy_(b.target);
  }
  if (checkpoint_) checkpoint_->wait_until_staged();  // it reads the state the step writes
  auto body = [this] {
    zero_grad();
    {
      const nn::amp::autocast amp(run_.device, amp_dtype(a_.amp), a_.amp != "off");
      graph_loss_ = loss_of(par_.ddp ? par_.ddp->forward(graph_x_) : (*model_)(graph_x_), graph_y_);
    }
    // --amp fp16: the scaler is capturable, so the skip and the scale's update stay on the GPU.
    scaler_.scale(graph_loss_).backward();
    if (a_.grad_clip > 0) {
      scaler_.unscale_(*par_.adamw);
      grad_norm_ = nn::clip_grad_norm_(model_->parameters(), a_.grad_clip);
    }
    scaler_.step(*par_.adamw);
    scaler_.update();
  };
  constexpr int64_t kEagerSteps = 3;
  if (graph_.ready()) {
    graph_.replay();
  } else if (graph_warmup_ < kEagerSteps) {
    body();
    ++graph_warmup_;
  } else {
    ember::cuda::graph(graph_, body);
    graph_.replay();
  }
  return graph_loss_.item<float>();
}

// --pp: one step of the schedule over this rank's stages (DDP's reductions within it, once per
// stage), the tied embedding's two gradients summed, the norm clipped over the pipeline;
// returns the step's loss, the mean of the micro-batches' (sent from the last stage's rank).
double Trainer::pipeline_step(const nn::data::Batch& b) {
  Pipeline& pipe = *par_.pipe;
  zero_grad();
  std::vector<Tensor> losses;
  pipe.schedule->step(pipe.first ? local(b.data).to(run_.device) : Tensor(),
                      pipe.last ? local(b.target).to(run_.device) : Tensor(), &losses);
  pipeline_compute_s_ += pipe.schedule->last_step().compute_s;
  pipeline_wall_s_ += pipe.schedule->last_step().wall_s;
  dist::ProcessGroup& pp = *layout_.pp_group;
  if (pipe.sharded) {
    // Under HSDP the replicas hold the same pieces: the first one's stand for them all.
    const bool counted = layout_.first_replica;
    sum_tied_embedding_grad_sharded(*pipe.part, *layout_.same_tp, model_->config, run_.device,
                                    counted, a_.tp);
    if (a_.grad_clip > 0) {
      grad_norm_ = clip_sharded_pipeline_grad_norm_(
          *pipe.part, a_.grad_clip, *run_.pg, counted,
          layout_.tp_mesh ? layout_.tp_mesh->get_group().get() : nullptr);
    }
  } else {
    sum_tied_embedding_grad(*pipe.part, pp, model_->config, run_.device, a_.tp);
    if (a_.grad_clip > 0) {
      grad_norm_ = clip_pipeline_grad_norm_(*pipe.part, a_.grad_clip, pp, layout_.tp_mesh.get());
    }
  }
  if (checkpoint_) checkpoint_->wait_until_staged();
  if (par_.zero) {
    par_.zero->step();  // collective over dp
  } else {
    par_.adamw->step();
  }
  double mean = 0;
  for (const Tensor& l : losses) mean += l.item<double>() / static_cast<double>(losses.size());
  Tensor loss = ember::from_vector(std::vector<double>{mean}).to(pp.default_device());
  pp.broadcast(loss, {.root = pipe.last_rank})->wait();
  return loss.to(ember::kCPU).to_vector<double>()[0];
}

Tensor Trainer::loss_of(const Tensor& logits, const Tensor& y) const {
  if (const std::optional<dist::DTensor> d = dist::as_dtensor(logits)) {
    return dist::loss_parallel::cross_entropy(*d, y);
  }
  return lm_loss(logits, y);
}

// The mean loss over --eval-batches validation batches per rank (every rank scores its own
// windows; one all-reduce adds up the sums).
// --pp: the schedule's forwards only; the last stage's ranks (one per dp index) score.
double Trainer::evaluate() {
  ember::NoGradGuard no_grad;
  model_->eval();
  double sum = 0;
  for (int64_t i = 0; i < a_.eval_batches; ++i) {
    const nn::data::Batch b = data_.validation_batch(i, a_.eval_batches);
    if (par_.pipe) {
      const Pipeline& pipe = *par_.pipe;
      std::vector<Tensor> losses;
      pipe.schedule->eval(pipe.first ? local(b.data).to(run_.device) : Tensor(),
                          pipe.last ? local(b.target).to(run_.device) : Tensor(), &losses);
      for (const Tensor& l : losses) sum += l.item<double>() / static_cast<double>(losses.size());
      continue;
    }
    const nn::amp::autocast amp(run_.device, amp_dtype(a_.amp), a_.amp != "off");
    Tensor logits = (*model_)(local(b.data).to(run_.device));
    sum += loss_of(logits, local(b.target).to(run_.device)).item<float>();
  }
  model_->train();
  // On the group's device: NCCL takes device tensors only.
  Tensor total = ember::from_vector(std::vector<double>{sum}).to(run_.pg->default_device());
  run_.pg->allreduce(total)->wait();
  total = total.cpu();
  // Every rank of a tensor-parallel row scores the row's batches; of a pipeline, only the last
  // stage's (its tp and cp ranks; a cp rank its part of the sequences).
  const int64_t scorers = par_.pipe ? layout_.dp->size() * a_.tp * a_.cp : run_.world;
  return total.to_vector<double>()[0] / static_cast<double>(a_.eval_batches * scorers);
}

void Trainer::after_eval(double val_loss) {
  if (run_.leader) {
    std::printf("step %lld: validation loss %.4f\n", static_cast<long long>(step_), val_loss);
    std::fflush(stdout);
    metrics_.write({{"kind", "eval"}, {"global_step", step_}, {"val_loss", val_loss}});
  }
  if (checkpoint_ && a_.checkpoint_every == 0) save_checkpoint();
}

// Tokens trained per second: each data-parallel row (a model's tp, pp or cp ranks) trains its
// batch.
double tokens_per_s(int64_t steps, const Args& a, int world, double seconds) {
  const double tokens =
      static_cast<double>(steps * a.batch_size * a.context * world / (a.tp * a.pp * a.cp));
  return seconds > 0 ? tokens / seconds : 0;
}

// --cp: this rank's part of each sequence of a batch ([B, T] -> [B, T / cp]); else the batch.
Tensor Trainer::local(const Tensor& t) const {
  if (!layout_.cp_group) return t;
  return dist::context_parallel_shard(t, 1, layout_.cp_group->rank(), layout_.cp_group->size());
}

// The last step's communication wait: DDP's exposed communication (with --pp each stage's
// DDP's), or the host's waits on fully_shard's collectives; a pipeline's sends and receives are
// not counted.
double Trainer::comm_wait_ms() {
  if (par_.ddp) return par_.ddp->stats().exposed_communication.last_ms;
  if (par_.pipe && !par_.pipe->ddp.empty()) {
    double ms = 0;
    for (const auto& d : par_.pipe->ddp) ms += d->stats().exposed_communication.last_ms;
    return ms;
  }
  if (a_.shard != "fsdp" && a_.shard != "hsdp") return 0;
  const nn::Module& root = par_.pipe ? static_cast<const nn::Module&>(*par_.pipe->part) : *model_;
  const double total = dist::fsdp_comm_stats(root).wait_ms;
  const double step = total - fsdp_wait_ms_;
  fsdp_wait_ms_ = total;
  return step;
}

// Collective (the straggler report's gather); rank 0 prints the progress line.
void Trainer::log_progress(LogWindow& window) {
  const auto now = Clock::now();
  const dist::StepTimes mine = window.times(now);
  const std::vector<dist::StepTimes> ranks = dist::gather_step_times(*run_.pg, mine);
  if (layout_
          .cp_group) {  // each rank's loss is of its part of the sequences: the model's is the mean
    Tensor sum = ember::from_vector(std::vector<double>{window.loss_sum})
                     .to(layout_.cp_group->default_device());
    layout_.cp_group->allreduce(sum, {.op = dist::ReduceOp::Avg})->wait();
    window.loss_sum = sum.cpu().to_vector<double>()[0];
  }
  const double n = static_cast<double>(window.steps);
  run_times_.step_ms += mine.step_ms * n;
  run_times_.comm_wait_ms += mine.comm_wait_ms * n;
  run_steps_ += window.steps;
  if (run_.leader) {
    const double trained = static_cast<double>(timed_steps_);
    const double tps = tokens_per_s(timed_steps_, a_, run_.world, train_seconds_);
    const double eta = trained > 0 ? train_seconds_ / trained * static_cast<double>(a_.steps - step_) : 0;
    constexpr int kWidth = 20;
    const int filled = static_cast<int>(kWidth * step_ / std::max<int64_t>(1, a_.steps));
    const double loss = window.loss_sum / std::max(1.0, n);
    // No speed while every step so far is a warm-up step (--warmup-steps): "-", not 0.
    char speed[64] = "- tok/s  ETA -";
    if (trained > 0) {
      std::snprintf(speed, sizeof speed, "%.0f tok/s  ETA %s", tps, format_duration(eta).c_str());
    }
    // The gradient's norm as llm.c prints it: the window's last step's, before clipping.
    const double norm = grad_norm_.defined() ? grad_norm_.item<double>() : -1;
    char norm_text[32] = "";
    if (norm >= 0) std::snprintf(norm_text, sizeof norm_text, "  norm %.4f", norm);
    std::printf("%sstep %lld/%lld [%s%s] %3d%%  loss %.4f%s  lr %.2e  %s%s", run_.tty ? "\r" : "",
                static_cast<long long>(step_), static_cast<long long>(a_.steps),
                std::string(filled, '#').c_str(), std::string(kWidth - filled, '-').c_str(),
                static_cast<int>(100 * step_ / std::max<int64_t>(1, a_.steps)), loss, norm_text,
                lr(), speed, run_.tty ? "\x1b[K" : "\n");
    if (run_.world > 1 && !run_.tty) std::printf("  %s\n", dist::straggler_report(ranks).c_str());
    std::fflush(stdout);
    nlohmann::json step = {{"kind", "step"},
                           {"global_step", step_},
                           {"loss", loss},
                           {"lr", lr()},
                           {"slowest_rank", dist::slowest_rank(ranks)},
                           {"comm_wait_ms", mine.comm_wait_ms}};
    if (trained > 0) step["tokens_per_s"] = tps;
    if (norm >= 0) step["grad_norm"] = norm;
    metrics_.write(step);
  }
  window.reset(now);
}

// Collective: the process's resident high-water mark and the peak of live tensor bytes on the
// training device (the CPU allocator's, or the GPU's as torch.cuda.max_memory_allocated), each the
// largest over the ranks.
void Trainer::measure_peak_memory() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const int64_t peak = run_.device.is_cuda()
                           ? ember::cuda::max_memory_allocated(run_.device.index)
                           : ember::cpu_allocator_stats().peak_allocated;
  peak_memory_bytes_ = peak;
  Tensor peaks = ember::from_vector(std::vector<double>{
      static_cast<double>(ru.ru_maxrss) / 1024.0, static_cast<double>(peak) / (1024.0 * 1024.0)});
  run_.pg->allreduce(peaks, {.op = dist::ReduceOp::Max})->wait();
  const std::vector<double> v = peaks.to_vector<double>();
  peak_rss_mb_ = v[0];
  peak_allocated_mb_ = v[1];
}

// ---- checkpoints ----

// The settings a resumed run must share (the data order and the schedule depend on them), and
// the shape emberckpt convert needs for Hugging Face's layout.
std::map<std::string, std::string> run_settings(const Args& a, int world) {
  auto s = [](auto v) { return std::to_string(v); };
  // The data by its path made absolute (a file resumed from another folder is the same file);
  // synthetic tokens by name (they are a function of the seed and the vocabulary).
  std::error_code ec;
  const std::string data =
      a.data == kSyntheticData ? a.data : std::filesystem::weakly_canonical(a.data, ec).string();
  return {{"world_size", s(world)},   {"batch_size", s(a.batch_size)},
          {"context", s(a.context)},  {"layers", s(a.layers)},
          {"heads", s(a.heads)},      {"dim", s(a.dim)},
          {"steps", s(a.steps)},      {"seed", s(a.seed)},
          {"comm_hook", a.comm_hook}, {"data", ec ? a.data : data},
          {"vocab", s(a.vocab)}};
}

// Everything the run goes on from: the model (or with --pp this rank's stages) in its layout,
// the optimizer's state (ZeRO's partitions, FSDP's shards), the schedule, the loss scale, the
// generator (dropout's draws) and the comm hook's per-rank state. The data position is the step.
ckpt::State Trainer::checkpoint_state() {
  std::shared_ptr<ckpt::Stateful> model = ckpt::model(checkpoint_root());
  std::shared_ptr<ckpt::Stateful> optim = ckpt::optimizer(par_.optimizer(), checkpoint_root());
  if (par_.pipe && par_.pipe->sharded && !par_.pipe->part->has_embedding() &&
      par_.pipe->part->has_head()) {
    // The last stage's copy of the tied embedding equals the first stage's (their gradients are
    // summed), but fully_shard lays it out at other offsets: the first stage's ranks save it,
    // every stage reads it back.
    model = saved_elsewhere(model, "wte.weight");
    optim = saved_elsewhere(optim, "wte.weight");
  }
  ckpt::State s = {{"model", model},
                   {"optim", optim},
                   {"lr_scheduler", ckpt::lr_scheduler(schedule_)},
                   {"grad_scaler", ckpt::grad_scaler(scaler_)},
                   {"rng", ckpt::rng()}};
  if (hook_.state_dict) s["hook"] = hook_checkpoint_state(hook_, run_.rank, run_.world, &hook_restored_);
  return s;
}

// Collective: every rank writes its part into --checkpoint-dir (in the background with
// --async-checkpoint).
void Trainer::save_checkpoint() {
  auto meta = run_settings(a_, run_.world);
  meta["global_step"] = std::to_string(step_);
  meta["shard"] = a_.shard;
  meta["tp"] = std::to_string(a_.tp);
  meta["pp"] = std::to_string(a_.pp);
  checkpoint_->save(checkpoint_state(), meta);
}

// Loads the checkpoint if --resume finds one; returns the step to continue from. The batches
// are a function of the step, so the run goes on with the windows it would have drawn. Any
// layout (--shard, --tp, --pp) and world size loads any other's.
int64_t Trainer::maybe_resume() {
  if (!a_.resume) return 0;
  const std::string& dir = checkpoint_->dir();
  if (!checkpoint_->exists()) {
    if (run_.leader) std::printf("resume: no checkpoint in %s; starting from scratch\n", dir.c_str());
    return 0;
  }
  // The settings are checked before anything is loaded.
  const CheckpointMeta meta(dir, dist::ShardedCheckpoint(dir).metadata());
  for (const auto& [key, value] : run_settings(a_, run_.world)) {
    // Checkpoints written before the data and the vocabulary were recorded go on unchecked.
    const bool recorded = meta.has(key.c_str()) || (key != "data" && key != "vocab");
    if (key != "world_size" && recorded) meta.must_match(key.c_str(), value);
  }
  const int64_t step = meta.get_int("global_step", 0, a_.steps);
  checkpoint_->load(checkpoint_state(), run_.rank, /*optional=*/"hook");
  // Another world size is allowed (an elastic restart with fewer or more nodes): the windows
  // are a function of the step and the rank, the schedule of the step, and every layout loads
  // at any world size; only the comm hook's per-rank state cannot follow.
  auto saved = [&](const char* key) { return meta.get(key); };
  if (run_.leader) {
    if (saved("world_size") != std::to_string(run_.world)) {
      std::printf("resume: saved at world size %s, now %d%s\n", saved("world_size").c_str(),
                  run_.world, hook_.state_dict && !hook_restored_ ? " (the comm hook's state starts afresh)" : "");
    }
    for (const auto& [key, now] : {std::pair{"tp", a_.tp}, std::pair{"pp", a_.pp}}) {
      if (saved(key) != std::to_string(now)) {
        std::printf("resume: saved at --%s %s, now %lld\n", key, saved(key).c_str(),
                    static_cast<long long>(now));
      }
    }
    std::printf("resume: %s at step %lld\n", dir.c_str(), static_cast<long long>(step));
  }
  return step;
}

// ---- the end ----

// --sample N bytes after --prompt: greedy (the likeliest byte) at temperature 0, else drawn
// from softmax(logits / temperature) with a generator seeded by --seed.
std::string Trainer::generate(nn::Module& model) {
  ember::NoGradGuard no_grad;
  model.eval();
  std::mt19937_64 rng(a_.seed);
  std::vector<int64_t> ids(a_.prompt.begin(), a_.prompt.end());
  for (int64_t& id : ids) id = static_cast<uint8_t>(id);
  if (ids.empty()) ids.push_back('\n');
  std::string out;
  for (int64_t i = 0; i < a_.sample; ++i) {
    const auto first = ids.size() > static_cast<size_t>(a_.context) ? ids.end() - a_.context : ids.begin();
    const std::vector<int64_t> window(first, ids.end());
    Tensor x = ember::from_vector(window, {1, static_cast<int64_t>(window.size())}).to(run_.device);
    Tensor logits = model(x).select(1, x.size(1) - 1).reshape({-1}).to(ember::kCPU);
    const int64_t vocab = logits.numel();
    int64_t next = 0;
    if (a_.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      const std::vector<float> p = ember::softmax(logits / a_.temperature, 0).to_vector<float>();
      double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      while (next < vocab - 1 && (u -= p[static_cast<size_t>(next)]) > 0) ++next;
    }
    ids.push_back(next);
    out += static_cast<char>(next);
  }
  model.train();
  return out;
}

void Trainer::report(double val_loss) {
  // Sharded, the whole model exists on no rank: gather it (collective) into a plain model for
  // sampling and saving.
  std::shared_ptr<GPT> whole = model_;
  if ((a_.shard == "fsdp" || a_.shard == "hsdp") &&
      (a_.sample > 0 || !a_.save_weights.empty() || !a_.export_hf.empty())) {
    const nn::NamedTensors state = dist::full_state_dict(*model_);
    if (!run_.leader) return;
    whole = seeded_model(a_, run_.device);
    whole->load_state_dict(state);
  } else if (layout_.cp_group &&
             (a_.sample > 0 || !a_.save_weights.empty() || !a_.export_hf.empty())) {
    // Context parallel, every rank holds the whole model, attending over its part of the
    // sequence: a plain copy samples over the whole.
    if (!run_.leader) return;
    whole = seeded_model(a_, run_.device);
    whole->load_state_dict(model_->state_dict());
  }
  if (!run_.leader) return;
  if (hook_.summary) std::printf("%s\n", hook_.summary().c_str());
  if (par_.ddp) {
    if (const std::string bytes = ddp_bytes_line(par_.ddp->stats()); !bytes.empty()) {
      std::printf("%s\n", bytes.c_str());
    }
  }
  if (a_.sample > 0) std::printf("sample:\n%s%s\n", a_.prompt.c_str(), generate(*whole).c_str());
  if (!a_.save_weights.empty()) {
    nn::save_state_dict(a_.save_weights, whole->state_dict(),
                        {{"model", "gpt"}, {"global_step", std::to_string(step_)}});
  }
  if (!a_.export_hf.empty()) {
    export_gpt2(*whole, a_.export_hf);
    std::printf("exported the model to %s (GPT-2, Hugging Face's layout)\n", a_.export_hf.c_str());
  }
  std::printf("val_loss=%.4f\n", val_loss);
  const double tps = tokens_per_s(timed_steps_, a_, run_.world, train_seconds_);
  if (timed_steps_ == 0) {
    // Every step this run trained was a warm-up step (a resumed run near its end, or
    // --stop-at-step before --warmup-steps): nothing was timed, so no speed is claimed.
    std::printf("tokens_per_s=unknown (no step past --warmup-steps %lld in this run)\n",
                static_cast<long long>(a_.warmup_steps));
  } else {
    std::printf("tokens_per_s=%.0f\n", tps);
  }
  // Model FLOPs utilization: the model's FLOPs per second over the peak of every rank that
  // works on it (each data-parallel row's tp x pp ranks share its tokens' FLOPs).
  const int64_t flops = flops_per_token(model_->config, a_.context);
  std::printf("flops_per_token=%lld\n", static_cast<long long>(flops));
  const double peak = a_.peak_tflops > 0 ? a_.peak_tflops : table_peak_tflops(a_, run_.device);
  if (peak > 0 && timed_steps_ > 0) {
    std::printf("mfu=%.4f\n",
                tps * static_cast<double>(flops) / (peak * 1e12 * static_cast<double>(run_.world)));
  } else {
    std::printf("mfu=unknown\n");
  }
  std::printf("peak_rss_mb=%.0f\npeak_allocated_mb=%.1f\n", peak_rss_mb_, peak_allocated_mb_);
  std::printf("peak_memory_bytes=%lld\n", static_cast<long long>(peak_memory_bytes_));
  if (par_.pipe) std::printf("pipeline_bubble=%.3f\n", pipeline_bubble_);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "A GPT-2-style byte-level language model trained data-parallel with Ember's DDP.\n"
      "Run it under emberrun (emberrun --nproc-per-node 2 gpt ...), mpirun, or alone."};
  add_options(app, a);
  const auto status = parse_command_line(app, argc, argv, [&]() -> std::string {
    if (!a.init_from_hf.empty()) {
      try {  // the model's shape is the Hugging Face config's
        // Not a plain stream: a FIFO or /dev/zero in its place must not block or fill memory.
        const GPTConfig c = gpt_config_from_gpt2(
            nn::read_small_file(a.init_from_hf + "/config.json", 256 << 20, "[config.json]"));
        if (app.count("--vocab") > 0 && a.vocab != c.vocab) {
          return "--vocab " + std::to_string(a.vocab) + " disagrees with --init-from-hf's " +
                 "vocabulary of " + std::to_string(c.vocab);
        }
        a.layers = c.layers, a.heads = c.heads, a.dim = c.dim, a.vocab = c.vocab;
        a.positions = c.context;
      } catch (const std::exception& e) {
        return std::string("--init-from-hf: ") + e.what();
      }
    } else if (app.count("--vocab") == 0) {
      a.vocab = default_vocab(a.data);
    }
    for (const std::string& why : {unavailable(a), bad_shape(a)}) {
      if (!why.empty()) return why;
    }
    return "";
  });
  if (status) return *status;
  ember::cuda::set_matmul_allow_tf32(a.allow_tf32);
  return train_and_report<Trainer>("gpt", a);
}
