// The llama's fused path under data parallelism over NCCL on 2 GPUs, end to end as `strobe fit` runs
// it (build_run, Trainer::fit): every fused op (add + RMSNorm, rotary, SwiGLU, grouped K/V) and the
// fused LM head (strobe::linear_cross_entropy, whose gradients are made in the forward with each
// rank's 1 / count on its device) with a tied embedding. 2 ranks x 4 sequences end where one process
// with the 8 of them ends. Skips (with the reason) without 2 visible GPUs; the parent never touches
// CUDA (its forked children could not initialize it).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <map>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "runner/experiment_builder.h"
#include "runner/hang.h"
#include "tests/distributed/multiprocess.h"
#include "tests/test_dirs.h"

namespace strobe {
namespace llama_nccl {

namespace st = strobe::testing;

constexpr int kSkipCode = 77;

std::string yaml(const std::string& root, const std::string& precision) {
  return fmt::format(R"(name: ddp_llama
seed: 11
trainer:
  max_epochs: 2
  max_steps: 8
  accumulate_grad_batches: 2
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  device: auto
  precision: "{}"
  dist_timeout: 120
  default_root_dir: {}
model:
  name: llama
  vocab_size: 1000
  embed_dim: 128
  depth: 2
  num_heads: 4
  num_kv_heads: 2
  ffn_dim: 256
  max_seq_len: 64
  rope_theta: 500000
  tie_embeddings: true
  attention: sdpa
  fused_ops: true
data:
  name: synthetic_tokens
  vocab_size: 1000
  max_seq_len: 64
  fixed_length: true
  num_samples: 64
  num_val_samples: 16
  batch_size: 4
  collate: pad_to_max
  num_workers: 0
task:
  fused_linear_loss: true
optimizer:
  name: sgd
  lr: 0.5
  momentum: 0.9
scheduler:
  name: none
)",
                     precision, root);
}

// A rank that crashes prints where (its stderr comes back in the failure message), then dies of it.
void backtrace_on_crash() {
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE}) {
    std::signal(sig, [](int s) {
      void* frames[64];
      const int n = ::backtrace(frames, 64);
      ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
      std::signal(s, SIG_DFL);
      std::raise(s);
    });
  }
}

// One `strobe fit` per rank (world 1: the single-process reference, also in a child); each writes
// its parameters (on the CPU) and its metrics to dir.
std::vector<st::RankResult> fit(int world, const std::string& dir, const std::string& precision,
                                const std::vector<std::string>& sets) {
  auto body = [&](int rank) {
    // No OpenMP thread pool in a forked child (libgomp is not fork-safe): as the CPU ranks of TrainerDDP.
    torch::set_num_threads(1);
    if (torch::cuda::device_count() < 2) return kSkipCode;
    auto doc = config::Document::load_string(yaml(dir + "/root", precision), "ddp_llama.yaml");
    for (const auto& s : sets) doc.apply_override(s);
    auto run = build_run(doc, RunOptions{});
    auto& t = run->trainer->view();
    // trainer.strategy fsdp: a unit's parameters hold no data between steps (an empty tensor here).
    auto snapshot = [&] {
      std::vector<torch::Tensor> v;
      for (auto& p : run->module->net().parameters())
        v.push_back(p.storage().nbytes() == 0 ? torch::empty({0}) : p.detach().to(torch::kCPU, torch::kFloat).clone());
      return v;
    };
    const auto initial = snapshot();
    const int rc = run->trainer->fit();
    const auto params = snapshot();
    int64_t unmoved = 0, freed = 0;  // parameters that training left as they were; those fsdp holds sharded
    for (size_t i = 0; i < params.size(); ++i) {
      freed += params[i].numel() == 0;
      unmoved += params[i].numel() > 0 && torch::equal(params[i], initial[i]);
    }
    nlohmann::json out = {{"rc", rc},          {"global_step", t.state().global_step}, {"metrics", t.metrics()},
                          {"unmoved", unmoved}, {"freed", freed},                       {"run_dir", run->run_dir}};
    torch::save(params, fmt::format("{}/params{}.pt", dir, rank));
    std::ofstream(fmt::format("{}/rank{}.json", dir, rank)) << out.dump(1);
    return rc;
  };
  return st::run_ranks(world, body, dir, std::chrono::seconds(240), backtrace_on_crash);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, false);
}

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> v;
  torch::load(v, path);
  return v;
}

// Two bf16-master ranks of `strategy` over NCCL with `sets`, in base/strategy: rank 0's report, after
// checking both ended with exit 0 and the same validation loss. Null when fewer than 2 GPUs are
// visible (the caller skips); "error" set when a rank failed (its failure already recorded).
nlohmann::json two_ranks(const std::string& base, const std::string& strategy, std::vector<std::string> sets) {
  sets.push_back("trainer.strategy=" + strategy);
  const std::string dir = base + "/" + strategy;
  auto rs = fit(2, dir, "bf16-master", sets);
  for (auto& r : rs)
    if (r.exit_code == kSkipCode) return nullptr;
  for (auto& r : rs)
    if (r.exit_code != 0) {
      ADD_FAILURE() << strategy << "\n" << describe(rs);
      return {{"error", r.exit_code}};
    }
  auto j = read_json(dir + "/rank0.json");
  j["dir"] = dir;
  EXPECT_EQ(read_json(dir + "/rank1.json")["metrics"]["val/loss"], j["metrics"]["val/loss"]) << strategy;
  j["rank1"] = read_json(dir + "/rank1.json");
  return j;
}

}  // namespace llama_nccl

TEST(GpuDDP, LlamaFusedOpsAndFusedHeadOverNcclMatchOneProcessOnTheUnionBatch) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  namespace ln = llama_nccl;
  namespace st = strobe::testing;
  // "fp8": bf16-master with trainer.fp8 on every projection (each rank's own scales: near, not on,
  // one process).
  for (const std::string variant : {"bf16-master", "32", "fp8"}) {
    const bool fp8 = variant == "fp8";
    const std::string precision = fp8 ? "bf16-master" : variant;
    const std::vector<std::string> extra = fp8 ? std::vector<std::string>{"trainer.fp8={min_size: 0}"} : std::vector<std::string>{};
    const std::string base = st::empty_test_dir("strobe_gpu_ddp_llama_" + variant + "_" + std::to_string(::getpid())).string();
    const std::string two = base + "/two", one = base + "/one";
    auto rs = ln::fit(2, two, precision, extra);
    bool skip = false;
    for (auto& r : rs) skip |= r.exit_code == ln::kSkipCode;
    if (skip) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << precision << "\n" << describe(rs);
    auto one_sets = extra;
    one_sets.push_back("data.batch_size=8");
    auto r1 = ln::fit(1, one, precision, one_sets);
    ASSERT_EQ(r1[0].exit_code, 0) << precision << "\n" << describe(r1);
    auto j0 = ln::read_json(two + "/rank0.json"), j1 = ln::read_json(two + "/rank1.json"),
         js = ln::read_json(one + "/rank0.json");
    ASSERT_EQ(j0["global_step"], 8) << precision;
    ASSERT_EQ(js["global_step"], 8) << precision;
    auto p0 = ln::load_params(two + "/params0.pt"), p1 = ln::load_params(two + "/params1.pt"),
         ps = ln::load_params(one + "/params0.pt");
    ASSERT_EQ(p0.size(), ps.size());
    ASSERT_EQ(p0.size(), 1u + 2 * 9 + 1) << "embed_tokens, 9 per layer, norm: the tied head is the embedding";
    // Both ranks hold bitwise the same weights. fp32 (cuBLAS without TF32): the weights within the
    // reduction's rounding; SGD, unlike AdamW, is not invariant to the gradients' scale, so a rank
    // that averaged wrongly (its 1 / count, the world size) would show. bf16-master: a bf16 forward
    // over 4 sequences rounds unlike one over 8, so the model is compared through its validation loss.
    const bool fp32 = precision == "32";
    for (size_t i = 0; i < p0.size(); ++i) {
      EXPECT_TRUE(torch::equal(p0[i], p1[i])) << precision << " parameter " << i << " differs between ranks";
      EXPECT_TRUE(p0[i].isfinite().all().item<bool>()) << precision << " parameter " << i;
      if (!fp32) continue;
      const double worst = (p0[i] - ps[i]).abs().max().item<double>() / std::max(ps[i].abs().max().item<double>(), 1e-3);
      EXPECT_LT(worst, 1e-4) << precision << " parameter " << i;
    }
    const double val = j0["metrics"]["val/loss"].get<double>(), val1 = j1["metrics"]["val/loss"].get<double>(),
                 val_one = js["metrics"]["val/loss"].get<double>();
    std::cout << "[ llama ddp nccl ] " << variant << ": val/loss 2 ranks " << val << ", 1 process " << val_one << "\n";
    EXPECT_EQ(val, val1) << variant << ": the ranks' validation losses differ";
    EXPECT_NEAR(val, val_one, (fp32 ? 1e-5 : fp8 ? 1e-2 : 1e-3) * val_one) << variant;
    // Not a run that stood still: every parameter moved, on both sides.
    EXPECT_EQ(j0["unmoved"], 0) << precision;
    EXPECT_EQ(js["unmoved"], 0) << precision;
    checkpoint::remove_tree(base);
  }
#endif
}

// ZeRO-2 on the same llama over NCCL, with the fused AdamW updating bf16-master's fp32 shards from
// bf16 gradient shards and activation checkpointing: two zero2 ranks end where two ddp ranks end
// (validation loss to 1e-3, the weights through it), bitwise alike on both ranks.
TEST(GpuZero2, LlamaBf16MasterFusedAdamWWithActivationCheckpointingEndsWhereDdpEnds) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  namespace ln = llama_nccl;
  namespace st = strobe::testing;
  const std::string base = st::empty_test_dir("strobe_gpu_zero2_llama_" + std::to_string(::getpid())).string();
  const std::vector<std::string> common = {"optimizer={name: adamw, lr: 0.003, fused: true}",
                                           "model.activation_checkpointing=blocks"};
  std::map<std::string, nlohmann::json> j;
  for (const std::string strategy : {"ddp", "zero2"}) {
    j[strategy] = ln::two_ranks(base, strategy, common);
    if (j[strategy].is_null()) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
    ASSERT_FALSE(j[strategy].contains("error")) << strategy;
    const std::string dir = j[strategy]["dir"];
    auto p0 = ln::load_params(dir + "/params0.pt"), p1 = ln::load_params(dir + "/params1.pt");
    for (size_t i = 0; i < p0.size(); ++i) EXPECT_TRUE(torch::equal(p0[i], p1[i])) << strategy << " parameter " << i;
    EXPECT_EQ(j[strategy]["unmoved"], 0) << strategy;
  }
  const double vd = j["ddp"]["metrics"]["val/loss"].get<double>(), vz = j["zero2"]["metrics"]["val/loss"].get<double>();
  std::cout << "[ llama zero2 nccl ] val/loss ddp " << vd << ", zero2 " << vz << "\n";
  EXPECT_NEAR(vz, vd, 1e-3 * vd);
  checkpoint::remove_tree(base);
#endif
}

// trainer.strategy fsdp on the same llama over NCCL, untied (the embedding and the head units of
// their own, the fused linear cross-entropy in the head's unit), with bf16-master's fused AdamW and
// activation checkpointing: the units gather over NCCL with the prefetch on its stream, and two
// fsdp ranks end where two zero2 ranks end (validation loss and the checkpoint's fp32 weights, to
// 1e-4: the same gathered bf16 weights, each gradient element averaged over the same two ranks),
// both ranks alike, every unit's parameters holding no data between steps. The ema callback runs on
// both: fsdp's averages of its rows of the fp32 values (gathered whole over NCCL at the save) are
// within bf16 rounding of zero2's averages of its bf16 working weights.
TEST(GpuFsdp, LlamaUntiedBf16MasterWithActivationCheckpointingEndsWhereZero2Ends) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  namespace ln = llama_nccl;
  namespace st = strobe::testing;
  const std::string base = st::empty_test_dir("strobe_gpu_fsdp_llama_" + std::to_string(::getpid())).string();
  const std::vector<std::string> common = {"optimizer={name: adamw, lr: 0.003, fused: true}", "model.tie_embeddings=false",
                                           "model.activation_checkpointing=blocks",
                                           "callbacks=[{name: ema, decay: 0.9, validate: false}]"};
  std::map<std::string, nlohmann::json> j;
  std::map<std::string, std::map<std::string, torch::Tensor>> w, ema;
  for (const std::string strategy : {"zero2", "fsdp"}) {
    j[strategy] = ln::two_ranks(base, strategy, common);
    if (j[strategy].is_null()) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
    ASSERT_FALSE(j[strategy].contains("error")) << strategy;
    EXPECT_EQ(j[strategy]["global_step"], 8) << strategy;
    // 2 layers x 9 parameters, the embedding and the head; the final norm stays gathered.
    EXPECT_EQ(j[strategy]["freed"], strategy == "fsdp" ? 20 : 0) << strategy;
    EXPECT_EQ(j[strategy]["rank1"]["freed"], j[strategy]["freed"]) << strategy;
    for (auto& [k, t] : checkpoint::load_checkpoint_file(j[strategy]["run_dir"].get<std::string>() + "/checkpoints/last.ckpt").tensors)
      if (k.rfind("model/", 0) == 0) w[strategy][k] = t;
      else if (k.rfind("ema/", 0) == 0) ema[strategy][k] = t;
  }
  ASSERT_EQ(ema["fsdp"].size(), 21u);
  ASSERT_EQ(ema["zero2"].size(), 21u);
  for (auto& [k, t] : ema["fsdp"]) {
    const auto& z = ema["zero2"].at(k);
    ASSERT_TRUE(t.isfinite().all().item<bool>()) << k;
    EXPECT_LT((t - z).abs().max().item<double>() / std::max(z.abs().max().item<double>(), 1e-3), 1e-2) << k;
    EXPECT_FALSE(torch::equal(t, w["fsdp"].at("model/" + k.substr(4)))) << k << ": the average is the weight";
  }
  const double vz = j["zero2"]["metrics"]["val/loss"].get<double>(), vf = j["fsdp"]["metrics"]["val/loss"].get<double>();
  std::cout << "[ llama fsdp nccl ] val/loss zero2 " << vz << ", fsdp " << vf << "\n";
  EXPECT_NEAR(vf, vz, 1e-4 * vz);
  ASSERT_EQ(w["fsdp"].size(), w["zero2"].size());
  for (auto& [k, t] : w["fsdp"]) {
    const auto& z = w["zero2"].at(k);
    const double scale = std::max(z.abs().max().item<double>(), 1e-3);
    EXPECT_LT((t - z).abs().max().item<double>() / scale, 1e-4) << k;
  }
  checkpoint::remove_tree(base);
#endif
}

// A rank that leaves out its third stop agreement over NCCL (STROBE_SKIP_COLLECTIVE, the record's
// test hook): NCCL pairs collectives by order, so the ranks hang (or fail); every rank ends within
// trainer.dist_timeout (30 s) with one line, rank 0's naming rank 1; both
// files in the run directory carry NCCL's flight recorder beside Strobe's record, and strobe hang's
// report holds both.
TEST(GpuDDP, ASkippedStopAgreementOverNcclIsNamedWithNcclsRecordInTheFiles) {
#ifndef STROBE_TORCH_HAS_CUDA
  GTEST_SKIP() << "built without STROBE_TORCH_HAS_CUDA (a libtorch without CUDA)";
#else
  namespace ln = llama_nccl;
  namespace st = strobe::testing;
  const std::string dir = st::empty_test_dir("strobe_gpu_ddp_skip_" + std::to_string(::getpid())).string();
  ::setenv("STROBE_SKIP_COLLECTIVE", "stop agreement@1#3", 1);
  auto rs = ln::fit(2, dir, "32", {"trainer.max_steps=1000", "trainer.max_epochs=-1", "trainer.dist_timeout=30"});
  ::unsetenv("STROBE_SKIP_COLLECTIVE");
  bool skip = false;
  for (auto& r : rs) skip |= r.exit_code == ln::kSkipCode;
  if (skip) GTEST_SKIP() << "fewer than 2 CUDA devices visible";
  for (auto& r : rs) {
    EXPECT_EQ(r.exit_code, 1) << describe(rs);
    EXPECT_LT(r.seconds, 30.0 + 5.0) << describe(rs);
    EXPECT_EQ(st::count_lines_with(r.stderr_text, "strobe: rank "), 1) << r.stderr_text;
  }
  // Where NCCL lets each rank's host run ahead of its GPU, the numbers may stand apart: the line
  // names rank 1 either as the rank that issued another kind or as one that stood behind.
  EXPECT_EQ(st::count_lines_with(rs[0].stderr_text, "strobe: rank 0 of 2: distributed job "), 1) << rs[0].stderr_text;
  EXPECT_NE(rs[0].stderr_text.find("rank 1 "), std::string::npos) << rs[0].stderr_text;
  const std::string run_dir = dir + "/root/ddp_llama/version_0";
  for (int r = 0; r < 2; ++r) {
    auto j = ln::read_json(fmt::format("{}/collectives_rank{}.json", run_dir, r));
    ASSERT_TRUE(j.is_object()) << "rank " << r;
    ASSERT_TRUE(j.contains("nccl")) << "rank " << r;
    EXPECT_FALSE(j["nccl"]["entries"].empty()) << "rank " << r << ": NCCL's flight recorder holds the run's collectives";
  }
  const std::string report = explain_hang(run_dir);
  EXPECT_NE(report.find("diverged first: rank 1"), std::string::npos) << report;
  EXPECT_NE(report.find("NCCL's record"), std::string::npos) << report;
  std::cout << report;
  checkpoint::remove_tree(dir);
#endif
}

}  // namespace strobe
