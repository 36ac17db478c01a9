// emberckpt: looks into, checks and converts the checkpoints dist::checkpoint::save,
// AsyncSaver, save_model_checkpoint and save_sharded write (docs/checkpoints.md).
//
//   emberckpt inspect ckpt/                  objects, tensors (shape, dtype, pieces, bytes), files
//   emberckpt verify ckpt/                   every piece against its checksum
//   emberckpt consolidate ckpt/ out.safetensors [--object model]
//                                            one ordinary safetensors file (with --object, that
//                                            object's tensors under their own names: a plain
//                                            model's load_state_dict reads them)
//   emberckpt convert SRC DST --to sharded|safetensors|hf [--object K] [--heads N]
//                             [--config config.json] [--max-shard-bytes B]
//                                            SRC: a checkpoint directory, a Hugging Face model
//                                            directory (config.json) or a .safetensors file;
//                                            examples/gpt's model and GPT-2's are renamed into
//                                            each other (examples/gpt_hf.h), other models keep
//                                            their names (--to hf then needs --config)
//
// Needs no process group. Exit status: 0 done (verify: every piece good); 1 the checkpoint
// cannot be read, fails its checks or the file cannot be written; 2 bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/checkpoint/checkpoint.h>
#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/io/hf_checkpoint.h>
#include <ember/nn/io/serialize.h>
#include <ember/tensor/error.h>
#include <ember/tensor/version.h>
#include "examples/gpt_hf.h"

namespace {

using ember::dist::ShardedCheckpoint;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string bytes_text(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) {
    b /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

void inspect(const ShardedCheckpoint& ck) {
  int64_t total = 0, checksummed = 0, pieces = 0;
  std::map<int, int64_t> per_rank;
  for (const std::string& name : ck.names()) {
    const auto& e = ck.entry(name);
    for (const auto& p : e.pieces) {
      const int64_t b = p.numel * ember::itemsize(e.dtype);
      total += b;
      per_rank[p.rank] += b;
      ++pieces;
      checksummed += p.checksum.has_value();
    }
  }
  std::printf("%s: save %s by %d ranks, %zu tensors in %lld pieces, %s (%lld of the pieces "
              "checksummed)\n",
              ck.dir().c_str(), ck.save_id().c_str(), ck.world_size(), ck.names().size(),
              static_cast<long long>(pieces), bytes_text(static_cast<double>(total)).c_str(),
              static_cast<long long>(checksummed));
  if (auto it = ck.metadata().find("checkpoint.objects"); it != ck.metadata().end()) {
    std::printf("objects: %s\n", it->second.c_str());
  }
  for (const auto& [k, v] : ck.metadata()) {
    if (k == "checkpoint.objects") continue;
    std::printf("  metadata %s = %s\n", k.c_str(),
                v.size() > 120 ? (v.substr(0, 117) + "...").c_str() : v.c_str());
  }
  for (int r = 0; r < ck.world_size(); ++r) {
    for (const auto& [k, v] : ck.rank_metadata(r)) {
      std::printf("  rank %d: %s = %s\n", r, k.c_str(), v.c_str());
    }
  }
  for (const auto& [rank, b] : per_rank) {
    std::printf("  file %s: %s\n", std::filesystem::path(ck.rank_file(rank)).filename().c_str(),
                bytes_text(static_cast<double>(b)).c_str());
  }
  for (const std::string& name : ck.names()) {
    const auto& e = ck.entry(name);
    std::printf("  %s %s %s, %s in %zu piece(s) on ranks", name.c_str(),
                std::string(ember::dtype_name(e.dtype)).c_str(), shape_text(e.shape).c_str(),
                bytes_text(static_cast<double>(ck.numel(name) * ember::itemsize(e.dtype))).c_str(),
                e.pieces.size());
    for (const auto& p : e.pieces) std::printf(" %d", p.rank);
    std::printf("\n");
  }
}

using Named = std::vector<std::pair<std::string, ember::Tensor>>;

// The whole tensors of checkpoint object `object`, under their own names; `values`, if given,
// gets its values the same way. ValueError naming the objects there when it has neither.
Named object_tensors(const ShardedCheckpoint& ck, const std::string& object,
                     std::map<std::string, std::string>* values = nullptr) {
  const std::string prefix = object + ".";
  Named tensors;
  for (const std::string& name : ck.names()) {
    if (name.rfind(prefix, 0) == 0) tensors.emplace_back(name.substr(prefix.size()), ck.read_full(name));
  }
  bool has_values = false;
  for (const auto& [k, v] : ck.metadata()) {
    if (k.rfind(prefix, 0) != 0) continue;
    has_values = true;
    if (values) (*values)[k.substr(prefix.size())] = v;
  }
  EMBER_CHECK(!tensors.empty() || has_values, "[emberckpt] ", ck.dir(), " has no object '",
              object, "'", ck.metadata().count("checkpoint.objects")
                               ? " (it has " + ck.metadata().at("checkpoint.objects") + ")"
                               : std::string());
  return tensors;
}

// `object`'s tensors under their own names and its values as metadata ("" : everything).
void consolidate(const ShardedCheckpoint& ck, const std::string& out, const std::string& object) {
  if (object.empty()) {
    ck.consolidate(out);
    return;
  }
  std::map<std::string, std::string> meta;
  const Named tensors = object_tensors(ck, object, &meta);
  ember::nn::save_safetensors(out, tensors, meta);
}


// ---- convert ----

namespace fs = std::filesystem;

// What convert carries from one format to another.
struct Model {
  Named tensors;
  std::map<std::string, std::string> metadata;
  std::string hf_config;  // a Hugging Face source's config.json ("" otherwise)
};

// The metadata key under which a converted Hugging Face model keeps its config.json, so that
// converting back writes it again.
constexpr const char* kHfConfigKey = "hf_config";

bool is_gpt(const Named& tensors) {
  bool wte = false, block = false;
  for (const auto& [name, t] : tensors) {
    wte |= name == "wte.weight";
    block |= name == "blocks.0.qkv.weight";
  }
  return wte && block;
}

Model read_source(const std::string& src, const std::string& object) {
  Model m;
  if (fs::is_regular_file(src)) {
    const ember::nn::SafetensorsFile f = ember::nn::load_safetensors(src);
    m.tensors = f.tensors();
    m.metadata = f.metadata();
  } else if (fs::exists(fs::path(src) / "config.json")) {
    const ember::nn::HFCheckpoint hf = ember::nn::load_hf_checkpoint(src);
    m.hf_config = hf.config_json;
    const auto j = nlohmann::json::parse(hf.config_json);
    const bool gpt2 = j.contains("model_type") && j["model_type"].is_string() &&
                      j["model_type"].get<std::string>() == "gpt2";
    m.tensors = gpt2 ? ember::examples::from_gpt2_tensors(hf.tensors) : hf.tensors;
    m.metadata[kHfConfigKey] = hf.config_json;
  } else {
    const ShardedCheckpoint ck(src);
    // A dist::checkpoint::save's checkpoint: one object's tensors (the model's by default).
    std::string obj = object;
    if (obj.empty() && ck.metadata().count("checkpoint.objects")) obj = "model";
    if (obj.empty()) {  // save_sharded's own checkpoint: its tensors as they are
      for (const std::string& name : ck.names()) m.tensors.emplace_back(name, ck.read_full(name));
    } else {
      m.tensors = object_tensors(ck, obj);
    }
    for (const auto& [k, v] : ck.metadata()) {
      if (k != "checkpoint.objects") m.metadata[k] = v;
    }
  }
  return m;
}

// The GPT-2 config of examples/gpt's tensors: the shapes give all but the heads, which come from
// the checkpoint's metadata (examples/gpt records "heads"), a GPT-2 source's config or --heads.
std::string gpt2_config_of(const Model& m, int64_t heads) {
  ember::examples::GPTConfig c;
  int64_t layers = 0;
  for (const auto& [name, t] : m.tensors) {
    if (name == "wte.weight") c.vocab = t.size(0), c.dim = t.size(1);
    if (name == "wpe.weight") c.context = t.size(0);
    if (name.rfind("blocks.", 0) == 0) {
      layers = std::max<int64_t>(layers, std::stoll(name.substr(7, name.find('.', 7) - 7)) + 1);
    }
  }
  c.layers = layers;
  if (heads <= 0 && m.metadata.count(kHfConfigKey)) {
    heads = ember::examples::gpt_config_from_gpt2(m.metadata.at(kHfConfigKey)).heads;
  }
  if (heads <= 0 && m.metadata.count("heads")) {
    const std::string& v = m.metadata.at("heads");
    try {
      heads = std::stoll(v);
    } catch (const std::exception&) {
      EMBER_CHECK(false,
                  "[emberckpt convert] the checkpoint's \"heads\" metadata is not a number: '", v,
                  "'");
    }
  }
  EMBER_CHECK(heads > 0, "[emberckpt convert] the number of attention heads is not in the "
              "checkpoint: give --heads");
  c.heads = heads;
  return ember::examples::gpt2_config_json(c);
}

void write_hf(const Model& m, const std::string& dst, int64_t heads,
              const std::string& config_file, int64_t max_shard_bytes) {
  ember::nn::HFSaveOptions options;
  if (max_shard_bytes > 0) options.max_shard_bytes = max_shard_bytes;
  if (is_gpt(m.tensors)) {
    ember::nn::save_hf_checkpoint(dst, ember::examples::to_gpt2_tensors(m.tensors),
                                  gpt2_config_of(m, heads), options);
    return;
  }
  std::string config = m.hf_config;
  if (!config_file.empty()) {
    std::ifstream in(config_file);
    EMBER_CHECK(in.good(), "[emberckpt convert] cannot read --config ", config_file);
    config.assign(std::istreambuf_iterator<char>(in), {});
  }
  EMBER_CHECK(!config.empty(), "[emberckpt convert] --to hf of a model other than examples/gpt's "
              "needs its config.json (--config FILE): the tensors keep their names");
  ember::nn::save_hf_checkpoint(dst, m.tensors, config, options);
}

// One process's checkpoint of object `object` ("model" by default), which
// dist::checkpoint::load({{"model", model(m)}}) reads at any layout.
void write_sharded(const Model& m, const std::string& dst, const std::string& object) {
  namespace ckpt = ember::dist::checkpoint;
  const Named tensors = m.tensors;
  auto state = ckpt::stateful(
      [&] {
        ckpt::SavedState s;
        for (const auto& [name, t] : tensors) {
          s.tensors.push_back({.name = name, .shape = t.sizes().vec(), .data = t.reshape({-1})});
        }
        return s;
      },
      [](const ckpt::StateReader&) {});
  const std::string key = object.empty() ? "model" : object;
  std::map<std::string, std::string> metadata;  // a source's object values are not the user's
  for (const auto& [k, v] : m.metadata) {
    if (k.rfind(key + ".", 0) != 0) metadata[k] = v;
  }
  ember::dist::ProcessGroupThreads pg(ember::dist::ThreadWorld::create(1), 0);
  ckpt::save({{key, state}}, dst, pg, metadata);
}

void convert(const std::string& src, const std::string& dst, const std::string& to,
             const std::string& object, int64_t heads, const std::string& config_file,
             int64_t max_shard_bytes) {
  const Model m = read_source(src, object);
  if (to == "safetensors") {
    ember::nn::save_safetensors(dst, m.tensors, m.metadata);
  } else if (to == "hf") {
    write_hf(m, dst, heads, config_file, max_shard_bytes);
  } else {
    write_sharded(m, dst, object);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, verify, consolidate and convert Ember's checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, object, to, config_file;
  int64_t heads = 0, max_shard_bytes = 0;
  auto* ins = app.add_subcommand("inspect", "objects, tensors, pieces and files");
  ins->add_option("dir", dir, "checkpoint directory (holds index.json)")->required();
  auto* ver = app.add_subcommand("verify", "check every piece against its checksum");
  ver->add_option("dir", dir, "checkpoint directory")->required();
  auto* con = app.add_subcommand("consolidate", "write one ordinary safetensors file");
  con->add_option("dir", dir, "checkpoint directory")->required();
  con->add_option("out", out, "the safetensors file to write")->required();
  con->add_option("--object", object,
                  "only this object's tensors, under their own names (e.g. model)");
  auto* conv = app.add_subcommand("convert", "between Ember's sharded format, one safetensors "
                                              "file and Hugging Face's layout");
  conv->add_option("src", dir, "a checkpoint directory, a Hugging Face directory or a "
                               ".safetensors file")->required();
  conv->add_option("dst", out, "what to write")->required();
  conv->add_option("--to", to, "the format of dst")
      ->required()
      ->check(CLI::IsMember({"sharded", "safetensors", "hf"}));
  conv->add_option("--object", object, "the checkpoint object to take (default: model) or to "
                                       "write (default: model)");
  conv->add_option("--heads", heads, "attention heads of examples/gpt's model, when the "
                                     "checkpoint does not record them")
      ->check(CLI::PositiveNumber);
  conv->add_option("--config", config_file, "--to hf: config.json of a model other than "
                                            "examples/gpt's");
  conv->add_option("--max-shard-bytes", max_shard_bytes, "--to hf: the largest shard")
      ->check(CLI::PositiveNumber);
  app.set_version_flag("--version", std::string("emberckpt (Ember) ") + ember::version());
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForVersion& v) {
    std::printf("%s\n", v.what());
    return 0;
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "emberckpt: %s\n%s", e.what(), app.help().c_str());
    return 2;
  }
  try {
    if (*conv) {
      convert(dir, out, to, object, heads, config_file, max_shard_bytes);
      std::printf("emberckpt: wrote %s\n", out.c_str());
      return 0;
    }
    const ShardedCheckpoint ck(dir);
    if (*ins) inspect(ck);
    if (*ver) {
      ck.verify();
      // A checkpoint written before checksums (index version 2) has pieces with none: say so
      // rather than report them checked.
      size_t pieces = 0, unchecked = 0;
      for (const std::string& name : ck.names()) {
        for (const auto& piece : ck.entry(name).pieces) {
          ++pieces;
          if (!piece.checksum) ++unchecked;
        }
      }
      if (unchecked == 0) {
        std::printf("emberckpt: %s: every piece of %zu tensors matches its checksum\n", dir.c_str(),
                    ck.names().size());
      } else {
        std::printf(
            "emberckpt: %s: %zu of %zu pieces carry no checksum (a checkpoint written "
            "before checksums): only their files' sizes were checked; the other %zu "
            "match their checksums\n",
            dir.c_str(), unchecked, pieces, pieces - unchecked);
      }
    }
    if (*con) {
      consolidate(ck, out, object);
      std::printf("emberckpt: wrote %s\n", out.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emberckpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
