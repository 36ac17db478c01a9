// Fuzzes the readers of checkpoint metadata: the first byte picks one, the rest is the file.
//   even: a sharded checkpoint's index.json (ShardedCheckpoint, distributed/checkpoint/), read
//         and walked (names, entries, per-rank metadata), then verify() against rank files that
//         are not there;
//   odd:  a Hugging Face model's model.safetensors.index.json (load_hf_checkpoint, nn/), beside
//         a valid config.json and no shards.
// Any input must load or throw ember::Error (ValueError for malformed metadata); a crash, a
// sanitizer report, another exception, a hang or an allocation past -rss_limit_mb is a finding.
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz/fuzz_util.h"
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/io/hf_checkpoint.h>
#include <ember/tensor/error.h>

namespace {

void read_sharded(const std::string& dir) {
  const ember::dist::ShardedCheckpoint ck(dir);
  int64_t numel = 0;
  for (const std::string& name : ck.names()) {
    numel += static_cast<int64_t>(ck.entry(name).pieces.size());
    numel += ck.numel(name) > 0 ? 1 : 0;
  }
  for (int r = 0; r < ck.world_size() && r < 64; ++r) numel += ck.rank_metadata(r).size();
  (void)ck.metadata().size();
  ck.verify();  // the rank files are missing: ember::Error, unless there are no pieces
  (void)numel;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  namespace fs = std::filesystem;
  static const std::string sharded = ember::fuzz::scratch_dir() + "/sharded";
  static const std::string hf = ember::fuzz::scratch_dir() + "/hf";
  static const bool made = [] {
    fs::create_directories(sharded);
    fs::create_directories(hf);
    const std::string config = R"({"model_type": "gpt2"})";
    ember::fuzz::write_file(hf + "/config.json", config.data(), config.size());
    return true;
  }();
  (void)made;
  try {
    if (data[0] % 2 == 0) {
      ember::fuzz::write_file(sharded + "/index.json", data + 1, size - 1);
      read_sharded(sharded);
    } else {
      ember::fuzz::write_file(hf + "/model.safetensors.index.json", data + 1, size - 1);
      ember::nn::load_hf_checkpoint(hf);
    }
  } catch (const ember::Error&) {
  }
  return 0;
}
