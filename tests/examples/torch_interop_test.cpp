// Weights that PyTorch reads and PyTorch weights that Ember reads: examples/fashion_mnist's CNN
// trained in Ember, converted by scripts/to_torch.py and evaluated by the PyTorch model of
// benchmarks/vs_pytorch (through tests/examples/torch_fashion_mnist.py), and the reverse. The
// same weights must give the same test accuracy on both sides (within 0.1 points). Skipped when
// /usr/bin/python3 cannot import torch or the dataset is missing.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

namespace fs = std::filesystem;

const std::string kData = "/usr/share/datasets/fashion-mnist";
const std::string kPython = "/usr/bin/python3";
// A loaded 2-core machine runs torch's forward over the test set in tens of seconds.
constexpr int kPythonLimitS = 300;

std::string example() { return std::string(EMBER_BINARY_DIR) + "/examples/fashion_mnist"; }
std::string source(const std::string& rel) { return std::string(EMBER_SOURCE_DIR) + "/" + rel; }
std::string converter() { return kPython + " " + source("scripts/to_torch.py"); }
std::string torch_side() { return kPython + " " + source("tests/examples/torch_fashion_mnist.py"); }

using Result = ember::test::CommandResult;
Result run(const std::string& cmd, int limit_s = kPythonLimitS) {
  return ember::test::run_command(cmd, limit_s);
}

// The accuracy after `key=` in a program's output, or -1.
double accuracy(const std::string& out, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex(key + "=([0-9.]+)"))) return -1;
  return std::stod(m[1]);
}

class TorchInterop : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kData + "/t10k-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "no Fashion-MNIST at " << kData << " (install dataset-fashion-mnist)";
    }
    if (run(kPython + " -c 'import torch'", 120).status != 0) {
      GTEST_SKIP() << kPython << " cannot import torch (install python3-torch)";
    }
    ASSERT_TRUE(fs::exists(example())) << example();
  }
  ember::test::TempDir tmp{"torch_interop_test"};
};

TEST_F(TorchInterop, EmberTrainedCnnGivesTheSameAccuracyInTorch) {
  const std::string weights = tmp.file("ember.safetensors"), pt = tmp.file("ember.pt");
  Result r = run("env EMBER_NUM_THREADS=1 " + example() +
                 " --model cnn --max-steps 200 --save-weights " + weights);
  ASSERT_EQ(r.status, 0) << r.output;
  const double ember_acc = accuracy(r.output, "test_accuracy");
  ASSERT_GT(ember_acc, 0.6) << r.output;  // trained: chance is 0.1
  EXPECT_EQ(ember::nn::load_safetensors(weights).metadata().at("format"), "pt");

  r = run(converter() + " " + weights + " " + pt);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("8 tensors"), std::string::npos) << r.output;
  r = run(torch_side() + " eval " + pt + " --model cnn --data " + kData);
  ASSERT_EQ(r.status, 0) << r.output;  // a name or shape torch does not expect fails here
  const double torch_acc = accuracy(r.output, "torch_test_accuracy");
  EXPECT_NEAR(100 * torch_acc, 100 * ember_acc, 0.1) << r.output;
}

TEST_F(TorchInterop, TorchTrainedCnnGivesTheSameAccuracyInEmber) {
  const std::string pt = tmp.file("torch.pt"), weights = tmp.file("torch.safetensors");
  Result r = run(torch_side() + " train " + pt + " --model cnn --steps 100 --data " + kData);
  ASSERT_EQ(r.status, 0) << r.output;
  const double torch_acc = accuracy(r.output, "torch_test_accuracy");
  ASSERT_GT(torch_acc, 0.6) << r.output;

  r = run(converter() + " --from-torch " + pt + " " + weights);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(ember::nn::load_safetensors(weights).metadata().at("format"), "pt");
  // --epochs 0: evaluation of the given weights only.
  r = run("env EMBER_NUM_THREADS=1 " + example() + " --model cnn --epochs 0 --init-weights " +
          weights);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NEAR(100 * accuracy(r.output, "test_accuracy"), 100 * torch_acc, 0.1) << r.output;
}

TEST_F(TorchInterop, ClearErrors) {
  // A missing file, a file that is not safetensors, a dtype torch has no type for.
  Result r = run(converter() + " " + tmp.file("missing.safetensors") + " " + tmp.file("out.pt"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("missing.safetensors: cannot read: No such file"), std::string::npos)
      << r.output;
  std::ofstream(tmp.file("text.safetensors")) << "this is not a safetensors file";
  r = run(converter() + " " + tmp.file("text.safetensors") + " " + tmp.file("out.pt"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("text.safetensors: not a safetensors file"), std::string::npos)
      << r.output;
  const std::string header = R"({"q":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})";
  const uint64_t n = header.size();
  std::ofstream u16(tmp.file("u16.safetensors"), std::ios::binary);
  u16.write(reinterpret_cast<const char*>(&n), 8);  // little-endian on every machine Ember runs on
  u16 << header << std::string(4, '\0');
  u16.close();
  r = run(converter() + " " + tmp.file("u16.safetensors") + " " + tmp.file("out.pt"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("tensor 'q': safetensors dtype U16 has no torch equivalent"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(tmp.file("out.pt")));
  // The reverse: not a torch file, and a tensor of a dtype Ember lacks.
  r = run(converter() + " --from-torch " + tmp.file("text.safetensors") + " " + tmp.file("out.st"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("not a file torch.load reads"), std::string::npos) << r.output;
  r = run(kPython + " -c 'import torch; torch.save({\"w\": torch.zeros(2, dtype=torch.int8)}, \"" +
          tmp.file("i8.pt") + "\")'");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(converter() + " --from-torch " + tmp.file("i8.pt") + " " + tmp.file("out.st"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("tensor 'w': dtype torch.int8 has no Ember equivalent"),
            std::string::npos)
      << r.output;
  // Ember refuses weights of another model by name and shape.
  ember::nn::save_state_dict(tmp.file("bad.safetensors"),
                             {{"0.weight", ember::zeros({2, 2})}});
  r = run(example() + " --model cnn --epochs 0 --init-weights " + tmp.file("bad.safetensors"), 120);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("0.weight"), std::string::npos) << r.output;
}

}  // namespace
