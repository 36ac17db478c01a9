// One checkpoint of everything a run needs to go on (torch.distributed.checkpoint's save, load,
// async_save and Stateful): a map of named objects, each saying what it holds on this rank, in
// the sharded format of sharded_checkpoint.h (every rank writes its parts in parallel, a part
// several ranks hold is written once, every piece checksummed) and loaded at any layout and
// world size.
//
//   namespace ckpt = dist::checkpoint;
//   ckpt::State state = {{"model", ckpt::model(*model)},
//                        {"optim", ckpt::optimizer(opt, *model)},
//                        {"schedule", ckpt::lr_scheduler(schedule)},
//                        {"rng", ckpt::rng()}};
//   ckpt::save(state, "ckpt/step_100", pg);          // collective
//   ckpt::load(state, "ckpt/step_100");              // not collective; any layout, any world
//
//   ckpt::AsyncSaver saver(pg);                      // collective: its own group for the writes
//   saver.save(state, "ckpt/step_200");              // blocks only to copy the state to memory
//   if (auto e = saver.poll_error()) log(*e);        // a failed write, at the next step
//
// In a checkpoint the object "optim"'s tensor "w.exp_avg" is "optim.w.exp_avg" and its value
// "param_groups" is the metadata key "optim.param_groups"; the metadata key
// "checkpoint.objects" lists the objects. The adapters keep references: the objects they wrap
// must outlive the State.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/distributed/process_group.h>
#include <ember/nn/amp/grad_scaler.h>
#include <ember/nn/module.h>
#include <ember/nn/optim/lr_scheduler.h>
#include <ember/nn/optim/optimizer.h>
#include <ember/tensor/ops/random.h>

namespace ember::dist::checkpoint {

/// What one object puts in a checkpoint on this rank.
struct SavedState {
  /// Its tensors, each whole or this rank's piece of a larger one (names relative to the
  /// object). A tensor several ranks hold alike is given as a `replicated` piece on each: one
  /// of them writes it.
  std::vector<ShardPiece> tensors;
  /// Strings the same on every rank (rank 0's are kept).
  std::map<std::string, std::string> values;
  /// Strings of this rank (a generator's position, a data loader's): every rank's are kept.
  std::map<std::string, std::string> rank_values;
};

/// One object's part of a saved checkpoint, for its load.
class StateReader {
 public:
  /// `object`: the object's key ("" reads the checkpoint's names and metadata as they are);
  /// `rank`: the reading process's rank (whose rank_values it gets).
  StateReader(const ShardedCheckpoint& ck, std::string object, int rank);

  const std::string& object() const { return object_; }
  const ShardedCheckpoint& checkpoint() const { return ck_; }
  bool contains(const std::string& name) const;
  /// The object's tensor names (without the object's prefix).
  std::vector<std::string> tensor_names() const;
  std::vector<int64_t> shape(const std::string& name) const;
  Dtype dtype(const std::string& name) const;
  /// ShardedCheckpoint's reads, of the object's tensor `name`.
  Tensor read(const std::string& name, int64_t offset, int64_t numel, const Box& box = {}) const;
  void read_into(const std::string& name, int64_t offset, Tensor& out, const Box& box = {}) const;
  Tensor read_full(const std::string& name) const;
  /// A value the object saved; nullopt if it saved none of that name.
  std::optional<std::string> find_value(const std::string& key) const;
  /// The same, or ValueError naming the object, the key and the checkpoint.
  std::string value(const std::string& key) const;
  /// The value this rank saved under `key` (rank_values), or, when no rank of that number
  /// saved (a checkpoint of fewer ranks), rank 0's; nullopt if none.
  std::optional<std::string> rank_value(const std::string& key) const;

 private:
  std::string full(const std::string& name) const { return prefix_ + name; }
  const ShardedCheckpoint& ck_;
  std::string object_, prefix_;
  int rank_;
};

/// An object whose state a checkpoint holds (torch.distributed.checkpoint.stateful.Stateful).
class Stateful {
 public:
  virtual ~Stateful() = default;
  /// What this rank holds of it now (tensors may be views of live state: save() writes them
  /// before it returns, AsyncSaver copies them first).
  virtual SavedState state_dict() const = 0;
  /// Restores it from the checkpoint, reading what this rank holds at the current layout.
  virtual void load_state_dict(const StateReader& reader) = 0;
};

using State = std::map<std::string, std::shared_ptr<Stateful>>;

/// A model in any layout Ember has: replicated (plain, DDP's module), fully_shard-ed, laid out
/// by parallelize_module, and both. Tensors under the model's state_dict() names; a load reads
/// this rank's parts at its current layout.
std::shared_ptr<Stateful> model(const nn::Module& root);
/// An optimizer over `root`'s parameters (or fully_shard's pieces of them: fsdp_parameters):
/// its per-parameter state under "<parameter name>.<key>" (laid out as the parameter, so it
/// follows it to whichever rank holds it at load time), its type and groups as values.
std::shared_ptr<Stateful> optimizer(nn::optim::Optimizer& opt, const nn::Module& root);
/// An LR scheduler's state_dict().
std::shared_ptr<Stateful> lr_scheduler(nn::optim::LRScheduler& scheduler);
/// A GradScaler's scale and growth tracker.
std::shared_ptr<Stateful> grad_scaler(nn::amp::GradScaler& scaler);
/// A generator's seed and position, per rank (null: the default generator of the thread that
/// saves or loads; CPU and CUDA draw from it alike). A checkpoint of fewer ranks gives the
/// extra ranks rank 0's.
std::shared_ptr<Stateful> rng(Generator* generator = nullptr);
/// An object of one's own from two functions (a data loader's position, counters).
std::shared_ptr<Stateful> stateful(std::function<SavedState()> save,
                                   std::function<void(const StateReader&)> load);

/// Saves every object of `state` into `dir` (created if missing; shared by the ranks).
/// Collective over `pg`, which holds every rank with a part of any object. `metadata`: the
/// user's strings, returned by load(); keys must not start with an object's key and a dot, nor
/// be "checkpoint.objects". Throws ValueError for a bad key and save_sharded's errors (the
/// same on every rank); the previous checkpoint in `dir`, if any, stays the current one then.
void save(const State& state, const std::string& dir, ProcessGroup& pg,
          const std::map<std::string, std::string>& metadata = {});

struct LoadOptions {
  /// The reading process's rank, for per-rank values; -1: the default group's rank (0 without
  /// one).
  int rank = -1;
  /// An object of `state` the checkpoint lacks is an error (otherwise it is left as it is).
  bool strict = true;
};

/// Restores every object of `state` from `dir`; returns save()'s `metadata`. Not collective:
/// each rank reads what it holds now. Every piece read is checked against its checksum.
/// Throws ValueError naming an object the checkpoint lacks (strict) and the objects' and
/// ShardedCheckpoint's errors.
std::map<std::string, std::string> load(const State& state, const std::string& dir,
                                        const LoadOptions& options = {});

/// Saves in the background (torch's async_save): save() blocks only while the state is copied
/// to host memory and the ranks agree on the plan (collective over the group), then a thread
/// writes this rank's file and, over a group of its own, the index, while training goes on.
/// At most one save is in flight: the next save() waits for it (and logs that it does). The
/// index is written only when every rank's file is durable, so a crash or kill mid-save leaves
/// the previous checkpoint current and loadable. A failed write (a full disk, a read-only
/// directory) never throws into training: poll_error() reports it once, naming the file.
class AsyncSaver {
 public:
  /// Collective over `pg`: creates the group the background writes use (new_group of pg's
  /// ranks; gloo when pg is NCCL's). `pg` must be a group new_group can name by global ranks.
  explicit AsyncSaver(std::shared_ptr<ProcessGroup> pg);
  /// Waits for a save in flight; its error, if any, is logged.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// Collective over the group, as save(). Throws save()'s agreement errors (bad pieces, bad
  /// keys) right away; a failure while staging or writing comes from poll_error() or wait(),
  /// on every rank (a rank whose staging fails still takes part, sending its error).
  /// `stage_in_background`: return right after the ranks agree and copy the state on the
  /// background thread too; the caller must then call wait_until_staged() before anything
  /// changes the state (the next optimizer step: forward and backward may run meanwhile), as
  /// torchtitan's staging does.
  void save(const State& state, const std::string& dir,
            const std::map<std::string, std::string>& metadata = {},
            bool stage_in_background = false);
  /// Waits until the save in flight no longer reads the live state (at once when none is, or it
  /// was staged in save()).
  void wait_until_staged();
  /// The error of a save that has failed since the last call ("[async_save] <dir>: ..."), once;
  /// nullopt if none. Never blocks.
  std::optional<std::string> poll_error();
  /// Waits for the save in flight, then throws an error poll_error() has not reported yet
  /// (ember::Error).
  void wait();
  bool in_flight() const;

  struct Times {
    double blocked_s = 0;  ///< the caller's time in the last save()
    double written_s = 0;  ///< the last save's background write and commit
  };
  /// Of the last save (written_s once it has finished).
  Times last_times() const;

 private:
  void join();
  std::shared_ptr<ProcessGroup> pg_, commit_pg_;
  std::thread worker_;
  mutable std::mutex mu_;
  std::vector<std::string> errors_;  // not yet reported
  std::vector<Tensor> staging_;      // host copies of the pieces, by index, reused
  Times times_;
  bool busy_ = false;
  bool staged_ = true;
  std::condition_variable staged_cv_;
};

}  // namespace ember::dist::checkpoint

namespace ember::dist::detail {
/// The adapters' parts, which save_model_checkpoint and load_model_checkpoint also use.
checkpoint::SavedState model_state(const nn::Module& root);
checkpoint::SavedState optimizer_state(const nn::Module& root, const nn::optim::Optimizer& opt);
void load_model_state(const checkpoint::StateReader& r, const nn::Module& root);
void load_optimizer_state(const checkpoint::StateReader& r, const nn::Module& root,
                          nn::optim::Optimizer& opt);
}  // namespace ember::dist::detail
