// dist::checkpoint: one checkpoint of model, optimizer, LR schedule, RNG and the user's own
// state, saved at one layout and loaded at another (DDP 2 -> 1, FSDP 4 -> 2 -> 1, ZeRO 2 -> 3)
// with training going on as if uninterrupted; async saves that copy the state before training
// changes it, report a failed write without stopping training, and leave the previous
// checkpoint current when killed mid-save.
#include <ember/distributed/checkpoint/checkpoint.h>

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/init.h>
#include <ember/distributed/sharding/fsdp.h>
#include <ember/distributed/sharding/zero.h>
#include <ember/nn/layers/activation.h>
#include <ember/nn/layers/dropout.h>
#include <ember/nn/functional.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/adam.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/grad_mode.h>
#include <ember/tensor/ops.h>
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/store/store_test_util.h"
#include "tests/tensor/test_util.h"

namespace ember::dist::checkpoint {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using test::require_close;
using test::TempDir;

constexpr int kBatch = 12;  // divides over 1, 2, 3 and 4 ranks

std::shared_ptr<nn::Sequential> make_model(double dropout = 0) {
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(6, 16));
  m->push_back(std::make_shared<nn::Tanh>());
  m->push_back(std::make_shared<nn::Dropout>(dropout));
  m->push_back(std::make_shared<nn::Linear>(16, 3));
  NoGradGuard no_grad;
  uint64_t seed = 10;
  for (Tensor p : m->parameters()) p.copy_(test::rand_t(p.shape().vec(), kFloat32, seed++) * 0.5);
  return m;
}

Tensor batch_x(int step) { return test::rand_t({kBatch, 6}, kFloat32, 100 + step); }
Tensor batch_y(int step) { return test::rand_t({kBatch, 3}, kFloat32, 200 + step); }

// This rank's rows of the step's batch among `world` ranks.
Tensor rows(const Tensor& t, int rank, int world) {
  const int64_t n = kBatch / world;
  return t.narrow(0, rank * n, n);
}

// One step: forward through `net` (the model, or its DDP) on this rank's rows, backward,
// optimizer and schedule; returns the loss.
double train_step(nn::Module& net, nn::optim::Optimizer& opt, nn::optim::LRScheduler& sched,
                  int step, int rank = 0, int world = 1) {
  opt.zero_grad();
  Tensor loss = nn::functional::mse_loss(net(rows(batch_x(step), rank, world)),
                                         rows(batch_y(step), rank, world));
  loss.backward();
  opt.step();
  sched.step();
  return loss.item<double>();
}

struct Trainer {
  std::shared_ptr<nn::Sequential> model = make_model();
  nn::optim::AdamW opt{model->parameters(), {.lr = 1e-2}};
  nn::optim::StepLR sched{opt, 2, 0.5};
  State state() {
    return {{"model", checkpoint::model(*model)}, {"optim", optimizer(opt, *model)},
            {"schedule", lr_scheduler(sched)}};
  }
};

// The unsplit model trained `steps` steps in one process.
std::vector<std::pair<std::string, Tensor>> uninterrupted(int steps) {
  Trainer r;
  for (int t = 0; t < steps; ++t) train_step(*r.model, r.opt, r.sched, t);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [n, p] : r.model->named_parameters()) out.push_back({n, p.detach().clone()});
  return out;
}

void expect_params(const nn::Module& m, const std::vector<std::pair<std::string, Tensor>>& want,
                   const std::string& what) {
  const auto got = m.named_parameters();
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NO_THROW(require_close(what + ": " + got[i].first, got[i].second, want[i].second, 1e-6));
  }
}

// DDP over 2 rank threads saves model, AdamW and StepLR after 3 steps; one process loads them
// and trains 3 more on the whole batches: the parameters of an uninterrupted 6-step run.
TEST(Checkpoint, DdpTwoRanksGoOnInOneProcess) {
  TempDir dir;
  run_rank_threads(2, [&](int rank) {
    Trainer r;
    auto ddp = std::make_shared<DistributedDataParallel>(r.model, default_group());
    for (int t = 0; t < 3; ++t) train_step(*ddp, r.opt, r.sched, t, rank, 2);
    save(r.state(), dir.path(), *default_group(), {{"step", "3"}});
  }, 60s);
  Trainer r;
  const auto meta = load(r.state(), dir.path());
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"step", "3"}}));
  EXPECT_DOUBLE_EQ(r.opt.param_groups()[0].lr(), 1e-2 * 0.5) << "StepLR's position";
  for (int t = 3; t < 6; ++t) train_step(*r.model, r.opt, r.sched, t);
  expect_params(*r.model, uninterrupted(6), "DDP 2 -> 1");
}

// FSDP: 4 rank threads train 2 steps and save; 2 load, train 2 more and save; one process loads
// and trains the last 2: the uninterrupted run's parameters.
TEST(Checkpoint, FsdpFourToTwoToOne) {
  TempDir four, two;
  auto fsdp_run = [](int steps_from, int steps_to, const std::string& from, const std::string& to) {
    return [=](int rank) {
      const int world = default_group()->size();
      auto m = make_model();
      fully_shard(m);
      nn::optim::AdamW opt(fsdp_parameters(*m), {.lr = 1e-2});
      nn::optim::StepLR sched(opt, 2, 0.5);
      State s = {{"model", model(*m)}, {"optim", optimizer(opt, *m)}, {"schedule", lr_scheduler(sched)}};
      if (!from.empty()) load(s, from);
      for (int t = steps_from; t < steps_to; ++t) train_step(*m, opt, sched, t, rank, world);
      save(s, to, *default_group());
    };
  };
  run_rank_threads(4, fsdp_run(0, 2, "", four.path()), 60s);
  run_rank_threads(2, fsdp_run(2, 4, four.path(), two.path()), 60s);
  Trainer r;
  load(r.state(), two.path());
  for (int t = 4; t < 6; ++t) train_step(*r.model, r.opt, r.sched, t);
  expect_params(*r.model, uninterrupted(6), "FSDP 4 -> 2 -> 1");
}

// ZeRO: each of 2 ranks saves AdamW's state of its partition; 3 ranks, partitioned otherwise,
// each load theirs and go on; every rank ends with the uninterrupted run's parameters.
TEST(Checkpoint, ZeroTwoToThree) {
  TempDir dir;
  auto zero_run = [&](int from, int to, bool loading) {
    return [&, from, to, loading](int rank) {
      const int world = default_group()->size();
      auto m = make_model();
      auto ddp = std::make_shared<DistributedDataParallel>(m, default_group());
      ZeroRedundancyOptimizer zero(
          m->parameters(),
          [](std::vector<nn::optim::ParamGroup> g) {
            return std::make_unique<nn::optim::AdamW>(std::move(g), nn::optim::AdamWOptions{.lr = 1e-2});
          },
          default_group());
      nn::optim::StepLR sched(zero.optimizer(), 2, 0.5);
      State s = {{"model", model(*m)}, {"optim", optimizer(zero.optimizer(), *m)},
                 {"schedule", lr_scheduler(sched)}};
      if (loading) load(s, dir.path());
      for (int t = from; t < to; ++t) {
        zero.zero_grad();
        nn::functional::mse_loss((*ddp)(rows(batch_x(t), rank, world)), rows(batch_y(t), rank, world))
            .backward();
        zero.step();
        sched.step();
      }
      if (!loading) {
        save(s, dir.path(), *default_group());
      } else {
        expect_params(*m, uninterrupted(6), "ZeRO 2 -> 3, rank " + std::to_string(rank));
      }
    };
  };
  run_rank_threads(2, zero_run(0, 3, false), 60s);
  run_rank_threads(3, zero_run(3, 6, true), 60s);
}

// With the generator (dropout's masks) and a data position of the user's own saved, a run
// loaded from step 3 is the uninterrupted run, bit for bit.
TEST(Checkpoint, RngAndDataPositionMakeTheSameRun) {
  TempDir dir;
  auto run = [&](bool stop_at_3, bool resume) {
    Generator gen(7);
    set_thread_default_generator(&gen);
    struct Reset {
      ~Reset() { set_thread_default_generator(nullptr); }
    } reset;
    auto m = make_model(/*dropout=*/0.3);
    nn::optim::AdamW opt(m->parameters(), {.lr = 1e-2});
    nn::optim::StepLR sched(opt, 2, 0.5);
    int next_step = 0;  // the "data loader"'s position
    State s = {{"model", model(*m)},
               {"optim", optimizer(opt, *m)},
               {"schedule", lr_scheduler(sched)},
               {"rng", rng(&gen)},
               {"data", stateful([&] { return SavedState{{}, {{"next_step", std::to_string(next_step)}}, {}}; },
                                 [&](const StateReader& r) { next_step = std::stoi(r.value("next_step")); })}};
    if (resume) load(s, dir.path());
    std::vector<double> losses;
    while (next_step < 6) {
      losses.push_back(train_step(*m, opt, sched, next_step));
      ++next_step;
      if (stop_at_3 && next_step == 3) {
        run_rank_threads(1, [&](int) { save(s, dir.path(), *default_group()); }, 60s);
        // What the process would do next, discarded: the checkpoint must not depend on it.
        gen.advance(1000);
        return std::make_pair(losses, m->named_parameters());
      }
    }
    return std::make_pair(losses, m->named_parameters());
  };
  const auto whole = run(false, false);
  run(true, false);
  const auto rest = run(false, true);
  ASSERT_EQ(rest.first.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.first[i], whole.first[3 + i]) << "loss of step " << 3 + i;
  for (size_t i = 0; i < whole.second.size(); ++i) {
    EXPECT_TRUE(equal(rest.second[i].second, whole.second[i].second)) << whole.second[i].first;
  }
}

// What load refuses: an object the checkpoint lacks (naming the ones it has), and a directory
// that save() did not write.
TEST(Checkpoint, LoadNamesWhatIsMissing) {
  TempDir dir, other;
  Trainer r;
  run_rank_threads(1, [&](int) { save(r.state(), dir.path(), *default_group()); }, 60s);
  State more = r.state();
  more["rng"] = rng();
  std::string e = test::message_of([&] { load(more, dir.path()); });
  EXPECT_NE(e.find("has no object 'rng' (it has model, optim, schedule)"), std::string::npos) << e;
  EXPECT_NO_THROW(load(more, dir.path(), {.strict = false}));
  e = test::message_of([&] {
    run_rank_threads(1, [&](int) { save(r.state(), other.path(), *default_group(), {{"model.x", "1"}}); }, 60s);
  });
  EXPECT_NE(e.find("metadata key 'model.x' would mix with object 'model'"), std::string::npos) << e;
  e = test::message_of([&] { load({{"a.b", rng()}}, dir.path()); });
  EXPECT_NE(e.find("object key 'a.b'"), std::string::npos) << e;
  // Saved optimizer groups that are not groups (an edited index) are named, not passed on as
  // the JSON library's exception.
  const std::string index = (fs::path(dir.path()) / "index.json").string();
  std::string text;
  {
    std::ifstream in(index);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string key = "\"optim.param_groups\": ";
  const size_t at = text.find(key);
  ASSERT_NE(at, std::string::npos) << text.substr(0, 400);
  const size_t from = at + key.size(), to = text.find("\n", from);
  const std::string bad =
      text.substr(0, from) + "\"[1]\"" + (text[to - 1] == ',' ? "," : "") + text.substr(to);
  std::ofstream(index) << bad;
  e = test::message_of([&] { load(Trainer().state(), dir.path()); });
  EXPECT_NE(e.find("the checkpoint's optimizer param_groups holds 1 where a parameter group"),
            std::string::npos)
      << e;
}

// ---- async ----

// Two ranks save asynchronously at steps 2 and 4: save() returns once the state is copied (or,
// staged in the background, wait_until_staged() does), so parameters changed right after it do
// not reach the file; the second save waits for the first; each checkpoint loads back as the
// model was at its step.
TEST(AsyncSave, WritesWhatWasThereWhenSaveReturned) {
  TempDir at2, at4;
  std::vector<std::pair<std::string, Tensor>> params2, params4;
  run_rank_threads(2, [&](int rank) {
    Trainer r;
    auto ddp = std::make_shared<DistributedDataParallel>(r.model, default_group());
    AsyncSaver saver(default_group());
    for (int t = 0; t < 4; ++t) {
      train_step(*ddp, r.opt, r.sched, t, rank, 2);
      if (t == 1 || t == 3) {
        if (rank == 0) {
          auto& keep = t == 1 ? params2 : params4;
          for (const auto& [n, p] : r.model->named_parameters()) keep.push_back({n, p.detach().clone()});
        }
        // The second save copies the state in the background too: the caller waits for that
        // before it changes the state.
        saver.save(r.state(), t == 1 ? at2.path() : at4.path(), {{"step", std::to_string(t + 1)}},
                   /*stage_in_background=*/t == 3);
        EXPECT_GE(saver.last_times().blocked_s, 0);
        if (t == 3) {  // training changes the parameters while the save is written
          saver.wait_until_staged();
          NoGradGuard no_grad;
          for (Tensor p : r.model->parameters()) p.fill_(123.0);
        }
      }
    }
    saver.wait();
    EXPECT_FALSE(saver.poll_error().has_value());
    EXPECT_GT(saver.last_times().written_s, 0);
  }, 60s);
  for (const auto& [dir, want] : {std::pair{at2.path(), params2}, std::pair{at4.path(), params4}}) {
    Trainer r;
    const auto meta = load(r.state(), dir);
    expect_params(*r.model, want, dir);
  }
}

// A parameter on the GPU written on a stream of the caller's own (made current, as the rank
// threads of the one-GPU harness do) just before a save staged in the background: the staged
// copy waits for that write (the worker's stream is not ordered with the caller's), so the
// checkpoint holds 2, not the 1 the parameter held while the GPU was still spinning.
TEST(AsyncSaveCuda, BackgroundStagingWaitsForTheCallersStream) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  TempDir dir;
  run_rank_threads(1, [&](int) {
    cuda::set_device(0);
    cuda::StreamGuard own(cuda::Stream::create(0));
    auto model = std::make_shared<nn::Linear>(64, 64);
    model->to(cuda_device(0));
    AsyncSaver saver(default_group());
    {
      NoGradGuard no_grad;
      for (Tensor p : model->parameters()) p.fill_(1.0);
      cuda::current_stream().synchronize();
      cuda::spin(int64_t{1} << 31);  // the fill below waits behind this on the caller's stream
      for (Tensor p : model->parameters()) p.fill_(2.0);
    }
    saver.save({{"model", checkpoint::model(*model)}}, dir.path(), {},
               /*stage_in_background=*/true);
    saver.wait();
    EXPECT_FALSE(saver.poll_error().has_value());
  });
  auto loaded = std::make_shared<nn::Linear>(64, 64);
  load({{"model", checkpoint::model(*loaded)}}, dir.path());
  for (const Tensor& p : loaded->parameters()) {
    EXPECT_EQ(p.min().item<double>(), 2.0);
    EXPECT_EQ(p.max().item<double>(), 2.0);
  }
}

// A save that cannot be written (its directory is a file) is reported by poll_error, naming
// the path, without throwing into training; the next save works.
TEST(AsyncSave, AFailedWriteIsReportedAndTrainingGoesOn) {
  TempDir tmp;
  const std::string blocked = tmp.file("not_a_dir");
  std::ofstream(blocked) << "a file where the checkpoint directory should be";
  run_rank_threads(2, [&](int rank) {
    Trainer r;
    AsyncSaver saver(default_group());
    saver.save(r.state(), blocked);
    train_step(*r.model, r.opt, r.sched, 0, rank, 2);  // training goes on meanwhile
    EXPECT_THROW(saver.wait(), Error);
    saver.save(r.state(), blocked);
    while (saver.in_flight()) std::this_thread::yield();
    const std::optional<std::string> e = saver.poll_error();
    ASSERT_TRUE(e.has_value());
    EXPECT_NE(e->find("[async_save] " + blocked), std::string::npos) << *e;
    EXPECT_FALSE(saver.poll_error().has_value()) << "reported once";
    saver.save(r.state(), tmp.file("good"));
    saver.wait();
  }, 60s);
  Trainer r;
  EXPECT_NO_THROW(load(r.state(), tmp.file("good")));
}

// A disk that fills up mid-save (the process may write no file past 64 bytes, RLIMIT_FSIZE: the
// write fails with EFBIG as it would with ENOSPC): the async save's failure is reported, naming
// the file, training goes on, and the previous checkpoint stays current. In a child process, so
// the limit stays there; the child's exit status carries its verdict.
TEST(AsyncSave, ADiskFillingUpIsReportedAndThePreviousCheckpointStays) {
  TempDir dir;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int verdict = 10;
    try {
      run_rank_threads(2, [&](int rank) {
        Trainer r;
        save(r.state(), dir.path(), *default_group(), {{"step", "first"}});
        default_group()->barrier()->wait();
        if (rank == 0) {
          ::signal(SIGXFSZ, SIG_IGN);
          const rlimit small{64, 64};
          ::setrlimit(RLIMIT_FSIZE, &small);
        }
        default_group()->barrier()->wait();
        AsyncSaver saver(default_group());
        train_step(*r.model, r.opt, r.sched, 0, rank, 2);
        saver.save(r.state(), dir.path(), {{"step", "second"}});
        train_step(*r.model, r.opt, r.sched, 1, rank, 2);  // training goes on meanwhile
        while (saver.in_flight()) std::this_thread::yield();
        const std::optional<std::string> e = saver.poll_error();
        if (rank == 0) {
          verdict = !e ? 11
                   : e->find("[async_save] " + dir.path()) == std::string::npos ? 12
                   : e->find("File too large") == std::string::npos ? 13
                                                                     : 0;
          if (verdict != 0 && e) std::fprintf(stderr, "reported: %s\n", e->c_str());
        }
      }, 60s);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      verdict = 14;
    }
    ::_exit(verdict);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "11: nothing reported; 12: the directory not named; "
                                       "13: not the write's error; 14: an exception";
  Trainer r;
  EXPECT_EQ(load(r.state(), dir.path()).at("step"), "first");
}

// A process killed while its async save is being written (after its rank file, before the
// index) leaves the previous checkpoint current and loadable with its values.
TEST(AsyncSave, AKillMidWriteKeepsThePreviousCheckpoint) {
  TempDir dir;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      run_rank_threads(1, [&](int) {
        Trainer r;
        save(r.state(), dir.path(), *default_group(), {{"step", "first"}});
        AsyncSaver saver(default_group());
        train_step(*r.model, r.opt, r.sched, 0);
        detail::set_sharded_save_hook([](int) { ::kill(::getpid(), SIGKILL); });
        saver.save(r.state(), dir.path(), {{"step", "second"}});
        saver.wait();
      }, 60s);
    } catch (...) {
    }
    ::_exit(3);  // not reached when the kill works
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  Trainer r;
  const auto meta = load(r.state(), dir.path());
  EXPECT_EQ(meta.at("step"), "first");
  expect_params(*r.model, uninterrupted(0), "the first checkpoint");
  // The killed save's rank file is left behind, and removed by the next save.
  int files = 0;
  for (const auto& f : fs::directory_iterator(dir.path())) files += f.path().extension() == ".safetensors";
  EXPECT_EQ(files, 2);
  run_rank_threads(1, [&](int) { save(r.state(), dir.path(), *default_group()); }, 60s);
  files = 0;
  for (const auto& f : fs::directory_iterator(dir.path())) files += f.path().extension() == ".safetensors";
  EXPECT_EQ(files, 1);
}

}  // namespace
}  // namespace ember::dist::checkpoint
