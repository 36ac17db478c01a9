// The examples' checkpoints, through dist::checkpoint (docs/checkpoints.md): one folder holds
// the run's latest checkpoint of every object (model, optimizer, schedule, RNG, loss scale, the
// communication hook's per-rank state, the run's position), each rank writing its part, loadable
// at any layout and world size. With --async-checkpoint the write happens in the background
// (AsyncSaver), and so does the copy to memory, during the next step's forward (and backward):
// the trainer calls wait_until_staged() before anything changes the saved state. A write that
// fails is reported while training goes on.
#pragma once

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>

#include <ember/distributed/checkpoint/checkpoint.h>
#include <ember/distributed/ddp/hook_registry.h>

namespace ember::examples {

namespace ckpt = dist::checkpoint;

/// A communication hook's state as a checkpoint object: each rank's tensors, written by that
/// rank as "rank<r>.<name>" (error feedback's residuals differ between ranks), and the world
/// size. A load at the saved world size restores this rank's; at another the state cannot
/// follow and is left fresh, and `*restored` says which happened.
inline std::shared_ptr<ckpt::Stateful> hook_checkpoint_state(const dist::MadeCommHook& hook,
                                                             int rank, int world, bool* restored) {
  const std::string mine = "rank" + std::to_string(rank) + ".";
  return ckpt::stateful(
      [&hook, mine, world] {
        ckpt::SavedState s;
        for (const auto& [name, t] : hook.state_dict()) {
          s.tensors.push_back({.name = mine + name, .shape = t.sizes().vec(), .data = t.reshape({-1})});
        }
        s.values["world_size"] = std::to_string(world);
        return s;
      },
      [&hook, mine, world, restored](const ckpt::StateReader& r) {
        *restored = r.value("world_size") == std::to_string(world);
        if (!*restored) return;
        nn::NamedTensors state;
        for (const std::string& name : r.tensor_names()) {
          if (name.rfind(mine, 0) == 0) state.emplace_back(name.substr(mine.size()), r.read_full(name));
        }
        hook.load_state_dict(state);
      });
}

/// `inner` with its tensor `name` (and `name.<key>`, an optimizer's state of it) left out of what
/// this rank saves, because another rank saves the same tensor laid out differently (a pipeline's
/// last stage's copy of the tied embedding, fully_shard-ed at other offsets than the first
/// stage's), but read back on load like the rest.
inline std::shared_ptr<ckpt::Stateful> saved_elsewhere(std::shared_ptr<ckpt::Stateful> inner,
                                                      const std::string& name) {
  return ckpt::stateful(
      [inner, name] {
        ckpt::SavedState s = inner->state_dict();
        std::erase_if(s.tensors, [&](const dist::ShardPiece& p) {
          return p.name == name || p.name.rfind(name + ".", 0) == 0;
        });
        return s;
      },
      [inner](const ckpt::StateReader& r) { inner->load_state_dict(r); });
}

/// The run's checkpoint folder: written by save() (collective), synchronously or in the
/// background, read back by load().
class RunCheckpoint {
 public:
  /// Collective over `pg` when `async` (the background writes' group).
  RunCheckpoint(std::string dir, std::shared_ptr<dist::ProcessGroup> pg, bool async, bool leader)
      : dir_(std::move(dir)),
        pg_(std::move(pg)),
        leader_(leader),
        saver_(async ? std::make_unique<ckpt::AsyncSaver>(pg_) : nullptr) {}

  const std::string& dir() const { return dir_; }
  /// Whether a complete checkpoint is there (its index is written last). Throws, naming what
  /// was found, when the folder holds the checkpoint of an earlier version instead (a
  /// checkpoint.safetensors file, or sharded/): resuming must not silently start from scratch
  /// and later overwrite it.
  bool exists() const {
    namespace fs = std::filesystem;
    if (fs::exists(dir_ + "/index.json")) return true;
    for (const char* older : {"checkpoint.safetensors", "sharded/index.json"}) {
      if (fs::exists(dir_ + "/" + older)) {
        throw std::runtime_error(
            dir_ + " holds " + older + ", a checkpoint of an earlier version of this program, "
            "which reads dist::checkpoint's folders (docs/checkpoints.md): resume it with the "
            "version that wrote it, or give another --checkpoint-dir to start afresh");
      }
    }
    return false;
  }

  /// Collective. Synchronous: returns when every rank's part and the index are durable (throws
  /// if they cannot be written). Asynchronous: returns once the ranks agree on the plan (waiting
  /// first for the previous save, if it is still being written); the state is copied in the
  /// background, and wait_until_staged() must come before the state changes.
  void save(const ckpt::State& state, const std::map<std::string, std::string>& meta) {
    if (saver_) {
      saver_->save(state, dir_, meta, /*stage_in_background=*/true);
    } else {
      ckpt::save(state, dir_, *pg_, meta);
    }
  }

  /// Returns once the save in flight no longer reads the live state (at once when none does):
  /// before an optimizer step, and before a backward that changes saved state (a communication
  /// hook's error feedback, ZeRO's step inside backward).
  void wait_until_staged() {
    if (saver_) saver_->wait_until_staged();
  }

  /// Rank 0 prints a background write that has failed since the last call (training goes on;
  /// the previous checkpoint stays the current one). Never blocks.
  void report_failures() {
    if (!saver_) return;
    if (auto e = saver_->poll_error(); e && leader_) {
      std::printf("checkpoint: %s; training goes on, the previous checkpoint stays current\n",
                  e->c_str());
      std::fflush(stdout);
    }
  }

  /// Waits for the write in flight, reporting its failure (the end of training).
  void finish() {
    if (!saver_) return;
    try {
      saver_->wait();
    } catch (const std::exception& e) {
      if (leader_) std::printf("checkpoint: %s\n", e.what());
    }
    report_failures();
  }

  /// Restores every object of `state` and returns the checkpoint's metadata. `optional`: an
  /// object the checkpoint may lack (it is then left as it is; a communication hook the saving
  /// run did not have); any other it lacks is an error naming it. `rank`: this process's.
  std::map<std::string, std::string> load(ckpt::State state, int rank,
                                          const std::string& optional = "") const {
    if (!optional.empty() && state.count(optional)) {
      const dist::ShardedCheckpoint ck(dir_);
      const auto it = ck.metadata().find("checkpoint.objects");
      const auto objects = it == ck.metadata().end()
                               ? nlohmann::json::array()
                               : nlohmann::json::parse(it->second, nullptr, false);
      bool has = false;
      if (objects.is_array()) {
        for (const auto& o : objects) has = has || o == optional;
      }
      if (!has) state.erase(optional);
    }
    return ckpt::load(state, dir_, {.rank = rank});
  }

 private:
  std::string dir_;
  std::shared_ptr<dist::ProcessGroup> pg_;
  bool leader_;
  std::unique_ptr<ckpt::AsyncSaver> saver_;
};

}  // namespace ember::examples
