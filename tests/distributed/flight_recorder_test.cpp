// The flight recorder (distributed/flight_recorder.h) as a user meets it: the ring's entries
// and its wrap-around, the settings and their errors, the dump every rank writes when a
// collective times out or fails, and ember_flight_analyze naming the rank, the collective and
// its sequence number for the two classic hangs of a DDP loop: a rank that skips one
// all-reduce, and a rank whose bucket size differs. On the threads backend (ranks are threads)
// and on gloo over TCP and over shared memory (ranks are processes).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <barrier>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <latch>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_mpi.h>
#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/ddp/ddp.h>
#include <ember/distributed/flight_recorder.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/nn/layers/linear.h>
#include <ember/tensor/gpu/cuda.h>
#include "cmake/build_paths.h"
#include "tests/distributed/ddp/ddp_test_util.h"
#include "tests/distributed/backends/mpi_job.h"
#include "tests/distributed/backends/threads_test_util.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

// Sets an environment variable for one test; restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no file " << path;
  return in ? json::parse(in) : json();
}

struct Analysis {
  int rc;
  std::string out;
};

// ember_flight_analyze DIR, as a user runs it after the job.
Analysis analyze(const std::string& dir) {
  const std::string cmd = EMBER_BINARY_DIR + "/launcher/ember_flight_analyze '" + dir + "' 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  const int status = p ? ::pclose(p) : -1;
  std::printf("ember_flight_analyze says:\n%s", out.c_str());  // for whoever reads the log
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

test::ThreadsSetup threads(int n, Duration timeout) {
  test::ThreadsSetup s;
  s.n = n;
  s.timeout = timeout;
  return s;
}

TEST(FlightRecorder, KeepsTheLastCollectivesOfEachGroupWithSizesDtypesAndStates) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv size("EMBER_FLIGHT_RECORDER_SIZE", "4");
  std::barrier sync(2);
  test::run_threads(threads(2, 60s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    for (int i = 0; i < 6; ++i) {  // #0..#5 of sizes 1..6: the ring keeps #2..#5
      Tensor t = ones({i + 1}, kFloat32);
      pg->allreduce(t)->wait();
    }
    Tensor d = ones({2, 3}, kFloat64);
    pg->broadcast(d)->wait();  // #6, and #2 leaves the ring
    sync.arrive_and_wait();    // both rings complete before the dump
    if (rank == 0) {
      const std::vector<std::string> files = dump_flight_recorder(dir.path());
      EXPECT_EQ(files, (std::vector<std::string>{dir.file("flight_rank0.json"),
                                                 dir.file("flight_rank1.json")}));
    }
    sync.arrive_and_wait();  // both groups alive until the dump is written
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const json doc = read_json(dir.file("flight_rank" + std::to_string(rank) + ".json"));
    EXPECT_EQ(doc["rank"], rank);
    EXPECT_EQ(doc["reason"], "requested");
    ASSERT_EQ(doc["groups"].size(), 1u);
    const json& g = doc["groups"][0];
    EXPECT_EQ(g["name"], "ranks [0,1] #0");
    EXPECT_EQ(g["backend"], "threads");
    EXPECT_EQ(g["rank"], rank);
    EXPECT_EQ(g["global_ranks"], json({0, 1}));
    const json& e = g["entries"];
    ASSERT_EQ(e.size(), 4u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(e[i]["seq"], i + 3);
      EXPECT_EQ(e[i]["op"], "allreduce");
      EXPECT_EQ(e[i]["sizes"], json({{i + 4}}));
      EXPECT_EQ(e[i]["dtypes"], json({"float32"}));
      EXPECT_EQ(e[i]["state"], "completed");
      EXPECT_GT(e[i]["enqueued_us"].get<int64_t>(), 0);
      EXPECT_GE(e[i]["completed_us"].get<int64_t>(), e[i]["enqueued_us"].get<int64_t>());
    }
    EXPECT_EQ(e[3]["seq"], 6);
    EXPECT_EQ(e[3]["op"], "broadcast");
    EXPECT_EQ(e[3]["sizes"], json({{2, 3}}));
    EXPECT_EQ(e[3]["dtypes"], json({"float64"}));
  }
  const Analysis a = analyze(dir.path());
  EXPECT_EQ(a.rc, 0) << a.out;
}

// A send or receive is an entry of its own, marked p2p and numbered apart from the
// collectives (the threads group used to add its sizes and state to the collective before it).
// A group made after another over the same ranks has ended gets a name of its own: the names
// counted the live groups only, so two live groups could share one (and the analysis kept one
// of them).
TEST(FlightRecorder, GroupsOverTheSameRanksKeepNamesOfTheirOwn) {
  if (!ProcessGroupGloo::is_available()) GTEST_SKIP() << "built without gloo";
  test::TempDir dir;
  auto make = [] { return std::make_shared<ProcessGroupGloo>(nullptr, 0, 1); };
  auto use = [](ProcessGroup& g) {
    Tensor t = ones({1});
    g.allreduce(t)->wait();
  };
  auto a = make();
  use(*a);
  auto b = make();
  use(*b);
  a.reset();
  auto c = make();
  use(*c);
  dump_flight_recorder(dir.path());
  const json doc = read_json(dir.file("flight_rank0.json"));
  std::set<std::string> names;
  for (const json& g : doc["groups"]) names.insert(g["name"].get<std::string>());
  EXPECT_EQ(names, (std::set<std::string>{"ranks [0] #1", "ranks [0] #2"})) << doc.dump();
}

TEST(FlightRecorder, SendsAndReceivesAreEntriesOfTheirOwn) {
  test::TempDir dir;
  std::barrier sync(2);
  test::run_threads(threads(2, 60s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    Tensor a = ones({1}, kFloat32), b = ones({2}, kFloat32), m = zeros({5}, kInt64);
    pg->allreduce(a)->wait();
    (rank == 0 ? pg->send(m, 1, 3) : pg->recv(m, 0, 3))->wait();
    pg->allreduce(b)->wait();
    sync.arrive_and_wait();
    if (rank == 0) dump_flight_recorder(dir.path());
    sync.arrive_and_wait();
  });
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const json doc = read_json(dir.file("flight_rank" + std::to_string(rank) + ".json"));
    const json& e = doc["groups"][0]["entries"];
    ASSERT_EQ(e.size(), 3u) << e.dump();
    EXPECT_EQ(e[0]["seq"], 0);
    EXPECT_EQ(e[0]["sizes"], json({{1}}));
    EXPECT_EQ(e[0]["state"], "completed");
    EXPECT_FALSE(e[0].contains("p2p"));
    EXPECT_EQ(e[1]["p2p"], true);
    EXPECT_EQ(e[1]["seq"], 0);
    EXPECT_EQ(e[1]["op"], rank == 0 ? "send" : "recv");
    EXPECT_EQ(e[1]["sizes"], json({{5}}));
    EXPECT_EQ(e[1]["dtypes"], json({"int64"}));
    EXPECT_EQ(e[2]["seq"], 1);
    EXPECT_EQ(e[2]["sizes"], json({{2}}));
  }
  EXPECT_EQ(analyze(dir.path()).rc, 0);
}

TEST(FlightRecorder, SettingsAndTheirErrors) {
  {
    ScopedEnv size("EMBER_FLIGHT_RECORDER_SIZE", "0");
    test::TempDir dir;  // unique, removed at the end
    std::barrier sync(2);
    test::run_threads(threads(2, 60s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
      Tensor t = ones({3}, kFloat32);
      pg->allreduce(t)->wait();
      sync.arrive_and_wait();
      if (rank == 0) {
        EXPECT_TRUE(dump_flight_recorder(dir.path()).empty()) << "0 turns it off";
      }
      sync.arrive_and_wait();
    });
    EXPECT_TRUE(dir.list().empty());
  }
  {
    ScopedEnv size("EMBER_FLIGHT_RECORDER_SIZE", "lots");
    try {
      (void)flight_recorder_size();
      ADD_FAILURE() << "accepted EMBER_FLIGHT_RECORDER_SIZE=lots";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("EMBER_FLIGHT_RECORDER_SIZE"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("lots"), std::string::npos) << e.what();
    }
  }
  {
    ScopedEnv torch_name("TORCH_NCCL_TRACE_BUFFER_SIZE", "7");
    EXPECT_EQ(flight_recorder_size(), 7) << "PyTorch's variable is read when Ember's is unset";
    ScopedEnv size("EMBER_FLIGHT_RECORDER_SIZE", "9");
    EXPECT_EQ(flight_recorder_size(), 9) << "Ember's variable wins";
  }
  EXPECT_THROW(dump_flight_recorder(""), ValueError);
}

// A rank that never issues the collective the others wait in: their timeouts dump every rank's
// ring, and the analysis names the rank, the collective and its sequence number.
TEST(FlightRecorder, ATimeoutDumpsEveryRankAndTheAnalysisNamesTheRankThatNeverCalled) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());
  std::latch timed_out(2);
  test::run_threads(threads(3, 2s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    for (int i = 0; i < 2; ++i) {
      Tensor t = ones({4}, kFloat32);
      pg->allreduce(t)->wait();
    }
    if (rank == 1) {
      timed_out.wait();  // alive, with its group, while the others time out
      return;
    }
    Tensor t = ones({4}, kFloat32);
    EXPECT_THROW(pg->allreduce(t)->wait(), DistTimeoutError);
    timed_out.count_down();
  });
  EXPECT_EQ(dir.list(), (std::vector<std::string>{"flight_rank0.json", "flight_rank1.json",
                                                  "flight_rank2.json"}));
  const json doc = read_json(dir.file("flight_rank0.json"));
  EXPECT_NE(doc["reason"].get<std::string>().find("allreduce #2 on rank"), std::string::npos)
      << doc["reason"];
  const Analysis a = analyze(dir.path());
  EXPECT_EQ(a.rc, 1) << a.out;
  EXPECT_NE(a.out.find("rank 1 never called allreduce #2, allreduce(float32 [4]); ranks 0 and 2"),
            std::string::npos)
      << a.out;
}

// A DDP loop over a Linear(4, 3) (one bucket of 15 gradients) that all-reduces the loss after
// each step, as training loops do to log it. `skip_loss_on_rank1`: rank 1 skips that all-reduce
// in step 1 (the pattern behind Megatron-LM's pipeline hangs); `small_buckets_on_rank1`:
// rank 1's buckets hold one parameter each. Every rank ends with a barrier, as a job does, so a
// rank that runs out of collectives early waits too. Errors are caught: the dumps are the
// result. Returns the sequence number of rank 0's step-1 loss all-reduce via `loss_seq`.
void ddp_loop(std::shared_ptr<ProcessGroup> pg, int rank, bool skip_loss_on_rank1,
              bool small_buckets_on_rank1, uint64_t* loss_seq) {
  manual_seed(7);
  auto model = std::make_shared<nn::Linear>(4, 3);
  DDPOptions o;
  if (small_buckets_on_rank1 && rank == 1) {
    o.bucket_cap_mb = 1.0 / (1024 * 1024);
    o.first_bucket_cap_mb = o.bucket_cap_mb;
  }
  try {
    DistributedDataParallel ddp(model, pg, o);
    for (int step = 0; step < 3; ++step) {
      Tensor loss = ddp.forward(full({2, 4}, static_cast<double>(rank + step))).sum();
      loss.backward();
      Tensor l = loss.detach().reshape({1}).contiguous();
      if (skip_loss_on_rank1 && rank == 1 && step == 1) continue;  // the bug
      if (rank == 0 && step == 1 && loss_seq != nullptr) *loss_seq = pg->sequence_number();
      pg->allreduce(l)->wait();
    }
    pg->barrier()->wait();
  } catch (const std::exception&) {
    // A failed collective dumped the rings (EMBER_FLIGHT_RECORDER_DIR).
  }
}

// What the analysis says of the skipped all-reduce: the skip itself when the other ranks went
// on past it (their next collective matches rank 1's), else the mismatch it caused.
void expect_names_skip(const Analysis& a, uint64_t seq) {
  const std::string s = std::to_string(seq);
  EXPECT_EQ(a.rc, 1) << a.out;
  const bool skip = a.out.find("rank 1 skipped allreduce #" + s + ", allreduce(float32 [1])") !=
                    std::string::npos;
  const size_t at = a.out.find("allreduce #" + s + " differs across ranks: ranks 0 and 2 called "
                               "allreduce(float32 [1]); rank 1 called allreduce");
  const bool mismatch =
      at != std::string::npos &&
      a.out.find("rank 1 likely skipped allreduce #" + s + ")", at) != std::string::npos;
  EXPECT_TRUE(skip || mismatch) << "expected rank 1, allreduce and #" << s << " named in:\n"
                                << a.out;
}

void expect_names_bucket_mismatch(const Analysis& a) {
  EXPECT_EQ(a.rc, 1) << a.out;
  // gloo over shared memory all-reduces DDP's buckets with allreduce_coalesced: either name.
  const size_t at = a.out.find(" differs across ranks: ranks 0 and 2 called allreduce");
  EXPECT_NE(at, std::string::npos) << a.out;
  EXPECT_NE(a.out.find("; rank 1 called allreduce", at), std::string::npos) << a.out;
  EXPECT_EQ(a.out.find("likely skipped"), std::string::npos) << "no skip here:\n" << a.out;
}

TEST(FlightRecorder, ThreadsDdpLoopWhereOneRankSkipsAnAllreduce) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());
  uint64_t seq = 0;
  std::barrier done(3);
  test::run_threads(threads(3, 3s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    ddp_loop(pg, rank, /*skip_loss_on_rank1=*/true, false, &seq);
    done.arrive_and_wait();  // every group alive until each rank's failure has dumped
  });
  ASSERT_GT(seq, 0u);
  EXPECT_EQ(dir.list().size(), 3u);
  expect_names_skip(analyze(dir.path()), seq);
}

TEST(FlightRecorder, ThreadsDdpLoopWhereOneRanksBucketSizeDiffers) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());
  std::barrier done(3);
  test::run_threads(threads(3, 3s), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    ddp_loop(pg, rank, false, /*small_buckets_on_rank1=*/true, nullptr);
    done.arrive_and_wait();
  });
  EXPECT_EQ(dir.list().size(), 3u);
  expect_names_bucket_mismatch(analyze(dir.path()));
}

// gloo ranks are processes: each dumps its own ring when its collective fails or times out.
void run_gloo(bool shm, const std::function<void(std::shared_ptr<ProcessGroup>, int)>& body) {
  test::Children kids(3, [&](int rank, const std::string& port) {
    TCPStoreOptions so;
    so.timeout = 60s;
    auto store =
        std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    ProcessGroupGloo::GlooOptions go{5s, "127.0.0.1"};
    go.shared_memory = shm;
    body(std::make_shared<ProcessGroupGloo>(std::make_shared<PrefixStore>("pg", store), rank, 3,
                                            go),
         rank);
  });
  TCPStoreServerOptions o;
  o.host = "127.0.0.1";
  TCPStoreServer server(o);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

class FlightRecorderGloo : public ::testing::TestWithParam<bool> {};

TEST_P(FlightRecorderGloo, DdpLoopWhereOneRankSkipsAnAllreduce) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());
  run_gloo(GetParam(), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    uint64_t seq = 0;
    ddp_loop(pg, rank, /*skip_loss_on_rank1=*/true, false, &seq);
    if (rank == 0) std::ofstream(dir.file("loss_seq.txt")) << seq;
  });
  EXPECT_EQ(dir.list().size(), 4u) << "three dumps and loss_seq.txt";
  uint64_t seq = 0;
  std::ifstream(dir.file("loss_seq.txt")) >> seq;
  ASSERT_GT(seq, 0u);
  expect_names_skip(analyze(dir.path()), seq);
}

TEST_P(FlightRecorderGloo, DdpLoopWhereOneRanksBucketSizeDiffers) {
  test::TempDir dir;  // unique, removed at the end
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());
  run_gloo(GetParam(), [&](std::shared_ptr<ProcessGroup> pg, int rank) {
    ddp_loop(pg, rank, false, /*small_buckets_on_rank1=*/true, nullptr);
  });
  EXPECT_EQ(dir.list().size(), 3u);
  expect_names_bucket_mismatch(analyze(dir.path()));
}

// NCCL completes a collective's future when it is queued on the group's stream: its entry is
// started until its Work has finished on the device, or a later collective of the group has
// (DDP drops its Works early). One rank, so it runs on any machine with one GPU.
TEST(FlightRecorderNccl, EntriesCompleteOnceTheDeviceHasFinished) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL (EMBER_WITH_NCCL=OFF)";
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  test::TempDir dir;
  ProcessGroupNccl::NcclOptions o;
  o.timeout = 60s;
  o.device = 0;
  auto pg = std::make_shared<ProcessGroupNccl>(std::make_shared<HashStore>(), 0, 1, o);
  Tensor a = ones({4}, TensorOptions(kFloat32).device(cuda_device(0)));
  (void)pg->allreduce(a);  // its Work dropped at once
  Tensor b = ones({2, 3}, TensorOptions(kFloat16).device(cuda_device(0)));
  WorkPtr w = pg->allreduce(b);
  w->wait();
  cuda::current_stream(0).synchronize();
  ASSERT_EQ(dump_flight_recorder(dir.path()).size(), 1u);
  const json doc = read_json(dir.file("flight_rank0.json"));
  ASSERT_EQ(doc["groups"].size(), 1u);
  EXPECT_EQ(doc["groups"][0]["backend"], "nccl");
  const json& e = doc["groups"][0]["entries"];
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0]["sizes"], json({{4}}));
  EXPECT_EQ(e[0]["state"], "completed") << "a later collective of the group has finished";
  EXPECT_EQ(e[1]["sizes"], json({{2, 3}}));
  EXPECT_EQ(e[1]["dtypes"], json({"float16"}));
  EXPECT_EQ(e[1]["state"], "completed") << "its Work has finished on the device";
  // The last collective's Work dropped, nothing after it: its end event says it finished.
  Tensor c = ones({3}, TensorOptions(kFloat32).device(cuda_device(0)));
  (void)pg->allreduce(c);
  cuda::synchronize(0);  // the whole device: the group's stream too
  ASSERT_EQ(dump_flight_recorder(dir.path()).size(), 1u);
  const json last = read_json(dir.file("flight_rank0.json"))["groups"][0]["entries"];
  ASSERT_EQ(last.size(), 3u);
  EXPECT_EQ(last[2]["state"], "completed") << "its end event has passed";
}

// MPI ranks are processes under mpirun: each records its collectives (sizes, dtypes, completed
// states) and dumps them; the dumps of ranks that agree give no finding.
TEST(FlightRecorderMpi, EveryRankRecordsItsCollectives) {
  test::TempDir dir;
  ScopedEnv where("EMBER_FLIGHT_RECORDER_DIR", dir.path());  // mpirun's ranks inherit it
  test::expect_mpi_job_passes(2, "FlightRecorderMpiRanks.*", 120s,
                              ProcessGroupMpi::is_available());
  if (IsSkipped() || HasFailure()) return;
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const json doc = read_json(dir.file("flight_rank" + std::to_string(rank) + ".json"));
    ASSERT_EQ(doc["groups"].size(), 1u);
    EXPECT_EQ(doc["groups"][0]["backend"], "mpi");
    const json& e = doc["groups"][0]["entries"];
    ASSERT_EQ(e.size(), 3u);
    EXPECT_EQ(e[0]["op"], "allreduce");
    EXPECT_EQ(e[0]["sizes"], json({{3}}));
    EXPECT_EQ(e[1]["op"], "broadcast");
    EXPECT_EQ(e[1]["dtypes"], json({"float64"}));
    EXPECT_EQ(e[2]["op"], "barrier");
    for (const json& x : e) EXPECT_EQ(x["state"], "completed") << x.dump();
  }
  const Analysis a = analyze(dir.path());
  EXPECT_EQ(a.rc, 0) << a.out;
}

TEST(FlightRecorderMpiRanks, IssueAndDump) {
  SKIP_UNLESS_UNDER_MPIRUN();
  std::shared_ptr<ProcessGroupMpi> g = ProcessGroupMpi::create();
  Tensor a = ones({3}, kFloat32);
  g->allreduce(a)->wait(60s);
  Tensor b = zeros({2, 2}, kFloat64);
  g->broadcast(b)->wait(60s);
  g->barrier()->wait(60s);
  ASSERT_FALSE(flight_recorder_dir().empty()) << "mpirun did not pass EMBER_FLIGHT_RECORDER_DIR";
  EXPECT_EQ(dump_flight_recorder(flight_recorder_dir()).size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Transports, FlightRecorderGloo, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "SharedMemory" : "Tcp"; });

}  // namespace
}  // namespace ember::dist
