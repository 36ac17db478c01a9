// examples/minimal_ddp_gpu as a user runs it: its one argument is checked without touching a GPU;
// without a GPU it fails at once, alone or under emberrun, naming what is missing (never a hang
// in NCCL's set-up); with one, a rank trains an epoch and saves the weights.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <ember/nn/io/serialize.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/version.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace ember {
namespace {

#ifndef EMBER_HAVE_MINIMAL_DDP_GPU
#define EMBER_HAVE_MINIMAL_DDP_GPU 0
#endif

class MinimalDdpGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EMBER_HAVE_MINIMAL_DDP_GPU) {
      GTEST_SKIP() << "minimal_ddp_gpu is built only with CUDA and NCCL (EMBER_WITH_CUDA, "
                      "EMBER_WITH_NCCL and NCCL found)";
    }
  }
  static std::string program() {
    return std::string(EMBER_BINARY_DIR) + "/examples/minimal_ddp_gpu";
  }
  static std::string emberrun() { return std::string(EMBER_BINARY_DIR) + "/launcher/emberrun"; }
  // A command run in the temporary folder (the program writes model.safetensors there).
  test::CommandResult run_here(const std::string& cmd, int limit_s) {
    return test::run_command("sh -c 'cd " + tmp.path() + " && exec " + cmd + "'", limit_s);
  }
  test::TempDir tmp{"ember_minimal_ddp_gpu_test"};
};

TEST_F(MinimalDdpGpu, HelpVersionAndItsArgument) {
  auto r = test::run_command(program() + " --help", 30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "usage: minimal_ddp_gpu [EPOCHS] (3)\n");
  r = test::run_command(program() + " --version", 30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "minimal_ddp_gpu (Ember) " EMBER_VERSION "\n");
  for (const char* bad : {"two", "-1", "1001"}) {
    r = test::run_command(program() + " " + bad, 30);
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find(std::string("EPOCHS must be an integer in [0, 1000], got '") + bad),
              std::string::npos)
        << r.output;
  }
}

TEST_F(MinimalDdpGpu, WithoutAGpuItStopsAtOnceSayingWhy) {
  if (cuda::is_available()) GTEST_SKIP() << "this machine has a GPU: the program would train";
  const std::string why = "minimal_ddp_gpu: error: [minimal_ddp_gpu] device 'cuda': ";
  // Alone: the GPU is looked for before the job is joined, so no launcher variables are needed
  // to get the real reason.
  auto r = run_here(program() + " 1", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find(why + cuda::unavailable_reason()), std::string::npos) << r.output;
  // Under emberrun every rank says so and the job fails (status 124 would be the timeout).
  r = run_here(emberrun() + " --standalone --nproc-per-node 2 " + program() + " 1", 120);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "the job hung instead of failing:\n" << r.output;
  EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("model.safetensors")));
}

// One rank on this machine's first GPU over NCCL: an epoch, then the weights.
TEST_F(MinimalDdpGpu, OneRankTrainsAnEpochOnTheGpu) {
  if (!cuda::is_available()) GTEST_SKIP() << cuda::unavailable_reason();
  auto r = run_here(emberrun() + " --standalone --nproc-per-node 1 " + program() + " 1", 600);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("using nccl"), std::string::npos)
      << "the default backend on a GPU should be nccl:\n" << r.output;
  auto saved = nn::load_safetensors(tmp.file("model.safetensors"));
  EXPECT_EQ(saved.size(), 4u);
  EXPECT_EQ(saved.at("1.weight").shape(), (Shape{512, 784}));
}

}  // namespace
}  // namespace ember
