// What a rank reads from its environment (init.h includes it): env://'s variables as emberrun,
// torchrun, mpirun and srun set them, the local rank and its GPU, timeouts from variables.
#pragma once

#include <map>
#include <optional>
#include <string>

#include <ember/distributed/store/store.h>
#include <ember/tensor/device.h>

namespace ember::dist {

/// What env:// found: the rank, the world size, rank 0's address and the store's port, and
/// which variables they came from.
struct EnvRendezvous {
  int rank = -1;
  int world_size = -1;
  std::string master_addr;
  int master_port = -1;
  std::string source;  // e.g. "RANK/WORLD_SIZE", "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE"
};

/// Parses env:// variables from `env` (a snapshot of the environment): RANK and WORLD_SIZE,
/// else OMPI_COMM_WORLD_RANK/_SIZE, else PMI_RANK/PMI_SIZE, else SLURM_PROCID/SLURM_NTASKS;
/// MASTER_ADDR, else the first host of SLURM_JOB_NODELIST (or SLURM_NODELIST); MASTER_PORT,
/// else under Slurm 15000 + SLURM_JOB_ID % 10000 (PyTorch Lightning's rule). (mpirun without
/// MASTER_ADDR does not come here when Ember is built with MPI: the address goes over MPI.)
/// `rank`/`world_size` >= 0 override the environment and must agree with it if it has them.
/// Throws ValueError echoing the variables found when something is missing, not an integer,
/// out of range or contradictory, or when the Slurm variables are a batch script's own (a job
/// id, SLURM_NTASKS > 1, no SLURM_STEP_ID: the program was started without srun).
EnvRendezvous parse_env_rendezvous(const std::map<std::string, std::string>& env, int rank = -1,
                                   int world_size = -1);

/// Whether a launcher started this process as one rank of a job: one of the rank variables
/// parse_env_rendezvous reads (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID) is set in
/// `env`. A program run on its own can then make itself a world of one.
bool launched_as_rank(const std::map<std::string, std::string>& env);
/// The same, of this process's environment.
bool launched_as_rank();

/// This process's rank among the ranks of its node: LOCAL_RANK (emberrun, torchrun), else
/// OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH, Intel MPI), SLURM_LOCALID
/// (srun); nullopt when none is set. Throws ValueError naming the variable when its value is
/// not a non-negative integer.
std::optional<int> local_rank(const std::map<std::string, std::string>& env);
/// The same, of this process's environment.
std::optional<int> local_rank();

/// The number of ranks on this process's node: LOCAL_WORLD_SIZE (emberrun, torchrun), else
/// OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI), MPI_LOCALNRANKS (MPICH, Intel MPI); nullopt when none
/// is set. Throws ValueError naming the variable when its value is not a positive integer.
std::optional<int> local_world_size(const std::map<std::string, std::string>& env);
/// The same, of this process's environment.
std::optional<int> local_world_size();

/// The CUDA device of this rank when each rank of a node takes one GPU: its local_rank(env),
/// or 0 when no launcher set one. Throws ValueError naming the variable, its value and
/// `device_count` (and CUDA_VISIBLE_DEVICES when set) if the local rank is not below
/// device_count, and NotImplementedError if device_count is 0.
int local_cuda_device(const std::map<std::string, std::string>& env, int device_count);
/// The same, of this process's environment and cuda::device_count().
int local_cuda_device();

/// The device `spec` names for this rank, given the environment `env` and `device_count`
/// visible CUDA devices (torch's `torch.device("cuda", local_rank) if torch.cuda.is_available()
/// else "cpu"`):
///   "auto"    the local rank's GPU (local_cuda_device) when device_count > 0, else cpu;
///   "cpu"     the CPU;
///   "cuda"    the local rank's GPU: one GPU per rank, as NCCL needs;
///   "cuda:N"  GPU N, whatever the local rank (ranks sharing one GPU, e.g. over gloo).
/// `who` names the program or call in messages ("[who] device 'cuda:2': ..."). Throws
/// ValueError for another spec, for "cuda:N" with N >= device_count, and for more local ranks
/// than GPUs; NotImplementedError when a GPU is asked for and device_count is 0. Pure: selects
/// nothing.
Device local_device(const std::string& spec, const std::map<std::string, std::string>& env,
                    int device_count, const std::string& who = "local_device");
/// The same, of this process's environment and CUDA devices; a GPU it returns is made this
/// thread's current device (cuda::set_device), as torch.cuda.set_device(local_rank) in a torch
/// script, so that tensors and NCCL groups made afterwards land there. Without a usable GPU the
/// NotImplementedError says why (no driver, a build without CUDA, ...).
Device local_device(const std::string& spec = "auto", const std::string& who = "local_device");

/// A timeout in whole seconds, 1 to 604800, from the environment variable `name`
/// (EMBER_PG_TIMEOUT, EMBER_NCCL_INIT_TIMEOUT); nullopt when it is unset or empty. Throws
/// ValueError naming the variable when it is not such a number.
std::optional<Duration> timeout_from_env(const char* name);

/// The first host of a Slurm node list: "node[03-05,9],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace ember::dist
