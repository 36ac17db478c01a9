#include <ember/nn/io/hf_checkpoint.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include <ember/nn/io/atomic_file.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/error.h>

namespace ember::nn {

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // config.json keeps its keys' order

constexpr const char* kConfig = "config.json";
constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";
// An id per export, in every weight file's metadata and in the index's: a shard rewritten in
// place by an export that did not finish, or a single file left beside a newer index, then
// names another export than the index does, and the load refuses the mix instead of returning
// two models' tensors as one. Files without it (transformers' own) are read as before.
constexpr const char* kExportKey = "ember_export";

std::string new_export_id() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << ((static_cast<uint64_t>(rd()) << 32) | rd());
  return os.str();
}

// Shard i (from 1) of n, as transformers names them.
std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

bool is_weight_file(const std::string& name) {
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == kSingle || name == kIndex || std::regex_match(name, shard);
}

int64_t nbytes(const Tensor& t) { return t.numel() * static_cast<int64_t>(itemsize(t.dtype())); }

// config.json and the index: refused unread past this (transformers' indexes of the largest
// models are a few MB).
constexpr uint64_t kMaxJsonBytes = uint64_t{256} << 20;

std::string read_text(const fs::path& path) {
  return read_small_file(path.string(), kMaxJsonBytes, "[load_hf_checkpoint]");
}

Json parse_object(const std::string& text, const std::string& what, const char* op) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  EMBER_CHECK(j.is_object(), "[", op, "] ", what, " must hold a JSON object, got ",
              j.is_discarded() ? std::string("text that is not JSON") : std::string(j.type_name()));
  return j;
}

}  // namespace

void save_hf_checkpoint(const std::string& dir,
                        const std::vector<std::pair<std::string, Tensor>>& tensors,
                        const std::string& config_json, const HFSaveOptions& options) {
  const Json config = parse_object(config_json, "the config", "save_hf_checkpoint");
  EMBER_CHECK(options.max_shard_bytes > 0, "[save_hf_checkpoint] max_shard_bytes must be > 0, got ",
              options.max_shard_bytes);
  fs::create_directories(dir);

  // Consecutive tensors into shards of at most max_shard_bytes (one alone may exceed it).
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0, total = 0;
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    EMBER_CHECK(tensors[i].second.defined(), "[save_hf_checkpoint] tensor '", tensors[i].first,
                "' is undefined");
    // Checked here, not per file: two of a name in different shards would each be written, and
    // the index could name only one of them.
    EMBER_CHECK(names.insert(tensors[i].first).second, "[save_hf_checkpoint] tensor '",
                tensors[i].first, "' is given twice");
    const int64_t b = nbytes(tensors[i].second);
    if (!shards.back().empty() && in_shard + b > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
    total += b;
  }

  std::set<std::string> written;
  const std::map<std::string, std::string> stamp = {{kExportKey, new_export_id()}};
  if (shards.size() == 1) {
    save_state_dict((fs::path(dir) / kSingle).string(), tensors, stamp);
    written.insert(kSingle);
  } else {
    Json weight_map = Json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string file = shard_name(s + 1, shards.size());
      std::vector<std::pair<std::string, Tensor>> part;
      for (size_t i : shards[s]) {
        part.push_back(tensors[i]);
        weight_map[tensors[i].first] = file;
      }
      save_state_dict((fs::path(dir) / file).string(), part, stamp);
      written.insert(file);
    }
    const Json index = {{"metadata", {{"total_size", total}, {kExportKey, stamp.at(kExportKey)}}},
                        {"weight_map", weight_map}};
    write_file_atomic((fs::path(dir) / kIndex).string(), index.dump(2) + "\n");
    written.insert(kIndex);
  }
  write_file_atomic((fs::path(dir) / kConfig).string(), config.dump(2) + "\n");

  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (is_weight_file(name) && !written.count(name)) fs::remove(entry.path());
  }
}

HFCheckpoint load_hf_checkpoint(const std::string& dir) {
  const fs::path root(dir);
  auto fail = [&](auto&&... what) -> void {
    throw ValueError(::ember::detail::str_cat("[load_hf_checkpoint] '", dir, "': ", what...));
  };
  // Whether p is a regular file (or, with `any`, exists at all); a path the system cannot look
  // at (a name too long, no permission) is named as such rather than passing std::filesystem's
  // own exception on.
  auto is_file = [&](const fs::path& p, bool any = false) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      fail("cannot look at '", p.filename().string(), "': ", ec.message());
    }
    return any ? fs::exists(st) : fs::is_regular_file(st);
  };
  HFCheckpoint out;
  if (!is_file(root / kConfig, true)) fail("no config.json (not a Hugging Face model)");
  out.config_json = read_text(root / kConfig);
  parse_object(out.config_json, ::ember::detail::str_cat("'", (root / kConfig).string(), "'"),
               "load_hf_checkpoint");

  // An index's export id, when it has one (Ember wrote it).
  auto export_in = [](const Json& j) -> std::optional<std::string> {
    if (!j.is_object() || !j.contains("metadata") || !j["metadata"].is_object())
      return std::nullopt;
    const Json& m = j["metadata"];
    if (!m.contains(kExportKey) || !m[kExportKey].is_string()) return std::nullopt;
    return m[kExportKey].get<std::string>();
  };
  auto export_of = [](const SafetensorsFile& f) -> std::optional<std::string> {
    auto it = f.metadata().find(kExportKey);
    return it == f.metadata().end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  if (is_file(root / kSingle)) {
    SafetensorsFile f = load_safetensors((root / kSingle).string());
    const std::optional<std::string> mine = export_of(f);
    const std::optional<std::string> indexed =
        is_file(root / kIndex) ? export_in(Json::parse(read_text(root / kIndex), nullptr, false))
                               : std::nullopt;
    if (mine && indexed && *mine != *indexed) {
      fail("holds both ", kSingle, " and ", kIndex, " from different exports (", *mine, " and ",
           *indexed, "): an export that did not finish; export again");
    }
    out.tensors = f.tensors();
    out.files = {kSingle};
    return out;
  }
  if (!is_file(root / kIndex)) {
    if (is_file(root / "pytorch_model.bin", true)) {
      fail("has pytorch_model.bin only; Ember reads safetensors (transformers' "
           "save_pretrained(dir, safe_serialization=True) writes them)");
    }
    fail("has neither ", kSingle, " nor ", kIndex);
  }
  const std::string index_path = (root / kIndex).string();
  const Json index = parse_object(read_text(root / kIndex),
                                  ::ember::detail::str_cat("'", index_path, "'"),
                                  "load_hf_checkpoint");
  if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
    fail(kIndex, " has no \"weight_map\" object");
  }
  // file -> the tensors the index puts in it; the files in name order (sorted below).
  std::map<std::string, std::set<std::string>> listed;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) fail(kIndex, ": the file of '", name, "' is not a string");
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
      fail(kIndex, " puts '", name, "' in '", f, "', which is not a file of the directory");
    }
    if (!listed.count(f)) out.files.push_back(f);
    listed[f].insert(name);
  }
  std::sort(out.files.begin(), out.files.end());
  const std::optional<std::string> indexed = export_in(index);  // the index parsed above
  int64_t total = 0;
  for (const std::string& f : out.files) {
    const fs::path path = root / f;
    if (!is_file(path)) {
      fail("the shard '", f, "' that ", kIndex, " lists (for '", *listed[f].begin(), "' and ",
           listed[f].size() - 1, " more) is missing");
    }
    SafetensorsFile shard = load_safetensors(path.string());
    const std::optional<std::string> mine = export_of(shard);
    if (indexed && mine != indexed) {
      fail("the shard '", f, "' is from ", mine ? "export " + *mine : "no Ember export", " but ",
           kIndex, " from export ", *indexed,
           ": an export that did not finish; export "
           "again");
    }
    for (const auto& [name, t] : shard.tensors()) {
      if (!listed[f].count(name)) {
        fail("the shard '", f, "' holds '", name, "', which ", kIndex,
             " does not list there (a foreign or stale shard?)");
      }
      total += nbytes(t);
    }
    for (const std::string& name : listed[f]) {
      if (!shard.contains(name)) fail(kIndex, " puts '", name, "' in '", f, "', which lacks it");
    }
    out.tensors.insert(out.tensors.end(), shard.tensors().begin(), shard.tensors().end());
  }
  if (index.contains("metadata") && index["metadata"].is_object() &&
      index["metadata"].contains("total_size") &&
      index["metadata"]["total_size"].is_number_integer()) {  // get<> casts a float unchecked
    const auto want = index["metadata"]["total_size"].get<int64_t>();
    if (want != total) {
      fail(kIndex, " gives total_size ", want, " bytes, but its shards hold ", total);
    }
  }
  return out;
}

}  // namespace ember::nn
