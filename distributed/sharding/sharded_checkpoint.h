// Sharded checkpoints: every rank writes the pieces of tensors it holds, rank 0 an index, and
// any process (any world size) reads back any range of any tensor, or consolidates the set
// into one ordinary safetensors file. See docs/sharding.md ("Sharded checkpoints").
//
// Layout of a checkpoint directory DIR:
//   DIR/<save id>.rank<R>.safetensors  rank R's pieces as 1-D tensors (nn::save_safetensors),
//                                       named "<tensor name>@<offset>"
//   DIR/index.json                      format version, save id, world size, metadata, and per
//                                       tensor its shape, dtype and pieces (rank, offset, numel,
//                                       byte offset in that rank's file)
// The index is written (atomically) only after every rank's file is durable, so it always
// names a complete set: a crash mid-save leaves the previous index and its files untouched.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/tensor/tensor.h>

namespace ember::dist {

/// One rank's piece of a logical tensor: elements [offset, offset + data.numel()) of the tensor
/// `name` of shape `shape`, flattened in row-major order. `data` is 1-D, on any device (copied
/// to the CPU to be written), of any dtype nn::save_safetensors supports.
struct ShardPiece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  Tensor data;
};

/// Saves this rank's `pieces` into the checkpoint directory `dir` (created if missing; shared
/// by all ranks). A collective over `pg`: every rank calls it, with its own pieces (possibly
/// none). A replicated tensor is saved by giving it on one rank only (offset 0, whole).
///
/// The pieces of one name, across ranks, must agree on shape and dtype, must not overlap and
/// must together cover the tensor (pieces with no elements only take part in the agreement).
/// Every rank checks every rank's descriptors (exchanged by all-gather, before any file is
/// written), so a violation throws the same ValueError on every rank, naming the tensor, the
/// gap or overlap and the ranks. A rank whose file cannot be written makes every rank throw
/// (ember::Error naming that rank and the reason), and the index is not written.
///
/// Steps: agree on a save id (rank 0's, broadcast); each rank writes its file atomically; an
/// all-gather of every rank's outcome (the barrier after which all files are durable); rank 0
/// writes index.json atomically, then removes the rank files the new index does not name
/// (earlier saves', or a crashed save's); a last exchange of rank 0's outcome, so when this
/// returns on any rank the set is complete. Rank 0's `metadata` is kept in the index and in
/// consolidate()'s file. Every wait is bounded by pg's timeout.
void save_sharded(const std::string& dir, const std::vector<ShardPiece>& pieces, ProcessGroup& pg,
                  const std::map<std::string, std::string>& metadata = {});

/// A saved sharded checkpoint, for reading. Needs no process group: any process reads any
/// range, whatever world size saved it. Thread-safe for concurrent reads (each read opens the
/// files it needs).
class ShardedCheckpoint {
 public:
  /// One stored piece: elements [offset, offset + numel) of a tensor, at byte `file_offset` of
  /// rank `rank`'s file.
  struct Piece {
    int rank = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    int64_t file_offset = 0;
  };
  struct Entry {
    std::vector<int64_t> shape;
    Dtype dtype = kFloat32;
    std::vector<Piece> pieces;  // ascending offsets, tiling [0, numel) exactly
  };

  /// Reads and validates `dir`/index.json: its JSON and fields, that each tensor's pieces tile
  /// it, and that every rank file it names exists and is long enough. Throws ember::Error for a
  /// missing or unreadable index, ValueError for a malformed one or a missing or truncated rank
  /// file; messages name the file (and the tensor).
  explicit ShardedCheckpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  /// The world size of the job that saved.
  int world_size() const { return world_size_; }
  /// The save's id (the rank files' name prefix).
  const std::string& save_id() const { return save_id_; }
  /// save_sharded's `metadata`.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The tensors' names, in the order rank 0 first saw them (rank by rank, piece by piece).
  std::vector<std::string> names() const { return order_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  /// Throws IndexError naming `name` and the directory if it is not in the checkpoint.
  const std::vector<int64_t>& shape(const std::string& name) const;
  Dtype dtype(const std::string& name) const;
  int64_t numel(const std::string& name) const;
  const Entry& entry(const std::string& name) const;
  /// The path of rank `rank`'s file.
  std::string rank_file(int rank) const;

  /// Elements [offset, offset + numel) of `name`, flattened, as a new 1-D CPU tensor,
  /// assembled from whichever ranks' files hold them; reads only those bytes (pread).
  /// Throws IndexError for an unknown name or a range outside [0, numel(name)], ember::Error
  /// naming the file if a rank file cannot be opened or is shorter than the index says.
  Tensor read(const std::string& name, int64_t offset, int64_t numel) const;
  /// read() into `out`, a contiguous 1-D tensor of `name`'s dtype whose numel() elements are
  /// read from element `offset` on (no extra copy on the CPU: a loader can fill its own buffer;
  /// a CUDA tensor takes them through host memory).
  /// Throws ValueError for any other `out`, and what read() throws.
  void read_into(const std::string& name, int64_t offset, Tensor& out) const;
  /// The whole tensor, shaped as saved.
  Tensor read_full(const std::string& name) const;

  /// Writes every tensor, whole and shaped, with the metadata, to one ordinary safetensors
  /// file (nn::save_safetensors: atomic; names as saved, in names() order) that
  /// nn::load_safetensors and a non-sharded model's load_state_dict read. Holds all tensors in
  /// memory at once.
  void consolidate(const std::string& out_file) const;

 private:
  std::string dir_;
  std::string save_id_;
  int world_size_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<std::string> order_;
  std::map<std::string, Entry> entries_;
};

}  // namespace ember::dist

namespace ember::dist::detail {
/// Test hook: when set, save_sharded calls it on every rank after that rank's file is durable
/// and before the ranks exchange their outcomes (an exception it throws counts as that rank's
/// failure; a hook may also end the process, as a crash there would). Null clears it. Set it
/// before the ranks start.
void set_sharded_save_hook(std::function<void(int rank)> hook);
}  // namespace ember::dist::detail
