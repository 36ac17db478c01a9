// Fuzzes the IDX reader behind MNIST / FashionMNIST: each input becomes a data folder holding
// train-images-idx3-ubyte and train-labels-idx1-ubyte, each raw or gzip. Any folder must either
// load or throw ember::Error naming the file; a crash, a sanitizer report, another exception or
// an allocation beyond libFuzzer's -rss_limit_mb (a header that claims more than the file holds)
// is a finding.
//
// Input: byte 0 is flags, bytes 1-2 the images file's length n (little-endian, cut to what is
// there), then n bytes of images file, then the labels file. Flag bits 0 and 1 name the images
// and labels file .gz; bit 2 has the harness gzip the bytes (a valid stream, so the fuzzer
// reaches the IDX checks behind the decompression), else they are written as they are (so it
// also attacks the gzip reading itself).
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "fuzz/fuzz_util.h"
#include <ember/nn/data/mnist.h>

namespace {

void put(const std::string& dir, const char* name, bool gz_name, bool compress, const uint8_t* p,
         size_t n) {
  const std::string base = dir + "/" + name;
  std::error_code ec;
  std::filesystem::remove(base, ec);
  std::filesystem::remove(base + ".gz", ec);
  const std::string path = gz_name ? base + ".gz" : base;
  if (!compress) {
    ember::fuzz::write_file(path, p, n);
    return;
  }
  gzFile f = gzopen(path.c_str(), "wb1");
  if (f == nullptr || (n > 0 && gzwrite(f, p, static_cast<unsigned>(n)) != static_cast<int>(n)) ||
      gzclose(f) != Z_OK) {
    std::fprintf(stderr, "idx_fuzzer: cannot write %s\n", path.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint8_t flags = data[0];
  const size_t n = std::min<size_t>(data[1] | (size_t{data[2]} << 8), size - 3);
  const std::string dir = ember::fuzz::scratch_dir() + "/idx";
  std::filesystem::create_directories(dir);
  const bool compress = flags & 4;
  put(dir, "train-images-idx3-ubyte", flags & 1, compress, data + 3, n);
  put(dir, "train-labels-idx1-ubyte", flags & 2, compress, data + 3 + n, size - 3 - n);
  try {
    const ember::nn::data::MNIST ds(dir, /*train=*/true);
    if (ds.data().size(0) != ds.targets().size(0)) {
      std::fprintf(stderr, "idx_fuzzer: %lld images but %lld labels\n",
                   static_cast<long long>(ds.data().size(0)),
                   static_cast<long long>(ds.targets().size(0)));
      std::abort();
    }
  } catch (const ember::Error&) {
  }
  return 0;
}
