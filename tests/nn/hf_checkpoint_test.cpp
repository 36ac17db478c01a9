// nn/io/hf_checkpoint.h: Hugging Face's directory layout, one file or sharded, and its refusals.
#include <ember/nn/io/hf_checkpoint.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <ember/nn/io/serialize.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>
#include <ember/tensor/ops.h>

#include "tests/temp_dir.h"

namespace ember::nn {
namespace {

using test::TempDir;
using Named = std::vector<std::pair<std::string, Tensor>>;

const char* kConfig = R"({"model_type": "toy", "hidden_size": 8})";

// Three float32 tensors of 4 KB, 2 KB and 4 KB, and an int64 one.
Named toy_tensors() {
  return {{"b.weight", arange(0, 1024, 1, {kFloat32}).reshape({32, 32})},
          {"a.bias", arange(0, 512, 1, {kFloat32})},
          {"c.weight", full({1024}, 3.0f)},
          {"steps", arange(0, 4, 1, {kInt64})}};
}

void expect_same(const Named& got, const Named& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_TRUE(equal(got[i].second, want[i].second)) << want[i].first;
  }
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

std::string error_of(const std::string& dir) {
  try {
    load_hf_checkpoint(dir);
  } catch (const ValueError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HFCheckpoint, OneFileRoundTripsWithItsConfig) {
  TempDir d;
  save_hf_checkpoint(d.path(), toy_tensors(), kConfig);
  EXPECT_EQ(d.list(), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(load_safetensors(d.file("model.safetensors")).metadata().at("format"), "pt");
  HFCheckpoint c = load_hf_checkpoint(d.path());
  expect_same(c.tensors, toy_tensors());
  EXPECT_EQ(nlohmann::json::parse(c.config_json)["hidden_size"], 8);
  EXPECT_EQ(c.files, (std::vector<std::string>{"model.safetensors"}));
}

TEST(HFCheckpoint, ShardsPastTheSizeWithAnIndexAsTransformersWrites) {
  TempDir d;
  save_hf_checkpoint(d.path(), toy_tensors(), kConfig, {.max_shard_bytes = 6000});
  // 4 KB | 2 KB + 4 KB would pass 6000 | 4 KB + 32 B
  EXPECT_EQ(d.list(), (std::vector<std::string>{"config.json", "model-00001-of-00003.safetensors",
                                                "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors",
                                                "model.safetensors.index.json"}));
  const auto index = read_json(d.file("model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 4096 + 2048 + 4096 + 32);
  EXPECT_EQ(index["weight_map"]["a.bias"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["steps"], "model-00003-of-00003.safetensors");
  HFCheckpoint c = load_hf_checkpoint(d.path());
  expect_same(c.tensors, toy_tensors());
  EXPECT_EQ(c.files.size(), 3u);

  // Exporting again as one file removes the shards and the index (one model per directory).
  save_hf_checkpoint(d.path(), toy_tensors(), kConfig);
  EXPECT_EQ(d.list(), (std::vector<std::string>{"config.json", "model.safetensors"}));
}

// A name given twice is refused before anything is written, also when the two would land in
// different shards (the index could name only one).
TEST(HFCheckpoint, ANameGivenTwiceIsRefused) {
  TempDir d;
  try {
    save_hf_checkpoint(d.path(), {{"x", full({1024}, 1.0)}, {"x", full({1024}, 2.0)}}, kConfig,
                       {.max_shard_bytes = 5000});
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("[save_hf_checkpoint] tensor 'x' is given twice"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(d.list().empty());
}

// What an export that did not finish leaves (its first shard rewritten in place, the rest and
// the index the earlier export's; or a single file beside a newer sharded index) is refused,
// naming the export ids, rather than loaded as one model.
TEST(HFCheckpoint, AnExportThatDidNotFinishIsRefusedNotMixed) {
  TempDir a, b, single;
  const Named ones = {{"x", full({1000}, 1.0f)}, {"y", full({1000}, 1.0f)}};
  const Named twos = {{"x", full({1000}, 2.0f)}, {"y", full({1000}, 2.0f)}};
  save_hf_checkpoint(a.path(), ones, kConfig, {.max_shard_bytes = 5000});
  save_hf_checkpoint(b.path(), twos, kConfig, {.max_shard_bytes = 5000});
  const std::string first = "model-00001-of-00002.safetensors";
  std::filesystem::copy_file(b.file(first), a.file(first),
                             std::filesystem::copy_options::overwrite_existing);
  std::string e = error_of(a.path());
  EXPECT_NE(e.find("the shard '" + first + "' is from export "), std::string::npos) << e;
  EXPECT_NE(e.find("an export that did not finish"), std::string::npos) << e;

  save_hf_checkpoint(single.path(), ones, kConfig);
  std::filesystem::copy_file(single.file("model.safetensors"), b.file("model.safetensors"));
  e = error_of(b.path());
  EXPECT_NE(e.find("holds both model.safetensors and model.safetensors.index.json from different "
                   "exports"),
            std::string::npos)
      << e;
  // A whole export loads as before.
  expect_same(load_hf_checkpoint(single.path()).tensors, ones);
}

TEST(HFCheckpoint, BrokenDirectoriesAreNamed) {
  TempDir d;
  save_hf_checkpoint(d.path(), toy_tensors(), kConfig, {.max_shard_bytes = 6000});
  const std::string shard2 = d.file("model-00002-of-00003.safetensors");
  const std::string index = d.file("model.safetensors.index.json");
  auto rewrite_index = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto j = read_json(index);
    edit(j);
    std::ofstream(index) << j.dump();
  };
  // The index as transformers writes it, without Ember's export id: what follows checks the
  // files themselves (AnExportThatDidNotFinishIsRefusedNotMixed checks the ids).
  rewrite_index([](auto& j) { j["metadata"].erase("ember_export"); });

  // A tensor the index puts in a shard that lacks it.
  rewrite_index([](auto& j) { j["weight_map"]["a.bias"] = "model-00001-of-00003.safetensors"; });
  EXPECT_NE(error_of(d.path()).find("puts 'a.bias' in 'model-00001-of-00003.safetensors', which "
                                  "lacks it"),
            std::string::npos)
      << error_of(d.path());
  // ... and the shard that has it, unlisted there.
  rewrite_index([](auto& j) { j["weight_map"]["a.bias"] = "model-00002-of-00003.safetensors"; });
  EXPECT_EQ(error_of(d.path()), "(no error)");

  // A foreign shard: a tensor the index does not list in it.
  save_state_dict(shard2, {{"a.bias", zeros({512})}, {"intruder", zeros({1})}});
  EXPECT_NE(error_of(d.path()).find("holds 'intruder', which"), std::string::npos)
      << error_of(d.path());
  // A shard of other sizes: the index's total no longer adds up.
  save_state_dict(shard2, {{"a.bias", zeros({100})}});
  EXPECT_NE(error_of(d.path()).find("total_size 10272 bytes, but its shards hold 8624"),
            std::string::npos)
      << error_of(d.path());
  // A missing shard.
  std::filesystem::remove(shard2);
  EXPECT_NE(error_of(d.path()).find("the shard 'model-00002-of-00003.safetensors'"),
            std::string::npos);
  EXPECT_NE(error_of(d.path()).find("is missing"), std::string::npos);
  // An index that points outside the directory.
  rewrite_index([](auto& j) { j["weight_map"]["a.bias"] = "../elsewhere.safetensors"; });
  EXPECT_NE(error_of(d.path()).find("which is not a file of the directory"), std::string::npos);
  // A shard name longer than the file system allows (found by fuzzing: std::filesystem threw
  // its own exception through the loader).
  rewrite_index([](auto& j) { j["weight_map"]["a.bias"] = std::string(300, 'x') + ".safetensors"; });
  EXPECT_NE(error_of(d.path()).find("cannot look at 'xxx"), std::string::npos)
      << error_of(d.path());
  EXPECT_NE(error_of(d.path()).find("File name too long"), std::string::npos) << error_of(d.path());
  // An index that is not JSON.
  std::ofstream(index) << "{\"weight_map\": ";
  EXPECT_NE(error_of(d.path()).find("text that is not JSON"), std::string::npos);

  // No weights at all; weights only in PyTorch's pickle format; no config.
  TempDir e;
  std::ofstream(e.file("config.json")) << kConfig;
  EXPECT_NE(error_of(e.path()).find("has neither model.safetensors nor"), std::string::npos);
  std::ofstream(e.file("pytorch_model.bin")) << "pickle";
  EXPECT_NE(error_of(e.path()).find("has pytorch_model.bin only"), std::string::npos);
  std::filesystem::remove(e.file("config.json"));
  EXPECT_NE(error_of(e.path()).find("no config.json"), std::string::npos);

  // A config that is not an object is refused before anything is written.
  TempDir f;
  EXPECT_THROW(save_hf_checkpoint(f.path(), toy_tensors(), "[1, 2]"), ValueError);
  EXPECT_TRUE(f.list().empty());
}

}  // namespace
}  // namespace ember::nn
