// One checkpoint API over Stateful objects (checkpoint.h).
#include <ember/distributed/checkpoint/checkpoint.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <set>

#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/error.h>
#include <ember/tensor/gpu/cuda.h>
#include <ember/tensor/observe/log.h>

namespace ember::dist::checkpoint {

using ember::detail::str_cat;
using Json = nlohmann::json;

namespace {
constexpr const char* kObjectsKey = "checkpoint.objects";

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

// ---- reading one object ----

StateReader::StateReader(const ShardedCheckpoint& ck, std::string object, int rank)
    : ck_(ck), object_(std::move(object)), prefix_(object_.empty() ? "" : object_ + "."),
      rank_(rank) {}

bool StateReader::contains(const std::string& name) const { return ck_.contains(full(name)); }

std::vector<std::string> StateReader::tensor_names() const {
  std::vector<std::string> out;
  for (const std::string& n : ck_.names()) {
    if (n.rfind(prefix_, 0) == 0) out.push_back(n.substr(prefix_.size()));
  }
  return out;
}

std::vector<int64_t> StateReader::shape(const std::string& name) const { return ck_.shape(full(name)); }
Dtype StateReader::dtype(const std::string& name) const { return ck_.dtype(full(name)); }

Tensor StateReader::read(const std::string& name, int64_t offset, int64_t numel, const Box& box) const {
  return ck_.read(full(name), offset, numel, box);
}
void StateReader::read_into(const std::string& name, int64_t offset, Tensor& out, const Box& box) const {
  ck_.read_into(full(name), offset, out, box);
}
Tensor StateReader::read_full(const std::string& name) const { return ck_.read_full(full(name)); }

std::optional<std::string> StateReader::find_value(const std::string& key) const {
  auto it = ck_.metadata().find(full(key));
  if (it == ck_.metadata().end()) return std::nullopt;
  return it->second;
}

std::string StateReader::value(const std::string& key) const {
  std::optional<std::string> v = find_value(key);
  EMBER_CHECK(v.has_value(), "[checkpoint::load] ", ck_.dir(), ": '", object_,
              "' saved no value '", key, "'");
  return *v;
}

std::optional<std::string> StateReader::rank_value(const std::string& key) const {
  const int from = rank_ >= 0 && rank_ < ck_.world_size() ? rank_ : 0;
  const auto mine = ck_.rank_metadata(from);
  auto it = mine.find(full(key));
  if (it == mine.end()) return std::nullopt;
  return it->second;
}

// ---- adapters ----

namespace {

class FunctionState : public Stateful {
 public:
  FunctionState(std::function<SavedState()> save, std::function<void(const StateReader&)> load)
      : save_(std::move(save)), load_(std::move(load)) {
    EMBER_CHECK(save_ && load_, "[checkpoint::stateful] expected a save and a load function");
  }
  SavedState state_dict() const override { return save_(); }
  void load_state_dict(const StateReader& r) override { load_(r); }

 private:
  std::function<SavedState()> save_;
  std::function<void(const StateReader&)> load_;
};

}  // namespace

std::shared_ptr<Stateful> stateful(std::function<SavedState()> save,
                                   std::function<void(const StateReader&)> load) {
  return std::make_shared<FunctionState>(std::move(save), std::move(load));
}

std::shared_ptr<Stateful> model(const nn::Module& root) {
  return stateful([&root] { return detail::model_state(root); },
                  [&root](const StateReader& r) { detail::load_model_state(r, root); });
}

std::shared_ptr<Stateful> optimizer(nn::optim::Optimizer& opt, const nn::Module& root) {
  return stateful([&opt, &root] { return detail::optimizer_state(root, opt); },
                  [&opt, &root](const StateReader& r) { detail::load_optimizer_state(r, root, opt); });
}

std::shared_ptr<Stateful> lr_scheduler(nn::optim::LRScheduler& scheduler) {
  return stateful([&scheduler] { return SavedState{{}, {{"state", scheduler.state_dict()}}, {}}; },
                  [&scheduler](const StateReader& r) { scheduler.load_state_dict(r.value("state")); });
}

std::shared_ptr<Stateful> grad_scaler(nn::amp::GradScaler& scaler) {
  return stateful(
      [&scaler] { return SavedState{{}, {{"state", Json(scaler.state_dict()).dump()}}, {}}; },
      [&scaler](const StateReader& r) {
        const std::string text = r.value("state");
        const Json j = Json::parse(text, nullptr, false);
        std::map<std::string, double> state;
        bool ok = j.is_object();
        for (auto e = j.begin(); ok && e != j.end(); ++e) {
          ok = e->is_number();
          if (ok) state[e.key()] = e->get<double>();
        }
        EMBER_CHECK(ok, "[checkpoint::grad_scaler] ", r.checkpoint().dir(), ": '", r.object(),
                    ".state' must be a JSON object of numbers, got '", text, "'");
        scaler.load_state_dict(state);
      });
}

std::shared_ptr<Stateful> rng(Generator* generator) {
  auto gen = [generator]() -> Generator& { return generator ? *generator : default_generator(); };
  return stateful(
      [gen] {
        Generator& g = gen();
        return SavedState{{}, {}, {{"seed", std::to_string(g.seed())}, {"offset", std::to_string(g.offset())}}};
      },
      [gen](const StateReader& r) {
        const std::optional<std::string> seed = r.rank_value("seed"), offset = r.rank_value("offset");
        EMBER_CHECK(seed && offset, "[checkpoint::rng] ", r.checkpoint().dir(), ": '", r.object(),
                    "' holds no generator state");
        Generator& g = gen();
        try {
          g.manual_seed(std::stoull(*seed));
          g.set_offset(std::stoull(*offset));
        } catch (const std::logic_error&) {
          EMBER_CHECK(false, "[checkpoint::rng] ", r.checkpoint().dir(), ": '", r.object(),
                      "' has seed '", *seed, "' and offset '", *offset, "', expected integers");
        }
      });
}

// ---- save and load ----

namespace {

struct Gathered {
  std::vector<ShardPiece> pieces;
  std::map<std::string, std::string> metadata, rank_metadata;
};

void check_key(const std::string& key, const char* op) {
  EMBER_CHECK(!key.empty() && key.find('.') == std::string::npos, "[", op, "] object key '", key,
              "': expected a non-empty name without dots");
}

// Every object's state under its key, and the user's metadata beside it.
Gathered gather(const State& state, const std::map<std::string, std::string>& metadata,
                const char* op) {
  Gathered g;
  Json objects = Json::array();
  for (const auto& [key, obj] : state) {
    check_key(key, op);
    EMBER_CHECK(obj != nullptr, "[", op, "] object '", key, "' is null");
    objects.push_back(key);
    SavedState s = obj->state_dict();
    for (ShardPiece& p : s.tensors) {
      p.name = key + "." + p.name;
      g.pieces.push_back(std::move(p));
    }
    for (const auto& [k, v] : s.values) g.metadata[key + "." + k] = v;
    for (const auto& [k, v] : s.rank_values) g.rank_metadata[key + "." + k] = v;
  }
  for (const auto& [k, v] : metadata) {
    EMBER_CHECK(k != kObjectsKey, "[", op, "] metadata key '", k, "' is reserved");
    for (const auto& [key, obj] : state) {
      EMBER_CHECK(k.rfind(key + ".", 0) != 0, "[", op, "] metadata key '", k,
                  "' would mix with object '", key, "''s values; choose another");
    }
    g.metadata[k] = v;
  }
  g.metadata[kObjectsKey] = objects.dump();
  return g;
}

}  // namespace

void save(const State& state, const std::string& dir, ProcessGroup& pg,
          const std::map<std::string, std::string>& metadata) {
  Gathered g = gather(state, metadata, "checkpoint::save");
  save_sharded(dir, g.pieces, pg, g.metadata, g.rank_metadata);
}

std::map<std::string, std::string> load(const State& state, const std::string& dir,
                                        const LoadOptions& options) {
  const ShardedCheckpoint ck(dir);
  int rank = options.rank;
  if (rank < 0) rank = is_initialized() ? default_group()->rank() : 0;
  std::set<std::string> saved;
  auto it = ck.metadata().find(kObjectsKey);
  const Json objects = it == ck.metadata().end() ? Json() : Json::parse(it->second, nullptr, false);
  EMBER_CHECK(objects.is_array(), "[checkpoint::load] ", dir,
              " was not written by checkpoint::save (no object list in its metadata)");
  for (const Json& o : objects) saved.insert(o.is_string() ? o.get<std::string>() : o.dump());
  for (const auto& [key, obj] : state) {
    check_key(key, "checkpoint::load");
    if (saved.count(key) == 0) {
      std::string have;
      for (const std::string& s : saved) have += (have.empty() ? "" : ", ") + s;
      EMBER_CHECK(!options.strict, "[checkpoint::load] ", dir, " has no object '", key,
                  "' (it has ", have.empty() ? "none" : have, ")");
      continue;
    }
    obj->load_state_dict(StateReader(ck, key, rank));
  }
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : ck.metadata()) {
    bool objects_value = k == kObjectsKey;
    for (const std::string& key : saved) objects_value = objects_value || k.rfind(key + ".", 0) == 0;
    if (!objects_value) meta[k] = v;
  }
  return meta;
}

// ---- async ----

namespace {

std::shared_ptr<ProcessGroup> commit_group(const ProcessGroup& pg) {
  std::vector<int> ranks;
  for (int r = 0; r < pg.size(); ++r) ranks.push_back(get_global_rank(pg, r));
  return new_group(ranks, std::nullopt, pg.backend_name() == "nccl" ? "gloo" : "");
}

}  // namespace

AsyncSaver::AsyncSaver(std::shared_ptr<ProcessGroup> pg)
    : pg_(std::move(pg)), commit_pg_(commit_group(*pg_)) {}

AsyncSaver::~AsyncSaver() {
  join();
  for (const std::string& e : errors_) logging::warn(e);
}

void AsyncSaver::join() {
  if (worker_.joinable()) worker_.join();
}

bool AsyncSaver::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_;
}

void AsyncSaver::save(const State& state, const std::string& dir,
                      const std::map<std::string, std::string>& metadata,
                      bool stage_in_background) {
  const auto t0 = std::chrono::steady_clock::now();
  if (in_flight()) {
    logging::info("[async_save] waiting for the save still in flight before saving to ", dir);
  }
  join();
  Gathered g = gather(state, metadata, "async_save");
  // Staged on the worker, a GPU's pieces are copied on the worker's stream, which is not ordered
  // with the caller's (streams made by Stream::create do not wait for the default stream): an
  // event recorded here on the caller's stream of each such device, which the worker's stream
  // waits for, orders the copies after the work the caller queued (the step that wrote them).
  std::vector<std::shared_ptr<cuda::Event>> caller_done;
  if (stage_in_background) {
    std::set<int> gpus;  // the devices of this rank's pieces on a GPU
    for (const ShardPiece& piece : g.pieces) {
      if (piece.data.defined() && piece.data.is_cuda()) gpus.insert(piece.data.device().index);
    }
    for (int d : gpus) {
      caller_done.push_back(std::make_shared<cuda::Event>());
      caller_done.back()->record(cuda::current_stream(d));
    }
  }
  std::shared_ptr<detail::PreparedSave> prepared =
      detail::prepare_sharded_save(dir, std::move(g.pieces), *pg_, g.metadata, g.rank_metadata);
  // Copies training cannot change, in host memory, of the pieces this rank writes only; the
  // buffers are kept for the next save (a fresh 1 GB costs more in page faults than in copying).
  auto stage = [this, prepared, caller_done] {
    for (const auto& e : caller_done) e->block(cuda::current_stream(e->device()));
    detail::stage_sharded_save(*prepared, [this](size_t i, const Tensor& data) {
      if (staging_.size() <= i) staging_.resize(i + 1);
      Tensor& buf = staging_[i];
      // A GPU's pieces land in page-locked memory: the copy then runs at the link's speed, not
      // through a bounce buffer.
      const bool pinned = data.is_cuda();
      if (!buf.defined() || buf.numel() != data.numel() || buf.dtype() != data.dtype() ||
          buf.is_pinned() != pinned) {
        buf = empty({data.numel()}, TensorOptions(data.dtype()).pinned_memory(pinned));
      }
      buf.copy_(data.detach().reshape({-1}));
      return buf;
    });
  };
  // A rank whose staging throws still commits, sending the error: every rank's save then fails
  // alike, where a rank that skipped the commit would leave the others waiting for its file.
  auto stage_or_fail = [prepared, stage] {
    try {
      stage();
    } catch (const std::exception& e) {
      detail::fail_sharded_save(*prepared, str_cat("staging failed: ", e.what()));
    }
  };
  if (!stage_in_background) stage_or_fail();
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = true;
    staged_ = !stage_in_background;
    times_ = {seconds_since(t0), 0};
  }
  worker_ = std::thread([this, prepared, dir, stage_or_fail, stage_in_background] {
    const auto w0 = std::chrono::steady_clock::now();
    std::string error;
    try {
      if (stage_in_background) {
        struct Staged {  // also when staging throws: nobody may wait for it forever
          AsyncSaver* s;
          ~Staged() {
            {
              std::lock_guard<std::mutex> lock(s->mu_);
              s->staged_ = true;
            }
            s->staged_cv_.notify_all();
          }
        } staged{this};
        stage_or_fail();
      }
      detail::commit_sharded_save(*prepared, *commit_pg_);
    } catch (const std::exception& e) {
      error = str_cat("[async_save] ", dir, ": ", e.what());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!error.empty()) errors_.push_back(std::move(error));
    times_.written_s = seconds_since(w0);
    busy_ = false;
  });
}

void AsyncSaver::wait_until_staged() {
  std::unique_lock<std::mutex> lock(mu_);
  staged_cv_.wait(lock, [this] { return staged_; });
}

std::optional<std::string> AsyncSaver::poll_error() {
  std::lock_guard<std::mutex> lock(mu_);
  if (errors_.empty()) return std::nullopt;
  std::string e = std::move(errors_.front());
  errors_.erase(errors_.begin());
  return e;
}

void AsyncSaver::wait() {
  join();
  if (std::optional<std::string> e = poll_error()) throw Error(*e);
}

AsyncSaver::Times AsyncSaver::last_times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return times_;
}

}  // namespace ember::dist::checkpoint
