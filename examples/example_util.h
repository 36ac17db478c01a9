// What the example programs share: process group and device set-up, the communication hook,
// the metrics file, checkpoint metadata, the straggler bookkeeping and CLI validators, so that
// every example behaves alike under emberrun, mpirun and alone.
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ember/distributed/ddp/comm_hooks.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/ddp/hook_registry.h>
#include <ember/distributed/debug/stragglers.h>
#include <ember/distributed/init.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/nn/nn.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/version.h>

namespace ember::examples {

using Clock = std::chrono::steady_clock;

// init_process_group from the launcher's (or mpirun's, or Slurm's) variables; a plain run
// without any of them is a world of one.
inline std::shared_ptr<dist::ProcessGroup> init_distributed(const std::string& backend, int timeout_s) {
  dist::InitOptions o;
  o.backend = backend;
  if (timeout_s > 0) o.timeout = std::chrono::seconds(timeout_s);
  if (!dist::launched_as_rank() && backend != "mpi") {
    o.store = std::make_shared<dist::HashStore>();
    o.rank = 0;
    o.world_size = 1;
  }
  return dist::init_process_group(o);
}

// --tensorboard: every number of a metrics record becomes the scalar "<kind>/<key>" (nested
// objects "<kind>/<key>/<field>") at the record's global step, written at once, as the JSON
// lines are; where in the run the record stands (epoch, step) is the x axis, not a series.
inline void log_to_tensorboard(nn::SummaryWriter& tb, const std::string& prefix, const nlohmann::json& j,
                        int64_t step) {
  for (const auto& [key, v] : j.items()) {
    if (v.is_number()) tb.add_scalar(prefix + "/" + key, v.get<double>(), step);
    if (v.is_object()) log_to_tensorboard(tb, prefix + "/" + key, v, step);
  }
}

// Rank 0's metrics file: one JSON object per line, appended and flushed line by line, so a
// crash loses at most the line being written. With --tensorboard, the same records go to an
// event file in that folder too.
class Metrics {
 public:
  Metrics(const std::string& path, const std::string& tensorboard_dir, bool append) {
    if (!tensorboard_dir.empty()) {
      tensorboard_.emplace(tensorboard_dir, nn::SummaryWriter::Options{.flush_secs = 0, .rank = 0});
    }
    if (path.empty()) return;
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) throw std::runtime_error("--metrics: cannot open '" + path + "' for writing");
  }
  void write(const nlohmann::json& j) {
    if (tensorboard_) {
      nlohmann::json values = j;
      for (const char* position : {"kind", "epoch", "step", "global_step"}) values.erase(position);
      log_to_tensorboard(*tensorboard_, j.value("kind", "metrics"), values,
                         j.value("global_step", int64_t{0}));
    }
    if (!out_.is_open()) return;
    out_ << j.dump() << '\n';
    out_.flush();
  }

 private:
  std::ofstream out_;
  std::optional<nn::SummaryWriter> tensorboard_;
};

inline std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = std::lround(s);
  std::ostringstream os;
  if (t >= 3600)
    os << t / 3600 << "h" << (t % 3600) / 60 << "m";
  else if (t >= 60)
    os << t / 60 << "m" << t % 60 << "s";
  else
    os << t << "s";
  return os.str();
}


// The metadata of a checkpoint being resumed, checked against this run's settings.
class CheckpointMeta {
 public:
  CheckpointMeta(std::string path, std::map<std::string, std::string> meta)
      : path_(std::move(path)), meta_(std::move(meta)) {}
  bool has(const char* key) const { return meta_.count(key) != 0; }
  const std::string& get(const char* key) const {
    auto it = meta_.find(key);
    if (it == meta_.end()) {
      throw std::runtime_error(path_ + ": checkpoint metadata lacks '" + key + "'");
    }
    return it->second;
  }
  // The integer under `key`, which must lie in [lo, hi]: a damaged or hand-edited checkpoint is
  // refused by name rather than resumed from a nonsense position.
  int64_t get_int(const char* key, int64_t lo, int64_t hi) const {
    const std::string& text = get(key);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi) {
      throw std::runtime_error(path_ + ": checkpoint metadata '" + key + "' must be an integer in [" +
                               std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + text +
                               "'");
    }
    return v;
  }
  void must_match(const char* key, const std::string& now) const {
    if (get(key) != now) {
      throw std::runtime_error(path_ + ": saved with " + key + " " + get(key) +
                               ", but this run has " + now +
                               "; resume with the same settings (the data order depends on them)");
    }
  }

 private:
  std::string path_;
  std::map<std::string, std::string> meta_;
};

// The device this rank trains on: dist::local_device's reading of --device (the local rank's GPU
// for "cuda", GPU N for "cuda:N", made current), except that an NCCL group's own GPU wins over
// any GPU asked for: NCCL's collectives run there, so the model must be there too.
inline ember::Device pick_device(const std::string& program, const std::string& name,
                                 const dist::ProcessGroup& pg) {
  if (name != "cpu" && pg.default_device().is_cuda()) {
    ember::cuda::set_device(pg.default_device().index);
    return pg.default_device();
  }
  return dist::local_device(name, program);
}

// Where a trainer stands in the job, the first thing its constructor sets up: the process group
// (joined here), this rank and the world size, whether this rank leads (rank 0 prints and writes
// the files), whether the leader prints to a terminal (progress then redraws one line), and the
// device this rank trains on.
struct RunContext {
  RunContext(const char* program, const std::string& backend, int timeout_s,
             const std::string& device_name)
      : pg(init_distributed(backend, timeout_s)),
        rank(pg->rank()),
        world(pg->size()),
        leader(rank == 0),
        tty(leader && isatty(STDOUT_FILENO)),
        device(pick_device(program, device_name, *pg)) {}

  std::shared_ptr<dist::ProcessGroup> pg;
  int rank, world;
  bool leader, tty;
  ember::Device device;
};

// Loads --comm-hook-plugin's libraries, then makes --comm-hook's hook (any registered spec,
// dist::make_comm_hook; "none": no hook) and registers it on `ddp`. "powersgd" and
// "batched_powersgd" without options take --powersgd-rank and --powersgd-start. Returns the made
// hook (its state, summary and after-step work); an empty one for "none".
inline dist::MadeCommHook register_comm_hook(dist::DistributedDataParallel& ddp,
                                             const std::string& comm_hook,
                                             const std::vector<std::string>& plugins,
                                             int64_t powersgd_rank, int64_t powersgd_start) {
  for (const std::string& path : plugins) dist::load_comm_hook_plugin(path);
  if (comm_hook == "none") return {};
  std::string spec = comm_hook;
  if (spec == "powersgd" || spec == "batched_powersgd") {
    spec += ":rank=" + std::to_string(powersgd_rank) + ",start=" + std::to_string(powersgd_start);
  }
  dist::MadeCommHook made = dist::make_comm_hook(spec, ddp.process_group());
  ddp.register_comm_hook(made.hook, made.name);
  return made;
}

inline int64_t count_parameters(const nn::Module& model) {
  int64_t n = 0;
  for (const Tensor& p : model.parameters()) n += p.numel();
  return n;
}

// DistributedDataParallel's statistics for the metrics file.
inline nlohmann::json ddp_json(const dist::DDPStats& s) {
  auto timing = [](const dist::DDPStats::Timing& t) {
    return nlohmann::json{{"last_ms", t.last_ms}, {"mean_ms", t.mean_ms}};
  };
  return {{"world_size", s.world_size},
          {"backend", s.backend},
          {"comm_hook", s.comm_hook},
          {"parameters", s.parameters},
          {"bucket_count", s.bucket_count},
          {"bucket_bytes", s.bucket_bytes},
          {"rebuilds", s.rebuilds},
          {"unused_parameters", s.unused_parameters},
          {"iterations", s.iterations},
          {"bytes_sent", s.bytes_sent},
          {"bucket_bytes_sent", s.bucket_bytes_sent},
          {"allreduce_bytes", s.allreduce_bytes},
          {"compression_ratio", s.compression_ratio},
          {"forward", timing(s.forward)},
          {"backward", timing(s.backward)},
          {"communication", timing(s.communication)},
          {"overlapped_communication", timing(s.overlapped_communication)},
          {"exposed_communication", timing(s.exposed_communication)}};
}

// "gradients: 0.6 MB sent per step (all-reduce: 2.7 MB, 4.4x fewer over the run)", or "" before
// DDP's first synchronised step or when a hook did not count its bytes.
inline std::string ddp_bytes_line(const dist::DDPStats& s) {
  if (s.iterations == 0 || s.bytes_sent < 0) return "";
  char line[160];
  std::snprintf(line, sizeof line,
                "gradients: %.2f MB sent per step by this rank (all-reduce: %.2f MB; %.1fx fewer "
                "over the run)",
                s.bytes_sent / 1e6, s.allreduce_bytes / 1e6, s.compression_ratio);
  return line;
}

// Loss averages, throughput and where this rank's time went between two progress lines.
struct LogWindow {
  double loss_sum = 0;
  int64_t steps = 0;
  Clock::time_point since = Clock::now();
  double data_ms = 0;       // waiting for batches
  double comm_wait_ms = 0;  // the end of backward waiting for DDP's communication
  void add(double loss) {
    loss_sum += loss;
    ++steps;
  }
  void reset(Clock::time_point now) { *this = {0, 0, now}; }
  // Means per step, for the straggler report.
  dist::StepTimes times(Clock::time_point now) const {
    const double n = static_cast<double>(std::max<int64_t>(steps, 1));
    return {std::chrono::duration<double, std::milli>(now - since).count() / n, data_ms / n,
            comm_wait_ms / n};
  }
};

// A diverged run stops at once, naming the step and the rank, instead of training on garbage
// and exiting 0; `keep_going` (the examples' --continue-on-nan) lets it go on.
inline void check_loss_is_finite(float loss, const char* step_name, int64_t step, int rank,
                                 bool keep_going) {
  if (std::isfinite(loss) || keep_going) return;
  throw std::runtime_error("the loss is " + std::to_string(loss) + " at " + step_name + " " +
                           std::to_string(step) + " on rank " + std::to_string(rank) +
                           " (pass --continue-on-nan to keep training)");
}

// Adds the hidden testing aids stop_self_if_asked() acts on.
inline void add_fault_options(CLI::App& app, int64_t& fail_at_step, int64_t& hang_at_step) {
  app.add_option("--fail-at-step", fail_at_step,
                 "testing aid: rank 1 kills itself (SIGKILL) at this step in the first run")
      ->group("");
  app.add_option("--hang-at-step", hang_at_step,
                 "testing aid: rank 1 stops itself (SIGSTOP) at this step in the first run")
      ->group("");
}

// The testing aids --fail-at-step and --hang-at-step (-1: off): at that step of the first run
// (not a restart), rank 1 (rank 0 alone) kills itself, or stops (SIGSTOP) as a hung rank would.
// `settle` runs first (the run's background checkpoint write, waited for): the tests that kill a
// rank check what a resume from the last checkpoint gives, and a kill racing that write would
// make which checkpoint is last a matter of timing.
inline void stop_self_if_asked(const char* program, int rank, int world, int64_t step,
                               int64_t fail_at, int64_t hang_at,
                               const std::function<void()>& settle = {}) {
  const char* restarts = std::getenv("EMBER_RESTART_COUNT");
  const bool first_run = restarts == nullptr || std::string(restarts) == "0";
  if (rank != std::min(1, world - 1) || !first_run) return;
  for (const auto& [at, option, what, signal] :
       {std::tuple{fail_at, "--fail-at-step", "kills", SIGKILL},
        std::tuple{hang_at, "--hang-at-step", "stops", SIGSTOP}}) {
    if (at != step) continue;
    if (settle) settle();
    std::fprintf(stderr, "%s: %s %lld: rank %d %s itself\n", program, option,
                 static_cast<long long>(step), rank, what);
    std::fflush(stderr);
    std::raise(signal);
  }
}

// CLI11's PositiveNumber and NonNegativeNumber print their upper bound, DBL_MAX, in all of its
// 309 digits: these say what was expected instead.
inline CLI::Validator number_above_zero(bool zero_ok) {
  const std::string want = zero_ok ? ">= 0" : "> 0";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        const bool ok =
            ec == std::errc() && end == text.data() + text.size() && (zero_ok ? v >= 0 : v > 0);
        return ok ? std::string() : "expected a number " + want + ", got " + text;
      },
      "NUMBER " + want);
}
inline const CLI::Validator kPositive = number_above_zero(false);
inline const CLI::Validator kNonNegative = number_above_zero(true);

// --device: cpu, cuda (the local rank's GPU) or cuda:N (N a GPU index).
inline const CLI::Validator kDeviceName(
    [](std::string& s) -> std::string {
      const bool index = s.size() > 5 && s.rfind("cuda:", 0) == 0 &&
                         s.find_first_not_of("0123456789", 5) == std::string::npos;
      return s == "cpu" || s == "cuda" || index ? "" : "expected cpu, cuda or cuda:N, got '" + s + "'";
    },
    "cpu|cuda|cuda:N");

// --version: "<program> (Ember) <library version>" on stdout, exit 0.
inline void add_version_flag(CLI::App& app, const char* argv0) {
  app.set_version_flag("--version", std::filesystem::path(argv0).filename().string() +
                                        " (Ember) " + ember::version());
}

// Parses the command line into app's options, then runs `validate` (the checks across options;
// it returns what is wrong, or nothing). Returns the status main() should end with, or nothing to
// go on: 0 after --help, 2 after a bad flag (CLI11 printed the error and a usage hint) or a
// validation error ("<program>: <what>" on stderr). With EMBER_CHECK_ARGS=1 in the environment a
// good command line ends here too, with status 0 and nothing run:
// scripts/check_doc_commands.py parses every command the docs show this way.
inline std::optional<int> parse_command_line(
    CLI::App& app, int argc, char** argv,
    const std::function<std::string()>& validate = {}) {
  add_version_flag(app, argv[0]);
  const std::string program = std::filesystem::path(argv[0]).filename().string();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (const std::string why = validate ? validate() : ""; !why.empty()) {
    std::fprintf(stderr, "%s: %s\n", program.c_str(), why.c_str());
    return 2;
  }
  if (const char* check = std::getenv("EMBER_CHECK_ARGS"); check && std::string(check) == "1") {
    std::printf("%s: arguments ok\n", program.c_str());
    return 0;
  }
  return std::nullopt;
}

// An example's run: builds its Trainer (which joins the process group), trains, reports, and
// leaves the group. An exception ends it with status 1 and "<program>: error: <what>" on stderr.
template <typename TrainerT, typename ArgsT>
int train_and_report(const char* program, const ArgsT& a) {
  try {
    {
      TrainerT trainer(a);
      trainer.report(trainer.train());
    }
    dist::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace ember::examples
