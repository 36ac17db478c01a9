// Sharded checkpoints: every rank writes the pieces of tensors it holds, rank 0 an index, and
// any process (any world size) reads back any range of any tensor, or consolidates the set
// into one ordinary safetensors file. See docs/sharding.md ("Sharded checkpoints").
//
// Layout of a checkpoint directory DIR:
//   DIR/<save id>.rank<R>.safetensors  rank R's pieces as 1-D tensors (nn::save_safetensors),
//                                       named "<tensor name>@<its first element's flat index>"
//   DIR/index.json                      format version, save id, world size, metadata, and per
//                                       tensor its shape, dtype and pieces (rank, box, offset,
//                                       numel, byte offset in that rank's file)
// A piece is a run of elements of a box of the tensor: the whole tensor (a flat range, as FSDP
// and ZeRO hold), or a block such as a tensor-parallel shard (Shard(1) of a matrix is not one
// flat range), or a flat range of such a block (FSDP over tensor parallelism).
// The index is written (atomically) only after every rank's file is durable, so it always
// names a complete set: a crash mid-save leaves the previous index and its files untouched.
// Every piece carries the XXH3-64 checksum of its bytes in the index; a reader checks a piece
// the first time it reads from it, so a corrupted, truncated or foreign piece (another save's
// file put in its place) is an error naming the tensor and the file, never wrong values.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ember/distributed/process_group.h>
#include <ember/tensor/tensor.h>

namespace ember::dist {

/// A block of a tensor: the elements at [offset[d], offset[d] + shape[d]) along every dimension
/// d of the tensor seen as `view` (a row-major shape of as many elements: a fused projection's
/// [3, C, C] blocks for its [3C, C] weight; empty: the tensor's own shape). A Box without a
/// shape is the whole tensor (then view and offset are empty too).
struct Box {
  std::vector<int64_t> view;
  std::vector<int64_t> offset;
  std::vector<int64_t> shape;
  bool whole() const { return shape.empty(); }
  bool operator==(const Box&) const = default;
};

/// One rank's piece of a logical tensor: elements [offset, offset + data.numel()) of `box` of
/// the tensor `name` of shape `shape`, in the box's row-major order (the whole tensor's when
/// `box` is whole). `data` is 1-D, on any device (copied to the CPU to be written), of any
/// dtype nn::save_safetensors supports. `replicated`: other ranks may give the very same piece
/// (same box, offset and numel), and one of them writes it (the one with the fewest bytes to
/// write so far: replicated tensors spread over the ranks); without it, the same piece on two
/// ranks is an overlap.
struct ShardPiece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  Tensor data;
  Box box = {};
  bool replicated = false;
};

/// Saves this rank's `pieces` into the checkpoint directory `dir` (created if missing; shared
/// by all ranks). A collective over `pg`: every rank calls it, with its own pieces (possibly
/// none). A replicated tensor is saved by giving it on one rank only (offset 0, whole), or on
/// several as `replicated` pieces.
///
/// The pieces of one name, across ranks, must agree on shape and dtype, must not overlap (but
/// for identical replicated ones) and must together cover the tensor (pieces with no elements only
/// take part in the agreement). Every rank checks every rank's descriptors (exchanged by
/// all-gather, before any file is written), so a violation throws the same ValueError on every
/// rank, naming the tensor, the gap or overlap and the ranks. A rank whose file cannot be written
/// makes every rank throw (ember::Error naming that rank and the reason), and the index is not
/// written. A save to a directory that a save of this process still writes (an async save not yet
/// waited for) is refused the same way before anything is written: its end would delete the other's
/// files. If writing the index fails after its rename (the directory's fsync), every rank throws,
/// but no file is removed: the new set is the checkpoint, and the old files stay until a save is
/// known durable.
///
/// Steps: agree on a save id (rank 0's, broadcast); each rank writes its file atomically; an
/// all-gather of every rank's outcome (the barrier after which all files are durable); rank 0
/// writes index.json atomically, then removes the rank files the new index does not name
/// (earlier saves', or a crashed save's); a last exchange of rank 0's outcome, so when this
/// returns on any rank the set is complete. Rank 0's `metadata` is kept in the index and in
/// consolidate()'s file. Every wait is bounded by pg's timeout.
/// `rank_metadata`: this rank's own strings, kept for every rank (ShardedCheckpoint::
/// rank_metadata), for state that differs between ranks (a generator's position).
void save_sharded(const std::string& dir, const std::vector<ShardPiece>& pieces, ProcessGroup& pg,
                  const std::map<std::string, std::string>& metadata = {},
                  const std::map<std::string, std::string>& rank_metadata = {});

/// A saved sharded checkpoint, for reading. Needs no process group: any process reads any
/// range, whatever world size saved it. Thread-safe for concurrent reads (each read opens the
/// files it needs).
class ShardedCheckpoint {
 public:
  /// One stored piece: elements [offset, offset + numel) of `box` of a tensor, at byte
  /// `file_offset` of rank `rank`'s file.
  struct Piece {
    int rank = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    int64_t file_offset = 0;
    Box box = {};
    /// XXH3-64 of the piece's bytes; absent in checkpoints written before checksums (version 2).
    std::optional<uint64_t> checksum;
  };
  /// A run of consecutive elements of the whole tensor (row-major) stored consecutively:
  /// elements [start, start + length) are elements [at, at + length) of pieces[piece].
  struct Run {
    int64_t start = 0;
    int64_t length = 0;
    size_t piece = 0;
    int64_t at = 0;
  };
  struct Entry {
    std::vector<int64_t> shape;
    Dtype dtype = kFloat32;
    std::vector<Piece> pieces;
    std::vector<Run> runs;  // ascending starts, tiling [0, numel) exactly
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
  /// Rank `rank`'s `rank_metadata` (empty for a rank outside the saving world, or none saved).
  std::map<std::string, std::string> rank_metadata(int rank) const;
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

  /// Elements [offset, offset + numel) of `box` of `name` (whole: the tensor flattened), as a
  /// new 1-D CPU tensor assembled from whichever ranks' files hold them, whatever boxes they
  /// were saved as; reads only those bytes (pread). Throws IndexError for an unknown name, a
  /// box that does not fit the tensor or a range outside the box, ember::Error naming the file
  /// if a rank file cannot be opened or is shorter than the index says.
  Tensor read(const std::string& name, int64_t offset, int64_t numel, const Box& box = {}) const;
  /// read() into `out`, a contiguous 1-D tensor of `name`'s dtype whose numel() elements are
  /// read from element `offset` of `box` on (no extra copy on the CPU: a loader can fill its
  /// own buffer; a CUDA tensor takes them through host memory).
  /// Throws ValueError for any other `out`, and what read() throws.
  void read_into(const std::string& name, int64_t offset, Tensor& out, const Box& box = {}) const;
  /// The whole tensor, shaped as saved.
  Tensor read_full(const std::string& name) const;
  /// `box` of the tensor, shaped as the box.
  Tensor read_box(const std::string& name, const Box& box) const;

  /// Checks every piece of every tensor against its checksum (reading every byte once).
  /// Throws what a read of a bad piece throws (ember::Error naming the tensor and the file).
  void verify() const;

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
  std::vector<std::map<std::string, std::string>> rank_metadata_;
  std::vector<std::string> order_;
  std::map<std::string, Entry> entries_;
  // Pieces checked against their checksums so far, by (tensor, piece index); shared by copies.
  struct Verified;
  std::shared_ptr<Verified> verified_;
  void verify_piece(const std::string& name, size_t piece) const;
  void check_piece(const std::string& name, size_t piece, uint64_t got) const;
};

}  // namespace ember::dist

namespace ember::dist::detail {
/// save_sharded in two halves, so that the writing can happen on another thread (async saves):
/// prepare is collective over `pg` (the descriptors' exchange, the plan, the save id; it
/// throws save_sharded's agreement errors), commit writes this rank's file and, collectively
/// over `commit_pg` (the same ranks in the same order), the index. The pieces' data must stay
/// as they are until commit returns.
struct PreparedSave;
std::shared_ptr<PreparedSave> prepare_sharded_save(const std::string& dir,
                                                   std::vector<ShardPiece> pieces, ProcessGroup& pg,
                                                   const std::map<std::string, std::string>& metadata,
                                                   const std::map<std::string, std::string>& rank_metadata);
void commit_sharded_save(PreparedSave& save, ProcessGroup& commit_pg);
/// Marks this rank's part of a prepared save as failed (its staging threw): commit then sends
/// `why` instead of writing, so every rank's commit throws it (none waits for a file that will
/// not come) and the previous checkpoint stays the current one.
void fail_sharded_save(PreparedSave& save, std::string why);
/// Between the two: replaces the data of each piece this rank will write by copy(i, data) (i:
/// the piece's index in `pieces`), and drops the others' (they are only described), so that
/// commit needs nothing the caller may change.
void stage_sharded_save(PreparedSave& save, const std::function<Tensor(size_t, const Tensor&)>& copy);

/// Test hook: when set, save_sharded calls it on every rank after that rank's file is durable
/// and before the ranks exchange their outcomes (an exception it throws counts as that rank's
/// failure; a hook may also end the process, as a crash there would). Null clears it. Set it
/// before the ranks start.
void set_sharded_save_hook(std::function<void(int rank)> hook);
}  // namespace ember::dist::detail
