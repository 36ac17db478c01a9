// consolidate_checkpoint: turns a sharded checkpoint (a directory that dist::save_sharded wrote,
// at any world size) into one ordinary safetensors file, which nn::load_safetensors, a
// non-sharded model's load_state_dict and safetensors.torch.load_file read.
//
//   build/examples/consolidate_checkpoint ckpt/ model.safetensors
//   build/examples/consolidate_checkpoint ckpt/ --list        (names, shapes, dtypes, pieces)
//
// Needs no process group and no GPU. The output is written atomically. Exit status: 0 done;
// 1 the checkpoint cannot be read or the file cannot be written; 2 bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include <ember/distributed/checkpoint/sharded_checkpoint.h>
#include <ember/tensor/error.h>
#include <ember/tensor/version.h>

namespace {

void list(const ember::dist::ShardedCheckpoint& ckpt) {
  std::printf("%s: save %s by %d ranks, %zu tensors\n", ckpt.dir().c_str(), ckpt.save_id().c_str(),
              ckpt.world_size(), ckpt.names().size());
  for (const auto& [k, v] : ckpt.metadata())
    std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
  for (const std::string& name : ckpt.names()) {
    const auto& e = ckpt.entry(name);
    std::string shape = "[";
    for (size_t i = 0; i < e.shape.size(); ++i)
      shape += (i ? ", " : "") + std::to_string(e.shape[i]);
    std::printf("  %s %s %s, %zu piece(s) on ranks", name.c_str(),
                std::string(ember::dtype_name(e.dtype)).c_str(), (shape + "]").c_str(),
                e.pieces.size());
    for (const auto& p : e.pieces) std::printf(" %d", p.rank);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Consolidates a sharded checkpoint (dist::save_sharded) into one safetensors file"};
  std::string dir, out;
  bool list_only = false;
  app.add_option("dir", dir, "checkpoint directory (holds index.json)")->required();
  app.add_option("out", out, "the safetensors file to write");
  app.add_flag("--list", list_only, "print the tensors instead of writing a file");
  app.set_version_flag("--version", std::string("consolidate_checkpoint (Ember) ") + ember::version());
  try {
    app.parse(argc, argv);
    if (!list_only && out.empty()) throw CLI::RequiredError("out (or --list)");
  } catch (const CLI::CallForVersion& v) {
    std::printf("%s\n", v.what());
    return 0;
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "consolidate_checkpoint: %s\n%s", e.what(), app.help().c_str());
    return 2;
  }
  try {
    const ember::dist::ShardedCheckpoint ckpt(dir);
    if (list_only) {
      list(ckpt);
      return 0;
    }
    ckpt.consolidate(out);
    std::printf("consolidate_checkpoint: wrote %s (%zu tensors from a save by %d ranks)\n",
                out.c_str(), ckpt.names().size(), ckpt.world_size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consolidate_checkpoint: %s\n", e.what());
    return 1;
  }
  return 0;
}
