// examples/fashion_mnist under a real Slurm cluster of one node, started by the test: munged,
// slurmctld and slurmd run as root from a unique temporary folder with ports the OS picked, and
// are stopped at the end even when a check fails. `srun -n 2` trains at world size 2 without
// emberrun and without MASTER_ADDR/MASTER_PORT, examples/slurm/fashion_mnist.sbatch runs as
// written under `sbatch --wait`, so does gpt_gpu_srun.sbatch with its device and GPUs overridden,
// and a batch script that runs the program without srun fails at once saying so. Without root,
// Slurm (slurm-wlm, munge) or Fashion-MNIST the cases skip with the reason.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <ember/nn/data/token_stream.h>
#include "cmake/build_paths.h"
#include "tests/examples/example_test_util.h"

namespace {

namespace fs = std::filesystem;
using ember::test::CommandResult;
using ember::test::run_command;

const std::string kData = "/usr/share/datasets/fashion-mnist";
std::string example() { return std::string(EMBER_BINARY_DIR) + "/examples/fashion_mnist"; }

bool on_path(const std::string& tool) {
  return run_command("sh -c 'command -v " + tool + "'", 10).status == 0;
}

/// n distinct TCP ports free at the time of asking (the OS's picks); the daemons bind them a
/// moment later. Every socket stays bound until all are picked: one at a time, the OS may hand
/// out the same port twice (seen: slurmctld and slurmd given one port).
std::vector<int> free_ports(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    fds.push_back(fd);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ports.push_back(port);
  }
  for (int fd : fds) close(fd);
  return ports;
}

/// Whether `port` can be bound on every address now.
bool port_free(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

/// The cluster's first job id. Without MASTER_PORT a job's rendezvous port is 15000 + its id %
/// 10000 (distributed/environment.h), so two clusters running at once (ctest -j) that both
/// started at job 1 would both listen on 15001. Each starts where its next few jobs' ports are
/// free, searching from its pid.
int first_job_id() {
  for (int i = 0; i < 10000; ++i) {
    const int id = 1 + (static_cast<int>(getpid()) + 97 * i) % 9990;
    if (port_free(15000 + id) && port_free(15001 + id) && port_free(15002 + id)) return id;
  }
  return 1;
}

/// Polls `cmd` until its output contains `want` or `limit` passes; returns the last output.
std::string wait_for_output(const std::string& cmd, const std::string& want,
                            std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::string out;
  while (std::chrono::steady_clock::now() < deadline) {
    out = run_command(cmd, 20).output;
    if (out.find(want) != std::string::npos) return out;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // polling a condition
  }
  return out;
}

/// The text of the job output file in `dir` whose name starts with `prefix`; "" when none.
std::string read_job_output(const std::string& dir, const std::string& prefix) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) {
      std::ifstream f(e.path());
      return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
  }
  return "";
}

/// One node's Slurm cluster under `dir`: its own munge key and socket, controller and node
/// daemon on free ports, state and logs in the folder. The destructor stops all three.
class SlurmCluster {
 public:
  explicit SlurmCluster(std::string dir) : dir_(std::move(dir)) {}
  ~SlurmCluster() { stop(); }

  /// "" once the node is idle and accepts jobs, else why not (with the daemons' logs).
  std::string start() {
    for (const char* sub : {"/munge", "/state", "/spool", "/log"}) fs::create_directories(dir_ + sub);
    fs::permissions(dir_ + "/munge", fs::perms::owner_all, fs::perm_options::replace);
    CommandResult r = run_command("dd if=/dev/urandom of=" + dir_ + "/munge/munge.key bs=1024 count=1 status=none && chmod 400 " +
                                      dir_ + "/munge/munge.key", 20);
    if (r.status != 0) return "munge key: " + r.output;
    r = run_command("munged -f -S " + socket() + " --key-file=" + dir_ + "/munge/munge.key --log-file=" + dir_ +
                        "/munge/log --pid-file=" + dir_ + "/munge/pid --seed-file=" + dir_ + "/munge/seed",
                    30);
    if (r.status != 0) return "munged: " + r.output;
    munged_ = true;

    char host[256] = {};
    gethostname(host, sizeof host - 1);
    node_ = host;
    const unsigned cpus = std::max(2u, std::thread::hardware_concurrency());
    const std::vector<int> ports = free_ports(2);
    std::ofstream conf(conf_path());
    conf << "ClusterName=embertest\nFirstJobId=" << first_job_id() << "\n"
         << "SlurmctldHost=" << node_ << "(127.0.0.1)\n"
         << "SlurmctldPort=" << ports[0] << "\nSlurmdPort=" << ports[1] << "\n"
         << "AuthType=auth/munge\nAuthInfo=socket=" << socket() << "\nCredType=cred/munge\n"
         << "SlurmUser=root\nSlurmdUser=root\n"
         << "StateSaveLocation=" << dir_ << "/state\nSlurmdSpoolDir=" << dir_ << "/spool\n"
         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\nSlurmdPidFile=" << dir_ << "/slurmd.pid\n"
         << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\nSlurmdLogFile=" << dir_ << "/log/slurmd.log\n"
         << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
         << "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
         << "SwitchType=switch/none\nMpiDefault=none\nSchedulerType=sched/builtin\n"
         << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nReturnToService=2\n"
         << "SlurmdParameters=config_overrides\n"
         << "NodeName=" << node_ << " NodeAddr=127.0.0.1 CPUs=" << cpus << " State=UNKNOWN\n"
         << "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n";
    conf.close();

    r = run_command(env() + " slurmctld -c", 30);
    if (r.status != 0) return "slurmctld: " + r.output + logs();
    ctld_ = true;
    if (wait_for_output(env() + " scontrol ping", "is UP", std::chrono::seconds(60)).find("is UP") ==
        std::string::npos) {
      return "slurmctld did not answer scontrol ping" + logs();
    }
    r = run_command(env() + " slurmd -N " + node_, 30);
    if (r.status != 0) return "slurmd: " + r.output + logs();
    slurmd_ = true;
    if (wait_for_output(env() + " sinfo -h -o %t", "idle", std::chrono::seconds(60)).find("idle") ==
        std::string::npos) {
      return "the node did not become idle" + logs();
    }
    return "";
  }

  /// The variable that points Slurm's commands at this cluster.
  std::string conf_var() const { return "SLURM_CONF=" + conf_path(); }
  /// A command prefix setting it.
  std::string env() const { return "env " + conf_var(); }

  std::string logs() const {
    std::string all;
    for (const char* name : {"/log/slurmctld.log", "/log/slurmd.log"}) {
      std::ifstream f(dir_ + name);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      all += "\n--- " + std::string(name) + " (last 3000 bytes)\n" +
             text.substr(text.size() > 3000 ? text.size() - 3000 : 0);
    }
    return all;
  }

 private:
  std::string socket() const { return dir_ + "/munge/sock"; }
  std::string conf_path() const { return dir_ + "/slurm.conf"; }

  /// SIGTERM to the daemon whose pid file is given, then SIGKILL if it is still there 10 s on.
  static void kill_daemon(const std::string& pid_file) {
    std::ifstream f(pid_file);
    pid_t pid = 0;
    if (!(f >> pid) || pid <= 1) return;
    kill(pid, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (kill(pid, 0) == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling for the exit
    }
    if (kill(pid, 0) == 0) kill(pid, SIGKILL);
  }

  void stop() {
    if (slurmd_) kill_daemon(dir_ + "/slurmd.pid");
    if (ctld_) kill_daemon(dir_ + "/slurmctld.pid");
    if (munged_) kill_daemon(dir_ + "/munge/pid");
    slurmd_ = ctld_ = munged_ = false;
  }

  std::string dir_, node_;
  bool munged_ = false, ctld_ = false, slurmd_ = false;
};

class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "starting slurmctld and slurmd needs root";
    for (const char* tool : {"munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol"}) {
      if (!on_path(tool)) GTEST_SKIP() << tool << " not found (install slurm-wlm and munge)";
    }
    if (!fs::exists(kData + "/train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << "no Fashion-MNIST at " << kData << " (install dataset-fashion-mnist)";
    }
    ASSERT_TRUE(fs::exists(example())) << example();
    cluster_ = std::make_unique<SlurmCluster>(tmp_.path());
    const std::string why = cluster_->start();
    ASSERT_EQ(why, "") << "could not start a one-node Slurm cluster: " << why;
  }
  void TearDown() override { cluster_.reset(); }

  ember::test::TempDir tmp_{"slurm_test"};
  std::unique_ptr<SlurmCluster> cluster_;
};

const std::string kNoMaster = "env -u MASTER_ADDR -u MASTER_PORT ";
constexpr const char* kSmallRun = " --max-steps 20 --batch-size 32 --data ";

TEST_F(Slurm, SrunTrainsAtWorldSizeTwoWithoutALauncher) {
  // No MASTER_ADDR/MASTER_PORT: the node list and the job id give them. No thread count either:
  // the two tasks share the CPUs they may run on (task/none binds nothing), so each takes half.
  CommandResult r = run_command(kNoMaster + "-u EMBER_NUM_THREADS -u OMP_NUM_THREADS " +
                                    cluster_->conf_var() + " srun -n 2 " + example() + kSmallRun +
                                    kData,
                                300);
  ASSERT_EQ(r.status, 0) << r.output << cluster_->logs();
  EXPECT_NE(r.output.find("fashion_mnist: world size 2, backend gloo"), std::string::npos) << r.output;
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int mine = CPU_COUNT(&set);
  const int online = static_cast<int>(std::thread::hardware_concurrency());
  const int share = mine == online ? std::max(1, mine / 2) : mine;
  EXPECT_NE(r.output.find(std::to_string(share) + " threads per rank"), std::string::npos)
      << "expected " << share << " threads of " << mine << " CPUs:\n" << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(test_accuracy=([0-9.]+))"))) << r.output;
  EXPECT_GT(std::stod(m[1]), 0.2) << r.output;  // chance is 0.1
}

TEST_F(Slurm, TheDocumentedSbatchScriptRunsAsWritten) {
  const std::string script = std::string(EMBER_SOURCE_DIR) + "/examples/slurm/fashion_mnist.sbatch";
  ASSERT_TRUE(fs::exists(script)) << script;
  // As the docs say: from the repository root, EMBER_BUILD naming the build folder; the output
  // file goes to the temporary folder instead of the source tree.
  CommandResult r = run_command("sh -c 'cd " + std::string(EMBER_SOURCE_DIR) + " && " + kNoMaster + cluster_->conf_var() +
                                    " EMBER_NUM_THREADS=1 EMBER_BUILD=" +
                                    EMBER_BINARY_DIR + " sbatch --wait --output=" + tmp_.path() +
                                    "/job_%j.out " + script + kSmallRun + kData + "'",
                                300);
  const std::string job_output = read_job_output(tmp_.path(), "job_");
  ASSERT_EQ(r.status, 0) << r.output << job_output << cluster_->logs();
  EXPECT_NE(job_output.find("fashion_mnist: world size 2, backend gloo"), std::string::npos) << job_output;
  EXPECT_NE(job_output.find("test_accuracy="), std::string::npos) << job_output;
}

TEST_F(Slurm, TheGpuSrunScriptRunsAsWrittenWithTheDeviceOverridden) {
  // This one-node cluster has neither GPUs nor two nodes: sbatch's own options override the
  // script's #SBATCH lines and the program's last flags its --device and --backend (gpt takes a
  // flag's last value), so the rest of the script runs as written: srun's tasks meet as two
  // ranks, and each keeps to its --cpus-per-task core.
  if (!fs::exists(ember::nn::data::kKjvBible) || !on_path("bible")) {
    GTEST_SKIP() << "no " << ember::nn::data::kKjvBible << " or no bible(1) (install "
                 << "bible-kjv-text and bible-kjv)";
  }
  const std::string script = std::string(EMBER_SOURCE_DIR) + "/examples/slurm/gpt_gpu_srun.sbatch";
  ASSERT_TRUE(fs::exists(script)) << script;
  CommandResult r = run_command(
      "sh -c 'cd " + std::string(EMBER_SOURCE_DIR) + " && " + kNoMaster +
          "-u EMBER_NUM_THREADS -u OMP_NUM_THREADS " + cluster_->conf_var() + " EMBER_BUILD=" +
          EMBER_BINARY_DIR + " sbatch --wait --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 " +
          "--gpus-per-node=0 --time=10 --output=" + tmp_.path() + "/gpu_srun_%j.out " + script +
          " --device cpu --backend gloo --layers 1 --dim 32 --context 32 --steps 4 "
          "--eval-batches 1 --log-every 2 --cache-dir " + tmp_.path() + "/cache'",
      600);
  const std::string job_output = read_job_output(tmp_.path(), "gpu_srun_");
  ASSERT_EQ(r.status, 0) << r.output << job_output << cluster_->logs();
  EXPECT_NE(job_output.find("gpt: world size 2, backend gloo, device cpu"), std::string::npos)
      << job_output;
  EXPECT_NE(job_output.find("1 threads per rank"), std::string::npos) << job_output;
  EXPECT_NE(job_output.find("val_loss="), std::string::npos) << job_output;
}

TEST_F(Slurm, ABatchScriptThatForgetsSrunFailsAtOnceNamingTheMistake) {
  // The script runs the program itself: one process that sees SLURM_NTASKS=2 and SLURM_PROCID=0.
  // Without the check it would wait for its peer until the store's timeout; --time bounds the
  // job (and the command's limit the test) should the check ever be lost.
  CommandResult r = run_command(kNoMaster + cluster_->conf_var() +
                                    " EMBER_NUM_THREADS=1 sbatch --wait --ntasks=2 --time=3 "
                                    "--output=" + tmp_.path() + "/trap_%j.out --wrap '" +
                                    example() + kSmallRun + kData + "'",
                                300);
  const std::string job_output = read_job_output(tmp_.path(), "trap_");
  EXPECT_NE(r.status, 0) << r.output << job_output;
  EXPECT_NE(job_output.find("fashion_mnist: error: [init_process_group] SLURM_NTASKS=2 but this "
                            "process is the batch script of Slurm job"),
            std::string::npos)
      << r.output << job_output << cluster_->logs();
  EXPECT_NE(job_output.find("start each rank with `srun PROGRAM`"), std::string::npos)
      << job_output;
  EXPECT_EQ(job_output.find("test_accuracy="), std::string::npos) << job_output;
}

}  // namespace
