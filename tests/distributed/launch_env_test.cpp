// The launch environment: torchrun's and Slurm's variables, precedence, and one clear error for
// each malformed value (ConfigError = exit 2 in the CLI).
#include "strobe/distributed/launch_env.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "strobe/config/config.h"

namespace sd = strobe::distributed;

namespace {

sd::LaunchEnv parse(const std::map<std::string, std::string>& vars) {
  return sd::parse_launch_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    parse(vars);
  } catch (const strobe::config::ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  auto env = parse({});
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.launcher, "none");
}

TEST(LaunchEnv, TorchrunVariables) {
  auto env = parse({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.7"},
                    {"MASTER_PORT", "29511"}, {"TORCHELASTIC_RUN_ID", "abc"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.7");
  EXPECT_EQ(env.master_port, 29511);
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.launcher, "torchrun");
}

TEST(LaunchEnv, PlainEnvLaunchHostsTheStoreOnRankZero) {
  auto env = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_FALSE(env.agent_store);
  EXPECT_EQ(env.launcher, "env");
}

TEST(LaunchEnv, SlurmVariablesWithHostFromNodelistAndPortFromJobId) {
  auto env = parse({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                    {"SLURM_JOB_NODELIST", "gpu[07-08,11],cpu01"}, {"SLURM_JOB_ID", "4312345"}});
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "gpu07");
  EXPECT_EQ(env.master_port, 15000 + 2345);
  EXPECT_EQ(env.launcher, "slurm");
}

TEST(LaunchEnv, SlurmHonoursMasterAddrAndPort) {
  auto env = parse({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODELIST", "n[1-2]"},
                    {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(env.master_addr, "head");
  EXPECT_EQ(env.master_port, 4000);
}

TEST(LaunchEnv, TorchrunInsideSlurmWins) {
  auto env = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                    {"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}, {"GROUP_RANK", "0"}});
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.launcher, "torchrun");
}

TEST(LaunchEnv, SingleSlurmTaskIsOneProcess) {
  auto env = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.launcher, "none");
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(sd::first_slurm_host("node01"), "node01");
  EXPECT_EQ(sd::first_slurm_host("a,b,c"), "a");
  EXPECT_EQ(sd::first_slurm_host("gpu[003-010]"), "gpu003");
  EXPECT_EQ(sd::first_slurm_host("rack[2,4]-node[01-04],x"), "rack2-node01");
  EXPECT_EQ(sd::first_slurm_host("a-[1-2]-ib"), "a-1-ib");
  EXPECT_THROW(sd::first_slurm_host("gpu[1-2"), strobe::config::ConfigError);
  EXPECT_THROW(sd::first_slurm_host(""), strobe::config::ConfigError);
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  const std::map<std::string, std::string> ok{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
                                              {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  auto with = [&](const std::string& k, const std::string& v) {
    auto m = ok;
    m[k] = v;
    return m;
  };
  auto without = [&](const std::string& k) {
    auto m = ok;
    m.erase(k);
    return m;
  };
  EXPECT_NE(error_of(with("RANK", "one")).find("RANK=one: expected an integer"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "2")).find("RANK=2: must lie in [0, WORLD_SIZE=2)"), std::string::npos);
  EXPECT_NE(error_of(with("WORLD_SIZE", "0")).find("WORLD_SIZE=0"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_PORT", "70000")).find("MASTER_PORT=70000"), std::string::npos);
  EXPECT_NE(error_of(with("LOCAL_RANK", "-1")).find("LOCAL_RANK=-1"), std::string::npos);
  EXPECT_NE(error_of(without("MASTER_ADDR")).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of(without("MASTER_PORT")).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of(without("LOCAL_RANK")).find("LOCAL_RANK is not set"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}).find("SLURM_PROCID=x"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}).find("SLURM_NODELIST is not set"),
            std::string::npos);
}
