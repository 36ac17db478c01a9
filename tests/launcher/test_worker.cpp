// A worker program for the launcher tests (built as build/launcher/test_workers/test_worker).
// Usage: test_worker MODE DIR [ARGS...], with rank and restart count from emberrun's env.
//   env DIR            write DIR/env_<RANK>.txt (the launcher's variables), print a line on
//                      stdout and one on stderr, exit 0
//   exit DIR R CODE    rank R exits CODE at once; the others write DIR/ready_<RANK> (their
//                      pid) and wait to be stopped
//   flaky DIR R        first attempt: like exit (rank R exits 3); later attempts: every rank
//                      writes DIR/done_<RANK> with "restarts=<count> world=<WORLD_SIZE>
//                      group=<GROUP_RANK>/<GROUP_WORLD_SIZE>" and exits 0
//   error DIR R        rank R writes a structured error file, then exits 1; the others wait
//   block DIR [ignore] write DIR/pid_<RANK> (its pid), then wait to be stopped; with
//                      "ignore", ignore SIGTERM (so only SIGKILL ends it)
//   ckpt DIR STEPS K   each rank counts STEPS steps, saving the next step in DIR/ckpt_<RANK>
//                      after each; on the first attempt rank 1 kills itself with SIGKILL after
//                      step K. At the end it writes DIR/done_<RANK> with
//                      "steps=<N> restarts=<count> resumed_from=<first step of this attempt>"
//   elastic DIR STEPS [K@W ...]
//                      an elastic job's worker: trains from the checkpoint DIR/ckpt (the next
//                      step; rank 0 writes it after each step, once every rank of this attempt
//                      has read it, as a real job's collectives would keep the ranks together)
//                      to STEPS, printing "rank R of W: resuming from step S (restarts C)".
//                      At a step K given as K@W while WORLD_SIZE is not W, it writes
//                      DIR/held_<K>_<RANK>_<WORLD_SIZE> and waits to be stopped (the test
//                      changes the nodes meanwhile). At the end it writes DIR/done_<RANK>
//                      "world=<W> resumed_from=<S>" and prints "rank R of W: finished".
// Waiting workers give up after 60 s (alarm) so a broken launcher cannot leave them forever.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

// Written to a temp name, then renamed: readers never see a partial file.
void write_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
  }
  std::rename(tmp.c_str(), path.c_str());
}

[[noreturn]] void wait_forever() {
  alarm(60);
  for (;;) pause();
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

int elastic(const std::string& dir, int argc, char** argv) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  const int steps = std::atoi(argv[3]);
  const std::string ckpt = dir + "/ckpt", r = std::to_string(rank), w = std::to_string(world);
  // This attempt's files: MASTER_PORT is fresh in every round, but the OS may hand a later
  // round the port of an earlier one (seen in CI: rounds 0 and 2 of a job that shrank, then
  // grew), so the world size and restart count name it too, and rank 0 removes the files once
  // every rank has read the checkpoint.
  const std::string attempt = dir + "/read_" + std::to_string(env_int("MASTER_PORT")) + "_" +
                              std::to_string(world) + "_" +
                              std::to_string(env_int("EMBER_RESTART_COUNT")) + "_";
  int step = 0;
  if (std::ifstream in(ckpt); in) in >> step;
  const int first = step;
  write_file(attempt + r, "");
  std::printf("rank %d of %d: resuming from step %d (restarts %d)\n", rank, world, step,
              env_int("EMBER_RESTART_COUNT"));
  std::fflush(stdout);
  if (rank == 0) {  // a bounded file barrier: every rank read the checkpoint before it changes
    alarm(60);
    for (int i = 0; i < world; ++i)
      while (!exists(attempt + std::to_string(i))) usleep(5000);
    alarm(0);
    for (int i = 0; i < world; ++i) std::remove((attempt + std::to_string(i)).c_str());
  }
  for (; step < steps; ++step) {
    for (int i = 4; i < argc; ++i) {
      int k = -1, hold_world = -1;
      if (std::sscanf(argv[i], "%d@%d", &k, &hold_world) != 2 || k != step) continue;
      if (hold_world == world) continue;
      write_file(dir + "/held_" + std::to_string(step) + "_" + r + "_" + w, "");
      wait_forever();
    }
    if (rank == 0) write_file(ckpt, std::to_string(step + 1));
  }
  write_file(dir + "/done_" + r, "world=" + w + " resumed_from=" + std::to_string(first));
  std::printf("rank %d of %d: finished\n", rank, world);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: test_worker MODE DIR [ARGS...]\n");
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const int rank = env_int("RANK");
  const std::string r = std::to_string(rank);

  if (mode == "env") {
    std::ostringstream os;
    for (const char* k :
         {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "EMBER_RESTART_COUNT", "OMP_NUM_THREADS",
          "EMBER_NUM_THREADS", "OMP_WAIT_POLICY", "TORCHELASTIC_ERROR_FILE", "EMBER_ERROR_FILE"}) {
      const char* v = std::getenv(k);
      os << k << "=" << (v ? v : "<unset>") << "\n";
    }
    for (int i = 3; i < argc; ++i) os << "ARG=" << argv[i] << "\n";
    write_file(dir + "/env_" + r + ".txt", os.str());
    std::printf("hello from rank %d\n", rank);
    std::fflush(stdout);
    std::fprintf(stderr, "warning from rank %d\n", rank);
    return 0;
  }
  if (mode == "flaky" && env_int("EMBER_RESTART_COUNT") > 0) {
    const char* gw = std::getenv("GROUP_WORLD_SIZE");
    write_file(dir + "/done_" + r, "restarts=" + std::to_string(env_int("EMBER_RESTART_COUNT")) +
                                       " world=" + std::to_string(env_int("WORLD_SIZE")) +
                                       " group=" + std::to_string(env_int("GROUP_RANK")) + "/" +
                                       (gw ? gw : "?"));
    return 0;
  }
  if (mode == "exit" || mode == "error" || mode == "flaky") {
    if (argc < 4) return 2;
    if (rank == std::atoi(argv[3])) {
      std::printf("rank %d giving up\n", rank);
      std::fflush(stdout);
      if (mode == "error") {
        const char* path = std::getenv("EMBER_ERROR_FILE");
        if (path) {
          write_file(path,
                     "{\"message\": \"ValueError: [train] loss is NaN at step 7\", "
                     "\"where\": \"test_worker.cpp:main\", \"timestamp\": 1}");
        }
        return 1;
      }
      if (mode == "flaky") return 3;
      return argc > 4 ? std::atoi(argv[4]) : 1;
    }
    write_file(dir + "/ready_" + r, std::to_string(getpid()));
    wait_forever();
  }
  if (mode == "block") {
    if (argc > 3 && std::string(argv[3]) == "ignore") signal(SIGTERM, SIG_IGN);
    write_file(dir + "/pid_" + r, std::to_string(getpid()));
    wait_forever();
  }
  if (mode == "ckpt") {
    if (argc < 5) return 2;
    const int steps = std::atoi(argv[3]), kill_at = std::atoi(argv[4]);
    const int restarts = env_int("EMBER_RESTART_COUNT");
    const std::string ckpt = dir + "/ckpt_" + r;
    int step = 0;
    if (std::ifstream in(ckpt); in) in >> step;
    const int first = step;
    for (; step < steps; ++step) {
      write_file(ckpt, std::to_string(step + 1));
      if (restarts == 0 && rank == 1 && step + 1 == kill_at) raise(SIGKILL);
    }
    write_file(dir + "/done_" + r, "steps=" + std::to_string(step) + " restarts=" +
                                       std::to_string(restarts) +
                                       " resumed_from=" + std::to_string(first));
    return 0;
  }
  if (mode == "elastic" && argc > 3) return elastic(dir, argc, argv);
  std::fprintf(stderr, "test_worker: unknown mode '%s'\n", mode.c_str());
  return 2;
}
