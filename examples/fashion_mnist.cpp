// Fashion-MNIST trained data-parallel with DistributedDataParallel: Ember's main example and
// `make train`. Each rank trains on its DistributedSampler share of every epoch; gradients are
// averaged across ranks during backward; rank 0 prints progress and writes checkpoints.
//
//   emberrun --nproc-per-node 2 build/examples/fashion_mnist --model cnn --epochs 3
//   mpirun -np 2 build/examples/fashion_mnist --backend mpi
//   build/examples/fashion_mnist --epochs 1            # one process, no launcher needed
//
// See docs/quickstart.md for a walk through this file.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "examples/example_util.h"
#include "examples/run_checkpoint.h"
#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/hook_registry.h>
#include <ember/distributed/debug/stragglers.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops/random.h>
#include <ember/tensor/threading.h>
#include <ember/tensor/observe/trace.h>

namespace nn = ember::nn;
namespace dist = ember::dist;
namespace trace = ember::trace;
using ember::Tensor;
using namespace ember::examples;  // NOLINT: the examples' shared helpers

namespace {

struct Args {
  std::string data = ember::nn::data::kFashionMnistRoot;
  std::string model = "cnn";
  int epochs = 3;
  int64_t max_steps = 0;  // 0: no limit
  int64_t batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  std::string lr_schedule = "cosine";
  uint64_t seed = 0;
  std::string backend = "gloo";
  std::string device = "cpu";
  std::string comm_hook = "none";
  std::vector<std::string> comm_hook_plugins;
  int64_t powersgd_rank = 2;
  int64_t powersgd_start = 10;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // steps; 0: at the end of each epoch only
  bool async_checkpoint = false;
  bool resume = false;
  std::string save_weights;
  std::string init_weights;  // a state dict (e.g. from scripts/to_torch.py --from-torch)
  std::string metrics;
  std::string tensorboard;  // --tensorboard DIR: the metrics as TensorBoard scalars too
  int64_t log_every = 0;      // steps; 0: ten progress lines per epoch
  bool continue_on_nan = false;  // keep training when a step's loss is not finite
  int64_t fail_at_step = -1;  // testing aid: SIGKILL rank 1 at this global step, first run only
  int64_t hang_at_step = -1;  // testing aid: SIGSTOP rank 1 at this global step, first run only
  int timeout_s = 0;          // collective timeout in seconds; 0: EMBER_PG_TIMEOUT or 30 minutes
};

// Fashion-MNIST's training-set pixel mean and standard deviation (after scaling to [0, 1]).
constexpr double kMean = 0.2860;
constexpr double kStd = 0.3530;

std::shared_ptr<nn::Module> make_model(const std::string& name) {
  if (name == "cnn") {
    return std::make_shared<nn::Sequential>(
        std::make_shared<nn::Conv2d>(1, 32, 3, nn::Conv2dOptions{.padding = 1}),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
        std::make_shared<nn::Conv2d>(32, 64, 3, nn::Conv2dOptions{.padding = 1}),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64 * 7 * 7, 128),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(128, 10));
  }
  if (name == "mlp") {
    return std::make_shared<nn::Sequential>(
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 512),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 512),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(512, 10));
  }
  throw std::invalid_argument("--model: expected cnn or mlp, got '" + name + "'");
}

// One progress line: "epoch 1/3 [#####-----]  50%  469/938  loss 0.4521  6250 img/s  ETA 8s".
// On a terminal it redraws in place; through a pipe (emberrun, mpirun, a log) it is a line.
void print_progress(int epoch, int epochs, int64_t step, int64_t steps, double loss,
                    double images_per_s, double eta_s, bool tty) {
  constexpr int kWidth = 20;
  const int filled = steps > 0 ? static_cast<int>(kWidth * step / steps) : kWidth;
  char buf[256];
  std::snprintf(
      buf, sizeof buf, "epoch %d/%d [%s%s] %3d%%  %lld/%lld  loss %.4f  %.0f img/s  ETA %s", epoch,
      epochs, std::string(filled, '#').c_str(), std::string(kWidth - filled, '-').c_str(),
      steps > 0 ? static_cast<int>(100 * step / steps) : 100, static_cast<long long>(step),
      static_cast<long long>(steps), loss, images_per_s, format_duration(eta_s).c_str());
  if (tty) {
    std::printf("\r%s\x1b[K", buf);
  } else {
    std::printf("%s\n", buf);
  }
  std::fflush(stdout);
}

struct Evaluation {
  double loss = 0;
  double accuracy = 0;
};

// Test loss and accuracy over the whole test set: each rank scores a contiguous slice, and one
// all-reduce adds up the sums (no sample is counted twice, unlike a padded sampler).
Evaluation evaluate(nn::Module& model, const nn::data::MNIST& test, dist::ProcessGroup& pg,
                    ember::Device device) {
  ember::NoGradGuard no_grad;
  model.eval();
  const int64_t n = test.size();
  const int64_t begin = n * pg.rank() / pg.size();
  const int64_t end = n * (pg.rank() + 1) / pg.size();
  double loss_sum = 0, correct = 0;
  for (int64_t i = begin; i < end; i += 1000) {
    const int64_t len = std::min<int64_t>(1000, end - i);
    Tensor x = test.data().narrow(0, i, len).to(device);
    Tensor y = test.targets().narrow(0, i, len).to(device);
    Tensor logits = model.forward(x);
    loss_sum += nn::functional::cross_entropy(logits, y, {.reduction = "sum"}).item<float>();
    correct += static_cast<double>(ember::eq(logits.argmax(1), y).sum().item<int64_t>());
  }
  Tensor totals =
      ember::from_vector(std::vector<double>{loss_sum, correct, static_cast<double>(end - begin)});
  pg.allreduce(totals)->wait();
  const std::vector<double> t = totals.to_vector<double>();
  model.train();
  return {t[0] / t[2], t[1] / t[2]};
}

// Where training stands; saved in every checkpoint's metadata.
struct Position {
  int64_t epoch = 0;          // the epoch in progress (0-based)
  int64_t step_in_epoch = 0;  // batches of that epoch already trained on
  int64_t global_step = 0;
};

// What a checkpoint holds: the model, SGD's momentum buffers, the schedule, the generator and
// the hook's per-rank state (examples/run_checkpoint.h); the position and the settings a resumed
// run must share (the data order depends on them) go in its metadata.
struct TrainingState {
  nn::Module& model;
  nn::optim::Optimizer& opt;
  nn::optim::LRScheduler* schedule;  // null: constant learning rate
  const dist::MadeCommHook* hook;    // null: no hook state
  int rank, world;
  bool* hook_restored;  // set by a load: the checkpoint had this world's hook state
};

// `with_schedule`: false when the schedule is this run's own at a converted step (another
// world size), not the saved one.
ckpt::State checkpoint_state(const TrainingState& s, bool with_schedule = true) {
  ckpt::State state = {{"model", ckpt::model(s.model)},
                       {"optim", ckpt::optimizer(s.opt, s.model)},
                       {"rng", ckpt::rng()}};
  if (s.schedule != nullptr && with_schedule) state["lr_scheduler"] = ckpt::lr_scheduler(*s.schedule);
  if (s.hook != nullptr) state["hook"] = hook_checkpoint_state(*s.hook, s.rank, s.world, s.hook_restored);
  return state;
}

// Collective: every rank writes its part (in the background with --async-checkpoint).
void save_checkpoint(const Args& a, const TrainingState& s, const Position& pos,
                     RunCheckpoint& checkpoint) {
  const std::map<std::string, std::string> meta{
      {"epoch", std::to_string(pos.epoch)},
      {"step_in_epoch", std::to_string(pos.step_in_epoch)},
      {"global_step", std::to_string(pos.global_step)},
      {"model", a.model},
      {"world_size", std::to_string(s.world)},
      {"batch_size", std::to_string(a.batch_size)},
      {"seed", std::to_string(a.seed)},
      {"comm_hook", a.comm_hook}};
  checkpoint.save(checkpoint_state(s), meta);
}

// The loader's steps per epoch at `world` ranks: DistributedSampler pads each rank's share to
// ceil(N / world) and the loader keeps the last, partial batch.
int64_t steps_per_epoch_at(int64_t dataset_size, int64_t world, int64_t batch_size) {
  return ((dataset_size + world - 1) / world + batch_size - 1) / batch_size;
}

// Loads the checkpoint if there is one; returns where to continue. A checkpoint saved at
// another world size (an elastic restart under emberrun --nnodes MIN:MAX) resumes at the same
// place in the epoch: the sampler deals each epoch's permutation out rank by rank, so the
// batches trained so far are a prefix of it, counted in samples (rounded down: at most one
// batch per rank is trained again), and the cosine schedule continues from that step of this
// run's (longer or shorter) schedule. A hook's per-rank state starts afresh then.
Position maybe_resume(const Args& a, const TrainingState& s, const RunCheckpoint* checkpoint,
                      int64_t steps_per_epoch, int64_t dataset_size) {
  if (!a.resume || checkpoint == nullptr) return {};
  const bool verbose = s.rank == 0;
  const std::string& path = checkpoint->dir();
  if (!checkpoint->exists()) {
    if (verbose) std::printf("resume: no checkpoint in %s; starting from scratch\n", path.c_str());
    return {};
  }
  // The settings and the position are checked before anything is loaded.
  const CheckpointMeta meta(path, dist::ShardedCheckpoint(path).metadata());
  meta.must_match("model", a.model);
  meta.must_match("batch_size", std::to_string(a.batch_size));
  meta.must_match("seed", std::to_string(a.seed));
  meta.must_match("comm_hook", a.comm_hook);
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  const int64_t world = s.world, saved_world = meta.get_int("world_size", 1, kMax);
  const int64_t saved_steps = saved_world == world
                                  ? steps_per_epoch
                                  : steps_per_epoch_at(dataset_size, saved_world, a.batch_size);
  Position p{meta.get_int("epoch", 0, kMax), meta.get_int("step_in_epoch", 0, saved_steps),
             meta.get_int("global_step", 0, kMax * saved_steps)};
  if (p.global_step != p.epoch * saved_steps + p.step_in_epoch) {
    throw std::runtime_error(path + ": checkpoint metadata disagree: global_step " +
                             std::to_string(p.global_step) + " is not epoch " +
                             std::to_string(p.epoch) + " x " + std::to_string(saved_steps) +
                             " steps + step_in_epoch " + std::to_string(p.step_in_epoch));
  }
  if (saved_world != world) {
    p.step_in_epoch = std::min(steps_per_epoch, p.step_in_epoch * saved_world / world);
    p.global_step = p.epoch * steps_per_epoch + p.step_in_epoch;
  }
  checkpoint->load(checkpoint_state(s, /*with_schedule=*/saved_world == world), s.rank,
                   /*optional=*/"hook");
  // The optimizer's state restored each group's lr: the saved schedule continues from it; at
  // another world size the cosine is this run's, and a constant one runs at this run's --lr.
  nn::optim::LRScheduler* schedule = s.schedule;
  nn::optim::Optimizer& opt = s.opt;
  if (schedule != nullptr && saved_world == world) {
    // restored with the rest
  } else if (schedule != nullptr) {
    // This run's schedule, whose length follows the world size, at the converted step: the
    // state of a scheduler resumed just before it, whose next step takes the closed form.
    nlohmann::json state = nlohmann::json::parse(schedule->state_dict());
    state["last_epoch"] = p.global_step - 1;
    state["step_count"] = 0;
    for (auto& group : opt.param_groups()) group.set_lr(a.lr);
    schedule->load_state_dict(state.dump());
    schedule->step();
  } else {
    for (auto& group : opt.param_groups()) group.set_lr(a.lr);
  }
  if (verbose) {
    std::printf("resume: %s at epoch %lld, step %lld of the epoch (global step %lld)\n",
                path.c_str(), static_cast<long long>(p.epoch + 1),
                static_cast<long long>(p.step_in_epoch), static_cast<long long>(p.global_step));
    if (saved_world != world) {
      std::printf("resume: saved at world size %lld, now %lld: the position was converted in "
                  "samples, the lr is %g\n",
                  static_cast<long long>(saved_world), static_cast<long long>(world),
                  opt.param_groups().front().lr());
    }
  }
  return p;
}

// The same seed everywhere gives identical initial weights (DDP broadcasts rank 0's anyway).
std::shared_ptr<nn::Module> seeded_model(const Args& a, ember::Device device) {
  ember::manual_seed(a.seed);
  auto model = make_model(a.model);
  if (!a.init_weights.empty()) {
    model->load_state_dict(nn::load_safetensors(a.init_weights).tensors());
  }
  model->to(device);
  return model;
}

// What one epoch's pass did.
struct EpochStats {
  int64_t step = 0;     // batches of the epoch passed (skipped ones included)
  int64_t skipped = 0;  // batches trained on before a resume
  double loss_sum = 0;  // over the batches trained on in this run
  int64_t trained = 0;
  double seconds = 0;
  bool stop = false;  // --max-steps reached
};

// One rank's training run: the model, its DDP wrapper, data, optimizer and schedule, and where
// training stands. Rank 0 also prints progress, writes metrics and checkpoints.
class Trainer {
 public:
  explicit Trainer(const Args& a);
  // Trains to the end (or --max-steps), evaluating after each epoch; returns the last
  // evaluation.
  Evaluation train();
  // Rank 0 prints the hook's statistics, saves the weights and prints the final accuracy.
  void report(const Evaluation& last) const;

 private:
  EpochStats train_epoch(int64_t epoch);
  double train_step(const nn::data::Batch& batch);
  void log_progress(int64_t epoch, int64_t step, LogWindow& window, bool last_step);
  void report_stragglers();
  void finish_epoch(int64_t epoch, const EpochStats& e, const Evaluation& eval);
  void fail_if_asked() const;
  void print_banner() const;
  TrainingState state() {
    return {*model_, opt_, schedule_.get(), hook_.state_dict ? &hook_ : nullptr, run_.rank,
            run_.world, &hook_restored_};
  }
  double lr() const { return opt_.param_groups().front().lr(); }
  // --max-steps reached (or passed: a checkpoint may be further on than this run's limit).
  bool reached_max_steps() const { return a_.max_steps > 0 && global_step_ >= a_.max_steps; }

  const Args& a_;
  const RunContext run_;
  std::shared_ptr<nn::Module> model_;
  std::shared_ptr<nn::data::FashionMNIST> train_set_;
  const nn::data::FashionMNIST test_set_;
  nn::data::DataLoader loader_;
  const int64_t steps_per_epoch_, total_steps_, log_every_;
  dist::DistributedDataParallel ddp_;
  dist::MadeCommHook hook_;  // --comm-hook's (empty for none)
  nn::optim::SGD opt_;
  std::unique_ptr<nn::optim::CosineAnnealingLR> schedule_;
  std::unique_ptr<RunCheckpoint> checkpoint_;  // null without --checkpoint-dir
  bool hook_restored_ = false;
  const Position start_;  // where this run started (a resumed one: the checkpoint's)
  int64_t global_step_;   // steps trained, this run's and before
  double last_lr_ = 0;    // the lr of the last step trained
  dist::StepTimes run_times_;  // this run's totals over the logged windows (ms)
  int64_t run_steps_ = 0;
  Metrics metrics_;
  const Clock::time_point t_start_ = Clock::now();
};

constexpr nn::data::Normalization kNorm{kMean, kStd};

// A split with no examples would "train" zero steps and report success: refuse it by name.
nn::data::FashionMNIST non_empty(nn::data::FashionMNIST split, const std::string& dir,
                                 const char* which) {
  if (split.size() == 0) {
    throw std::runtime_error("--data " + dir + ": the " + which + " split holds no images");
  }
  return split;
}

Trainer::Trainer(const Args& a)
    : a_(a),
      run_("fashion_mnist", a.backend, a.timeout_s, a.device),
      model_(seeded_model(a, run_.device)),
      train_set_(std::make_shared<nn::data::FashionMNIST>(
          non_empty(nn::data::FashionMNIST(a.data, true, kNorm), a.data, "training"))),
      test_set_(non_empty(nn::data::FashionMNIST(a.data, false, kNorm), a.data, "test")),
      loader_(train_set_, {.batch_size = a.batch_size,
                           .sampler = std::make_shared<nn::data::DistributedSampler>(
                               train_set_->size(), run_.world, run_.rank, /*shuffle=*/true,
                               a.seed)}),
      steps_per_epoch_(loader_.size()),
      total_steps_(a.max_steps > 0 ? std::min<int64_t>(a.max_steps, a.epochs * steps_per_epoch_)
                                   : a.epochs * steps_per_epoch_),
      log_every_(a.log_every > 0 ? a.log_every : std::max<int64_t>(1, steps_per_epoch_ / 10)),
      ddp_(model_, run_.pg),
      hook_(register_comm_hook(ddp_, a.comm_hook, a.comm_hook_plugins, a.powersgd_rank,
                               a.powersgd_start)),
      opt_(ddp_.parameters(), {.lr = a.lr, .momentum = a.momentum}),
      // Cosine from lr to 0 over the run, one scheduler step per training step.
      schedule_(a.lr_schedule == "cosine" ? std::make_unique<nn::optim::CosineAnnealingLR>(
                                                opt_, std::max<int64_t>(1, total_steps_))
                                          : nullptr),
      checkpoint_(a.checkpoint_dir.empty()
                      ? nullptr
                      : std::make_unique<RunCheckpoint>(a.checkpoint_dir, run_.pg,
                                                        a.async_checkpoint, run_.leader)),
      start_(maybe_resume(a, state(), checkpoint_.get(), steps_per_epoch_, train_set_->size())),
      global_step_(start_.global_step),
      metrics_(run_.leader ? a.metrics : "", run_.leader ? a.tensorboard : "",
               start_.global_step > 0) {
  if (run_.leader) print_banner();
}

void Trainer::print_banner() const {
  std::printf(
      "fashion_mnist: world size %d, backend %s, comm hook %s, device %s, model %s, "
      "%lld parameters, batch %lld per rank, %lld steps per epoch, SGD lr %g (%s) "
      "momentum %g, %d threads per rank\n",
      run_.world, run_.pg->backend_name().c_str(), a_.comm_hook.c_str(), run_.device.str().c_str(),
      a_.model.c_str(), static_cast<long long>(count_parameters(*model_)),
      static_cast<long long>(a_.batch_size), static_cast<long long>(steps_per_epoch_), a_.lr,
      a_.lr_schedule.c_str(), a_.momentum, ember::get_num_threads());
  std::fflush(stdout);
}

Evaluation Trainer::train() {
  if (reached_max_steps()) {
    if (run_.leader) {
      std::printf("resume: the checkpoint is at global step %lld, at or past --max-steps %lld: "
                  "nothing to train\n",
                  static_cast<long long>(global_step_), static_cast<long long>(a_.max_steps));
    }
    return evaluate(*model_, test_set_, *run_.pg, run_.device);
  }
  std::optional<Evaluation> last;
  for (int64_t epoch = start_.epoch; epoch < a_.epochs; ++epoch) {
    const EpochStats e = train_epoch(epoch);
    last = evaluate(*model_, test_set_, *run_.pg, run_.device);
    finish_epoch(epoch, e, *last);
    if (e.stop) break;
  }
  if (checkpoint_) checkpoint_->finish();
  report_stragglers();
  return last ? *last : evaluate(*model_, test_set_, *run_.pg, run_.device);
}

// Collective: rank 0 prints the spread of step time over the whole run and where the slowest
// rank's time went.
void Trainer::report_stragglers() {
  if (run_.world == 1 || run_steps_ == 0) return;
  const double n = static_cast<double>(run_steps_);
  const auto ranks = dist::gather_step_times(
      *run_.pg, {run_times_.step_ms / n, run_times_.data_ms / n, run_times_.comm_wait_ms / n});
  if (run_.leader) {
    std::printf("whole run: %s\n", dist::straggler_report(ranks).c_str());
    std::fflush(stdout);
  }
}

EpochStats Trainer::train_epoch(int64_t epoch) {
  loader_.set_epoch(epoch);
  EpochStats e;
  e.skipped = epoch == start_.epoch ? start_.step_in_epoch : 0;
  const auto t_epoch = Clock::now();
  LogWindow window;
  auto fetch_start = Clock::now();
  for (const nn::data::Batch& batch : loader_) {
    if (e.step < e.skipped) {  // resuming mid-epoch: these batches were trained on before
      ++e.step;
      window.reset(Clock::now());
      fetch_start = Clock::now();
      continue;
    }
    window.data_ms += std::chrono::duration<double, std::milli>(Clock::now() - fetch_start).count();
    const double loss = train_step(batch);
    window.comm_wait_ms += ddp_.stats().exposed_communication.last_ms;
    ++e.step;
    e.loss_sum += loss;
    ++e.trained;
    window.add(loss);
    fail_if_asked();
    const bool last_step = e.step == steps_per_epoch_ || reached_max_steps();
    // Every rank takes part in the straggler report's collective at the same steps.
    if (e.step % log_every_ == 0 || last_step) log_progress(epoch, e.step, window, last_step);
    if (checkpoint_) checkpoint_->report_failures();
    if (checkpoint_ && a_.checkpoint_every > 0 && global_step_ % a_.checkpoint_every == 0 &&
        e.step < steps_per_epoch_) {
      save_checkpoint(a_, state(), {epoch, e.step, global_step_}, *checkpoint_);
    }
    if (reached_max_steps()) {
      e.stop = true;
      break;
    }
    fetch_start = Clock::now();
  }
  e.seconds = std::chrono::duration<double>(Clock::now() - t_epoch).count();
  return e;
}

// One optimizer step on `batch`; returns its loss.
double Trainer::train_step(const nn::data::Batch& batch) {
  trace::Span step_span("train step", "step", {{"step", global_step_ + 1}});
  Tensor x = batch.data.to(run_.device), y = batch.target.to(run_.device);
  last_lr_ = lr();
  // A checkpoint being staged in the background reads the live state: a hook's state (error
  // feedback) changes during backward, the rest at the optimizer step.
  if (checkpoint_ && hook_.state_dict) checkpoint_->wait_until_staged();
  opt_.zero_grad();
  trace::Span forward_span("forward", "model");
  Tensor loss = nn::functional::cross_entropy(ddp_.forward(x), y);
  forward_span.finish();
  loss.backward();
  trace::Span optimizer_span("optimizer step", "optim");
  if (checkpoint_) checkpoint_->wait_until_staged();
  opt_.step();
  if (hook_.after_step) hook_.after_step(ddp_.parameters());  // model averaging
  if (schedule_) schedule_->step();
  optimizer_span.finish();
  ++global_step_;
  const float value = loss.item<float>();
  check_loss_is_finite(value, "global step", global_step_, run_.rank, a_.continue_on_nan);
  return value;
}

void Trainer::fail_if_asked() const {
  stop_self_if_asked("fashion_mnist", run_.rank, run_.world, global_step_, a_.fail_at_step,
                     a_.hang_at_step, [this] {
                       if (checkpoint_) checkpoint_->finish();
                     });
}

// Collective (the straggler report's gather); rank 0 prints the progress line and the report
// (on a terminal, whose progress line redraws in place, the report only at the epoch's end).
void Trainer::log_progress(int64_t epoch, int64_t step, LogWindow& window, bool last_step) {
  const auto now = Clock::now();
  const dist::StepTimes mine = window.times(now);
  const std::vector<dist::StepTimes> ranks = dist::gather_step_times(*run_.pg, mine);
  const double n = static_cast<double>(window.steps);
  run_times_.step_ms += mine.step_ms * n;
  run_times_.data_ms += mine.data_ms * n;
  run_times_.comm_wait_ms += mine.comm_wait_ms * n;
  run_steps_ += window.steps;
  if (!run_.leader) {
    window.reset(now);
    return;
  }
  const double dt = std::chrono::duration<double>(now - window.since).count();
  const double images = static_cast<double>(a_.batch_size * run_.world);
  const double ips = dt > 0 ? static_cast<double>(window.steps) * images / dt : 0;
  const double eta = ips > 0 ? static_cast<double>(steps_per_epoch_ - step) * images / ips : 0;
  const double loss = window.loss_sum / static_cast<double>(window.steps);
  print_progress(static_cast<int>(epoch + 1), a_.epochs, step, steps_per_epoch_, loss, ips, eta,
                 run_.tty);
  if (run_.tty && last_step) std::printf("\n");
  if (run_.world > 1 && (!run_.tty || last_step)) {
    std::printf("  %s\n", dist::straggler_report(ranks).c_str());
    std::fflush(stdout);
  }
  const int slowest = dist::slowest_rank(ranks);
  metrics_.write({{"kind", "step"},
                  {"epoch", epoch + 1},
                  {"step", step},
                  {"global_step", global_step_},
                  {"loss", loss},
                  {"images_per_s", ips},
                  {"lr", last_lr_},
                  {"time_s", std::chrono::duration<double>(now - t_start_).count()},
                  {"slowest_rank", slowest},
                  {"step_ms", ranks[static_cast<size_t>(slowest)].step_ms},
                  {"data_ms", mine.data_ms},
                  {"comm_wait_ms", mine.comm_wait_ms}});
  window.reset(now);
}

// Rank 0 prints and records the epoch's results; every rank takes part in the checkpoint.
void Trainer::finish_epoch(int64_t epoch, const EpochStats& e, const Evaluation& eval) {
  const bool complete = e.step == steps_per_epoch_;
  if (run_.leader) {
    const double ips =
        e.seconds > 0 ? static_cast<double>(e.step - e.skipped) *
                            static_cast<double>(a_.batch_size * run_.world) / e.seconds
                      : 0;
    const double train_loss = e.trained ? e.loss_sum / static_cast<double>(e.trained) : 0.0;
    std::printf(
        "epoch %lld/%d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, %.1f s, "
        "%.0f img/s\n",
        static_cast<long long>(epoch + 1), a_.epochs, train_loss, eval.loss, 100 * eval.accuracy,
        e.seconds, ips);
    std::fflush(stdout);
    metrics_.write({{"kind", "epoch"},
                    {"epoch", epoch + 1},
                    {"global_step", global_step_},
                    {"train_loss", train_loss},
                    {"test_loss", eval.loss},
                    {"test_accuracy", eval.accuracy},
                    {"time_s", e.seconds},
                    {"images_per_s", ips},
                    {"complete", complete},
                    {"ddp", ddp_json(ddp_.stats())}});
  }
  if (checkpoint_) {
    save_checkpoint(
        a_, state(),
        complete ? Position{epoch + 1, 0, global_step_} : Position{epoch, e.step, global_step_},
        *checkpoint_);
  }
}

void Trainer::report(const Evaluation& last) const {
  if (!run_.leader) return;
  if (hook_.summary) std::printf("%s\n", hook_.summary().c_str());
  if (const std::string bytes = ddp_bytes_line(ddp_.stats()); !bytes.empty()) {
    std::printf("%s\n", bytes.c_str());
  }
  if (!a_.save_weights.empty()) {
    nn::save_state_dict(a_.save_weights, model_->state_dict(),
                        {{"model", a_.model}, {"global_step", std::to_string(global_step_)}});
  }
  std::printf("test_accuracy=%.4f\n", last.accuracy);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Fashion-MNIST trained data-parallel with Ember's DistributedDataParallel.\n"
      "Run it under emberrun (emberrun --nproc-per-node 2 fashion_mnist ...), mpirun, or alone."};
  app.add_option("--data", a.data, "folder with the IDX files (.gz or not)")->capture_default_str();
  app.add_option("--model", a.model, "cnn or mlp")
      ->check(CLI::IsMember({"cnn", "mlp"}))
      ->capture_default_str();
  app.add_option("--epochs", a.epochs, "passes over the training set (0: evaluate only)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--max-steps", a.max_steps, "stop after this many steps in all (0: no limit)")
      ->check(kNonNegative);
  app.add_option("--batch-size", a.batch_size, "examples per rank per step")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--lr", a.lr, "SGD learning rate")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--lr-schedule", a.lr_schedule, "constant, or cosine from --lr to 0 over the run")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  app.add_option("--momentum", a.momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--seed", a.seed, "weights and data order")->capture_default_str();
  app.add_option("--backend", a.backend, "gloo, mpi or nccl")
      ->check(CLI::IsMember({"gloo", "mpi", "nccl"}))
      ->capture_default_str();
  app.add_option("--device", a.device,
                 "cpu, cuda (one GPU per rank: the local rank's) or cuda:N (every rank on GPU N)")
      ->check(kDeviceName)
      ->capture_default_str();
  app.add_option("--comm-hook", a.comm_hook,
                 "gradient communication: none or a registered hook, NAME[:key=value,...] "
                 "(see docs/ddp.md)")
      ->capture_default_str();
  app.add_option("--comm-hook-plugin", a.comm_hook_plugins,
                 "a shared library that registers comm hooks (repeatable)");
  app.add_option("--powersgd-rank", a.powersgd_rank, "PowerSGD's matrix approximation rank")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--powersgd-start", a.powersgd_start, "plain all-reduce for this many steps first")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_flag("--continue-on-nan", a.continue_on_nan,
               "keep training when the loss is NaN or infinite (default: stop with an error)");
  app.add_option("--checkpoint-dir", a.checkpoint_dir,
                 "write the run's checkpoint here (every rank its part; docs/checkpoints.md) "
                 "after each epoch");
  app.add_option("--checkpoint-every", a.checkpoint_every, "also every N steps")
      ->check(kNonNegative);
  app.add_flag("--async-checkpoint", a.async_checkpoint,
               "write checkpoints in the background: a step waits only for the copy to memory");
  app.add_flag("--resume", a.resume,
               "continue from the checkpoint in --checkpoint-dir if there is one");
  app.add_option("--save-weights", a.save_weights, "write the final weights to FILE.safetensors");
  app.add_option("--init-weights", a.init_weights, "start from the weights in FILE.safetensors");
  app.add_option("--metrics", a.metrics,
                 "append one JSON line per logged step and per epoch to FILE.jsonl");
  app.add_option("--tensorboard", a.tensorboard,
                 "also write the metrics as TensorBoard scalars into event files in DIR");
  app.add_option("--log-every", a.log_every, "steps between progress lines (0: ten per epoch)")
      ->check(kNonNegative);
  app.add_option("--timeout", a.timeout_s,
                 "seconds a collective may wait for the other ranks before the job fails "
                 "(0: EMBER_PG_TIMEOUT, else 30 minutes)")
      ->check(kNonNegative);
  add_fault_options(app, a.fail_at_step, a.hang_at_step);
  const auto status = parse_command_line(app, argc, argv, [&]() -> std::string {
    if ((a.resume || a.async_checkpoint || a.checkpoint_every > 0) && a.checkpoint_dir.empty()) {
      return "--resume, --checkpoint-every and --async-checkpoint need --checkpoint-dir";
    }
    return "";
  });
  if (status) return *status;
  return train_and_report<Trainer>("fashion_mnist", a);
}
