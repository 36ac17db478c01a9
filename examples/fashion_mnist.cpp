// Fashion-MNIST trained data-parallel with DistributedDataParallel: Ember's main example and
// `make train`. Each rank trains on its DistributedSampler share of every epoch; gradients are
// averaged across ranks during backward; rank 0 prints progress and writes checkpoints.
//
//   emberrun --nproc-per-node 2 build/examples/fashion_mnist --model cnn --epochs 3
//   mpirun -np 2 build/examples/fashion_mnist --backend mpi
//   build/examples/fashion_mnist --epochs 1            # one process, no launcher needed
//
// See docs/quickstart.md for a walk through this file.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "distributed/comm_hooks.h"
#include "distributed/ddp.h"
#include "distributed/hash_store.h"
#include "distributed/init.h"
#include "distributed/powersgd.h"
#include "nn/nn.h"
#include "tensor/creation.h"
#include "tensor/cuda.h"
#include "tensor/elementwise.h"
#include "tensor/grad_mode.h"
#include "tensor/random.h"
#include "tensor/threading.h"

namespace nn = ember::nn;
namespace dist = ember::dist;
using ember::Tensor;
using Clock = std::chrono::steady_clock;

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
  int64_t powersgd_rank = 2;
  int64_t powersgd_start = 10;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // steps; 0: at the end of each epoch only
  bool resume = false;
  std::string save_weights;
  std::string metrics;
  int64_t log_every = 0;  // steps; 0: ten progress lines per epoch
  int64_t fail_at_step = -1;  // testing aid: SIGKILL rank 1 at this global step, first run only
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

// init_process_group from the launcher's (or mpirun's, or Slurm's) variables; a plain run
// without any of them is a world of one.
std::shared_ptr<dist::ProcessGroup> init_distributed(const std::string& backend) {
  const bool launched = std::getenv("RANK") || std::getenv("OMPI_COMM_WORLD_RANK") ||
                        std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID");
  dist::InitOptions o;
  o.backend = backend;
  if (!launched && backend != "mpi") {
    o.store = std::make_shared<dist::HashStore>();
    o.rank = 0;
    o.world_size = 1;
  }
  return dist::init_process_group(o);
}

// Rank 0's metrics file: one JSON object per line, appended and flushed line by line, so a
// crash loses at most the line being written.
class Metrics {
 public:
  Metrics(const std::string& path, bool append) {
    if (path.empty()) return;
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw std::runtime_error("--metrics: cannot open '" + path + "' for writing");
  }
  void write(const nlohmann::json& j) {
    if (!out_.is_open()) return;
    out_ << j.dump() << '\n';
    out_.flush();
  }

 private:
  std::ofstream out_;
};

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = std::lround(s);
  std::ostringstream os;
  if (t >= 3600) os << t / 3600 << "h" << (t % 3600) / 60 << "m";
  else if (t >= 60) os << t / 60 << "m" << t % 60 << "s";
  else os << t << "s";
  return os.str();
}

// One progress line: "epoch 1/3 [#####-----]  50%  469/938  loss 0.4521  6250 img/s  ETA 8s".
// On a terminal it redraws in place; through a pipe (emberrun, mpirun, a log) it is a line.
void print_progress(int epoch, int epochs, int64_t step, int64_t steps, double loss,
                    double images_per_s, double eta_s, bool tty) {
  constexpr int kWidth = 20;
  const int filled = steps > 0 ? static_cast<int>(kWidth * step / steps) : kWidth;
  char buf[256];
  std::snprintf(buf, sizeof buf, "epoch %d/%d [%s%s] %3d%%  %lld/%lld  loss %.4f  %.0f img/s  ETA %s",
                epoch, epochs, std::string(filled, '#').c_str(),
                std::string(kWidth - filled, '-').c_str(),
                steps > 0 ? static_cast<int>(100 * step / steps) : 100,
                static_cast<long long>(step), static_cast<long long>(steps), loss, images_per_s,
                format_duration(eta_s).c_str());
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
  Tensor totals = ember::from_vector(std::vector<double>{loss_sum, correct,
                                                         static_cast<double>(end - begin)});
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

std::string checkpoint_path(const std::string& dir) { return dir + "/checkpoint.safetensors"; }

// The communication hook's state is per rank (PowerSGD's error feedback differs between ranks):
// rank 0 gathers every rank's tensors into the checkpoint as "hook.rank<r>.<name>". Collective
// when there is a hook state; returns what rank 0 saves.
nn::NamedTensors gather_hook_state(const dist::PowerSGDState* state, dist::ProcessGroup& pg) {
  nn::NamedTensors out;
  if (state == nullptr) return out;
  for (const auto& [name, t] : state->state_dict()) {
    Tensor local = t.to(ember::kCPU).contiguous();
    std::vector<Tensor> all;
    if (pg.rank() == 0) {
      for (int r = 0; r < pg.size(); ++r) all.push_back(ember::empty_like(local));
    }
    pg.gather(all, local, dist::GatherOptions{})->wait();
    for (int r = 0; r < static_cast<int>(all.size()); ++r) {
      out.emplace_back("hook.rank" + std::to_string(r) + "." + name, all[r]);
    }
  }
  return out;
}

// Every rank calls it at the same step (the hook state is gathered); rank 0 writes the file.
void save_checkpoint(const Args& a, const nn::Module& model, const nn::optim::Optimizer& opt,
                     const Position& pos, dist::ProcessGroup& pg, const dist::PowerSGDState* hook) {
  const nn::NamedTensors extra = gather_hook_state(hook, pg);
  if (pg.rank() != 0) return;
  const int world_size = pg.size();
  std::filesystem::create_directories(a.checkpoint_dir);
  nn::save_checkpoint(checkpoint_path(a.checkpoint_dir), model, &opt,
                      {{"epoch", std::to_string(pos.epoch)},
                       {"step_in_epoch", std::to_string(pos.step_in_epoch)},
                       {"global_step", std::to_string(pos.global_step)},
                       {"model", a.model},
                       {"world_size", std::to_string(world_size)},
                       {"batch_size", std::to_string(a.batch_size)},
                       {"seed", std::to_string(a.seed)},
                       {"comm_hook", a.comm_hook}},
                      extra);
}

// Loads the checkpoint if there is one; returns where to continue.
Position maybe_resume(const Args& a, nn::Module& model, nn::optim::Optimizer& opt, int world_size,
                      int rank, dist::PowerSGDState* hook, bool verbose) {
  if (!a.resume || a.checkpoint_dir.empty()) return {};
  const std::string path = checkpoint_path(a.checkpoint_dir);
  if (!std::filesystem::exists(path)) {
    if (verbose) std::printf("resume: no checkpoint at %s; starting from scratch\n", path.c_str());
    return {};
  }
  nn::NamedTensors extra;
  const std::map<std::string, std::string> meta = nn::load_checkpoint(path, model, &opt, &extra);
  auto get = [&](const char* key) -> std::string {
    auto it = meta.find(key);
    if (it == meta.end()) throw std::runtime_error(path + ": checkpoint metadata lacks '" + key + "'");
    return it->second;
  };
  auto must_match = [&](const char* key, const std::string& now) {
    if (get(key) != now) {
      throw std::runtime_error(path + ": saved with " + key + " " + get(key) + ", but this run has " +
                               now + "; resume with the same settings (the data order depends on them)");
    }
  };
  must_match("model", a.model);
  must_match("world_size", std::to_string(world_size));
  must_match("batch_size", std::to_string(a.batch_size));
  must_match("seed", std::to_string(a.seed));
  must_match("comm_hook", a.comm_hook);
  if (hook != nullptr) {  // this rank's share of the hook state
    const std::string prefix = "hook.rank" + std::to_string(rank) + ".";
    nn::NamedTensors mine;
    for (auto& [name, t] : extra) {
      if (name.rfind(prefix, 0) == 0) mine.emplace_back(name.substr(prefix.size()), t);
    }
    hook->load_state_dict(mine);
  }
  Position p{std::stoll(get("epoch")), std::stoll(get("step_in_epoch")), std::stoll(get("global_step"))};
  if (verbose) {
    std::printf("resume: %s at epoch %lld, step %lld of the epoch (global step %lld)\n",
                path.c_str(), static_cast<long long>(p.epoch + 1),
                static_cast<long long>(p.step_in_epoch), static_cast<long long>(p.global_step));
  }
  return p;
}

int run(const Args& a) {
  auto pg = init_distributed(a.backend);
  const int rank = pg->rank(), world = pg->size();
  const bool leader = rank == 0;
  const bool tty = leader && isatty(STDOUT_FILENO);
  ember::Device device(a.device);
  if (device.is_cuda()) {
    EMBER_CHECK(ember::cuda::is_available(), "[fashion_mnist] --device cuda: ",
                ember::cuda::unavailable_reason());
    // One GPU per rank: the group's own with nccl, else LOCAL_RANK's (modulo the GPUs there
    // are, so ranks may share one), as a torch script's torch.cuda.set_device(local_rank).
    if (pg->default_device().is_cuda()) {
      device = pg->default_device();
    } else {
      const char* local = std::getenv("LOCAL_RANK");
      device = ember::cuda_device((local ? std::atoi(local) : 0) % ember::cuda::device_count());
    }
    ember::cuda::set_device(device.index);
  }

  // Same seed everywhere: identical initial weights (DDP broadcasts rank 0's anyway).
  ember::manual_seed(a.seed);
  auto model = make_model(a.model);
  model->to(device);

  const nn::data::Normalization norm{kMean, kStd};
  auto train_set = std::make_shared<nn::data::MNIST>(a.data, true, norm);
  const nn::data::MNIST test_set(a.data, false, norm);
  auto sampler = std::make_shared<nn::data::DistributedSampler>(train_set->size(), world, rank,
                                                                /*shuffle=*/true, a.seed);
  nn::data::DataLoader loader(train_set, {.batch_size = a.batch_size, .sampler = sampler});
  const int64_t steps_per_epoch = loader.size();

  dist::DistributedDataParallel ddp(model, pg);
  std::shared_ptr<dist::PowerSGDState> powersgd;
  if (a.comm_hook == "allreduce") {
    ddp.register_comm_hook(dist::allreduce_hook);
  } else if (a.comm_hook == "fp16") {
    ddp.register_comm_hook(dist::fp16_compress_hook);
  } else if (a.comm_hook == "bf16") {
    ddp.register_comm_hook(dist::bf16_compress_hook);
  } else if (a.comm_hook == "powersgd" || a.comm_hook == "batched_powersgd") {
    powersgd = std::make_shared<dist::PowerSGDState>(dist::PowerSGDOptions{
        .matrix_approximation_rank = a.powersgd_rank, .start_powerSGD_iter = a.powersgd_start});
    if (a.comm_hook == "powersgd") {
      ddp.register_comm_hook(powersgd, dist::powersgd_hook);
    } else {
      ddp.register_comm_hook(powersgd, dist::batched_powersgd_hook);
    }
  }
  nn::optim::SGD opt(ddp.parameters(), {.lr = a.lr, .momentum = a.momentum});
  Position pos = maybe_resume(a, *model, opt, world, rank, powersgd.get(), leader);
  Metrics metrics(leader ? a.metrics : "", pos.global_step > 0);

  if (leader) {
    std::printf("fashion_mnist: world size %d, backend %s, comm hook %s, device %s, model %s, %lld parameters, "
                "batch %lld per rank, %lld steps per epoch, SGD lr %g (%s) momentum %g, %d threads per rank\n",
                world, pg->backend_name().c_str(), a.comm_hook.c_str(), device.str().c_str(), a.model.c_str(),
                static_cast<long long>([&] {
                  int64_t n = 0;
                  for (const Tensor& p : model->parameters()) n += p.numel();
                  return n;
                }()),
                static_cast<long long>(a.batch_size), static_cast<long long>(steps_per_epoch),
                a.lr, a.lr_schedule.c_str(), a.momentum, ember::get_num_threads());
    std::fflush(stdout);
  }

  // The learning rate at a global step: constant, or cosine-annealed from lr to 0 over the run
  // (a function of the step alone, so a resumed run follows the same curve).
  const int64_t total_steps = a.max_steps > 0 ? std::min<int64_t>(a.max_steps, a.epochs * steps_per_epoch)
                                              : a.epochs * steps_per_epoch;
  auto lr_at = [&](int64_t step) {
    if (a.lr_schedule == "constant") return a.lr;
    return 0.5 * a.lr * (1 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(total_steps)));
  };

  const int64_t log_every = a.log_every > 0 ? a.log_every : std::max<int64_t>(1, steps_per_epoch / 10);
  const bool first_run = std::getenv("EMBER_RESTART_COUNT") == nullptr ||
                         std::string(std::getenv("EMBER_RESTART_COUNT")) == "0";
  bool stop = false;
  Evaluation last{};
  bool evaluated = false;
  const auto t_start = Clock::now();
  for (int64_t epoch = pos.epoch; epoch < a.epochs && !stop; ++epoch) {
    loader.set_epoch(epoch);
    const int64_t skip = epoch == pos.epoch ? pos.step_in_epoch : 0;
    const auto t_epoch = Clock::now();
    auto t_log = t_epoch;
    double loss_acc = 0, epoch_loss = 0;
    int64_t loss_n = 0, epoch_n = 0, step = 0;
    for (const nn::data::Batch& batch : loader) {
      if (step < skip) {  // resuming mid-epoch: these batches were trained on before
        ++step;
        t_log = Clock::now();
        continue;
      }
      Tensor x = batch.data.to(device), y = batch.target.to(device);
      const double lr = lr_at(pos.global_step);
      for (auto& group : opt.param_groups()) group.set_lr(lr);
      opt.zero_grad();
      Tensor loss = nn::functional::cross_entropy(ddp.forward(x), y);
      loss.backward();
      opt.step();
      ++step;
      ++pos.global_step;
      const double l = loss.item<float>();
      loss_acc += l;
      epoch_loss += l;
      ++loss_n;
      ++epoch_n;
      if (a.fail_at_step == pos.global_step && rank == std::min(1, world - 1) && first_run) {
        std::fprintf(stderr, "fashion_mnist: --fail-at-step %lld: rank %d kills itself\n",
                     static_cast<long long>(a.fail_at_step), rank);
        std::fflush(stderr);
        std::raise(SIGKILL);
      }
      const bool last_step = step == steps_per_epoch || pos.global_step == a.max_steps;
      if (leader && (step % log_every == 0 || last_step)) {
        const auto now = Clock::now();
        const double dt = std::chrono::duration<double>(now - t_log).count();
        const double ips = dt > 0 ? static_cast<double>(loss_n * a.batch_size * world) / dt : 0;
        const double eta = ips > 0 ? static_cast<double>((steps_per_epoch - step) * a.batch_size * world) / ips : 0;
        print_progress(static_cast<int>(epoch + 1), a.epochs, step, steps_per_epoch,
                       loss_acc / loss_n, ips, eta, tty);
        metrics.write({{"kind", "step"}, {"epoch", epoch + 1}, {"step", step},
                       {"global_step", pos.global_step}, {"loss", loss_acc / loss_n},
                       {"images_per_s", ips}, {"lr", lr_at(pos.global_step - 1)},
                       {"time_s", std::chrono::duration<double>(now - t_start).count()}});
        loss_acc = 0;
        loss_n = 0;
        t_log = now;
      }
      if (a.checkpoint_every > 0 && !a.checkpoint_dir.empty() &&
          pos.global_step % a.checkpoint_every == 0 && step < steps_per_epoch) {
        save_checkpoint(a, *model, opt, {epoch, step, pos.global_step}, *pg, powersgd.get());
      }
      if (pos.global_step == a.max_steps) {
        stop = true;
        break;
      }
    }
    if (tty) std::printf("\n");
    const double epoch_s = std::chrono::duration<double>(Clock::now() - t_epoch).count();
    last = evaluate(*model, test_set, *pg, device);
    evaluated = true;
    const int64_t trained = step - skip;
    if (leader) {
      const double ips = epoch_s > 0 ? static_cast<double>(trained * a.batch_size * world) / epoch_s : 0;
      std::printf("epoch %lld/%d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, %.1f s, "
                  "%.0f img/s\n",
                  static_cast<long long>(epoch + 1), a.epochs, epoch_n ? epoch_loss / epoch_n : 0.0,
                  last.loss, 100 * last.accuracy, epoch_s, ips);
      std::fflush(stdout);
      metrics.write({{"kind", "epoch"}, {"epoch", epoch + 1}, {"global_step", pos.global_step},
                     {"train_loss", epoch_n ? epoch_loss / epoch_n : 0.0}, {"test_loss", last.loss},
                     {"test_accuracy", last.accuracy}, {"time_s", epoch_s}, {"images_per_s", ips},
                     {"complete", step == steps_per_epoch}});
    }
    if (!a.checkpoint_dir.empty()) {
      const bool complete = step == steps_per_epoch;
      save_checkpoint(a, *model, opt,
                      complete ? Position{epoch + 1, 0, pos.global_step}
                               : Position{epoch, step, pos.global_step},
                      *pg, powersgd.get());
    }
  }
  if (!evaluated) last = evaluate(*model, test_set, *pg, device);
  if (leader && powersgd && pos.global_step > a.powersgd_start) {
    const auto stats = powersgd->compression_stats();
    std::printf("powersgd: rank %lld, %lld of %lld gradient elements all-reduced (%.1fx fewer)\n",
                static_cast<long long>(a.powersgd_rank), static_cast<long long>(stats.numel_after),
                static_cast<long long>(stats.numel_before), stats.rate);
  }
  if (leader) {
    if (!a.save_weights.empty()) {
      nn::save_safetensors(a.save_weights, model->state_dict(),
                           {{"model", a.model}, {"global_step", std::to_string(pos.global_step)}});
    }
    std::printf("test_accuracy=%.4f\n", last.accuracy);
    std::fflush(stdout);
  }
  dist::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Fashion-MNIST trained data-parallel with Ember's DistributedDataParallel.\n"
               "Run it under emberrun (emberrun --nproc-per-node 2 fashion_mnist ...), mpirun, or alone."};
  app.add_option("--data", a.data, "folder with the IDX files (.gz or not)")->capture_default_str();
  app.add_option("--model", a.model, "cnn or mlp")->check(CLI::IsMember({"cnn", "mlp"}))->capture_default_str();
  app.add_option("--epochs", a.epochs, "passes over the training set")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-steps", a.max_steps, "stop after this many steps in all (0: no limit)")->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", a.batch_size, "examples per rank per step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", a.lr, "SGD learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr-schedule", a.lr_schedule, "constant, or cosine from --lr to 0 over the run")
      ->check(CLI::IsMember({"constant", "cosine"}))->capture_default_str();
  app.add_option("--momentum", a.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--seed", a.seed, "weights and data order")->capture_default_str();
  app.add_option("--backend", a.backend, "gloo, mpi or nccl")->check(CLI::IsMember({"gloo", "mpi", "nccl"}))->capture_default_str();
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--comm-hook", a.comm_hook, "gradient communication (see docs/ddp.md)")
      ->check(CLI::IsMember({"none", "allreduce", "fp16", "bf16", "powersgd", "batched_powersgd"}))
      ->capture_default_str();
  app.add_option("--powersgd-rank", a.powersgd_rank, "PowerSGD's matrix approximation rank")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--powersgd-start", a.powersgd_start, "plain all-reduce for this many steps first")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "write checkpoint.safetensors here after each epoch");
  app.add_option("--checkpoint-every", a.checkpoint_every, "also every N steps")->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", a.resume, "continue from the checkpoint in --checkpoint-dir if there is one");
  app.add_option("--save-weights", a.save_weights, "write the final weights to FILE.safetensors");
  app.add_option("--metrics", a.metrics, "append one JSON line per logged step and per epoch to FILE.jsonl");
  app.add_option("--log-every", a.log_every, "steps between progress lines (0: ten per epoch)")->check(CLI::NonNegativeNumber);
  app.add_option("--fail-at-step", a.fail_at_step, "testing aid: rank 1 kills itself at this step in the first run")->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the help, or the error and a usage hint
    return code == 0 ? 0 : 2;
  }
  if (a.resume && a.checkpoint_dir.empty()) {
    std::fprintf(stderr, "fashion_mnist: --resume needs --checkpoint-dir\n");
    return 2;
  }
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: error: %s\n", e.what());
    return 1;
  }
}
