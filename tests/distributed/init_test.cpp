// init_process_group (env://, tcp://, file://, a given store), the default group, new_group and
// destroy_process_group; env:// parsing of torch's, Open MPI's, PMI's and Slurm's variables.
#include <ember/distributed/init.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include <ember/distributed/backends/process_group_gloo.h>
#include <ember/distributed/backends/process_group_nccl.h>
#include <ember/distributed/backends/process_group_threads.h>
#include <ember/distributed/detail/unavailable_backend.h>
#include <ember/distributed/store/hash_store.h>
#include <ember/distributed/store/tcp_store.h>
#include <ember/tensor/ops/creation.h>
#include <ember/tensor/gpu/cuda.h>
#include "tests/distributed/store/store_test_util.h"
#include "tests/distributed/require_gloo.h"

namespace ember::dist {
namespace {

using namespace std::chrono_literals;
using test::expect_error;
using test::require;
using Env = std::map<std::string, std::string>;

// ---- env:// parsing
// ------------------------------------------------------------------------------

TEST(ParseEnv, TorchVariables) {
  const EnvRendezvous r = parse_env_rendezvous(Env{
      {"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.master_addr, "10.0.0.1");
  EXPECT_EQ(r.master_port, 29500);
  EXPECT_EQ(r.source, "RANK/WORLD_SIZE");
}

TEST(ParseEnv, OpenMpiPmiAndSlurmFallbacks) {
  EnvRendezvous r = parse_env_rendezvous(Env{{"OMPI_COMM_WORLD_RANK", "3"},
                                             {"OMPI_COMM_WORLD_SIZE", "5"},
                                             {"MASTER_ADDR", "h"},
                                             {"MASTER_PORT", "1234"}});
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.world_size, 5);
  EXPECT_EQ(r.source, "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE");
  r = parse_env_rendezvous(
      Env{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.source, "PMI_RANK/PMI_SIZE");
  // Slurm without MASTER_ADDR: rank 0's host is the first of the job's node list.
  r = parse_env_rendezvous(Env{{"SLURM_PROCID", "6"},
                               {"SLURM_NTASKS", "8"},
                               {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"},
                               {"MASTER_PORT", "29500"}});
  EXPECT_EQ(r.rank, 6);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.master_addr, "gpu07");
  EXPECT_EQ(r.source, "SLURM_PROCID/SLURM_NTASKS");
  EXPECT_EQ(r.master_port, 29500);
  // ... and without MASTER_PORT the port comes from the job id, the same on every task.
  r = parse_env_rendezvous(Env{{"SLURM_PROCID", "1"},
                               {"SLURM_NTASKS", "2"},
                               {"SLURM_JOB_NODELIST", "n1"},
                               {"SLURM_JOB_ID", "123456"},
                               {"SLURM_STEP_ID", "0"}});
  EXPECT_EQ(r.master_port, 15000 + 3456);
  expect_error<ValueError>(
      [] {
        parse_env_rendezvous(
            Env{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n1"}});
      },
      {"env:// needs MASTER_PORT", "SLURM_PROCID=1"});
  expect_error<ValueError>(
      [] {
        parse_env_rendezvous(Env{{"SLURM_PROCID", "1"},
                                 {"SLURM_NTASKS", "2"},
                                 {"SLURM_JOB_NODELIST", "n1"},
                                 {"SLURM_JOB_ID", "x7"},
                                 {"SLURM_STEP_ID", "0"}});
      },
      {"SLURM_JOB_ID='x7' is not an integer"});
  // torch's variables win over the scheduler's (torchrun inside an allocation).
  r = parse_env_rendezvous(Env{{"RANK", "0"},
                               {"WORLD_SIZE", "2"},
                               {"SLURM_PROCID", "5"},
                               {"SLURM_NTASKS", "8"},
                               {"MASTER_ADDR", "a"},
                               {"MASTER_PORT", "1"}});
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 2);
  // Arguments alone (no rank variables).
  r = parse_env_rendezvous(Env{{"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}, 1, 3);
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.world_size, 3);
  EXPECT_EQ(r.source, "arguments");
}

// What a batch script's own process sees in a job of 4 tasks on 2 nodes (Slurm 22.05; srun's
// tasks see SLURM_STEP_ID and SLURM_STEPID too).
Env batch_step() {
  return Env{{"SLURM_JOB_ID", "4242"},       {"SLURM_JOBID", "4242"},
             {"SLURM_PROCID", "0"},          {"SLURM_LOCALID", "0"},
             {"SLURM_NODEID", "0"},          {"SLURM_NTASKS", "4"},
             {"SLURM_NPROCS", "4"},          {"SLURM_TASKS_PER_NODE", "2(x2)"},
             {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_NNODES", "2"}};
}

TEST(ParseEnv, ProgramInABatchScriptWithoutSrunIsNamedAtOnce) {
  const auto in_batch_script = [](Env env) {
    expect_error<ValueError>([&] { parse_env_rendezvous(env); },
                             {"[init_process_group] SLURM_NTASKS=4 but this process is the batch "
                              "script of Slurm job 4242, not one of its srun tasks (no "
                              "SLURM_STEP_ID), so its 3 peers would never come",
                              "srun PROGRAM", "srun emberrun", "docs/launcher.md#slurm",
                              "SLURM_PROCID=0", "SLURM_JOB_ID=4242"});
  };
  in_batch_script(batch_step());
  Env with_port = batch_step();
  with_port["MASTER_ADDR"] = "n1";
  with_port["MASTER_PORT"] = "29500";
  in_batch_script(with_port);
  // Arguments that agree with the environment do not make the batch script a task either.
  expect_error<ValueError>([] { parse_env_rendezvous(batch_step(), 0, 4); },
                           {"not one of its srun tasks"});

  // srun's tasks of the same job (either spelling of the step id).
  for (const char* step : {"SLURM_STEP_ID", "SLURM_STEPID"}) {
    Env task = batch_step();
    task[step] = "0";
    const EnvRendezvous r = parse_env_rendezvous(task);
    EXPECT_EQ(r.world_size, 4) << step;
    EXPECT_EQ(r.master_addr, "n1") << step;
    EXPECT_EQ(r.master_port, 15000 + 4242) << step;
  }
  // A job of one task: its batch script is the whole world.
  Env one = batch_step();
  one["SLURM_NTASKS"] = "1";
  EXPECT_EQ(parse_env_rendezvous(one).world_size, 1);
  // emberrun (or torchrun, or mpirun) started from the batch script: their variables decide.
  Env launched = batch_step();
  launched.insert(
      {{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(parse_env_rendezvous(launched).world_size, 8);
  Env mpi = batch_step();
  mpi.insert({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  EXPECT_EQ(parse_env_rendezvous(mpi).rank, 1);
}

TEST(ParseEnv, LaunchedAsRankByAnyLauncher) {
  EXPECT_FALSE(launched_as_rank(Env{}));
  EXPECT_FALSE(launched_as_rank(Env{{"MASTER_ADDR", "a"}, {"LOCAL_RANK", "0"}}));
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    EXPECT_TRUE(launched_as_rank(Env{{name, "0"}})) << name;
  }
}

TEST(ParseEnv, LocalRankFromEachLauncherInOrder) {
  EXPECT_EQ(local_rank(Env{{"RANK", "3"}}), std::nullopt);
  EXPECT_EQ(local_rank(Env{{"LOCAL_RANK", "2"}}), 2);
  EXPECT_EQ(local_rank(Env{{"OMPI_COMM_WORLD_LOCAL_RANK", "5"}}), 5);
  EXPECT_EQ(local_rank(Env{{"MPI_LOCALRANKID", "1"}}), 1);
  EXPECT_EQ(local_rank(Env{{"SLURM_LOCALID", "7"}}), 7);
  // emberrun/torchrun's variable wins over the scheduler's (torchrun inside an allocation).
  EXPECT_EQ(local_rank(Env{{"SLURM_LOCALID", "7"}, {"LOCAL_RANK", "0"}}), 0);
  EXPECT_EQ(local_rank(Env{{"SLURM_LOCALID", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}), 1);
  expect_error([] { local_rank(Env{{"LOCAL_RANK", "x"}}); },
               {"LOCAL_RANK='x' is not an integer"});
  expect_error([] { local_rank(Env{{"SLURM_LOCALID", "-1"}}); },
               {"SLURM_LOCALID=-1 is out of range"});
}

TEST(ParseEnv, LocalCudaDeviceIsTheLocalRankAndRefusesMoreRanksThanDevices) {
  EXPECT_EQ(local_cuda_device(Env{}, 1), 0);
  EXPECT_EQ(local_cuda_device(Env{{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}}, 8), 3);
  EXPECT_EQ(local_cuda_device(Env{{"SLURM_LOCALID", "7"}}, 8), 7);
  // Under mpirun every rank would otherwise take GPU 0; past the count no modulo shares one.
  expect_error([] { local_cuda_device(Env{{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}}, 2); },
               {"OMPI_COMM_WORLD_LOCAL_RANK=2", "sees 2 CUDA devices", "at most 2 ranks per node"});
  expect_error(
      [] {
        local_cuda_device(Env{{"LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "3"}}, 1);
      },
      {"LOCAL_RANK=1", "sees 1 CUDA device (CUDA_VISIBLE_DEVICES=3)"});
  EXPECT_THROW(local_cuda_device(Env{{"LOCAL_RANK", "0"}}, 0), NotImplementedError);
}

// The device a rank trains on, from "auto", "cpu", "cuda" or "cuda:N", the local rank and the
// number of GPUs the process sees (given here, so every case runs without a GPU).
TEST(ParseEnv, LocalDeviceFollowsTheSpecTheLocalRankAndTheGpus) {
  const Env two{{"LOCAL_RANK", "1"}};
  EXPECT_EQ(local_device("auto", Env{}, 0), kCPU);
  EXPECT_EQ(local_device("auto", two, 0), kCPU);
  EXPECT_EQ(local_device("auto", two, 2), cuda_device(1));
  EXPECT_EQ(local_device("auto", Env{}, 4), cuda_device(0));
  EXPECT_EQ(local_device("cpu", two, 2), kCPU);
  EXPECT_EQ(local_device("cuda", two, 2), cuda_device(1));
  EXPECT_EQ(local_device("cuda:0", two, 2), cuda_device(0));  // ranks may share a GPU
  // Bad specs name the caller, the spec and what is accepted.
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""}) {
    EXPECT_THROW(local_device(bad, Env{}, 1, "train"), ValueError) << bad;
    expect_error([&] { local_device(bad, Env{}, 1, "train"); },
                 {std::string("[train] device '") + bad + "'",
                  "expected 'auto', 'cpu', 'cuda' or 'cuda:N'"});
  }
  // A GPU asked for where there is none, or one past the count, or more ranks than GPUs.
  EXPECT_THROW(local_device("cuda", Env{}, 0), NotImplementedError);
  EXPECT_THROW(local_device("cuda:0", Env{}, 0), NotImplementedError);
  expect_error([] { local_device("cuda:0", Env{{"CUDA_VISIBLE_DEVICES", ""}}, 0, "train"); },
               {"[train] device 'cuda:0': no CUDA device is visible to this process",
                "(CUDA_VISIBLE_DEVICES=)"});
  expect_error([] { local_device("cuda:2", Env{}, 2, "train"); },
               {"[train] device 'cuda:2': this process sees 2 CUDA devices, numbered from 0"});
  expect_error([] { local_device("auto", Env{{"LOCAL_RANK", "3"}}, 2, "train"); },
               {"[train] device 'auto': LOCAL_RANK=3 but this process sees 2 CUDA devices",
                "at most 2 ranks per node"});
}

// Of this process: without a GPU, "auto" is the CPU and a GPU asked for says why there is none.
TEST(ParseEnv, LocalDeviceOfThisProcess) {
  if (cuda::is_available()) {
    const Device d = local_device("auto", "test");
    EXPECT_TRUE(d.is_cuda());
    EXPECT_EQ(cuda::current_device(), d.index);
    return;
  }
  EXPECT_EQ(local_device(), kCPU);
  EXPECT_EQ(local_device("cpu", "test"), kCPU);
  for (const char* gpu : {"cuda", "cuda:0"}) {
    EXPECT_THROW(local_device(gpu, "test"), NotImplementedError) << gpu;
    expect_error([&] { local_device(gpu, "test"); },
                 {std::string("[test] device '") + gpu + "': ",
                  cuda::unavailable_reason()});
  }
  expect_error([] { local_device("cuda:x", "test"); }, {"[test] device 'cuda:x': expected"});
}

TEST(ParseEnv, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("host1,host2"), "host1");
  EXPECT_EQ(first_slurm_host("a[1-3]"), "a1");
  EXPECT_EQ(first_slurm_host("n[003-005,9]x,b[1-2]"), "n003x");
  EXPECT_EQ(first_slurm_host("c[5,7]"), "c5");
}

TEST(ParseEnv, MissingOrContradictoryVariablesEchoWhatWasFound) {
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "1"}, {"MASTER_PORT", "1"}});
      },
      {"[init_process_group]", "found RANK but not WORLD_SIZE", "RANK=1", "MASTER_PORT=1"});
  expect_error([] { parse_env_rendezvous(Env{}); }, {"RANK and WORLD_SIZE", "found none of"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "abc"}, {"WORLD_SIZE", "2"}});
      },
      {"RANK='abc' is not an integer", "WORLD_SIZE=2"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "4"}, {"WORLD_SIZE", "4"}});
      },
      {"rank must be in [0, 4), got 4", "RANK=4"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "0"}, {"WORLD_SIZE", "0"}});
      },
      {"WORLD_SIZE=0 is out of range"});
  expect_error(
      [] {
        parse_env_rendezvous(
            Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}, 1);
      },
      {"rank 1 contradicts", "RANK/WORLD_SIZE rank 0"});
  expect_error(
      [] {
        parse_env_rendezvous(
            Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}, -1,
            3);
      },
      {"world_size 3 contradicts", "size 2"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
      },
      {"needs MASTER_PORT", "MASTER_ADDR=h"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "5"}});
      },
      {"needs MASTER_ADDR", "MASTER_PORT=5"});
  expect_error(
      [] {
        parse_env_rendezvous(Env{
            {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
      },
      {"MASTER_PORT=70000 is out of range"});
  expect_error([] { first_slurm_host("n[1-3"); }, {"Slurm node list 'n[1-3'"});
}

// ---- the default group in one process ----------------------------------------------------------

InitOptions with_store(std::shared_ptr<Store> store, int rank, int size) {
  InitOptions o;
  o.backend = "gloo";
  o.store = std::move(store);
  o.rank = rank;
  o.world_size = size;
  return o;
}

TEST(DefaultGroup, LifecycleAndErrors) {
  EMBER_REQUIRE_GLOO();
  destroy_process_group();  // a no-op when none
  EXPECT_FALSE(is_initialized());
  expect_error([] { default_group(); }, {"[default_group]", "not initialized"});
  expect_error([] { get_rank(); }, {"not initialized"});
  expect_error([] { new_group({0}); }, {"[new_group]", "not initialized"});

  InitOptions bad = with_store(std::make_shared<HashStore>(), 0, 1);
  bad.backend = "nope";
  expect_error([&] { init_process_group(bad); }, {"unknown backend 'nope'", "gloo"});
  InitOptions url;
  url.init_method = "foo://x";
  url.rank = 0;
  url.world_size = 1;
  expect_error([&] { init_process_group(url); }, {"unsupported init_method 'foo://x'"});
  url.init_method = "tcp://nohostport";
  expect_error([&] { init_process_group(url); }, {"expected tcp://host:port", "nohostport"});
  expect_error([] { init_process_group(with_store(std::make_shared<HashStore>(), -1, 1)); },
               {"rank must be in [0, 1), got -1"});
  InitOptions both = with_store(std::make_shared<HashStore>(), 0, 1);
  both.init_method = "env://";
  expect_error([&] { init_process_group(both); }, {"either a store or an init_method"});
  EXPECT_FALSE(is_initialized());

  auto pg = init_process_group(with_store(std::make_shared<HashStore>(), 0, 1));
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(default_group(), pg);
  EXPECT_EQ(get_rank(), 0);
  EXPECT_EQ(get_world_size(), 1);
  EXPECT_EQ(pg->backend_name(), "gloo");
  Tensor t = full({3}, 2.0, kFloat32);
  pg->allreduce(t)->wait();
  test::expect_close(t, {2, 2, 2}, 0, "allreduce over one rank");
  expect_error([] { init_process_group(with_store(std::make_shared<HashStore>(), 0, 1)); },
               {"already initialized"});
  auto sub = new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(get_world_size(sub), 1);
  expect_error([] { new_group({0, 0}); }, {"[new_group] ranks must be distinct", "[0, 0]"});
  expect_error([] { new_group({1}); }, {"[new_group] ranks must be in [0, 1)", "got 1..1"});
  expect_error([&] { get_group_rank(*sub, 3); }, {"global rank 3 is not a member"});
  expect_error([&] { get_global_rank(*sub, 1); }, {"group rank 1 is not in a group of size 1"});
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  // Re-initializing after destroy works.
  init_process_group(with_store(std::make_shared<HashStore>(), 0, 1));
  EXPECT_TRUE(is_initialized());
  destroy_process_group();
}

// ---- real multi-process rendezvous ------------------------------------------------------------

// The checks every rank runs once its default group is up: world allreduce, a subgroup of the
// even ranks, the whole world as a group, and destroy.
void exercise_world(int n, int rank) {
  require(is_initialized() && get_rank() == rank && get_world_size() == n,
          "rank/size after init: " + std::to_string(get_rank()) + "/" +
              std::to_string(get_world_size()));
  Tensor t = full({5}, rank + 1.0, kFloat64);
  default_group()->allreduce(t)->wait();
  require(t.to_vector<double>()[4] == n * (n + 1) / 2.0, "world allreduce");

  std::vector<int> evens;
  for (int r = 0; r < n; r += 2) evens.push_back(r);
  auto sub = new_group(evens);
  if (rank % 2 == 1) {
    require(sub == nullptr, "a non-member gets no group");
  } else {
    require(
        sub != nullptr && sub->size() == static_cast<int>(evens.size()) && sub->rank() == rank / 2,
        "subgroup rank");
    require(get_global_rank(*sub, sub->rank()) == rank && get_group_rank(*sub, rank) == rank / 2,
            "rank mapping");
    Tensor s = full({3}, static_cast<double>(rank), kInt64);
    sub->allreduce(s)->wait();
    double want = 0;
    for (int r : evens) want += r;
    require(s.to_vector<int64_t>()[0] == static_cast<int64_t>(want), "subgroup allreduce");
  }
  auto all = new_group({});
  require(all && all->size() == n && all->rank() == rank, "new_group({}) is the world");
  Tensor m = full({2}, static_cast<double>(rank), kInt32);
  all->allreduce(m,
                 [] {
                   AllreduceOptions o;
                   o.op = ReduceOp::Max;
                   return o;
                 }())
      ->wait();
  require(m.to_vector<int32_t>()[0] == n - 1, "allreduce max over new_group({})");
  default_group()->barrier()->wait();
  destroy_process_group();
  require(!is_initialized(), "destroyed");
}

void run(int n, const std::function<void(int rank, const std::string& msg)>& body,
         const std::string& message) {
  test::Children kids(n, body);
  kids.go(message);
  test::expect_children_ok(kids.join());
}

TEST(InitProcessGroup, EnvTorchVariables) {
  EMBER_REQUIRE_GLOO();
  const int n = 3;
  run(
      n,
      [](int rank, const std::string& port) {
        ::setenv("RANK", std::to_string(rank).c_str(), 1);
        ::setenv("WORLD_SIZE", "3", 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", port.c_str(), 1);
        InitOptions o;
        o.backend = "gloo";
        o.timeout = 60s;
        init_process_group(o);  // env:// by default
        exercise_world(3, rank);
      },
      std::to_string(test::unused_port()));
}

TEST(InitProcessGroup, EnvOpenMpiVariables) {
  EMBER_REQUIRE_GLOO();
  run(
      2,
      [](int rank, const std::string& port) {
        for (const char* v : {"RANK", "WORLD_SIZE"}) ::unsetenv(v);
        ::setenv("OMPI_COMM_WORLD_RANK", std::to_string(rank).c_str(), 1);
        ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", port.c_str(), 1);
        InitOptions o;
        o.backend = "gloo";
        o.init_method = "env://";
        o.timeout = 60s;
        init_process_group(o);
        exercise_world(2, rank);
      },
      std::to_string(test::unused_port()));
}

// env:// takes the rank and world size from the URL's query before the environment, as torch
// does ("env://?rank=0&world_size=2", the address still from MASTER_ADDR and MASTER_PORT); a
// query value that is not a number is named.
TEST(InitProcessGroup, EnvUrlQuery) {
  EMBER_REQUIRE_GLOO();
  run(
      2,
      [](int rank, const std::string& port) {
        for (const char* v : {"RANK", "WORLD_SIZE"}) ::unsetenv(v);
        ::setenv("MASTER_ADDR", "127.0.0.1", 1);
        ::setenv("MASTER_PORT", port.c_str(), 1);
        InitOptions o;
        o.backend = "gloo";
        o.timeout = 60s;
        o.init_method = "env://?rank=x&world_size=2";
        std::string msg;
        try {
          init_process_group(o);
        } catch (const ValueError& e) {
          msg = e.what();
        }
        require(msg.find("rank") != std::string::npos &&
                    msg.find("in env://?rank=x&world_size=2") != std::string::npos,
                "a query rank that is not a number: got '" + msg + "'");
        o.init_method = "env://?rank=" + std::to_string(rank) + "&world_size=2";
        init_process_group(o);
        exercise_world(2, rank);
      },
      std::to_string(test::unused_port()));
}

TEST(InitProcessGroup, TcpUrl) {
  EMBER_REQUIRE_GLOO();
  run(
      4,
      [](int rank, const std::string& port) {
        InitOptions o;
        o.backend = "gloo";
        o.init_method = "tcp://127.0.0.1:" + port + "?world_size=4";
        o.rank = rank;
        o.timeout = 60s;
        init_process_group(o);
        exercise_world(4, rank);
      },
      std::to_string(test::unused_port()));
}

TEST(InitProcessGroup, FileUrl) {
  EMBER_REQUIRE_GLOO();
  test::TempDir dir;
  run(
      3,
      [](int rank, const std::string& path) {
        ::setenv("EMBER_GLOO_HOSTNAME", "127.0.0.1", 1);
        InitOptions o;
        o.backend = "gloo";
        o.init_method = "file://" + path + "?rank=" + std::to_string(rank) + "&world_size=3";
        o.timeout = 60s;
        init_process_group(o);
        exercise_world(3, rank);
      },
      dir.file("store"));
}

// Forks 2 ranks; each calls init(rank, options) with options carrying a client of a
// TCPStoreServer on an OS-picked port of this process (60 s timeouts), then exercises the world.
void run_with_store(const std::function<void(int, const InitOptions&)>& init) {
  test::Children kids(2, [&](int rank, const std::string& port) {
    ::setenv("EMBER_GLOO_HOSTNAME", "127.0.0.1", 1);
    TCPStoreOptions so;
    so.timeout = 60s;
    auto store =
        std::make_shared<TCPStore>("127.0.0.1", static_cast<uint16_t>(std::stoi(port)), so);
    InitOptions o = with_store(store, rank, 2);
    o.timeout = 60s;
    init(rank, o);
    exercise_world(2, rank);
  });
  TCPStoreServerOptions so;
  so.host = "127.0.0.1";
  TCPStoreServer server(so);
  kids.go(std::to_string(server.port()));
  test::expect_children_ok(kids.join());
}

TEST(InitProcessGroup, GivenStore) {
  EMBER_REQUIRE_GLOO();
  run_with_store([](int, const InitOptions& o) {
    init_process_group(o);
    require(default_store() == o.store, "default_store() is the given store");
  });
}

// EMBER_PG_TIMEOUT (seconds) is the default group's collective timeout when the program sets
// none; one the program sets wins; a bad value is an error naming the variable.
TEST(InitProcessGroup, CollectiveTimeoutFromTheEnvironment) {
  EMBER_REQUIRE_GLOO();
  auto timeout_of = [](std::optional<Duration> set) {
    InitOptions o = with_store(std::make_shared<HashStore>(), 0, 1);
    o.timeout = set;
    const Duration t = init_process_group(o)->timeout();
    destroy_process_group();
    return t;
  };
  ::unsetenv("EMBER_PG_TIMEOUT");
  EXPECT_EQ(timeout_of({}), kDefaultCollectiveTimeout);
  ::setenv("EMBER_PG_TIMEOUT", "7", 1);
  EXPECT_EQ(timeout_of({}), Duration(7000));
  EXPECT_EQ(timeout_of(Duration(1500)), Duration(1500));
  ::setenv("EMBER_PG_TIMEOUT", "0", 1);
  expect_error([&] { timeout_of({}); }, {"EMBER_PG_TIMEOUT=0", "out of range"});
  ::setenv("EMBER_PG_TIMEOUT", "5m", 1);
  expect_error([&] { timeout_of({}); }, {"EMBER_PG_TIMEOUT='5m'", "not an integer"});
  ::unsetenv("EMBER_PG_TIMEOUT");
  EXPECT_FALSE(is_initialized());
}

// PyTorch's defaults: 10 minutes for NCCL, 30 for the other backends; the environment's wins.
TEST(InitProcessGroup, DefaultTimeoutFollowsTheBackend) {
  ::unsetenv("EMBER_PG_TIMEOUT");
  EXPECT_EQ(default_collective_timeout("nccl"), std::chrono::minutes(10));
  EXPECT_EQ(default_collective_timeout("gloo"), std::chrono::minutes(30));
  EXPECT_EQ(default_collective_timeout("mpi"), std::chrono::minutes(30));
  EXPECT_EQ(ProcessGroupNccl::NcclOptions{}.timeout, std::chrono::minutes(10));
  ::setenv("EMBER_PG_TIMEOUT", "42", 1);
  EXPECT_EQ(default_collective_timeout("nccl"), std::chrono::seconds(42));
  ::unsetenv("EMBER_PG_TIMEOUT");
}

// PyTorch (>= 2.6) picks the device's backend when none is named: NCCL for a process with a GPU
// in a build with NCCL, gloo otherwise.
TEST(InitProcessGroup, DefaultBackendFollowsTheDevice) {
  EXPECT_EQ(default_backend(/*cuda_available=*/true, /*nccl_built=*/true), "nccl");
  EXPECT_EQ(default_backend(true, false), "gloo");
  EXPECT_EQ(default_backend(false, true), "gloo");
  EXPECT_EQ(default_backend(false, false), "gloo");
  EXPECT_EQ(InitOptions{}.backend, "") << "the default must be 'follow the device'";
}

// A stand-in registered for a backend the build lacks is not available; an unknown name is not
// either; the backends this build has are.
TEST(Registry, IsBackendAvailableTellsBuiltBackendsFromStandIns) {
  EXPECT_TRUE(is_backend_available("threads"));
  EXPECT_EQ(is_backend_available("gloo"), gloo_available());
  EXPECT_EQ(is_backend_available("nccl"), nccl_available());
  EXPECT_FALSE(is_backend_available("no-such-backend"));
  register_backend("test-absent",
                   detail::unavailable_backend("test-absent", "Foo", "EMBER_WITH_FOO", "libfoo"),
                   BackendTraits{.built = false});
  EXPECT_FALSE(is_backend_available("test-absent"));
  const std::vector<std::string> names = registered_backends();
  EXPECT_NE(std::find(names.begin(), names.end(), "test-absent"), names.end());
}

// init_process_group without a backend: on this process's device's backend, which a machine
// without a GPU (or a build without NCCL) makes gloo; the group works.
TEST(InitProcessGroup, NoBackendGivenUsesTheDevicesBackend) {
  InitOptions o;
  o.store = std::make_shared<HashStore>();
  o.rank = 0;
  o.world_size = 1;
  const bool gpu = cuda::is_available() && nccl_available();
  if (!gpu) EMBER_REQUIRE_GLOO();
  auto pg = init_process_group(o);
  EXPECT_EQ(pg->backend_name(), gpu ? "nccl" : "gloo");
  EXPECT_EQ(default_collective_timeout(pg->backend_name()), pg->timeout());
  // new_group without a backend takes the default group's, the resolved one.
  auto sub = new_group({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->backend_name(), pg->backend_name());
  Tensor t = ones({3}).to(pg->default_device());
  pg->allreduce(t)->wait();
  EXPECT_EQ(t.to(kCPU).to_vector<float>(), std::vector<float>({1, 1, 1}));
  destroy_process_group();
}

// The same reading serves EMBER_NCCL_INIT_TIMEOUT (the nccl group's creation limit).
TEST(ParseEnv, TimeoutFromTheEnvironment) {
  ::setenv("EMBER_NCCL_INIT_TIMEOUT", "", 1);
  EXPECT_EQ(timeout_from_env("EMBER_NCCL_INIT_TIMEOUT"), std::nullopt);
  ::setenv("EMBER_NCCL_INIT_TIMEOUT", "90", 1);
  EXPECT_EQ(timeout_from_env("EMBER_NCCL_INIT_TIMEOUT"), Duration(90000));
  ::setenv("EMBER_NCCL_INIT_TIMEOUT", "1.5", 1);
  expect_error([] { timeout_from_env("EMBER_NCCL_INIT_TIMEOUT"); },
               {"EMBER_NCCL_INIT_TIMEOUT='1.5'", "not an integer"});
  ::unsetenv("EMBER_NCCL_INIT_TIMEOUT");
  EXPECT_EQ(timeout_from_env("EMBER_NCCL_INIT_TIMEOUT"), std::nullopt);
}

// EMBER_GLOO_THREADS (the gloo group's collective worker threads, 2 by default) and
// EMBER_GLOO_SHM (allreduce through shared memory, 1 by default) and
// EMBER_GLOO_RECEIVES_FIRST_BYTES: one thread works, 0 turns shared memory off, 1 posts every TCP
// allgather message receives first, and a bad value is an error naming the variable and what was
// wrong.
TEST(InitProcessGroup, GlooThreadsAndSharedMemoryFromTheEnvironment) {
  EMBER_REQUIRE_GLOO();
  auto init_alone = [] { init_process_group(with_store(std::make_shared<HashStore>(), 0, 1)); };
  ::setenv("EMBER_GLOO_THREADS", "0", 1);
  expect_error(init_alone, {"EMBER_GLOO_THREADS=0", "out of range [1, 64]"});
  ::setenv("EMBER_GLOO_THREADS", "two", 1);
  expect_error(init_alone, {"EMBER_GLOO_THREADS='two'", "not an integer"});
  ::unsetenv("EMBER_GLOO_THREADS");
  ::setenv("EMBER_GLOO_SHM", "2", 1);
  expect_error(init_alone, {"EMBER_GLOO_SHM=2", "out of range [0, 1]", "shared memory"});
  ::unsetenv("EMBER_GLOO_SHM");
  ::setenv("EMBER_GLOO_RECEIVES_FIRST_BYTES", "0", 1);
  expect_error(init_alone, {"EMBER_GLOO_RECEIVES_FIRST_BYTES=0", "out of range", "receives first"});
  ::unsetenv("EMBER_GLOO_RECEIVES_FIRST_BYTES");
  EXPECT_FALSE(is_initialized());
  // Two ranks with one worker thread each; EMBER_GLOO_SHM=0, then unset (shared memory).
  for (const char* shm : {"0", ""}) {
    run_with_store([shm](int, const InitOptions& o) {
      ::setenv("EMBER_GLOO_THREADS", "1", 1);
      if (*shm) ::setenv("EMBER_GLOO_SHM", shm, 1);
      // Over TCP, every allgather message posted receives first (Note [receives first over TCP]).
      if (*shm) ::setenv("EMBER_GLOO_RECEIVES_FIRST_BYTES", "1", 1);
      auto pg = std::dynamic_pointer_cast<ProcessGroupGloo>(init_process_group(o));
      test::require(pg && pg->uses_shared_memory() == !*shm,
                    std::string("EMBER_GLOO_SHM='") + shm + "': uses_shared_memory()");
      Tensor all = empty({6}, kUInt8);
      pg->allgather_into_tensor(all, full({3}, pg->rank() + 1, kUInt8))->wait();
      test::require(all.to(kInt64).to_vector<int64_t>() == std::vector<int64_t>{1, 1, 1, 2, 2, 2},
                    "allgather_into_tensor of 3 bytes");
    });
  }
}

// ---- registries: backends and init methods ------------------------------------------------------

// Every backend registers itself from its own file; those a build lacks register a refusal that
// says what is missing and how to get it (instead of "unknown backend"). The refusal is checked
// under a name of its own, so every build runs it; a build without NCCL also checks "nccl".
TEST(Registry, EveryBackendRegistersItselfAndAMissingOneSaysWhy) {
  const std::vector<std::string> names = registered_backends();
  for (const char* b : {"gloo", "mpi", "nccl", "threads"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), b), names.end()) << b;
  }
  register_backend("test-missing", detail::unavailable_backend("test-missing", "Foo",
                                                               "EMBER_WITH_FOO", "libfoo-dev"));
  std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"test-missing",
       {"[init_process_group] backend 'test-missing' is not in this build",
        "configured without Foo (EMBER_WITH_FOO=OFF, or it was not found)",
        "Install libfoo-dev and configure again with -DEMBER_WITH_FOO=ON"}}};
  if (!nccl_available()) {
    cases.push_back({"nccl", {"backend 'nccl' is not in this build", "-DEMBER_WITH_NCCL=ON"}});
  }
  for (const auto& [backend, parts] : cases) {
    InitOptions o = with_store(std::make_shared<HashStore>(), 0, 1);
    o.backend = backend;
    try {
      init_process_group(o);
      ADD_FAILURE() << backend << ": expected NotImplementedError";
    } catch (const NotImplementedError& e) {
      const std::string m = e.what();
      for (const std::string& part : parts) EXPECT_NE(m.find(part), std::string::npos) << m;
    }
    EXPECT_FALSE(is_initialized());
  }
}

// A program's own backend and init method, registered as the built-in ones are: one factory
// and one row. The method is picked by its URL, the backend by its name.
TEST(Registry, AUserBackendAndInitMethod) {
  int made = 0;
  register_backend("test-single", [&made](const BackendArgs& a) -> std::shared_ptr<ProcessGroup> {
    ++made;
    return std::make_shared<ProcessGroupThreads>(ThreadWorld::create(a.size), a.rank);
  });
  InitMethod mem;
  mem.name = "mem://";
  mem.accepts = [](const std::string& url, const std::string&) { return url.rfind("mem://", 0) == 0; };
  mem.rendezvous = [](const std::string&, const InitOptions&, Duration) {
    return Rendezvous{std::make_shared<HashStore>(), 0, 1, "", nullptr};
  };
  register_init_method(mem);
  InitOptions o;
  o.backend = "test-single";
  o.init_method = "mem://job";
  auto pg = init_process_group(o);
  EXPECT_EQ(made, 1);
  EXPECT_EQ(pg->backend_name(), "threads");
  Tensor t = ones({3});
  pg->allreduce(t)->wait();
  EXPECT_EQ(t.to_vector<float>(), std::vector<float>({1, 1, 1}));
  destroy_process_group();
  // Unknown URLs name every registered method, the new one included.
  o.init_method = "nope://x";
  expect_error([&] { init_process_group(o); },
               {"unsupported init_method 'nope://x'", "env://", "tcp://", "file://", "mem://"});
  expect_error([] { register_init_method(InitMethod{}); }, {"[register_init_method]"});
  expect_error([] { register_backend("x", nullptr); }, {"[register_backend]"});
}

// The threads backend through init_process_group: each rank thread has its own default group
// and its own new_group sub-groups, found through the store they share.
TEST(Registry, ThreadsBackendGivesEachRankThreadItsDefaultGroupAndSubGroups) {
  constexpr int n = 4;
  auto store = std::make_shared<HashStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> failures(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        InitOptions o = with_store(store, r, n);
        o.backend = "threads";
        o.timeout = 60s;
        auto pg = init_process_group(o);
        require(default_group() == pg && get_rank() == r && get_world_size() == n,
                "the thread's own default group");
        Tensor t = full({2}, static_cast<float>(r + 1));
        pg->allreduce(t)->wait();
        require(t.to_vector<float>() == std::vector<float>({10, 10}), "world allreduce");
        // Even ranks and odd ranks: every rank calls new_group for both, in the same order.
        auto even = new_group({0, 2});
        auto odd = new_group({1, 3});
        auto mine = r % 2 == 0 ? even : odd;
        require(mine && (r % 2 == 0 ? odd : even) == nullptr, "membership");
        require(mine->size() == 2 && mine->rank() == r / 2, "sub-group rank");
        Tensor u = full({1}, static_cast<float>(r));
        mine->allreduce(u)->wait();
        require(u.item<float>() == (r % 2 == 0 ? 0 + 2 : 1 + 3), "sub-group allreduce");
        destroy_process_group();
        require(!is_initialized(), "destroyed on this thread");
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
  EXPECT_FALSE(is_initialized());  // the process's own default group was never made
}

// A threads-backend rank whose rank 0 is in another process (the key rank 0 publishes names a
// world this process does not have) fails at once, saying why.
TEST(Registry, ThreadsBackendRefusesRanksInAnotherProcess) {
  auto store = std::make_shared<HashStore>();
  const std::string key = "1:0";  // pid 1 is never this test
  store->set("default_pg/threads_world", Bytes(key.begin(), key.end()));
  InitOptions o = with_store(store, 1, 2);
  o.backend = "threads";
  expect_error([&] { init_process_group(o); },
               {"[threads] rank 1 of 2", "is not in this process", "thread of one process"});
  EXPECT_FALSE(is_initialized());
}

}  // namespace
}  // namespace ember::dist
