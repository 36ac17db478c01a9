// emberckpt: looks into, checks and converts the checkpoints dist::checkpoint::save,
// AsyncSaver, save_model_checkpoint and save_sharded write (docs/checkpoints.md).
//
//   emberckpt inspect ckpt/                  objects, tensors (shape, dtype, pieces, bytes), files
//   emberckpt verify ckpt/                   every piece against its checksum
//   emberckpt consolidate ckpt/ out.safetensors [--object model]
//                                            one ordinary safetensors file (with --object, that
//                                            object's tensors under their own names: a plain
//                                            model's load_state_dict reads them)
//
// Needs no process group. Exit status: 0 done (verify: every piece good); 1 the checkpoint
// cannot be read, fails its checks or the file cannot be written; 2 bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/nn/serialize.h>
#include <ember/tensor/error.h>

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

// `object`'s tensors under their own names and its values as metadata ("" : everything).
void consolidate(const ShardedCheckpoint& ck, const std::string& out, const std::string& object) {
  if (object.empty()) {
    ck.consolidate(out);
    return;
  }
  const std::string prefix = object + ".";
  std::vector<std::pair<std::string, ember::Tensor>> tensors;
  for (const std::string& name : ck.names()) {
    if (name.rfind(prefix, 0) == 0) tensors.emplace_back(name.substr(prefix.size()), ck.read_full(name));
  }
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : ck.metadata()) {
    if (k.rfind(prefix, 0) == 0) meta[k.substr(prefix.size())] = v;
  }
  EMBER_CHECK(!tensors.empty() || !meta.empty(), "[emberckpt] ", ck.dir(), " has no object '",
              object, "'", ck.metadata().count("checkpoint.objects")
                               ? " (it has " + ck.metadata().at("checkpoint.objects") + ")"
                               : std::string());
  ember::nn::save_safetensors(out, tensors, meta);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, verify and consolidate Ember's distributed checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, object;
  auto* ins = app.add_subcommand("inspect", "objects, tensors, pieces and files");
  ins->add_option("dir", dir, "checkpoint directory (holds index.json)")->required();
  auto* ver = app.add_subcommand("verify", "check every piece against its checksum");
  ver->add_option("dir", dir, "checkpoint directory")->required();
  auto* con = app.add_subcommand("consolidate", "write one ordinary safetensors file");
  con->add_option("dir", dir, "checkpoint directory")->required();
  con->add_option("out", out, "the safetensors file to write")->required();
  con->add_option("--object", object,
                  "only this object's tensors, under their own names (e.g. model)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "emberckpt: %s\n%s", e.what(), app.help().c_str());
    return 2;
  }
  try {
    const ShardedCheckpoint ck(dir);
    if (*ins) inspect(ck);
    if (*ver) {
      ck.verify();
      std::printf("emberckpt: %s: every piece of %zu tensors matches its checksum\n", dir.c_str(),
                  ck.names().size());
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
