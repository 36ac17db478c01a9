// Checkpoints in the safetensors format (https://github.com/huggingface/safetensors): named
// tensors plus string-to-string metadata, in the layout any safetensors reader expects
// (`safetensors.torch.load_file` included). See docs/nn_checkpoints.md for the layout and the
// checks.
//
// Layout: 8-byte little-endian header size N, N bytes of UTF-8 JSON (padded with spaces so the
// data starts 8-byte aligned), then the tensors' bytes packed back to back. The JSON maps each
// tensor name to {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (offsets into
// the data that follows the header); the optional "__metadata__" entry maps strings to strings.
//
// dtypes: BOOL, U8, I32, I64, F16, BF16, F32, F64 (Ember's eight). Files holding other
// safetensors dtypes (I8, U16, F8_E4M3, ...) are refused with an error naming the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ember/tensor/tensor.h>

namespace ember::nn {

/// The contents of a safetensors file: tensors in file order, each looked up by name too.
/// The tensors are CPU, contiguous and own their memory (nothing refers to the file).
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  /// Throws ValueError if two tensors share a name.
  SafetensorsFile(std::vector<std::pair<std::string, Tensor>> tensors,
                  std::map<std::string, std::string> metadata);

  /// The named tensors in the order of their entries in the file's header (Ember writes them
  /// in the order given to save_safetensors).
  const std::vector<std::pair<std::string, Tensor>>& tensors() const { return tensors_; }
  /// The "__metadata__" entries (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t size() const { return tensors_.size(); }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// The tensor called `name`; throws IndexError naming it if there is none.
  const Tensor& at(const std::string& name) const;
  /// The tensor called `name`, or nullptr.
  const Tensor* find(const std::string& name) const;

 private:
  std::vector<std::pair<std::string, Tensor>> tensors_;
  std::map<std::string, std::string> metadata_;
  std::unordered_map<std::string, size_t> index_;
};

/// Writes `tensors` and `metadata` to `path` as a safetensors file, atomically (temp file,
/// fsync, rename: see nn/io/atomic_file.h), so an existing file at `path` is replaced only by a
/// complete new one. Tensors may be on any device and have any strides: each is copied to a
/// contiguous CPU tensor just before its bytes are written (one at a time, so the extra memory
/// is at most the largest tensor). The header lists the tensors in the given order; their data
/// is laid out by decreasing element size (stable), so every tensor is aligned to its element
/// size, as the reference writer does.
/// Throws ValueError for an undefined tensor, a duplicate name, the reserved name
/// "__metadata__", or a name or metadata string that is not valid UTF-8; ember::Error if the
/// file cannot be written (naming the path and the system's reason).
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Writes a model's state dict for PyTorch and Ember alike: save_safetensors with
/// {"format": "pt"} added to `metadata` unless it already has a "format" key. That is the
/// marker safetensors.torch.save_file writes and Hugging Face loaders look for; Ember's names
/// ("0.weight", "3.bias") and layouts (Linear weight [out, in], Conv2d [out, in, kh, kw]) are
/// PyTorch's, so the file is the equivalent torch model's state_dict (scripts/to_torch.py
/// turns it into a torch.save file and back).
void save_state_dict(const std::string& path,
                     const std::vector<std::pair<std::string, Tensor>>& state,
                     std::map<std::string, std::string> metadata = {});

/// Reads a safetensors file into CPU tensors. Any file is safe to pass: the header size, the
/// JSON, every entry's fields, dtype, shape and offsets, and the exact tiling of the data are
/// checked before anything is allocated, and a malformed file throws ValueError naming the
/// path and what is wrong (never crashes; the data is read into tensors only after every check,
/// and the parsed header takes a small multiple of the header's bytes: its arrays are refused
/// past 64 elements while parsing, a NUL byte in it at once). Bytes
/// of BOOL tensors other than 0 and 1 read as true. Throws ember::Error if the file cannot be
/// opened or read, or is not a regular file.
SafetensorsFile load_safetensors(const std::string& path);

/// The whole of a small regular file (an index, a config): a FIFO, device or directory is
/// refused by ember::Error without blocking, a file over `max_bytes` by ValueError without
/// being read; both name `op` (e.g. "[ShardedCheckpoint]") and the path.
std::string read_small_file(const std::string& path, uint64_t max_bytes, const char* op);

}  // namespace ember::nn
