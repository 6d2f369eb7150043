// LaunchEnv: who this process is in a multi-process job, read from the launcher's environment.
//
// Contract:
// - torchrun (and any launcher following PyTorch's env:// convention) sets RANK, WORLD_SIZE,
//   LOCAL_RANK, MASTER_ADDR, MASTER_PORT; these win whenever RANK and WORLD_SIZE are both set.
// - Otherwise Slurm's srun: SLURM_PROCID (rank), SLURM_NTASKS (world size), SLURM_LOCALID (local
//   rank); the rendezvous host is MASTER_ADDR if set, else the first host of SLURM_JOB_NODELIST /
//   SLURM_NODELIST; the port is MASTER_PORT if set, else 15000 + the last four digits of
//   SLURM_JOB_ID (the convention Lightning uses, so every task of a job derives the same port).
// - Neither: a single process (rank 0 of 1).
// - A malformed value (not an integer, rank outside [0, world), missing MASTER_ADDR or LOCAL_RANK
//   when world > 1, port outside 1..65535) throws config::ConfigError naming the variable: bad
//   usage, exit 2, before any socket is opened.
// - torchrun's agent hosts the TCPStore itself when TORCHELASTIC_USE_AGENT_STORE=True; then every
//   rank (rank 0 included) connects as a client, as torch.distributed does.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace strobe::distributed {

struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr;  // empty when world_size == 1
  int64_t master_port = 0;
  bool agent_store = false;     // torchrun's agent hosts the store (all ranks are clients)
  std::string launcher = "none";  // none | torchrun | env | slurm (for messages)
};

// Reads the variables through `get` (returns nullptr for an unset variable); tests pass a map.
using GetEnv = std::function<const char*(const char*)>;
LaunchEnv parse_launch_env(const GetEnv& get);
LaunchEnv launch_env_from_process();  // parse_launch_env over std::getenv

// The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03", "a-[1-2]-ib" -> "a-1-ib".
// Throws config::ConfigError on an unbalanced or empty list.
std::string first_slurm_host(const std::string& nodelist);

}  // namespace strobe::distributed
