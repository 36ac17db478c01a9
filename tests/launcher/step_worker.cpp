// A worker of an elastic job that runs one collective per step, for the etcd rendezvous tests
// (built as build/launcher/test_workers/step_worker when ember_distributed exists).
// Usage: step_worker DIR STEPS [K@W ...]
// init_process_group (env://: rank 0 hosts the job's store at MASTER_ADDR:MASTER_PORT), then
// steps from the checkpoint DIR/ckpt (the next step; 0 without one) to STEPS, each one
// allreduce of 1 per rank, checked against WORLD_SIZE. Rank 0 writes the checkpoint after each
// step: every rank has read it by then, having entered the step's allreduce. At a step K given
// as K@W while WORLD_SIZE is not W, every rank writes DIR/held_<K>_<RANK>_<WORLD_SIZE> ("<its
// agent's pid> <its pid>") and waits to be stopped, so the test changes the nodes at a known step;
// K@W/R holds rank R only, the others entering step K's allreduce (and waiting there for R).
// At its start, before init_process_group, it writes DIR/started_<RESTART_COUNT>_<RANK> with
// the wall-clock time in ns (when a round's workers start: what the tests measure from).
// Prints "rank R of W: resuming from step S (restarts C, MASTER_ADDR A:P)" and, at the end,
// "rank R of W: finished". Waiting gives up after 60 s (alarm), so a broken launcher cannot
// leave it behind.
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <ember/distributed/init.h>
#include <ember/tensor/ops/creation.h>

namespace {

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Written to a temp name, then renamed: readers never see a partial file.
void write_file(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path + ".tmp");
    out << text;
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

// Whether argv[first..argc) holds "step@W" or "step@W/rank" with W != world.
bool holds_at(int step, int world, int rank, int first, int argc, char** argv) {
  for (int i = first; i < argc; ++i) {
    int k = -1, w = -1, r = -1;
    const int n = std::sscanf(argv[i], "%d@%d/%d", &k, &w, &r);
    if (n >= 2 && k == step && w != world && (n == 2 || r == rank)) return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: step_worker DIR STEPS [K@W ...]\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  namespace dist = ember::dist;
  const std::string dir = argv[1];
  const int steps = std::atoi(argv[2]);
  try {
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    write_file(dir + "/started_" + env_or("EMBER_RESTART_COUNT", "x") + "_" +
                   env_or("RANK", "x"),
               std::to_string(static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec));
    int step = 0;
    if (std::ifstream in(dir + "/ckpt"); in) in >> step;
    auto pg = dist::init_process_group({.backend = "gloo"});
    const int rank = pg->rank(), world = pg->size();
    std::printf("rank %d of %d: resuming from step %d (restarts %s, MASTER_ADDR %s:%s)\n", rank,
                world, step, env_or("EMBER_RESTART_COUNT", "?"), env_or("MASTER_ADDR", "?"),
                env_or("MASTER_PORT", "?"));
    for (; step < steps; ++step) {
      if (holds_at(step, world, rank, 3, argc, argv)) {
        write_file(dir + "/held_" + std::to_string(step) + "_" + std::to_string(rank) + "_" +
                       std::to_string(world),
                   std::to_string(getppid()) + " " + std::to_string(getpid()));
        alarm(60);
        for (;;) pause();
      }
      ember::Tensor t = ember::full({1}, 1.0);
      pg->allreduce(t)->wait();
      if (t.item<float>() != static_cast<float>(world)) {
        std::fprintf(stderr, "step_worker: rank %d step %d: allreduce gave %g, expected %d\n",
                     rank, step, static_cast<double>(t.item<float>()), world);
        return 1;
      }
      if (rank == 0) write_file(dir + "/ckpt", std::to_string(step + 1));
    }
    dist::destroy_process_group();
    std::printf("rank %d of %d: finished\n", rank, world);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_worker: %s\n", e.what());
    return 1;
  }
}
