// EMBER_TRACE under emberrun: a short two-rank run of examples/fashion_mnist leaves the ranks'
// files and emberrun's merged DIR/trace.json, with a process row per rank, each rank's backward
// passes, DDP bucket all-reduces, the end-of-backward waits and the gloo collectives.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

TEST(FashionMnistTrace, TwoRanksMergeIntoOneTimeline) {
  const std::string data = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(data + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST at " << data << " (install dataset-fashion-mnist)";
  }
  ember::test::TempDir tmp("fashion_mnist_trace_test");
  const std::string bin = EMBER_BINARY_DIR, dir = tmp.file("trace");
  const auto r = ember::test::run_command(
      "env EMBER_NUM_THREADS=1 EMBER_TRACE=" + dir + " " + bin +
          "/launcher/emberrun --standalone --nproc-per-node 2 " + bin +
          "/examples/fashion_mnist --model mlp --max-steps 6 --batch-size 32",
      300);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("timeline of 2 ranks"), std::string::npos) << r.output;
  // Each rank's own file stays, whole (emberrun itself, which inherits EMBER_TRACE, writes none).
  for (int rank : {0, 1}) {
    std::ifstream rf(dir + "/trace_rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(rf) << "no trace file of rank " << rank;
    const json own = json::parse(rf);
    int backward = 0;
    for (const auto& e : own["traceEvents"]) backward += e["name"] == "backward";
    EXPECT_EQ(backward, 6) << "rank " << rank << "'s own file";
  }

  std::ifstream f(dir + "/trace.json");
  const json doc = json::parse(f);
  ASSERT_EQ(doc["otherData"]["ranks"].size(), 2u);
  EXPECT_EQ(doc["otherData"]["ranks"][0]["clock_offset_us"], 0);
  EXPECT_GE(doc["otherData"]["ranks"][1]["clock_error_us"].get<int64_t>(), 0)
      << "rank 1 measured its clock offset";
  std::map<int, std::map<std::string, int>> count;  // pid -> name -> events
  std::map<int, std::string> process_names;
  for (const auto& e : doc["traceEvents"]) {
    const int pid = e["pid"];
    if (e["name"] == "process_name") process_names[pid] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    ++count[pid][e["name"].get<std::string>()];
    if (e["cat"] == "collective") ++count[pid]["<collective>"];
    if (e["name"] == "bucket allreduce") {
      EXPECT_GT(e["args"]["bytes"].get<int64_t>(), 0);
    }
  }
  for (int rank : {0, 1}) {
    EXPECT_EQ(process_names[rank], "rank " + std::to_string(rank));
    EXPECT_EQ(count[rank]["backward"], 6) << "rank " << rank;
    EXPECT_EQ(count[rank]["train step"], 6) << "rank " << rank;
    EXPECT_EQ(count[rank]["wait for communication"], 6) << "rank " << rank;
    EXPECT_GE(count[rank]["bucket allreduce"], 6) << "rank " << rank;
    EXPECT_GE(count[rank]["<collective>"], 6) << "rank " << rank;
    EXPECT_GE(count[rank]["next batch"], 6) << "rank " << rank;
  }
}

}  // namespace
