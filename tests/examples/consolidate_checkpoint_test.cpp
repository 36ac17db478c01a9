// examples/consolidate_checkpoint as a user runs it: 2 rank threads save a sharded checkpoint,
// the tool writes one safetensors file, and nn::load_safetensors reads the whole tensors back.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace ember {
namespace {

std::string tool() { return std::string(EMBER_BINARY_DIR) + "/examples/consolidate_checkpoint"; }

test::CommandResult run(const std::string& args) {
  return test::run_command(std::string("'").append(tool()) + "' " + args, 60);
}

TEST(ConsolidateCheckpoint, WritesOneSafetensorsFileAndListsTheTensors) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Tensor w = arange(0, 12, 1, TensorOptions(kFloat32)).reshape({3, 4});
  const Tensor step = from_vector(std::vector<int64_t>{42}).reshape({});
  auto world = dist::ThreadWorld::create(2);
  dist::run_rank_threads(world, [&](int rank) {
    dist::ProcessGroupThreads pg(world, rank);
    std::vector<dist::ShardPiece> mine{
        {"w", {3, 4}, rank * 5, w.reshape({-1}).narrow(0, rank * 5, rank == 0 ? 5 : 7)}};
    if (rank == 0) mine.push_back({"step", {}, 0, step.reshape({1})});
    dist::save_sharded(ckpt, mine, pg, {{"format", "pt"}});
  });

  const auto listed = run("'" + ckpt + "' --list");
  EXPECT_EQ(listed.status, 0) << listed.output;
  EXPECT_NE(listed.output.find("by 2 ranks, 2 tensors"), std::string::npos) << listed.output;
  EXPECT_NE(listed.output.find("w float32 [3, 4], 2 piece(s) on ranks 0 1"), std::string::npos)
      << listed.output;

  const auto done = run("'" + ckpt + "' '" + dir.file("model.safetensors") + "'");
  ASSERT_EQ(done.status, 0) << done.output;
  const nn::SafetensorsFile f = nn::load_safetensors(dir.file("model.safetensors"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_EQ(f.at("w").shape(), w.shape());
  EXPECT_EQ(f.at("w").to_vector<float>(), w.to_vector<float>());
  EXPECT_EQ(f.at("step").dim(), 0);
  EXPECT_EQ(f.at("step").to_vector<int64_t>(), std::vector<int64_t>{42});
}

TEST(ConsolidateCheckpoint, BadUsageAndAMissingCheckpoint) {
  test::TempDir dir;
  EXPECT_EQ(run("").status, 2);
  EXPECT_EQ(run("'" + dir.path() + "'").status, 2) << "no output file and no --list";
  const auto missing = run("'" + dir.path() + "' '" + dir.file("out.safetensors") + "'");
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_NE(missing.output.find(dir.file("index.json")), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace ember
