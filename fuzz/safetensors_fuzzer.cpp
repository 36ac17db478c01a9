// Fuzzes load_safetensors: the input is the whole file. Any file must either load or throw
// ember::Error (ValueError for a malformed one) naming the path; a crash, a sanitizer report,
// another exception or an allocation beyond libFuzzer's -rss_limit_mb is a finding. A file
// that loads is also checked against its own size: its tensors cannot hold more bytes than
// the file has.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_util.h"
#include <ember/nn/io/serialize.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = ember::fuzz::scratch_dir() + "/input.safetensors";
  ember::fuzz::write_file(path, data, size);
  try {
    const auto file = ember::nn::load_safetensors(path);
    size_t bytes = 0;
    for (const auto& [name, t] : file.tensors()) bytes += t.nbytes();
    if (bytes > size) {
      std::fprintf(stderr, "safetensors_fuzzer: %zu tensor bytes from a %zu-byte file\n", bytes,
                   size);
      std::abort();
    }
  } catch (const ember::Error&) {
  }
  return 0;
}
