// A model in Hugging Face's layout (what `save_pretrained` writes and `from_pretrained` reads):
// a directory holding config.json and the weights as safetensors, either one file
// (model.safetensors) or, past a size, shards model-00001-of-0000N.safetensors listed by
// model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {tensor:
// file}}). The names and the config are the model's own: a mapping from an Ember model's names
// to an architecture's (examples/gpt_hf.h: GPT-2's) sits on top. See docs/checkpoints.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember::nn {

struct HFSaveOptions {
  /// The largest shard; a model whose tensors take more is split into shards of at most this
  /// many bytes each (a tensor larger than it gets a shard of its own). transformers' default.
  int64_t max_shard_bytes = 5'000'000'000;
};

/// Writes `tensors` (in this order, any device and strides) and `config_json` (a JSON object's
/// text, written as config.json) into `dir`, created if missing. Every file is written
/// atomically, the weights before the index and config.json; weight files of an earlier export
/// into `dir` that this one does not write (model.safetensors, shards, the index) are removed
/// afterwards, so the directory holds one model. Each safetensors file carries
/// {"format": "pt"}, the marker Hugging Face loaders look for, and the export's id
/// ("ember_export", also in the index's metadata), by which load_hf_checkpoint tells an export
/// that did not finish (shards of two exports, a stale single file beside a newer index).
/// Throws ValueError for a config that is not a JSON object, a name given twice, and
/// save_safetensors' errors; ember::Error (naming the file) if a file cannot be written.
void save_hf_checkpoint(const std::string& dir,
                        const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::string& config_json, const HFSaveOptions& options = {});

/// What load_hf_checkpoint read.
struct HFCheckpoint {
  /// CPU tensors in their files' order (the shards' order for a sharded model), in the dtypes
  /// stored.
  std::vector<std::pair<std::string, Tensor>> tensors;
  /// config.json's text.
  std::string config_json;
  /// The weight files read, in order (names within the directory).
  std::vector<std::string> files;
};

/// Reads a model in Hugging Face's layout: model.safetensors if the directory has one (as
/// transformers prefers), else model.safetensors.index.json and the shards it lists.
/// Throws ValueError, naming the file and what is wrong, for: no config.json or a config that is
/// not a JSON object; neither weight file (a directory of pytorch_model.bin only is named as
/// such); an index that is not JSON of that shape or names a file outside the directory; a shard
/// the index lists that is missing or lacks a tensor the index puts in it; a tensor in a shard
/// that the index does not list there; a total_size that is not the tensors' bytes; weight files
/// of different Ember exports (an export that did not finish); and load_safetensors' errors for
/// a malformed file.
HFCheckpoint load_hf_checkpoint(const std::string& dir);

}  // namespace ember::nn
