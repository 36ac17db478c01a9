// A worker that uses emberrun's environment for real: init_process_group (env://, rank 0 hosts
// the store at MASTER_ADDR:MASTER_PORT), one allreduce, then writes DIR/sum_<RANK> with the
// result. Built as build/launcher/test_workers/dist_worker when ember_distributed exists.
// Usage: dist_worker DIR
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "distributed/init.h"
#include "tensor/creation.h"

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  namespace dist = ember::dist;
  try {
    dist::InitOptions options;
    options.backend = "gloo";
    auto pg = dist::init_process_group(options);
    ember::Tensor t = ember::full({1}, static_cast<double>(pg->rank() + 1));
    pg->allreduce(t)->wait();
    std::string path = std::string(argv[1]) + "/sum_" + std::to_string(pg->rank());
    {
      std::ofstream out(path + ".tmp");
      out << t.item<float>() << " " << pg->size();
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
    dist::destroy_process_group();
    std::printf("rank %d done\n", pg->rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_worker: %s\n", e.what());
    return 1;
  }
}
