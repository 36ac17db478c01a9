// examples/emberckpt as a user runs it on a checkpoint dist::checkpoint::save wrote at 2 rank
// threads: inspect lists objects, tensors and files; verify passes, then names a corrupted
// piece; consolidate --object model writes a file a plain model loads; convert carries
// examples/gpt's model through GPT-2's Hugging Face layout, one file and the sharded format and
// back; bad input is refused.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/checkpoint/checkpoint.h>
#include <ember/distributed/init.h>
#include <ember/nn/layers/linear.h>
#include <ember/nn/optim/adam.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/ops/elementwise.h>
#include <ember/tensor/grad_mode.h>
#include "cmake/build_paths.h"
#include "examples/gpt_hf.h"
#include "tests/examples/example_test_util.h"

namespace ember {
namespace {

std::string tool() { return std::string(EMBER_BINARY_DIR) + "/examples/emberckpt"; }

test::CommandResult run(const std::string& args) {
  return test::run_command(std::string("'").append(tool()) + "' " + args, 60);
}

TEST(Emberckpt, InspectVerifyConsolidate) {
  test::TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  auto model = std::make_shared<nn::Linear>(4, 3);
  {
    NoGradGuard no_grad;
    model->weight.copy_(arange(0, 12, 1, TensorOptions(kFloat32)).reshape({3, 4}));
  }
  nn::optim::AdamW opt(model->parameters(), {.lr = 0.1});
  dist::run_rank_threads(2, [&](int) {
    namespace ckpt_api = dist::checkpoint;
    ckpt_api::save({{"model", ckpt_api::model(*model)}, {"rng", ckpt_api::rng()}}, ckpt,
                   *dist::default_group(), {{"step", "7"}});
  });

  const auto inspected = run("inspect '" + ckpt + "'");
  ASSERT_EQ(inspected.status, 0) << inspected.output;
  for (const char* want : {"by 2 ranks, 2 tensors in 2 pieces", "(2 of the pieces checksummed)",
                           "objects: [\"model\",\"rng\"]", "metadata step = 7", "rank 1: rng.seed = ",
                           "model.weight float32 [3, 4], 48 B in 1 piece(s) on ranks"}) {
    EXPECT_NE(inspected.output.find(want), std::string::npos) << want << "\n" << inspected.output;
  }
  const auto verified = run("verify '" + ckpt + "'");
  EXPECT_EQ(verified.status, 0) << verified.output;
  EXPECT_NE(verified.output.find("every piece of 2 tensors matches its checksum"), std::string::npos)
      << verified.output;

  const std::string out = dir.file("model.safetensors");
  const auto consolidated = run("consolidate '" + ckpt + "' '" + out + "' --object model");
  ASSERT_EQ(consolidated.status, 0) << consolidated.output;
  auto plain = std::make_shared<nn::Linear>(4, 3);
  plain->load_state_dict(nn::load_safetensors(out).tensors());
  EXPECT_TRUE(equal(plain->weight, model->weight));
  EXPECT_TRUE(equal(plain->bias, model->bias));
  const auto missing = run("consolidate '" + ckpt + "' '" + out + "' --object optim");
  EXPECT_EQ(missing.status, 1) << missing.output;
  EXPECT_NE(missing.output.find("has no object 'optim' (it has [\"model\",\"rng\"])"),
            std::string::npos) << missing.output;

  // A flipped byte in the weight's piece: verify names the tensor and the file, exit 1.
  const dist::ShardedCheckpoint ck(ckpt);
  const auto& piece = ck.entry("model.weight").pieces.at(0);
  {
    std::fstream f(ck.rank_file(piece.rank), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(piece.file_offset + 5);
    f.put('\x7f');
  }
  const auto bad = run("verify '" + ckpt + "'");
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("tensor 'model.weight'"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("fails its checksum"), std::string::npos) << bad.output;

  // An index from before checksums (version 2): verify says it checked only the sizes, not that
  // every piece matched a checksum it does not have.
  {
    const std::string index = ckpt + "/index.json";
    std::ifstream in(index);
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    j["version"] = 2;
    for (auto& t : j["tensors"]) {
      for (auto& p : t["pieces"]) p.erase("xxh3");
    }
    std::ofstream(index) << j.dump();
  }
  const auto unchecked = run("verify '" + ckpt + "'");
  EXPECT_EQ(unchecked.status, 0) << unchecked.output;
  EXPECT_NE(unchecked.output.find("2 of 2 pieces carry no checksum"), std::string::npos)
      << unchecked.output;
  EXPECT_EQ(unchecked.output.find("matches its checksum"), std::string::npos) << unchecked.output;

  EXPECT_EQ(run("inspect '" + dir.file("nowhere") + "'").status, 1);
  EXPECT_EQ(run("frobnicate x").status, 2);
  EXPECT_EQ(run("").status, 2);
}

TEST(Emberckpt, ConvertsBetweenSharded_OneFileAndHuggingFace) {
  test::TempDir dir;
  const examples::GPTConfig shape{.layers = 2, .heads = 4, .dim = 32, .context = 16};
  manual_seed(11);
  auto gpt = std::make_shared<examples::GPT>(shape);
  namespace ckpt = dist::checkpoint;
  dist::run_rank_threads(2, [&](int) {
    ckpt::save({{"model", ckpt::model(*gpt)}}, dir.file("ckpt"), *dist::default_group(),
               {{"heads", "4"}});
  });
  auto expect_gpt = [&](const nn::NamedTensors& state, const std::string& what) {
    const nn::NamedTensors want = gpt->state_dict();
    ASSERT_EQ(state.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(state[i].first, want[i].first) << what;
      EXPECT_TRUE(equal(state[i].second, want[i].second)) << what << ": " << want[i].first;
    }
  };

  // sharded -> Hugging Face: GPT-2's layout, the heads from the checkpoint's metadata.
  auto r = run("convert '" + dir.file("ckpt") + "' '" + dir.file("hf") + "' --to hf");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_gpt(examples::import_gpt2(dir.file("hf"))->state_dict(), "sharded -> hf");
  // Hugging Face -> sharded: what dist::checkpoint::load reads into the model.
  r = run("convert '" + dir.file("hf") + "' '" + dir.file("back") + "' --to sharded");
  ASSERT_EQ(r.status, 0) << r.output;
  manual_seed(12);
  auto other = std::make_shared<examples::GPT>(shape);
  ckpt::load({{"model", ckpt::model(*other)}}, dir.file("back"), {.rank = 0});
  expect_gpt(other->state_dict(), "hf -> sharded");
  // ... -> one file -> Hugging Face again (its config carried in the file's metadata).
  r = run("convert '" + dir.file("back") + "' '" + dir.file("gpt.safetensors") +
          "' --to safetensors");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_gpt(nn::load_safetensors(dir.file("gpt.safetensors")).tensors(), "sharded -> safetensors");
  r = run("convert '" + dir.file("gpt.safetensors") + "' '" + dir.file("hf2") + "' --to hf "
          "--max-shard-bytes 20000");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("hf2/model.safetensors.index.json")));
  expect_gpt(examples::import_gpt2(dir.file("hf2"))->state_dict(), "safetensors -> hf");

  // Without the heads recorded, or another model without a config, --to hf asks for them.
  nn::save_safetensors(dir.file("bare.safetensors"), gpt->state_dict());
  r = run("convert '" + dir.file("bare.safetensors") + "' '" + dir.file("hf3") + "' --to hf");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("give --heads"), std::string::npos) << r.output;
  EXPECT_EQ(run("convert '" + dir.file("bare.safetensors") + "' '" + dir.file("hf3") +
                "' --to hf --heads 4").status, 0);
  nn::save_safetensors(dir.file("linear.safetensors"), {{"weight", zeros({2, 2})}});
  r = run("convert '" + dir.file("linear.safetensors") + "' '" + dir.file("hf4") + "' --to hf");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("needs its config.json (--config FILE)"), std::string::npos)
      << r.output;
  EXPECT_EQ(run("convert a b --to onnx").status, 2);
}

}  // namespace
}  // namespace ember
