// examples/fashion_mnist --tensorboard: a short two-rank run writes one event file (rank 0's)
// whose scalars, read back by the independent reader (tests/nn/tfevents_reader.py), are the
// numbers of the --metrics JSON lines of the same run, at the same global steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>

#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"
#include "tests/nn/tfevents_test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(FashionMnistTensorBoard, TwoRanksLogTheMetricsOnRankZero) {
  const std::string data = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(data + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST at " << data << " (install dataset-fashion-mnist)";
  }
  EMBER_REQUIRE_TFEVENTS_READER();
  ember::test::TempDir tmp("fashion_mnist_tensorboard_test");
  const std::string bin = EMBER_BINARY_DIR;
  const std::string tb = tmp.file("tb"), metrics = tmp.file("metrics.jsonl");
  const auto r = ember::test::run_command(
      "env EMBER_NUM_THREADS=1 " + bin + "/launcher/emberrun --standalone --nproc-per-node 2 " +
          bin + "/examples/fashion_mnist --model mlp --max-steps 20 --log-every 10 " +
          "--batch-size 32 --metrics " + metrics + " --tensorboard " + tb,
      300);
  ASSERT_EQ(r.status, 0) << r.output;

  const json files = ember::test::read_tfevents({tb});
  ASSERT_EQ(files.size(), 1u) << "only rank 0 writes: " << files.dump();
  // (tag, global step) -> value, from the event file.
  std::map<std::pair<std::string, int64_t>, double> scalars;
  std::set<std::string> tags;
  for (const auto& e : files.begin().value()) {
    if (!e.contains("values")) continue;
    for (const auto& v : e["values"]) {
      scalars[{v["tag"], e["step"]}] = v["simple_value"].get<double>();
      tags.insert(v["tag"].get<std::string>());
    }
  }
  for (const char* want : {"step/loss", "step/lr", "step/images_per_s", "epoch/train_loss",
                           "epoch/test_loss", "epoch/test_accuracy", "epoch/images_per_s"}) {
    EXPECT_TRUE(tags.count(want)) << want << " is missing; tags: " << json(tags).dump();
  }
  EXPECT_FALSE(tags.count("step/global_step")) << "positions are the x axis, not series";

  std::ifstream in(metrics);
  std::string line;
  int records = 0;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    const int64_t step = j["global_step"];
    for (const auto& [key, v] : j.items()) {
      if (!v.is_number() || key == "epoch" || key == "step" || key == "global_step") continue;
      const std::string tag = j["kind"].get<std::string>() + "/" + key;
      const auto it = scalars.find({tag, step});
      ASSERT_NE(it, scalars.end()) << tag << " at step " << step << " is not in the event file";
      EXPECT_EQ(it->second, static_cast<float>(v.get<double>())) << tag << " at step " << step;
    }
    ++records;
  }
  EXPECT_EQ(records, 3);  // steps 10 and 20, and the (partial) first epoch
}

}  // namespace
