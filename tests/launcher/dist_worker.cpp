// A worker that uses emberrun's environment for real: init_process_group (env://, rank 0 hosts
// the store at MASTER_ADDR:MASTER_PORT), one allreduce, then writes DIR/sum_<RANK> with the
// result. Built as build/launcher/test_workers/dist_worker when ember_distributed exists.
// Also prints "rank R of W: allreduce(rank+1) = S" so a multi-node test (whose nodes may not
// share DIR) can check every rank took part from emberrun's or mpirun's output.
// It also writes DIR/init_<RANK>: the wall-clock time (ns) init_process_group returned, and
// for gloo prints "rank R: allreduce over shared memory" (every rank on one machine), "...
// over tcp", or, for a hierarchical group, "... over shared memory within the node, tcp between
// N nodes".
// DIST_WORKER_BARRIER_ON_RANK=R: rank R issues a barrier where the others all-reduce (a rank
// gone astray, for the flight recorder's test), so every rank's collective fails.
// Usage: dist_worker DIR [BACKEND]   (BACKEND: gloo, the default, or mpi under mpirun)
// EMBER_TEST_SET_BYTES=N: rank 0 also sets a key of N bytes in the job's store.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_hierarchical.h>
#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  // Line-buffered, so that a rank that hangs later (in destroy_process_group, at exit) has
  // already shown how far it got.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  namespace dist = ember::dist;
  try {
    dist::InitOptions options;
    options.backend = argc > 2 ? argv[2] : "gloo";
    auto pg = dist::init_process_group(options);
    {  // when init finished (ns since the epoch): what benchmarks/launch/ measures
      timespec ts{};
      clock_gettime(CLOCK_REALTIME, &ts);
      std::ofstream(std::string(argv[1]) + "/init_" + std::to_string(pg->rank()))
          << (static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec);
    }
    ember::Tensor t = ember::full({1}, static_cast<double>(pg->rank() + 1));
    const char* astray = std::getenv("DIST_WORKER_BARRIER_ON_RANK");
    if (astray != nullptr && std::atoi(astray) == pg->rank()) {
      pg->barrier()->wait();
    } else {
      pg->allreduce(t)->wait();
    }
    std::string path = std::string(argv[1]) + "/sum_" + std::to_string(pg->rank());
    {
      std::ofstream out(path + ".tmp");
      out << t.item<float>() << " " << pg->size();
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
    std::printf("rank %d of %d: allreduce(rank+1) = %g\n", pg->rank(), pg->size(),
                static_cast<double>(t.item<float>()));
    if (auto* gloo = dynamic_cast<dist::ProcessGroupGloo*>(pg.get())) {
      std::printf("rank %d: allreduce over %s\n", pg->rank(),
                  gloo->uses_shared_memory() ? "shared memory" : "tcp");
    } else if (auto* h = dynamic_cast<dist::ProcessGroupHierarchical*>(pg.get())) {
      std::printf("rank %d: allreduce over %s within the node, tcp between %d nodes\n",
                  pg->rank(), h->local_uses_shared_memory() ? "shared memory" : "tcp",
                  h->layout().nodes());
    }
    // EMBER_TEST_SET_BYTES=N: rank 0 sets a key of N bytes in the job's store (the test of
    // emberrun's --store-max-stored-bytes); a refusal ends the worker with the store's message.
    if (const char* n = std::getenv("EMBER_TEST_SET_BYTES"); n != nullptr && pg->rank() == 0) {
      const std::string big(std::stoul(n), 'x');
      dist::default_store()->set("big", dist::Bytes(big.begin(), big.end()));
      std::printf("rank 0 stored %s bytes\n", n);
    }
    // The group is destroyed here, not at the end of the scope, so that "done" means its
    // destruction (and, on rank 0, the store's server's) is over: a rank that hangs there
    // shows it by the missing line.
    const int rank = pg->rank();
    dist::destroy_process_group();
    pg.reset();
    std::printf("rank %d done\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_worker: %s\n", e.what());
    return 1;
  }
}
