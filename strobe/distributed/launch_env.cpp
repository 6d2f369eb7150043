#include "strobe/distributed/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>

#include "strobe/config/config.h"

namespace strobe::distributed {

namespace {

using config::ConfigError;

std::optional<int64_t> read_int(const GetEnv& get, const char* name, const std::string& launcher) {
  const char* v = get(name);
  if (!v) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (*v == '\0' || *end != '\0' || errno == ERANGE)
    throw ConfigError(fmt::format("{}={}: expected an integer ({} launch)", name, v, launcher));
  return static_cast<int64_t>(x);
}

int64_t slurm_port(const GetEnv& get) {
  const char* job = get("SLURM_JOB_ID");
  if (!job || !*job) return 29500;
  std::string id(job);
  for (char c : id)
    if (c < '0' || c > '9') throw ConfigError(fmt::format("SLURM_JOB_ID={}: expected digits", id));
  if (id.size() > 4) id = id.substr(id.size() - 4);
  return 15000 + std::stoll(id);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  if (nodelist.empty()) throw ConfigError("SLURM_NODELIST is empty");
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    if (nodelist[i] == '[') {
      size_t close = nodelist.find(']', i);
      if (close == std::string::npos) throw ConfigError(fmt::format("SLURM_NODELIST={}: unbalanced '['", nodelist));
      // The first value of the first range inside the brackets, zero padding kept ("[03-05]" -> "03").
      std::string inner = nodelist.substr(i + 1, close - i - 1);
      size_t stop = inner.find_first_of(",-");
      std::string first = inner.substr(0, stop);
      if (first.empty()) throw ConfigError(fmt::format("SLURM_NODELIST={}: empty range", nodelist));
      host += first;
      i = close + 1;
    } else {
      host += nodelist[i++];
    }
  }
  if (host.empty()) throw ConfigError(fmt::format("SLURM_NODELIST={}: no host", nodelist));
  return host;
}

LaunchEnv parse_launch_env(const GetEnv& get) {
  LaunchEnv env;
  const bool torch_style = get("RANK") && get("WORLD_SIZE");
  const bool slurm = !torch_style && get("SLURM_PROCID") && get("SLURM_NTASKS");
  if (!torch_style && !slurm) return env;

  if (torch_style) {
    env.launcher = (get("TORCHELASTIC_RUN_ID") || get("GROUP_RANK")) ? "torchrun" : "env";
    env.rank = *read_int(get, "RANK", env.launcher);
    env.world_size = *read_int(get, "WORLD_SIZE", env.launcher);
  } else {
    env.launcher = "slurm";
    env.rank = *read_int(get, "SLURM_PROCID", env.launcher);
    env.world_size = *read_int(get, "SLURM_NTASKS", env.launcher);
  }
  const char* rank_var = torch_style ? "RANK" : "SLURM_PROCID";
  const char* world_var = torch_style ? "WORLD_SIZE" : "SLURM_NTASKS";
  if (env.world_size < 1) throw ConfigError(fmt::format("{}={}: must be at least 1", world_var, env.world_size));
  if (env.rank < 0 || env.rank >= env.world_size)
    throw ConfigError(fmt::format("{}={}: must lie in [0, {}={})", rank_var, env.rank, world_var, env.world_size));
  if (env.world_size == 1) {
    env.rank = 0;
    env.launcher = "none";
    return env;
  }

  const char* local_var = torch_style ? "LOCAL_RANK" : "SLURM_LOCALID";
  auto local = read_int(get, local_var, env.launcher);
  if (!local)
    throw ConfigError(fmt::format("{} is not set: with {}={} every process needs its index on its node ({} sets it)",
                                  local_var, world_var, env.world_size, torch_style ? "torchrun" : "srun"));
  if (*local < 0) throw ConfigError(fmt::format("{}={}: must be >= 0", local_var, *local));
  env.local_rank = *local;

  if (const char* addr = get("MASTER_ADDR"); addr && *addr) {
    env.master_addr = addr;
  } else if (slurm) {
    const char* nodes = get("SLURM_JOB_NODELIST");
    if (!nodes || !*nodes) nodes = get("SLURM_NODELIST");
    if (!nodes) throw ConfigError("SLURM_NODELIST is not set and neither is MASTER_ADDR: no rendezvous host");
    env.master_addr = first_slurm_host(nodes);
  } else {
    throw ConfigError(fmt::format("MASTER_ADDR is not set: with WORLD_SIZE={} the rendezvous host is needed", env.world_size));
  }

  if (auto port = read_int(get, "MASTER_PORT", env.launcher)) {
    env.master_port = *port;
  } else if (slurm) {
    env.master_port = slurm_port(get);
  } else {
    throw ConfigError(fmt::format("MASTER_PORT is not set: with WORLD_SIZE={} the rendezvous port is needed", env.world_size));
  }
  if (env.master_port < 1 || env.master_port > 65535)
    throw ConfigError(fmt::format("MASTER_PORT={}: must lie in 1..65535", env.master_port));

  if (const char* agent = get("TORCHELASTIC_USE_AGENT_STORE")) env.agent_store = std::string(agent) == "True";
  return env;
}

LaunchEnv launch_env_from_process() {
  return parse_launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace strobe::distributed
