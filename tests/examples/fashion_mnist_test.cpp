// End-to-end tests of examples/fashion_mnist as a user runs it: alone, under emberrun with two
// ranks, resumed after a rank is killed, and with bad options. They train on the real
// Fashion-MNIST files (Debian's dataset-fashion-mnist) for a few dozen steps.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/io/serialize.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

namespace fs = std::filesystem;

const std::string kData = "/usr/share/datasets/fashion-mnist";
std::string example() { return std::string(EMBER_BINARY_DIR) + "/examples/fashion_mnist"; }
std::string emberrun() { return std::string(EMBER_BINARY_DIR) + "/launcher/emberrun"; }

using Result = ember::test::CommandResult;
Result run(const std::string& cmd, int limit_s = 300) { return ember::test::run_command(cmd, limit_s); }

double final_accuracy(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"(test_accuracy=([0-9.]+))");
  if (!std::regex_search(out, m, re)) return -1;
  return std::stod(m[1]);
}

class FashionMnist : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kData + "/train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "no Fashion-MNIST at " << kData << " (install dataset-fashion-mnist)";
    }
    ASSERT_TRUE(fs::exists(example())) << example();
  }
  ember::test::TempDir tmp{"fashion_mnist_test"};
};

TEST_F(FashionMnist, SingleProcessWithoutLauncher) {
  // One thread: on a loaded 2-core machine, two threads per process can crawl.
  Result r = run("env EMBER_NUM_THREADS=1 " + example() + " --max-steps 20 --log-every 10 --batch-size 32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("fashion_mnist: world size 1, backend gloo, comm hook none, device cpu, model cnn"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("epoch 1/3 ["), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("10/1875"), std::string::npos) << r.output;
  EXPECT_GT(final_accuracy(r.output), 0.2) << r.output;  // chance is 0.1
}

// Two ranks through emberrun: progress on rank 0 only, an epoch summary, the final line, and a
// metrics file whose lines parse and say what the console said.
TEST_F(FashionMnist, TwoRanksUnderEmberrunWithMetrics) {
  const std::string metrics = tmp.file("metrics.jsonl");
  const std::string weights = tmp.file("w.safetensors");
  Result r = run(emberrun() + " --standalone --nproc-per-node 2 " + example() +
                 " --model mlp --max-steps 30 --log-every 10 --metrics " + metrics +
                 " --save-weights " + weights);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: fashion_mnist: world size 2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 1]: epoch"), std::string::npos) << "only rank 0 reports\n" << r.output;
  EXPECT_NE(r.output.find("[rank 0]: epoch 1/3 [#"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("30/469"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: epoch 1/3: train loss"), std::string::npos) << r.output;
  const double acc = final_accuracy(r.output);
  EXPECT_GT(acc, 0.5) << r.output;
  // The straggler report after each progress line and over the whole run.
  EXPECT_NE(r.output.find("[rank 0]:   step time over 2 ranks: min "), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 0]: whole run: step time over 2 ranks"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(", waiting on communication "), std::string::npos) << r.output;

  std::ifstream in(metrics);
  std::string line;
  std::vector<nlohmann::json> steps, epochs;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    (j["kind"] == "step" ? steps : epochs).push_back(j);
  }
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0]["global_step"], 10);
  EXPECT_EQ(steps[2]["global_step"], 30);
  EXPECT_GT(steps[0]["loss"].get<double>(), steps[2]["loss"].get<double>());
  EXPECT_GT(steps[2]["images_per_s"].get<double>(), 0);
  // The cosine schedule over the 30 steps: the rate used by the step that was logged (step 10
  // and step 30 ran at global steps 9 and 29, counted from 0).
  const double pi = std::acos(-1.0);
  EXPECT_NEAR(steps[0]["lr"].get<double>(), 0.5 * 0.05 * (1 + std::cos(pi * 9 / 30)), 1e-12);
  EXPECT_NEAR(steps[2]["lr"].get<double>(), 0.5 * 0.05 * (1 + std::cos(pi * 29 / 30)), 1e-12);
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_NEAR(epochs[0]["test_accuracy"].get<double>(), acc, 1e-4);
  EXPECT_EQ(epochs[0]["complete"], false);
  // Where the time went, per logged window, and DDP's statistics per epoch.
  EXPECT_GE(steps[2]["slowest_rank"].get<int>(), 0);
  EXPECT_LE(steps[2]["slowest_rank"].get<int>(), 1);
  EXPECT_GT(steps[2]["step_ms"].get<double>(), 0);
  const nlohmann::json& ddp = epochs[0]["ddp"];
  EXPECT_EQ(ddp["world_size"], 2);
  EXPECT_EQ(ddp["backend"], "gloo");
  EXPECT_EQ(ddp["comm_hook"], "");
  EXPECT_EQ(ddp["iterations"], 30);
  EXPECT_EQ(ddp["parameters"], 6);
  EXPECT_GE(ddp["bucket_count"].get<int>(), 1);
  EXPECT_EQ(ddp["rebuilds"], 1);
  EXPECT_GT(ddp["backward"]["mean_ms"].get<double>(), 0);
  EXPECT_GE(ddp["communication"]["mean_ms"].get<double>(),
            ddp["exposed_communication"]["mean_ms"].get<double>());

  auto saved = ember::nn::load_safetensors(weights);
  EXPECT_EQ(saved.size(), 6u);  // three Linear layers' weight and bias
  EXPECT_TRUE(saved.contains("1.weight"));
  EXPECT_EQ(saved.metadata().at("global_step"), "30");
}

// Runs the job with `options` twice through emberrun with 2 ranks: once straight through, once
// with rank 1 killed at step 30 and emberrun restarting the job, which resumes from the step-20
// checkpoint. Both must end with exactly the same weights; returns the two runs' outputs.
std::pair<Result, Result> run_clean_and_resumed(const std::string& dir, const std::string& options,
                                                const std::string& checkpoint_options = "") {
  const std::string clean = dir + "/clean.safetensors", resumed = dir + "/resumed.safetensors";
  const std::string launcher = emberrun() + " --standalone --nproc-per-node 2 ";
  Result a = run(launcher + example() + options + " --save-weights " + clean);
  EXPECT_EQ(a.status, 0) << a.output;
  Result b = run(launcher + "--max-restarts 1 " + example() + options + " --checkpoint-dir " + dir +
                 "/ckpt --checkpoint-every 20 --resume --fail-at-step 30 --save-weights " + resumed +
                 checkpoint_options);
  EXPECT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("rank 1 kills itself"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resume: "), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("global step 20)"), std::string::npos) << b.output;
  if (a.status != 0 || b.status != 0) return {a, b};
  auto wa = ember::nn::load_safetensors(clean);
  auto wb = ember::nn::load_safetensors(resumed);
  EXPECT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa.tensors()) {
    const auto va = t.to_vector<float>();
    const auto vb = wb.at(name).to_vector<float>();
    EXPECT_EQ(va.size(), vb.size()) << name;
    for (size_t i = 0; i < std::min(va.size(), vb.size()); ++i) {
      if (va[i] != vb[i]) {
        ADD_FAILURE() << name << " differs at " << i << ": " << va[i] << " vs " << vb[i];
        break;
      }
    }
  }
  return {a, b};
}

TEST_F(FashionMnist, ResumesAfterAKillWithIdenticalWeights) {
  auto [a, b] = run_clean_and_resumed(tmp.path(), " --model mlp --max-steps 40 --log-every 10 --batch-size 32");
  EXPECT_EQ(final_accuracy(a.output), final_accuracy(b.output)) << a.output << b.output;
  // The checkpoint left behind says where the job ended.
  EXPECT_EQ(ember::dist::ShardedCheckpoint(tmp.file("ckpt")).metadata().at("global_step"), "40");
}

// The same with the checkpoints written in the background (--async-checkpoint): the kill at step
// 30 finds the checkpoint of step 20 complete, or (mid-write) the one before it current.
TEST_F(FashionMnist, ResumesAfterAKillWithAsyncCheckpoints) {
  auto [a, b] = run_clean_and_resumed(
      tmp.path(), " --model mlp --max-steps 40 --log-every 10 --batch-size 32", " --async-checkpoint");
  EXPECT_EQ(final_accuracy(a.output), final_accuracy(b.output)) << a.output << b.output;
  EXPECT_EQ(ember::dist::ShardedCheckpoint(tmp.file("ckpt")).metadata().at("global_step"), "40");
}

// The same with PowerSGD: each rank's error feedback and Qs travel in the checkpoint (each rank
// writes its own), so the resumed run still matches the uninterrupted one bit for bit; written in
// the background, staged before the backward that changes them.
TEST_F(FashionMnist, ResumesWithPowerSgdStateWithIdenticalWeights) {
  auto [a, b] = run_clean_and_resumed(tmp.path(), " --model mlp --max-steps 40 --log-every 10 --batch-size 32"
                                                " --comm-hook powersgd --powersgd-start 5",
                                      " --async-checkpoint");
  EXPECT_NE(a.output.find("comm hook powersgd"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("x fewer)"), std::string::npos) << a.output;
  const ember::dist::ShardedCheckpoint ck(tmp.file("ckpt"));
  const auto names = ck.names();
  EXPECT_NE(std::find(names.begin(), names.end(), "hook.rank1.iteration"), names.end())
      << "rank 1's hook state is saved";
}

// The same with a hook by name with options (sign compression after 5 steps): its residuals
// travel in the checkpoint and the summary line reports the bytes it saved.
TEST_F(FashionMnist, ResumesWithSignCompressionStateWithIdenticalWeights) {
  auto [a, b] = run_clean_and_resumed(tmp.path(), " --model mlp --max-steps 40 --log-every 10 --batch-size 32"
                                                " --comm-hook sign:start=5", "");
  EXPECT_EQ(final_accuracy(a.output), final_accuracy(b.output)) << a.output << b.output;
  EXPECT_NE(a.output.find("sign: sent "), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("x fewer bytes)"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("gradients: "), std::string::npos) << a.output;  // DDPStats' bytes
  EXPECT_NE(a.output.find("x fewer over the run)"), std::string::npos) << a.output;
  const ember::dist::ShardedCheckpoint ck(tmp.file("ckpt"));
  const auto names = ck.names();
  EXPECT_TRUE(std::any_of(names.begin(), names.end(), [](const std::string& n) {
    return n.rfind("hook.rank1.residual.", 0) == 0;
  })) << "rank 1's residuals are saved";
}

// A hook compiled as a plug-in (tests/distributed/ddp/plugins/hook_plugin.cpp) trains by name; an
// unknown name is refused listing the registered ones.
TEST_F(FashionMnist, TakesAHookFromAPlugin) {
  const std::string plugin = std::string(EMBER_TEST_PLUGIN_DIR) + "/libtest_hook_plugin_good.so";
  Result a = run(emberrun() + " --standalone --nproc-per-node 2 " + example() +
                 " --model mlp --max-steps 4 --comm-hook-plugin " + plugin +
                 " --comm-hook test_scaled:scale=1");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("comm hook test_scaled"), std::string::npos) << a.output;
  Result bad = run(example() + " --model mlp --max-steps 4 --comm-hook tpok");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("no hook named 'tpok' (from 'tpok'); registered: allreduce"),
            std::string::npos) << bad.output;
}

// An elastic restart (emberrun --nnodes MIN:MAX) resumes at another world size: the position
// is converted in samples (6 steps of 1 rank are 3 steps of 2), the cosine schedule is this
// run's at that step, and the banner prints the new world size.
TEST_F(FashionMnist, ResumesAtAnotherWorldSize) {
  const std::string ckpt = tmp.file("ckpt");
  Result a = run(example() + " --model mlp --max-steps 6 --lr-schedule cosine --checkpoint-dir " + ckpt);
  ASSERT_EQ(a.status, 0) << a.output;
  Result b = run(emberrun() + " --standalone --nproc-per-node 2 " + example() +
                 " --model mlp --max-steps 8 --lr-schedule cosine --resume --checkpoint-dir " + ckpt);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("fashion_mnist: world size 2,"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("at epoch 1, step 3 of the epoch (global step 3)"), std::string::npos)
      << b.output;
  // 8 steps of the 2-rank run's schedule, at step 3: 0.05 (1 + cos(3 pi / 8)) / 2.
  char lr[64];
  std::snprintf(lr, sizeof(lr), "the lr is %g\n", 0.05 * (1 + std::cos(3 * M_PI / 8)) / 2);
  EXPECT_NE(b.output.find(std::string("resume: saved at world size 1, now 2: the position was "
                                      "converted in samples, ") + lr),
            std::string::npos)
      << lr << b.output;
  EXPECT_EQ(ember::dist::ShardedCheckpoint(ckpt).metadata().at("global_step"),
            "8");
}

// A checkpoint further on than this run's --max-steps: nothing is trained (the run used to go
// through every remaining step of the job), the model is still evaluated, the checkpoint kept.
TEST_F(FashionMnist, ResumePastMaxStepsTrainsNothing) {
  const std::string ckpt = tmp.file("ckpt");
  Result a = run(example() + " --model mlp --max-steps 12 --checkpoint-dir " + ckpt);
  ASSERT_EQ(a.status, 0) << a.output;
  Result b = run(example() + " --model mlp --max-steps 10 --resume --checkpoint-dir " + ckpt);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("at global step 12, at or past --max-steps 10: nothing to train"),
            std::string::npos) << b.output;
  EXPECT_EQ(b.output.find("img/s"), std::string::npos) << "it trained:\n" << b.output;
  EXPECT_NE(b.output.find("test_accuracy="), std::string::npos) << b.output;
  EXPECT_EQ(ember::dist::ShardedCheckpoint(ckpt).metadata().at("global_step"),
            "12");
}

// Each position key of a checkpoint is parsed and range-checked, and a bad one is named.
TEST_F(FashionMnist, BadCheckpointPositionIsRefusedByName) {
  const std::string ckpt = tmp.file("ckpt"), index = ckpt + "/index.json";
  Result a = run(example() + " --model mlp --max-steps 5 --checkpoint-dir " + ckpt);
  ASSERT_EQ(a.status, 0) << a.output;
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(index));
  const struct {
    const char* key;
    const char* value;
    const char* expected;
  } cases[] = {
      {"global_step", "abc", "'global_step' must be an integer in [0, "},
      {"global_step", "5x", "'global_step' must be an integer in [0, "},
      {"step_in_epoch", "-7", "'step_in_epoch' must be an integer in [0, 938], got '-7'"},
      {"epoch", "-1", "'epoch' must be an integer in [0, "},
      {"global_step", "4", "global_step 4 is not epoch 0 x 938 steps + step_in_epoch 5"},
  };
  for (const auto& c : cases) {
    nlohmann::json edited = good;
    edited["metadata"][c.key] = c.value;
    std::ofstream(index) << edited.dump();
    Result b = run(example() + " --model mlp --max-steps 10 --resume --checkpoint-dir " + ckpt);
    EXPECT_EQ(b.status, 1) << c.key << "=" << c.value << "\n" << b.output;
    EXPECT_NE(b.output.find(c.expected), std::string::npos) << c.key << "=" << c.value << "\n"
                                                            << b.output;
  }
}

// A run whose loss stops being finite fails at once, naming the step, unless told to go on.
TEST_F(FashionMnist, NonFiniteLossStopsTheRunNamingTheStep) {
  const std::string options = " --model mlp --max-steps 30 --lr 1e30";
  Result a = run(example() + options);
  EXPECT_EQ(a.status, 1) << a.output;
  EXPECT_NE(a.output.find("at global step"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("--continue-on-nan"), std::string::npos) << a.output;
  Result b = run(example() + options + " --continue-on-nan");
  EXPECT_EQ(b.status, 0) << b.output;
}

// A hung rank (stopped, not dead: its sockets and shared memory stay open) ends the job within
// --timeout, with an error naming the collective that timed out, instead of after 30 minutes.
TEST_F(FashionMnist, HungRankEndsTheJobWithinTheTimeout) {
  for (const char* shm : {"1", "0"}) {
    Result r = run(std::string("env EMBER_GLOO_SHM=") + shm + " " + emberrun() +
                       " --standalone --nproc-per-node 2 " + example() +
                       " --model mlp --max-steps 50 --hang-at-step 5 --timeout 5",
                   240);
    EXPECT_NE(r.status, 0) << "EMBER_GLOO_SHM=" << shm << "\n" << r.output;
    EXPECT_NE(r.status, 124) << "the job hung past the test's limit\n" << r.output;
    EXPECT_NE(r.output.find("rank 1 stops itself"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("timed out"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("allreduce"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("on rank 0 of 2 timed out after 5000 ms"), std::string::npos)
        << r.output;
    // emberrun wakes the stopped rank with its SIGTERM instead of waiting out the grace period.
    EXPECT_EQ(r.output.find("after the grace period"), std::string::npos) << r.output;
  }
}

// An empty data set is an error, not a run that trains nothing and exits 0.
TEST_F(FashionMnist, EmptyDataSetIsAnError) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                       static_cast<char>(v >> 8), static_cast<char>(v)};
  };
  for (const char* split : {"train", "t10k"}) {
    std::ofstream(tmp.path() + "/" + split + "-images-idx3-ubyte", std::ios::binary)
        << be32(0x803) << be32(0) << be32(28) << be32(28);
    std::ofstream(tmp.path() + "/" + split + "-labels-idx1-ubyte", std::ios::binary)
        << be32(0x801) << be32(0);
  }
  Result r = run(example() + " --model mlp --data " + tmp.path());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the training split holds no images"), std::string::npos) << r.output;
}

// docs/quickstart.md's loop, as printed there, trains with two ranks and saves its weights.
TEST_F(FashionMnist, QuickstartLoopTrainsAndSaves) {
  const std::string minimal = std::string(EMBER_BINARY_DIR) + "/examples/minimal_ddp";
  Result r = run("sh -c 'cd " + tmp.path() + " && exec " + emberrun() + " --standalone --nproc-per-node 2 " +
                 minimal + " 1'");
  ASSERT_EQ(r.status, 0) << r.output;
  auto saved = ember::nn::load_safetensors(tmp.file("model.safetensors"));
  EXPECT_EQ(saved.size(), 4u);
  EXPECT_EQ(saved.at("1.weight").shape(), (ember::Shape{512, 784}));
}

TEST_F(FashionMnist, BadOptionsAreUsageErrors) {
  Result r = run(example() + " --model resnet");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--model"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resnet"), std::string::npos) << r.output;

  // Range errors say what was expected, without DBL_MAX's 309 digits.
  r = run(example() + " --lr -1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--lr: expected a number > 0, got -1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("17976931348623157"), std::string::npos) << r.output;
  r = run(example() + " --timeout -5");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--timeout: expected a number >= 0, got -5"), std::string::npos)
      << r.output;

  for (const char* flag : {" --resume", " --async-checkpoint", " --checkpoint-every 5"}) {
    r = run(example() + flag);
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("--resume, --checkpoint-every and --async-checkpoint need "
                            "--checkpoint-dir"),
              std::string::npos) << flag << "\n" << r.output;
  }

  // --device takes what its help says (cuda:N included); the rest is refused naming it.
  // EMBER_CHECK_ARGS=1 parses and validates the command line and runs nothing.
  r = run("env EMBER_CHECK_ARGS=1 " + example() + " --device cuda:1 --epochs 1");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("fashion_mnist: arguments ok"), std::string::npos) << r.output;
  r = run("env EMBER_CHECK_ARGS=1 " + example() + " --device gpu");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("expected cpu, cuda or cuda:N, got 'gpu'"), std::string::npos) << r.output;
  r = run("env EMBER_CHECK_ARGS=1 " + example() + " --resume");  // validated before the exit
  EXPECT_EQ(r.status, 2) << r.output;

  r = run(example() + " --data " + tmp.path() + "/nowhere --max-steps 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find(tmp.file("nowhere/train-images-idx3-ubyte")), std::string::npos) << r.output;
}

}  // namespace
