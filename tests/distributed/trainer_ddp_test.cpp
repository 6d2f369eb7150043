// The Trainer data-parallel end to end on CPU: every test forks real ranks on 127.0.0.1 (torchrun's
// variables), each building its run exactly as `strobe fit` does (build_run, Trainer::fit) with the
// labelled store-backed test double as the c10d CPU backend (store_backend.h). Single-process
// references run in a forked process too (WORLD_SIZE=1), so the test process itself never starts
// torch's thread pools before a fork.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/config/config.h"
#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/capture.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/model.h"
#include "runner/experiment_builder.h"
#include "runner/replay.h"
#include "tests/cli/cli_test_util.h"
#include "tests/distributed/multiprocess.h"
#include "tests/distributed/store_backend.h"
#include "tests/distributed/write_watch.h"
#include "tests/test_dirs.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;
namespace st = strobe::testing;
using st::count_lines_with;
using st::describe;

// An MLP with test faults on one rank, at the n-th training forward of that process:
// nan (the output becomes NaN, so the loss), kill (SIGKILL), term (SIGTERM), throw (an exception). With rng_extra each
// training forward draws rank + 1 extra numbers from the CPU generator, so the ranks' generator
// states differ (as they do in real runs with per-rank augmentation): a resume that restored
// another rank's RNG would change the dropout masks.
constexpr const char* kNcclRemoteError =
    "NCCL error in: ProcessGroupNCCL.cpp:3780, remote process exited or there was a network error, NCCL version 2.28.9";

class DdpProbe : public Model {
 public:
  DdpProbe(int64_t in, int64_t hidden, int64_t classes, double dropout, std::string fault, int64_t fault_rank,
           int64_t fault_call, bool rng_extra, int64_t pace_ms)
      : Model("DdpProbe"),
        fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        drop(register_module("drop", torch::nn::Dropout(dropout))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, classes))),
        fault_(std::move(fault)),
        fault_rank_(fault_rank),
        fault_call_(fault_call),
        rng_extra_(rng_extra),
        pace_ms_(pace_ms) {
    const char* r = std::getenv("RANK");
    rank_ = r ? std::atoll(r) : 0;
  }
  torch::Tensor forward(const Batch& batch) override {
    auto x = input(batch.at("image")).flatten(1);  // bf16-master: bf16 images
    bool poison = false, spike = false;
    if (is_training()) {
      ++calls_;
      if (rank_ == fault_rank_ && calls_ == fault_call_) {
        if (fault_ == "kill") std::raise(SIGKILL);
        if (fault_ == "term") std::raise(SIGTERM);
        if (fault_ == "throw") throw std::runtime_error(fmt::format("probe failure on rank {} at call {}", rank_, calls_));
        if (fault_ == "collective_error") C10_THROW_ERROR(DistBackendError, kNcclRemoteError);
        // lost_peer: the fault rank dies; the others' next collective fails as NCCL's does over a
        // network when the peer's socket closes (in well under a heartbeat).
        if (fault_ == "lost_peer") std::raise(SIGKILL);
        poison = fault_ == "nan";
        spike = fault_ == "spike";
      }
      if (rank_ != fault_rank_ && calls_ == fault_call_ && fault_ == "lost_peer") {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        C10_THROW_ERROR(DistBackendError, kNcclRemoteError);
      }
      if (rng_extra_) (void)torch::rand({rank_ + 1});
      // pace_ms: the fault rank's training forwards take this long (a slower rank).
      if (pace_ms_ > 0 && rank_ == fault_rank_) std::this_thread::sleep_for(std::chrono::milliseconds(pace_ms_));
    }
    // fc1 runs as a model's block runs (under trainer.strategy fsdp it is a unit, gathered around it).
    auto h = run_model_block(ActivationCheckpointing{}, 0, *fc1, {x}, [l = fc1](const std::vector<torch::Tensor>& t) mutable {
      return std::vector<torch::Tensor>{l->forward(t[0])};
    }, /*preserve_rng=*/false)[0];
    auto y = fc2->forward(drop->forward(torch::relu(h)));
    if (spike) return y * 1000;  // a finite loss spike
    return poison ? y + std::numeric_limits<float>::quiet_NaN() : y;
  }
  std::string default_task() const override { return "classification"; }
  std::vector<std::string> fsdp_units() const override { return {"fc1"}; }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;

 private:
  std::string fault_;
  int64_t fault_rank_, fault_call_;
  bool rng_extra_;
  int64_t pace_ms_;
  int64_t rank_ = 0, calls_ = 0;
};

std::shared_ptr<Model> make_ddp_probe(config::Section& cfg) {
  auto in = cfg.get_int("in_features", 64, 1);
  auto hidden = cfg.get_int("hidden", 32, 1);
  auto classes = cfg.get_int("num_classes", 4, 1);
  auto dropout = cfg.get_double("dropout", 0.0, 0.0, 0.99);
  auto fault = cfg.get_choice("fault", "none", {"none", "nan", "spike", "kill", "term", "throw", "collective_error", "lost_peer"});
  auto fault_rank = cfg.get_int("fault_rank", 1, 0);
  auto fault_call = cfg.get_int("fault_call", 1, 1);
  auto rng_extra = cfg.get_bool("rng_extra", false);
  auto pace_ms = cfg.get_int("pace_ms", 0, 0);
  cfg.finish();
  return std::make_shared<DdpProbe>(in, hidden, classes, dropout, fault, fault_rank, fault_call, rng_extra, pace_ms);
}
STROBE_REGISTER(model_registry(), "ddp_probe", make_ddp_probe);

// 64 samples: 2 ranks x batch 4 (or 1 process x batch 8) = 8 batches per epoch, 4 optimizer steps
// with 2 accumulation micro-batches; validation on 16 samples at every epoch end.
std::string yaml(const std::string& root) {
  return fmt::format(R"(name: ddp
seed: 5
trainer:
  max_epochs: 3
  max_steps: 6
  accumulate_grad_batches: 2
  gradient_clip_val: 0.05
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: true
  device: cpu
  dist_timeout: 30
  default_root_dir: {}
model:
  name: ddp_probe
  in_features: 64
  hidden: 32
  num_classes: 4
data:
  name: synthetic_images
  image_size: 8
  channels: 1
  num_classes: 4
  num_samples: 64
  num_val_samples: 16
  noise: 4.0
  batch_size: 4
  num_workers: 0
optimizer:
  name: adamw
  lr: 0.01
scheduler:
  name: none
)",
                     root);
}

struct Job {
  std::string dir;   // per-job files: rank<r>.stderr/.stdout/.json, params<r>.pt
  std::string root;  // trainer.default_root_dir (the only place run files may go)
};

Job new_job(const std::string& name) {
  Job j;
  j.dir = strobe::testing::empty_test_dir(fmt::format("strobe_ddp_trainer_{}_{}", name, ::getpid())).string();
  j.root = j.dir + "/root";
  return j;
}

// What a rank reports after fit (or after a refused resume).
nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json();
  return nlohmann::json::parse(in, nullptr, false);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `world` ranks of `strobe fit` (one process each), the config = yaml(root) + `sets`.
std::vector<st::RankResult> fit(int world, const Job& job, const std::vector<std::string>& sets,
                                std::optional<std::string> ckpt = std::nullopt, int deadline_s = 120) {
  const std::string dir = job.dir, root = job.root;
  auto body = [&](int rank) {
    torch::set_num_threads(1);
    st::watch_writes_under(root + "/");
    nlohmann::json out = {{"rank", rank}};
    int rc = 1;
    try {
      auto doc = config::Document::load_string(yaml(root), "ddp.yaml");
      for (const auto& s : sets) doc.apply_override(s);
      RunOptions opt;
      opt.ckpt = ckpt;
      auto run = build_run(doc, opt);
      rc = run->trainer->fit(std::move(run->checkpoint));
      auto& t = run->trainer->view();
      out["global_step"] = t.state().global_step;
      out["val_runs"] = t.state().val_runs;
      out["run_dir"] = run->run_dir;
      out["metrics"] = t.metrics();
      int64_t optimizer_numel = 0;  // what this rank's optimizer updates (zero2: its shards)
      if (auto* o = t.optimizer())
        for (auto& g : o->param_groups())
          for (auto& p : g.params()) optimizer_numel += p.numel();
      out["optimizer_numel"] = optimizer_numel;
      std::vector<torch::Tensor> params;
      int64_t freed = 0;  // fsdp: the parameters of the blocks' units hold no data between steps
      for (auto& p : run->module->net().parameters()) {
        const bool held = p.storage().nbytes() > 0;
        freed += !held;
        params.push_back(held ? p.detach().clone() : torch::empty({0}));
      }
      out["freed_params"] = freed;
      torch::save(params, fmt::format("{}/params{}.pt", dir, rank));
    } catch (const checkpoint::CheckpointError& e) {
      std::fprintf(stderr, "checkpoint error: %s\n", e.what());
      rc = 2;
    }
    out["rc"] = rc;
    out["writes"] = st::watched_writes();
    std::ofstream(fmt::format("{}/rank{}.json", dir, rank)) << out.dump(1);
    return rc;
  };
  auto setup = [dir] {
    st::install_store_backend();
    const char* r = std::getenv("RANK");
    if (!std::freopen(fmt::format("{}/rank{}.stdout", dir, r ? r : "0").c_str(), "w", stdout)) std::_Exit(98);
  };
  return st::run_ranks(world, body, dir, std::chrono::seconds(deadline_s), setup);
}

// Resumes `ckpt` on 2 ranks (in a folder of its own under job.dir) and expects every rank to refuse
// it: exit 2, one line holding `expect`.
void expect_refused_resume(const Job& job, const std::string& name, const std::vector<std::string>& sets,
                           const std::string& ckpt, const std::string& expect) {
  Job again = job;
  again.dir = job.dir + "/" + name;
  fs::create_directories(again.dir);
  auto rs = fit(2, again, sets, ckpt);
  for (auto& r : rs) {
    EXPECT_EQ(r.exit_code, 2) << name << "\n" << describe(rs);
    EXPECT_EQ(count_lines_with(r.stderr_text, expect), 1) << name << "\n" << r.stderr_text;
  }
}

std::vector<std::string> joined(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> v;
  torch::load(v, path);
  return v;
}

std::map<std::string, torch::Tensor> model_tensors(const std::string& ckpt) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [k, v] : checkpoint::load_checkpoint_file(ckpt).tensors)
    if (k.rfind("model/", 0) == 0) out[k] = v;
  return out;
}

double max_abs_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  double m = 0;
  for (auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end()) return std::numeric_limits<double>::infinity();
    m = std::max(m, (v - it->second).abs().max().item<double>());
  }
  return m;
}

// After 6 optimizer steps (2 micro-batches each, clipped) over an epoch boundary, 2 ranks with batch 4
// hold the parameters of one process with batch 8 (the union); validation means and the macro F1 of
// the synced metric collection equal the single process's on both ranks; rank 0 alone picked the
// run directory and wrote run files and console output.
TEST(TrainerDDP, TwoRanksEqualOneProcessOnTheUnionBatchAndOnlyRankZeroWrites) {
  Job two = new_job("equiv2"), one = new_job("equiv1");
  auto rs = fit(2, two, {});
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  auto r1 = fit(1, one, {"data.batch_size=8"});
  ASSERT_EQ(r1[0].exit_code, 0) << describe(r1);

  auto j0 = read_json(two.dir + "/rank0.json"), j1 = read_json(two.dir + "/rank1.json"), js = read_json(one.dir + "/rank0.json");
  ASSERT_EQ(j0["global_step"], 6);
  ASSERT_EQ(j1["global_step"], 6);
  const std::string run_dir = j0["run_dir"];
  EXPECT_EQ(j1["run_dir"], run_dir) << "every rank uses rank 0's run directory";
  EXPECT_EQ(fs::path(run_dir).filename(), "version_0");
  EXPECT_EQ(std::distance(fs::directory_iterator(two.root + "/ddp"), fs::directory_iterator{}), 1) << "one version directory";

  // Parameters: rank 1 == rank 0 exactly; both == the single process on the union batch.
  auto p0 = load_params(two.dir + "/params0.pt"), p1 = load_params(two.dir + "/params1.pt"),
       ps = load_params(one.dir + "/params0.pt");
  ASSERT_EQ(p0.size(), ps.size());
  for (size_t i = 0; i < p0.size(); ++i) {
    EXPECT_TRUE(torch::equal(p0[i], p1[i])) << "parameter " << i << " differs between ranks";
    EXPECT_TRUE(torch::allclose(p0[i], ps[i], 1e-4, 1e-5))
        << "parameter " << i << ": max |ddp - single| = " << (p0[i] - ps[i]).abs().max().item<double>();
  }
  // The checkpoint rank 0 wrote holds the same weights as the single process's.
  EXPECT_LT(max_abs_diff(model_tensors(run_dir + "/checkpoints/last.ckpt"), model_tensors(js["run_dir"].get<std::string>() + "/checkpoints/last.ckpt")), 1e-4);

  // Validation means (loss: batch-weighted; acc and macro F1 from the synced collection).
  for (const char* key : {"val/loss", "val/acc", "val/f1"}) {
    ASSERT_TRUE(j0["metrics"].contains(key)) << key << " in " << j0["metrics"].dump();
    const double a = j0["metrics"][key], b = j1["metrics"][key], s = js["metrics"][key];
    EXPECT_EQ(a, b) << key << " differs between ranks";
    EXPECT_NEAR(a, s, 1e-5) << key << " differs from the single process";
  }

  // Rank 0 wrote the run files; rank 1 opened nothing for writing under the root, printed nothing.
  EXPECT_FALSE(j0["writes"].empty());
  bool wrote_csv = false, wrote_ckpt = false, wrote_config = false;
  for (const auto& w : j0["writes"]) {
    const std::string p = w;
    wrote_csv |= p.find("metrics.csv") != std::string::npos;
    wrote_ckpt |= p.find("last.ckpt") != std::string::npos;
    wrote_config |= p.find("config.yaml") != std::string::npos;
  }
  EXPECT_TRUE(wrote_csv && wrote_ckpt && wrote_config) << j0["writes"].dump();
  EXPECT_TRUE(j1["writes"].empty()) << "rank 1 wrote: " << j1["writes"].dump();
  EXPECT_NE(slurp(two.dir + "/rank0.stdout").find("validation at epoch 0"), std::string::npos);
  EXPECT_EQ(slurp(two.dir + "/rank1.stdout"), "");
  // metrics.csv has each step once, with rank 0's and the synced values.
  const std::string csv = slurp(run_dir + "/metrics.csv");
  int rows6 = 0;
  std::istringstream lines(csv);
  for (std::string line; std::getline(lines, line);) rows6 += line.rfind("6,", 0) == 0;
  EXPECT_EQ(rows6, 1) << csv;
  checkpoint::remove_tree(two.dir);
  checkpoint::remove_tree(one.dir);
}

// optimizer.param_groups.freeze under data parallelism: fc1 frozen through epoch 0 (the reducer is
// built without it), unfrozen at epoch 1 (step 5: the reducer rebuilt with it on every rank): both
// ranks hold bitwise the same weights, those of one process on the union batch; fc1 trained only
// from the unfreeze.
// Under zero2 the same: the frozen parameters' shards get no gradient (so no update, not even
// weight decay) and the unfreeze hooks them.
TEST(TrainerDDP, AnUnfreezeRebuildsTheReducerAndMatchesOneProcessOnTheUnionBatch) {
  const std::string freeze = "optimizer.param_groups={freeze: ['fc1.*'], unfreeze_at_epoch: 1, unfreeze_lr_scale: 0.5}";
  Job one = new_job("unfreeze1");
  auto r1 = fit(1, one, {freeze, "data.batch_size=8", "optimizer.weight_decay=0.1"});
  ASSERT_EQ(r1[0].exit_code, 0) << describe(r1);
  auto ps = load_params(one.dir + "/params0.pt");
  for (const std::string strategy : {"ddp", "zero2"}) {
    Job two = new_job("unfreeze2-" + strategy);
    auto rs = fit(2, two, {freeze, "trainer.strategy=" + strategy, "optimizer.weight_decay=0.1"});
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << strategy << "\n" << describe(rs);
    EXPECT_NE(slurp(two.dir + "/rank0.stdout").find("strobe fit: epoch 1: unfroze 2 parameter tensors"), std::string::npos)
        << slurp(two.dir + "/rank0.stdout");
    auto p0 = load_params(two.dir + "/params0.pt"), p1 = load_params(two.dir + "/params1.pt");
    ASSERT_EQ(p0.size(), ps.size());
    for (size_t i = 0; i < p0.size(); ++i) {
      EXPECT_TRUE(torch::equal(p0[i], p1[i])) << strategy << " parameter " << i << " differs between ranks";
      EXPECT_TRUE(torch::allclose(p0[i], ps[i], 1e-4, 1e-5)) << strategy << " parameter " << i;
    }
    checkpoint::remove_tree(two.dir);
  }
  checkpoint::remove_tree(one.dir);
}

// Reduced precisions keep data parallelism exact up to their rounding: under bf16-mixed (autocast)
// and bf16-master (bf16 weights whose bf16 gradients the Reducer averages, fp32 masters updated
// from them) 2 ranks x batch 4 end where one process with batch 8 ends; both ranks bitwise alike.
TEST(TrainerDDP, ReducedPrecisionsMatchOneProcessOnTheUnionBatch) {
  for (const char* precision : {"bf16-mixed", "bf16-master"}) {
    const std::string set = std::string("trainer.precision=") + precision;
    Job two = new_job(std::string("prec2-") + precision), one = new_job(std::string("prec1-") + precision);
    auto rs = fit(2, two, {set});
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << precision << "\n" << describe(rs);
    auto r1 = fit(1, one, {set, "data.batch_size=8"});
    ASSERT_EQ(r1[0].exit_code, 0) << precision << "\n" << describe(r1);
    auto j0 = read_json(two.dir + "/rank0.json"), js = read_json(one.dir + "/rank0.json");
    auto p0 = load_params(two.dir + "/params0.pt"), p1 = load_params(two.dir + "/params1.pt");
    for (size_t i = 0; i < p0.size(); ++i) EXPECT_TRUE(torch::equal(p0[i], p1[i])) << precision << " parameter " << i;
    // The checkpoints hold fp32 weights (bf16-master: the masters); compare relative to their size.
    auto a = model_tensors(j0["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    auto b = model_tensors(js["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    ASSERT_EQ(a.size(), b.size());
    for (auto& [k, v] : a) {
      ASSERT_EQ(v.scalar_type(), torch::kFloat32) << k;
      const double scale = std::max(b.at(k).abs().max().item<double>(), 1e-3);
      EXPECT_LT((v - b.at(k)).abs().max().item<double>() / scale, 2e-2) << precision << " " << k;
    }
    checkpoint::remove_tree(two.dir);
    checkpoint::remove_tree(one.dir);
  }
}

// The llama LM (GQA, tied embeddings) under data parallelism: 2 ranks x 4 full-length sequences end
// where one process with the 8 of them ends, in fp32, bf16-master and fp32 with the fused LM head
// (task.fused_linear_loss), and the tied head is one parameter (the embedding's) on every rank; the
// optimizer in 6 parameter groups (no_decay and layer_decay: 3 layers, each with its own lr).
// A 2-layer llama with a tied head on tokens, clipped, with parameter groups.
std::vector<std::string> llama_sets() {
  return {"model={name: llama, vocab_size: 97, embed_dim: 32, depth: 2, num_heads: 4, num_kv_heads: 2, ffn_dim: 48, "
          "max_seq_len: 24, rope_theta: 500000, tie_embeddings: true, attention: math}",
          "data={name: synthetic_tokens, vocab_size: 97, max_seq_len: 24, fixed_length: true, num_samples: 64, "
          "num_val_samples: 16, batch_size: 4, collate: pad_to_max, num_workers: 0}",
          "trainer.gradient_clip_val=1.0", "optimizer.param_groups={no_decay: auto, layer_decay: 0.7}"};
}

TEST(TrainerDDP, LlamaWithATiedHeadMatchesOneProcessOnTheUnionBatch) {
  const std::vector<std::string> llama = llama_sets();
  // The fused head (strobe::linear_cross_entropy: its gradients made in the forward, each rank's
  // 1 / count on its device) reduces like the logits path.
  // zero2 (with activation checkpointing) too: the sharded optimizer over 6 groups, the tied head's
  // one gradient reduce-scattered once.
  // trainer.fp8 (every projection in float8) under ddp and zero2: each rank scales its own half of
  // the batch, so two ranks end near, not on, one process.
  struct Variant {
    std::string precision;
    bool fused_head;
    std::string strategy = "ddp";
    bool fp8 = false;
  };
  for (const Variant& v : {Variant{"32", false}, Variant{"bf16-master", false}, Variant{"32", true},
                           Variant{"32", false, "zero2"}, Variant{"bf16-master", true, "zero2"},
                           Variant{"bf16-master", false, "ddp", true}, Variant{"bf16-master", false, "zero2", true}}) {
    const std::string& precision = v.precision;
    const std::string variant = precision + (v.fused_head ? "-fused-head" : "") + (v.fp8 ? "-fp8" : "") + "-" + v.strategy;
    auto sets = llama;
    sets.push_back("trainer.precision=" + precision);
    if (v.fp8) sets.push_back("trainer.fp8={min_size: 0}");
    if (v.fused_head) sets.push_back("task.fused_linear_loss=true");
    if (v.fp8) sets.push_back("trainer.fp8={min_size: 0}");
    if (v.strategy == "zero2") sets.push_back("model.activation_checkpointing=blocks");
    sets.push_back("trainer.strategy=" + v.strategy);
    Job two = new_job("llama2-" + variant), one = new_job("llama1-" + variant);
    auto rs = fit(2, two, sets);
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << variant << "\n" << describe(rs);
    sets.push_back("data.batch_size=8");
    sets.push_back("trainer.strategy=ddp");  // one process: the same either way
    auto r1 = fit(1, one, sets);
    ASSERT_EQ(r1[0].exit_code, 0) << variant << "\n" << describe(r1);
    auto j0 = read_json(two.dir + "/rank0.json"), js = read_json(one.dir + "/rank0.json");
    ASSERT_EQ(j0["global_step"], 6) << variant;
    const std::string groups = slurp(j0["run_dir"].get<std::string>() + "/param_groups.txt");
    EXPECT_NE(groups.find("[default/layer_0]\nembed_tokens.weight\n\n"), std::string::npos) << groups;
    EXPECT_NE(groups.find("[default/layer_2/no_decay]\nlayers.1.input_layernorm.weight\nlayers.1.post_attention_layernorm.weight\nnorm.weight\n"),
              std::string::npos)
        << groups;
    auto p0 = load_params(two.dir + "/params0.pt"), p1 = load_params(two.dir + "/params1.pt"),
         ps = load_params(one.dir + "/params0.pt");
    ASSERT_EQ(p0.size(), ps.size());
    ASSERT_EQ(p0.size(), 1u + 2 * 9 + 1) << "embed_tokens, 9 per layer, norm: no lm_head";
    // fp32: the weights within the reduction's rounding, which AdamW's normalisation lifts on
    // near-zero gradients (1e-4 of the largest weight, as above; 2e-4 with the fused head, whose
    // chunked d weight sums in another order: the logits path's most sensitive weight, a norm's, is
    // already at 7e-5). bf16-master: a bf16 forward over 4
    // sequences rounds unlike one over 8, and a near-zero gradient's sign then decides a whole lr
    // step of a weight, so the weights are compared through the model they make: the validation
    // loss (on the same 16 sequences) to 0.1%; both ranks hold bitwise the same weights. fp8: each
    // rank's tensorwise scales are its own half-batch's, so to 1%.
    const bool fp32 = precision == "32";
    for (size_t i = 0; i < p0.size(); ++i) {
      EXPECT_TRUE(torch::equal(p0[i], p1[i])) << variant << " parameter " << i << " differs between ranks";
      if (!fp32) continue;
      const double worst = (p0[i] - ps[i]).abs().max().item<double>() / std::max(ps[i].abs().max().item<double>(), 1e-3);
      EXPECT_LT(worst, v.fused_head ? 2e-4 : 1e-4) << variant << " parameter " << i;
    }
    const double val = j0["metrics"]["val/loss"].get<double>(), val_one = js["metrics"]["val/loss"].get<double>();
    std::cout << "[ llama ddp ] " << variant << ": val/loss 2 ranks " << val << ", 1 process " << val_one << "\n";
    EXPECT_NEAR(val, val_one, (fp32 ? 1e-5 : v.fp8 ? 1e-2 : 1e-3) * val_one) << variant;
    if (v.fp8) EXPECT_NE(val, val_one) << variant << ": per-rank scales round differently";
    checkpoint::remove_tree(two.dir);
    checkpoint::remove_tree(one.dir);
  }
}

// Activation checkpointing under data parallelism: the checkpointed layers hand their parameters
// gradients to the accumulators the Reducer hooks, so two ranks end on bitwise the weights of two
// ranks without it.
TEST(TrainerDDP, ActivationCheckpointingEndsOnBitwiseTheWeightsOfARunWithoutIt) {
  std::vector<torch::Tensor> params[2];
  for (int i = 0; i < 2; ++i) {
    auto sets = llama_sets();
    sets.push_back(std::string("model.activation_checkpointing=") + (i == 0 ? "none" : "blocks"));
    Job job = new_job(i == 0 ? "ddp-ac-none" : "ddp-ac-blocks");
    auto rs = fit(2, job, sets);
    for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
    params[i] = load_params(job.dir + "/params1.pt");
    checkpoint::remove_tree(job.dir);
  }
  ASSERT_EQ(params[0].size(), params[1].size());
  for (size_t i = 0; i < params[0].size(); ++i) EXPECT_TRUE(torch::equal(params[0][i], params[1][i])) << "parameter " << i;
}

// ZeRO-2 ends where DDP ends: 2 ranks, 6 clipped AdamW steps of 2 micro-batches, in fp32 and in
// bf16-master, over a probe whose every dim 0 is odd (33 hidden units, 5 classes: each rank's shard
// is padded). Each rank's optimizer holds its shards only (ceil(dim0 / 2) rows of every parameter);
// the all-gathered parameters are bitwise equal across ranks; the weights, the checkpoint's fp32
// values and the validation loss equal DDP's within the reduction order's rounding.
TEST(TrainerZero2, EndsWhereDdpEndsWithEachRankUpdatingItsShards) {
  const std::vector<std::string> probe = {"model.hidden=33", "model.num_classes=5", "data.num_classes=5"};
  const int64_t full = 33 * 64 + 33 + 5 * 33 + 5, shard = 17 * 64 + 17 + 3 * 33 + 3;
  for (const char* precision : {"32", "bf16-master"}) {
    auto sets = probe;
    sets.push_back(std::string("trainer.precision=") + precision);
    Job ddp = new_job(std::string("z2-ddp-") + precision), zero2 = new_job(std::string("z2-zero2-") + precision);
    auto rd = fit(2, ddp, sets);
    for (auto& r : rd) ASSERT_EQ(r.exit_code, 0) << precision << "\n" << describe(rd);
    sets.push_back("trainer.strategy=zero2");
    auto rz = fit(2, zero2, sets);
    for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << precision << "\n" << describe(rz);
    auto jd = read_json(ddp.dir + "/rank0.json"), jz0 = read_json(zero2.dir + "/rank0.json"), jz1 = read_json(zero2.dir + "/rank1.json");
    ASSERT_EQ(jz0["global_step"], 6);
    EXPECT_EQ(jd["optimizer_numel"], full);
    EXPECT_EQ(jz0["optimizer_numel"], shard) << precision;
    EXPECT_EQ(jz1["optimizer_numel"], shard) << precision;
    auto pd = load_params(ddp.dir + "/params0.pt"), pz0 = load_params(zero2.dir + "/params0.pt"),
         pz1 = load_params(zero2.dir + "/params1.pt");
    ASSERT_EQ(pd.size(), pz0.size());
    const bool fp32 = std::string(precision) == "32";
    for (size_t i = 0; i < pd.size(); ++i) {
      EXPECT_TRUE(torch::equal(pz0[i], pz1[i])) << precision << " parameter " << i << " differs between the zero2 ranks";
      const double worst = (pd[i].to(torch::kFloat32) - pz0[i].to(torch::kFloat32)).abs().max().item<double>() /
                           std::max(pd[i].to(torch::kFloat32).abs().max().item<double>(), 1e-3);
      EXPECT_LT(worst, fp32 ? 1e-5 : 1e-2) << precision << " parameter " << i;
    }
    auto a = model_tensors(jd["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    auto b = model_tensors(jz0["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    ASSERT_EQ(a.size(), b.size());
    for (auto& [k, v] : b) {
      EXPECT_EQ(v.scalar_type(), torch::kFloat32) << k;
      EXPECT_EQ(v.sizes(), a.at(k).sizes()) << k;
      const double scale = std::max(a.at(k).abs().max().item<double>(), 1e-3);
      EXPECT_LT((v - a.at(k)).abs().max().item<double>() / scale, fp32 ? 1e-5 : 1e-2) << precision << " " << k;
    }
    // Rank 0 writes the run's files; rank 1 writes its optimizer shards (and their save's folder)
    // and nothing else.
    int shard_writes = 0;
    for (const auto& w : jz1["writes"]) {
      const std::string path = w;
      const bool folder = path.size() > 12 && path.substr(path.size() - 12) == "/checkpoints";  // whoever comes first
      EXPECT_TRUE(folder || path.find(".ckpt.zero2") != std::string::npos) << path;
      EXPECT_EQ(path.find("rank0"), std::string::npos) << path;
      shard_writes += path.find("/rank1.ckpt") != std::string::npos;
    }
    EXPECT_GT(shard_writes, 0) << jz1["writes"].dump();
    // Every shard folder belongs to a checkpoint file (top-k's removed files took theirs along).
    int folders = 0;
    for (const auto& e : fs::directory_iterator(jz0["run_dir"].get<std::string>() + "/checkpoints")) {
      const std::string name = e.path().string();
      if (name.size() < 6 || name.substr(name.size() - 6) != ".zero2") continue;
      ++folders;
      EXPECT_TRUE(fs::exists(name.substr(0, name.size() - 6))) << name << " outlived its checkpoint";
    }
    EXPECT_EQ(folders, 2) << "last.ckpt and the top-1 checkpoint";
    const double vd = jd["metrics"]["val/loss"], vz = jz0["metrics"]["val/loss"];
    std::cout << "[ zero2 ] " << precision << ": val/loss ddp " << vd << ", zero2 " << vz << "\n";
    EXPECT_EQ(jz1["metrics"]["val/loss"].get<double>(), vz);
    EXPECT_NEAR(vz, vd, (fp32 ? 1e-5 : 1e-3) * vd) << precision;
    checkpoint::remove_tree(ddp.dir);
    checkpoint::remove_tree(zero2.dir);
  }
}

// Four ranks: each optimizer holds ceil(dim0 / 4) rows of every parameter (27% of the probe's 2387
// values, padding included; rank 3's share of the 5-class layer is all padding) and the run ends
// where four ranks of ddp end: the sharding is the world size's, not two's.
TEST(TrainerZero2, FourRanksEachUpdateAQuarterAndEndWhereDdpEnds) {
  const std::vector<std::string> probe = {"model.hidden=33", "model.num_classes=5", "data.num_classes=5"};
  const int64_t shard = 9 * 64 + 9 + 2 * 33 + 2;
  Job ddp = new_job("z2-4-ddp"), zero2 = new_job("z2-4-zero2");
  auto rd = fit(4, ddp, probe);
  for (auto& r : rd) ASSERT_EQ(r.exit_code, 0) << describe(rd);
  auto sets = probe;
  sets.push_back("trainer.strategy=zero2");
  auto rz = fit(4, zero2, sets);
  for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << describe(rz);
  auto pd = load_params(ddp.dir + "/params0.pt");
  const double vd = read_json(ddp.dir + "/rank0.json")["metrics"]["val/loss"];
  for (int r = 0; r < 4; ++r) {
    auto j = read_json(fmt::format("{}/rank{}.json", zero2.dir, r));
    EXPECT_EQ(j["global_step"], 6) << "rank " << r;
    EXPECT_EQ(j["optimizer_numel"], shard) << "rank " << r;
    EXPECT_NEAR(j["metrics"]["val/loss"].get<double>(), vd, 1e-5 * vd) << "rank " << r;
    auto pz = load_params(fmt::format("{}/params{}.pt", zero2.dir, r));
    ASSERT_EQ(pz.size(), pd.size());
    for (size_t i = 0; i < pd.size(); ++i)
      EXPECT_LT((pd[i] - pz[i]).abs().max().item<double>() / std::max(pd[i].abs().max().item<double>(), 1e-3), 1e-5)
          << "rank " << r << " parameter " << i;
  }
  checkpoint::remove_tree(ddp.dir);
  checkpoint::remove_tree(zero2.dir);
}

// A NaN loss on rank 1 only (the loss check alone: rank 0's own loss is finite) stops both ranks with
// exit 3 at the same step; each rank writes its capture; the weights stay finite.
// Under zero2 too, where each rank's capture holds its optimizer shard and strobe replay runs both
// ranks' parts in one process (fresh moments), their losses bit for bit.
void nan_on_one_rank_stops_both(const std::string& strategy) {
  Job job = new_job("nan-" + strategy);
  auto rs = fit(2, job,
                {"model.fault=nan", "model.fault_rank=1", "model.fault_call=5",
                 "callbacks=[{name: nan_capture, check: loss, keep_last: 2}]", "trainer.strategy=" + strategy});
  ASSERT_EQ(rs[0].exit_code, 3) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 3) << describe(rs);
  auto j0 = read_json(job.dir + "/rank0.json"), j1 = read_json(job.dir + "/rank1.json");
  EXPECT_EQ(j0["global_step"], j1["global_step"]);
  EXPECT_LT(j0["global_step"].get<int64_t>(), 6);
  const std::string run_dir = j0["run_dir"];
  // Micro-batch 5 belongs to optimizer step 3: the capture is named after it.
  auto info = [&](const std::string& d) {
    auto data = checkpoint::load_checkpoint_file(d + "/" + capture::kCheckpointFile);
    return nlohmann::json::parse(data.blob("capture"));
  };
  ASSERT_TRUE(fs::exists(run_dir + "/nan/step_3")) << describe(rs);
  ASSERT_TRUE(fs::exists(run_dir + "/nan/rank1/step_3")) << describe(rs);
  EXPECT_FALSE(info(run_dir + "/nan/step_3")["loss_nonfinite"].get<bool>());
  EXPECT_TRUE(info(run_dir + "/nan/rank1/step_3")["loss_nonfinite"].get<bool>());
  for (auto& [k, v] : model_tensors(run_dir + "/checkpoints/last.ckpt"))
    EXPECT_TRUE(torch::isfinite(v).all().item<bool>()) << k << " is not finite in last.ckpt";
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "nan_capture: capture written to"), 1) << rs[0].stderr_text;
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "nan_capture:"), 0) << "console output is rank 0's";
  if (strategy == "zero2" || strategy == "fsdp") {
    auto d = checkpoint::load_checkpoint_file(run_dir + "/nan/rank1/step_3/" + capture::kCheckpointFile);
    EXPECT_EQ(nlohmann::json::parse(d.blob("zero2_shard"))["rank"], 1);
    auto body = [&](int) {
      torch::set_num_threads(1);
      std::ofstream(job.dir + "/replay.json") << capture::replay_capture(run_dir + "/nan", {}).dump(1);
      return 0;
    };
    auto r = st::run_ranks(1, body, job.dir + "/replay", std::chrono::seconds(120), [] {});
    ASSERT_EQ(r[0].exit_code, 0) << describe(r);
    auto rep = read_json(job.dir + "/replay.json");
    ASSERT_EQ(rep["ranks"].size(), 2u) << rep.dump(1);
    // The probe's NaN comes from its call count, which a replay restarts: rank 1's first loss is
    // finite there; every other loss replays bit for bit from the ranks' zero2 captures.
    EXPECT_TRUE(rep["ranks"][0]["loss"]["bits_equal"].get<bool>()) << rep.dump(1);
    const auto& l1 = rep["ranks"][1]["loss"];
    EXPECT_EQ(l1["captured"][0], "nan") << rep.dump(1);
    EXPECT_EQ(l1["replayed"][1], l1["captured"][1]) << rep.dump(1);
    EXPECT_EQ(count_lines_with(r[0].stderr_text, "its optimizer shard is not restored in one process"), 2) << r[0].stderr_text;
    // A rank's capture holds one optimizer shard: no run resumes from it.
    expect_refused_resume(job, "resume", {"trainer.strategy=zero2"}, run_dir + "/nan/rank1/step_3/" + capture::kCheckpointFile,
                          "written by one rank alone");
  }
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, NaNOnOneRankStopsBothWithExit3) { nan_on_one_rank_stops_both("ddp"); }
// Under fsdp (the probe's fc1 a unit): the same captures, made from the optimizer's shards, replay
// on one process bit for bit.
TEST(TrainerFsdp, NaNOnOneRankStopsBothWithExit3AndItsCaptureReplaysOnOneProcess) { nan_on_one_rank_stops_both("fsdp"); }
TEST(TrainerZero2, NaNOnOneRankStopsBothWithExit3AndItsCaptureReplaysOnOneProcess) { nan_on_one_rank_stops_both("zero2"); }

// A loss spike on rank 1 only: the spike detector sees the loss averaged over the ranks (all-reduced
// on the device), so both ranks call the same step a spike, capture it and stop with exit 3.
// Validation by time (trainer.val_check_interval as a duration) under data parallelism: rank 1's
// training forwards take 150 ms, rank 0's none, so the ranks' clocks cross the interval at different
// moments; the agreement makes both validate after the same steps (no hang: a validation is a
// collective), the same number of times, more than once in 16 steps of ~0.3 s with a 1 s interval.
TEST(TrainerDDP, ValidationByTimeHappensAfterTheSameStepsOnEveryRank) {
  Job job = new_job("val_by_time");
  auto rs = fit(2, job,
                {"model.pace_ms=150", "model.fault_rank=1", "trainer.max_steps=16", "trainer.max_epochs=-1",
                 "trainer.val_check_interval=\"00:00:01\""});
  ASSERT_EQ(rs[0].exit_code, 0) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 0) << describe(rs);
  const auto r0 = read_json(job.dir + "/rank0.json"), r1 = read_json(job.dir + "/rank1.json");
  EXPECT_EQ(r0["global_step"], 16);
  EXPECT_EQ(r0["val_runs"], r1["val_runs"]) << r0.dump() << r1.dump();
  EXPECT_GE(r0["val_runs"].get<int64_t>(), 2) << r0.dump();
  EXPECT_LE(r0["val_runs"].get<int64_t>(), 5) << r0.dump();
  checkpoint::remove_tree(job.dir);
}

void loss_spike_on_one_rank_stops_both(const std::string& strategy) {
  Job job = new_job("spike-" + strategy);
  auto rs = fit(2, job,
                {"model.fault=spike", "model.fault_rank=1", "model.fault_call=9", "trainer.strategy=" + strategy,
                 "callbacks=[{name: nan_capture, check: loss, keep_last: 2, spike: {window: 4, warmup: 3}}]"});
  ASSERT_EQ(rs[0].exit_code, 3) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 3) << describe(rs);
  const std::string run_dir = read_json(job.dir + "/rank0.json")["run_dir"];
  // Micro-batch 9 belongs to optimizer step 5.
  for (const std::string d : {run_dir + "/nan/step_5", run_dir + "/nan/rank1/step_5"}) {
    ASSERT_TRUE(fs::exists(d + "/" + capture::kCheckpointFile)) << d << "\n" << describe(rs);
    auto info = nlohmann::json::parse(checkpoint::load_checkpoint_file(d + "/" + capture::kCheckpointFile).blob("capture"));
    EXPECT_EQ(info["kind"], "spike") << d;
    EXPECT_GT(info["spike"]["loss"]["z"].get<double>(), 6.0) << info.dump(2);
  }
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "nan_capture: loss spike"), 1) << rs[0].stderr_text;
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, ALossSpikeOnOneRankStopsBothAtTheSameStep) { loss_spike_on_one_rank_stops_both("ddp"); }
TEST(TrainerFsdp, ALossSpikeOnOneRankStopsBothAtTheSameStep) { loss_spike_on_one_rank_stops_both("fsdp"); }

// strobe replay of a 2-rank capture reads both ranks' parts and replays each rank's micro-batches in
// one process (every rank's loss bit for bit); --bisect names the rank and the sample. The data: a
// regression file whose sample 163 has an outlier target; unshuffled, the two ranks take alternate
// indices, so sample 163 is rank 1's, in step 11.
TEST(TrainerDDP, ReplayOfATwoRankSpikeReadsEveryRankAndBisectNamesTheRankAndSample) {
  Job job = new_job("spike_replay");
  const std::string data = job.dir + "/reg.safetensors";
  auto writer = [&](int) {
    torch::manual_seed(0);
    auto x = torch::randn({200, 8});
    auto y = x.mm(torch::randn({8, 1}));
    y[163][0] = 1000.0;
    safetensors::write_file(data, {{"x", x}, {"y", y}});
    return 0;
  };
  ASSERT_EQ(st::run_ranks(1, writer, job.dir + "/writer", std::chrono::seconds(60), [] {})[0].exit_code, 0);
  auto rs = fit(2, job,
                {"model={name: mlp, in_features: 8, hidden: [16], num_classes: 1}", "task={name: regression}",
                 "data={name: tensor_file, path: " + data + ", fields: {image: x, target: y}, val_fraction: 0.1, batch_size: 4, "
                 "shuffle: false, num_workers: 0}",
                 "trainer.gradient_clip_val=0", "callbacks=[{name: nan_capture, keep_last: 2, spike: {window: 8, warmup: 8}}]", "trainer.max_steps=20"});
  ASSERT_EQ(rs[0].exit_code, 3) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 3) << describe(rs);
  const std::string run_dir = read_json(job.dir + "/rank0.json")["run_dir"];
  ASSERT_TRUE(fs::exists(run_dir + "/nan/step_11")) << describe(rs);
  // Replay and bisect in a process of their own (this one starts no thread pools before its forks).
  auto body = [&](int) {
    torch::set_num_threads(1);
    auto rep = capture::replay_capture(run_dir + "/nan", {});
    std::ofstream(job.dir + "/replay.json") << rep.dump(1);
    auto bis = capture::bisect_capture(run_dir + "/nan/rank1/step_11", {});
    std::ofstream(job.dir + "/bisect.json") << bis.dump(1);
    return 0;
  };
  auto r = st::run_ranks(1, body, job.dir + "/replay", std::chrono::seconds(120), [] {});
  ASSERT_EQ(r[0].exit_code, 0) << describe(r);
  auto rep = read_json(job.dir + "/replay.json"), bis = read_json(job.dir + "/bisect.json");
  EXPECT_EQ(rep["world_size"], 2) << rep.dump(1);
  ASSERT_EQ(rep["ranks"].size(), 2u) << rep.dump(1);
  EXPECT_TRUE(rep["ranks"][0]["loss"]["bits_equal"].get<bool>()) << rep.dump(1);
  EXPECT_TRUE(rep["ranks"][1]["loss"]["bits_equal"].get<bool>()) << rep.dump(1);
  EXPECT_TRUE(rep["exact"].get<bool>()) << rep.dump(1);
  EXPECT_EQ(rep["culprit_ranks"], nlohmann::json::array({1})) << rep.dump(1);
  EXPECT_EQ(bis["world_size"], 2) << bis.dump(1);
  ASSERT_EQ(bis["samples"].size(), 1u) << bis.dump(1);
  EXPECT_EQ(bis["samples"][0]["rank"], 1) << bis.dump(1);
  EXPECT_EQ(bis["samples"][0]["dataset_index"], 163) << bis.dump(1);
  EXPECT_FALSE(bis["rest_bad"].get<bool>()) << bis.dump(1);
  checkpoint::remove_tree(job.dir);
}

// A 2-rank checkpoint resumes on 2 ranks exactly (per-rank RNG: the ranks' generators differ), and
// one process with the same data.batch_size (another global batch) goes on, saying so. Under zero2
// the same (the ranks' optimizer shards, read through the manifest, make the resume exact; one
// process re-cuts them into a whole state), and additionally: the file holds the whole fp32 weights
// and no optimizer state, the shard folder holds the latest save's files only, one process
// validates from it, and resuming it with a shard file missing is refused with one line (exit 2).
void two_rank_checkpoint_resumes_exactly(const std::string& strategy) {
  const std::vector<std::string> sets = {"model.dropout=0.3", "model.rng_extra=true", "trainer.strategy=" + strategy};
  Job full = new_job("full-" + strategy), part = new_job("part-" + strategy);
  auto ra = fit(2, full, sets);
  for (auto& r : ra) ASSERT_EQ(r.exit_code, 0) << describe(ra);
  auto partial_sets = sets;
  partial_sets.push_back("trainer.max_steps=3");
  auto rb = fit(2, part, partial_sets);
  for (auto& r : rb) ASSERT_EQ(r.exit_code, 0) << describe(rb);
  const std::string part_dir = read_json(part.dir + "/rank0.json")["run_dir"];
  const std::string ckpt = part_dir + "/checkpoints/last.ckpt";
  {
    auto d = checkpoint::load_checkpoint_file(ckpt);
    EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["world_size"], 2);
    ASSERT_TRUE(d.tensors.count("rng/rank0/cpu") && d.tensors.count("rng/rank1/cpu"));
    EXPECT_FALSE(torch::equal(d.tensor("rng/rank0/cpu"), d.tensor("rng/rank1/cpu"))) << "the ranks' generators should differ";
  }
  // Resume (into the same run directory) up to step 6.
  Job resumed = part;
  resumed.dir = part.dir + "/resume";
  fs::create_directories(resumed.dir);
  auto rc = fit(2, resumed, sets, ckpt);
  for (auto& r : rc) ASSERT_EQ(r.exit_code, 0) << describe(rc);
  auto pa = load_params(full.dir + "/params0.pt"), pc0 = load_params(resumed.dir + "/params0.pt"),
       pc1 = load_params(resumed.dir + "/params1.pt");
  ASSERT_EQ(pa.size(), pc0.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pc0[i])) << "parameter " << i << ": max |resumed - uninterrupted| = "
                                             << (pa[i] - pc0[i]).abs().max().item<double>();
    EXPECT_TRUE(torch::equal(pc0[i], pc1[i]));
  }
  auto ja = read_json(full.dir + "/rank0.json"), jc = read_json(resumed.dir + "/rank0.json");
  EXPECT_EQ(ja["metrics"]["val/loss"], jc["metrics"]["val/loss"]);

  // One process with the same data.batch_size (half the global batch) goes on from the samples
  // consumed; under zero2 its optimizer state is re-cut from the two shards into a whole one.
  Job single = part;
  single.dir = part.dir + "/single";
  fs::create_directories(single.dir);
  auto rs = fit(1, single, sets, ckpt);
  EXPECT_EQ(rs[0].exit_code, 0) << describe(rs);
  EXPECT_EQ(count_lines_with(slurp(single.dir + "/rank0.stdout"), "on 2 process(es) -> 1, the global batch 16 -> 8"), 1)
      << slurp(single.dir + "/rank0.stdout");
  if (strategy == "zero2") {
    auto d = checkpoint::load_checkpoint_file(ckpt);
    EXPECT_FALSE(d.has_blob("optimizer"));
    auto manifest = nlohmann::json::parse(d.blob("zero2"));
    ASSERT_EQ(manifest["files"].size(), 2u) << manifest.dump();
    std::vector<std::string> tags;
    for (const auto& e : fs::directory_iterator(ckpt + ".zero2")) tags.push_back(e.path().filename().string());
    EXPECT_EQ(tags, std::vector<std::string>{manifest["tag"].get<std::string>()}) << "earlier saves' shards are removed";
    for (int r = 0; r < 2; ++r) {
      auto shard = checkpoint::load_checkpoint_file(part_dir + "/checkpoints/" + manifest["files"][r].get<std::string>());
      EXPECT_EQ(nlohmann::json::parse(shard.blob("zero2_shard"))["rank"], r);
      EXPECT_TRUE(shard.has_blob("optimizer"));
    }
    // One process evaluates its weights: the validation loss of the 2-rank run at step 3.
    auto body = [&](int) {
      torch::set_num_threads(1);
      auto doc = config::Document::load_string(yaml(part.root), "ddp.yaml");
      for (const auto& s : sets) doc.apply_override(s);
      RunOptions opt;
      opt.ckpt = ckpt;
      opt.stage = Stage::Validate;
      opt.create_run_dir = false;
      auto run = build_run(doc, opt);
      run->trainer->validate(std::move(run->checkpoint));
      std::ofstream(part.dir + "/validate.json") << nlohmann::json(run->trainer->view().metrics()).dump();
      return 0;
    };
    auto rv = st::run_ranks(1, body, part.dir + "/validate", std::chrono::seconds(60), [] {});
    ASSERT_EQ(rv[0].exit_code, 0) << describe(rv);
    EXPECT_TRUE(read_json(part.dir + "/validate.json").contains("val/loss"));
    // A shard file gone: every rank refuses, naming it.
    fs::remove(part_dir + "/checkpoints/" + manifest["files"][1].get<std::string>());
    expect_refused_resume(part, "gone", sets, ckpt, "rank1.ckpt its manifest names is missing");
  }
  checkpoint::remove_tree(full.dir);
  checkpoint::remove_tree(part.dir);
}

TEST(TrainerDDP, TwoRankCheckpointResumesExactlyOnTwoRanks) { two_rank_checkpoint_resumes_exactly("ddp"); }

// A checkpoint resumes on another number of processes when the global batch is kept (docs/
// DISTRIBUTED.md): 2 ranks x batch 4 stopped at step 3 continue as 1 process x batch 8 and as 4 ranks
// x batch 2, 1 process x batch 8 as 2 ranks x batch 4, and 4 ranks x batch 2 as 1 process x batch 8,
// each ending on the weights of the uninterrupted 2-rank run within
// the reduction order's rounding (a mean of two means of 4 against one mean of 8). The resume line
// says it. Another global batch trains on from the samples consumed, the line saying so. Under zero2
// on the resuming side the whole optimizer state is cut into the ranks' shards.
TEST(TrainerDDP, ACheckpointResumesOnAnotherNumberOfProcessesKeepingTheGlobalBatch) {
  const std::vector<std::string> sets = {"trainer.strategy=ddp"};
  Job full = new_job("ws-full"), two = new_job("ws-two"), one = new_job("ws-one");
  auto rf = fit(2, full, sets);
  for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << describe(rf);
  auto with = [&](const std::vector<std::string>& extra) { return joined(sets, extra); };
  auto rt = fit(2, two, with({"trainer.max_steps=3"}));
  for (auto& r : rt) ASSERT_EQ(r.exit_code, 0) << describe(rt);
  auto ro = fit(1, one, with({"trainer.max_steps=3", "data.batch_size=8"}));
  ASSERT_EQ(ro[0].exit_code, 0) << describe(ro);
  // The step-3 checkpoints, kept aside (a resume continues in its run directory and rewrites last.ckpt).
  auto ckpt_of = [](const Job& j) {
    const std::string kept = j.dir + "/step3.ckpt";
    if (!fs::exists(kept))
      fs::copy_file(read_json(j.dir + "/rank0.json")["run_dir"].get<std::string>() + "/checkpoints/last.ckpt", kept);
    return kept;
  };
  ckpt_of(two), ckpt_of(one);
  const auto want = load_params(full.dir + "/params0.pt");
  auto expect_close = [&](const std::string& params, const std::string& what) {
    const auto got = load_params(params);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = (got[i] - want[i]).abs().max().item<double>() / want[i].abs().max().item<double>();
      EXPECT_LT(err, 1e-5) << what << ": parameter " << i;
    }
    double moved = 0;  // the resumed run trained: it is not the checkpoint's weights
    const auto at3 = load_params(two.dir + "/params0.pt");
    for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, (got[i] - at3[i]).abs().max().item<double>());
    EXPECT_GT(moved, 1e-4) << what;
  };

  Job to_one = two;
  to_one.dir = two.dir + "/to_one";
  fs::create_directories(to_one.dir);
  auto r1 = fit(1, to_one, with({"data.batch_size=8"}), ckpt_of(two));
  ASSERT_EQ(r1[0].exit_code, 0) << describe(r1);
  EXPECT_EQ(read_json(to_one.dir + "/rank0.json")["global_step"], 6);
  EXPECT_EQ(count_lines_with(slurp(to_one.dir + "/rank0.stdout"),
                             "(step 3) on 2 process(es) -> 1, the global batch 16 kept (data.batch_size 4 -> 8)"), 1)
      << slurp(to_one.dir + "/rank0.stdout");
  expect_close(to_one.dir + "/params0.pt", "2 ranks -> 1 process");

  Job to_two = one;
  to_two.dir = one.dir + "/to_two";
  fs::create_directories(to_two.dir);
  auto r2 = fit(2, to_two, sets, ckpt_of(one));
  for (auto& r : r2) ASSERT_EQ(r.exit_code, 0) << describe(r2);
  expect_close(to_two.dir + "/params0.pt", "1 process -> 2 ranks");
  EXPECT_TRUE(torch::equal(load_params(to_two.dir + "/params0.pt")[0], load_params(to_two.dir + "/params1.pt")[0]));

  // Four ranks: 2 x 4 -> 4 x 2, and a 4 x 2 run's step-3 checkpoint -> 1 process x 8.
  Job to_four = two;
  to_four.dir = two.dir + "/to_four";
  fs::create_directories(to_four.dir);
  auto r4 = fit(4, to_four, with({"data.batch_size=2"}), ckpt_of(two));
  for (auto& r : r4) ASSERT_EQ(r.exit_code, 0) << describe(r4);
  EXPECT_EQ(count_lines_with(slurp(to_four.dir + "/rank0.stdout"),
                             "(step 3) on 2 process(es) -> 4, the global batch 16 kept (data.batch_size 4 -> 2)"), 1)
      << slurp(to_four.dir + "/rank0.stdout");
  expect_close(to_four.dir + "/params0.pt", "2 ranks -> 4 ranks");
  Job four = new_job("ws-four");
  auto rq = fit(4, four, with({"trainer.max_steps=3", "data.batch_size=2"}));
  for (auto& r : rq) ASSERT_EQ(r.exit_code, 0) << describe(rq);
  Job four_to_one = four;
  four_to_one.dir = four.dir + "/to_one";
  fs::create_directories(four_to_one.dir);
  auto r41 = fit(1, four_to_one, with({"data.batch_size=8"}), ckpt_of(four));
  ASSERT_EQ(r41[0].exit_code, 0) << describe(r41);
  expect_close(four_to_one.dir + "/params0.pt", "4 ranks -> 1 process");

  // Another global batch: 1 process x batch 4 from 2 x 4 trains on, from the samples consumed.
  Job half = two;
  half.dir = two.dir + "/half";
  fs::create_directories(half.dir);
  auto rh = fit(1, half, sets, ckpt_of(two));
  ASSERT_EQ(rh[0].exit_code, 0) << describe(rh);
  EXPECT_EQ(count_lines_with(slurp(half.dir + "/rank0.stdout"),
                             "(step 3) on 2 process(es) -> 1, the global batch 16 -> 8 (data.batch_size 4 x 2 process(es) x "
                             "trainer.accumulate_grad_batches 2 -> 4 x 1 x 2), epoch 0 going on after its first 48 sample(s); "
                             "the learning rate is not rescaled"),
            1)
      << slurp(half.dir + "/rank0.stdout");
  EXPECT_EQ(read_json(half.dir + "/rank0.json")["global_step"], 6);
  // 1 process x batch 8 -> 2 ranks x batch 4 under zero2: the whole optimizer state cut into shards.
  Job to_zero2 = one;
  to_zero2.dir = one.dir + "/to_zero2";
  fs::create_directories(to_zero2.dir);
  auto rz = fit(2, to_zero2, {"trainer.strategy=zero2"}, ckpt_of(one));
  for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << describe(rz);
  expect_close(to_zero2.dir + "/params1.pt", "1 process -> 2 ranks under zero2");
  for (const Job& j : {full, two, one, four}) checkpoint::remove_tree(j.dir);
}

// kill -9 of both ranks in the middle of a sharded save (their shards of step 6 written, the file
// not): last.ckpt is still step 4's, whole, with the shards its manifest names; resuming from it
// ends bitwise where the uninterrupted run ends, and that run's saves remove the crashed save's
// shard folder. Rank 0 hosts the rendezvous store: when it dies before rank 1 has read the save's
// tag (a loaded machine), rank 1 ends with the one line naming the lost store instead of reaching
// the point; either way nothing of the last checkpoint is lost.
TEST(TrainerZero2, AKillInTheMiddleOfAShardedSaveLeavesTheLastCheckpointWholeAndExact) {
  const std::vector<std::string> sets = {"model.dropout=0.3", "model.rng_extra=true", "trainer.strategy=zero2"};
  Job full = new_job("z2kill-full"), crash = new_job("z2kill-crash");
  auto ra = fit(2, full, sets);
  for (auto& r : ra) ASSERT_EQ(r.exit_code, 0) << describe(ra);
  ::setenv("STROBE_FAULT_AT", "zero2_shard_written@6", 1);
  auto rb = fit(2, crash, sets);
  ::unsetenv("STROBE_FAULT_AT");
  ASSERT_EQ(rb[0].exit_code, 128 + SIGKILL) << describe(rb);
  if (rb[1].exit_code != 128 + SIGKILL) {
    ASSERT_NE(rb[1].exit_code, 0) << describe(rb);
    EXPECT_EQ(count_lines_with(rb[1].stderr_text, "strobe: rank 1 of 2: distributed job failed: lost the rendezvous store at"), 1)
        << describe(rb);
  }
  const std::string ckpt_dir = crash.root + "/ddp/version_0/checkpoints";
  auto d = checkpoint::load_checkpoint_file(ckpt_dir + "/last.ckpt");
  EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["global_step"], 4);
  for (const auto& f : nlohmann::json::parse(d.blob("zero2"))["files"])
    EXPECT_TRUE(fs::exists(ckpt_dir + "/" + f.get<std::string>())) << f;
  bool crashed_shards = false;  // the step-6 save's shards are there, unreferenced
  for (const auto& folder : fs::directory_iterator(ckpt_dir))
    if (folder.is_directory())
      for (const auto& e : fs::directory_iterator(folder.path())) crashed_shards |= e.path().filename().string().rfind("step6-", 0) == 0;
  EXPECT_TRUE(crashed_shards);
  Job resumed = crash;
  resumed.dir = crash.dir + "/resume";
  fs::create_directories(resumed.dir);
  auto rc = fit(2, resumed, sets, ckpt_dir + "/last.ckpt");
  for (auto& r : rc) ASSERT_EQ(r.exit_code, 0) << describe(rc);
  auto pa = load_params(full.dir + "/params0.pt"), pc = load_params(resumed.dir + "/params1.pt");
  ASSERT_EQ(pa.size(), pc.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pc[i])) << "parameter " << i;
  auto last = nlohmann::json::parse(checkpoint::load_checkpoint_file(ckpt_dir + "/last.ckpt").blob("zero2"));
  std::vector<std::string> tags;
  for (const auto& e : fs::directory_iterator(ckpt_dir + "/last.ckpt.zero2")) tags.push_back(e.path().filename().string());
  EXPECT_EQ(tags, std::vector<std::string>{last["tag"].get<std::string>()});
  checkpoint::remove_tree(full.dir);
  checkpoint::remove_tree(crash.dir);
}
TEST(TrainerZero2, ShardedCheckpointResumesExactlyOnTwoRanksAndLoadsOnOne) { two_rank_checkpoint_resumes_exactly("zero2"); }

// model.init_from under zero2 with bf16-master, whose model is built on the host and reaches the GPU
// in bf16 (docs/DISTRIBUTED.md, "Building the model under zero2"): the file's fp32 values reach the
// ranks' master shards unrounded. One step with lr 0 on 3 ranks (the odd probe: every shard padded)
// leaves the checkpoint's fp32 values, gathered from the shards, bit-equal to the file's; loaded after
// the conversion to bf16 they would be rounded.
TEST(TrainerZero2, InitFromReachesTheMasterShardsUnrounded) {
  Job job = new_job("z2-init");
  torch::manual_seed(99);  // not the run's seed: the file's weights differ from the model's own
  auto doc = config::Document::load_string("{name: ddp_probe, in_features: 64, hidden: 33, num_classes: 5}", "model");
  auto section = doc.root();
  auto net = model_registry().create(section, "");
  safetensors::NamedTensors tensors;
  for (const auto& p : net->named_parameters()) tensors.emplace_back(p.key(), p.value().detach());
  const std::string path = job.dir + "/w.safetensors";
  safetensors::write_file(path, tensors);
  auto rs = fit(3, job, {"model.hidden=33", "model.num_classes=5", "data.num_classes=5", "data.batch_size=2",
                         "trainer.precision=bf16-master", "trainer.strategy=zero2", "trainer.max_steps=1", "optimizer.lr=0",
                         "model.init_from=" + path});
  for (auto& r : rs) ASSERT_EQ(r.exit_code, 0) << describe(rs);
  auto d = checkpoint::load_checkpoint_file(read_json(job.dir + "/rank0.json")["run_dir"].get<std::string>() +
                                            "/checkpoints/last.ckpt");
  EXPECT_TRUE(d.has_blob("zero2"));
  for (const auto& p : net->named_parameters()) {
    const torch::Tensor saved = d.tensor("model/" + p.key());
    EXPECT_EQ(saved.scalar_type(), torch::kFloat32) << p.key();
    EXPECT_TRUE(torch::equal(saved, p.value().detach())) << p.key();
  }
  checkpoint::remove_tree(job.dir);
}

// A zero2 checkpoint of 3 ranks (33 hidden units: 11 rows a rank; the 5-class layer 2 rows, rank 2's
// half padding) resumes re-cut on the host (docs/DISTRIBUTED.md): on 2 ranks under ddp (batch 3, the
// global batch 12 kept), in 1 process (batch 6) and on 2 ranks under zero2 (17 rows a rank), each
// ending on the uninterrupted 3-rank run's weights within a relative 1e-5 (the reduction order). 72
// samples: an epoch is 6 steps, so no epoch's padding differs. kill -9 in the middle of the re-cut,
// and in the resumed run's first save (its shards written, the file not): the checkpoint still
// resumes, exactly, and the finished run's save leaves its own 2 shards alone (a whole save over it
// later, none). A
// shard file that is not the one its manifest names (another rank's) is refused on every rank.
TEST(TrainerZero2, ShardsAreReCutForAnotherNumberOfProcessesAndStrategy) {
  const std::vector<std::string> probe = {"model.hidden=33", "model.num_classes=5", "data.num_classes=5", "data.num_samples=72"};
  auto with = [&](const std::vector<std::string>& extra) { return joined(probe, extra); };
  const auto three = with({"trainer.strategy=zero2", "data.batch_size=2"});
  Job full = new_job("recut-full"), part = new_job("recut-part");
  auto rf = fit(3, full, three);
  for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << describe(rf);
  auto three_at3 = three;
  three_at3.push_back("trainer.max_steps=3");
  auto rp = fit(3, part, three_at3);
  for (auto& r : rp) ASSERT_EQ(r.exit_code, 0) << describe(rp);
  const std::string ckpt_dir = read_json(part.dir + "/rank0.json")["run_dir"].get<std::string>() + "/checkpoints";
  const std::string ckpt = ckpt_dir + "/last.ckpt";
  ASSERT_EQ(nlohmann::json::parse(checkpoint::load_checkpoint_file(ckpt).blob("zero2"))["files"].size(), 3u);
  // A copy beside the run (a resume from it starts a new run directory and leaves the original alone).
  const std::string aside = part.dir + "/aside";
  fs::create_directories(aside);
  fs::copy(ckpt, aside + "/last.ckpt");
  fs::copy(ckpt + ".zero2", aside + "/last.ckpt.zero2", fs::copy_options::recursive);

  const auto want = load_params(full.dir + "/params0.pt"), at3 = load_params(part.dir + "/params0.pt");
  auto expect_close = [&](const std::string& params, const std::string& what) {
    const auto got = load_params(params);
    ASSERT_EQ(got.size(), want.size()) << what;
    double moved = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double err = (got[i] - want[i]).abs().max().item<double>() / want[i].abs().max().item<double>();
      EXPECT_LT(err, 1e-5) << what << ": parameter " << i;
      moved = std::max(moved, (got[i] - at3[i]).abs().max().item<double>());
    }
    EXPECT_GT(moved, 1e-4) << what << ": the resumed run did not train";
  };
  auto resume = [&](const std::string& name, int world, const std::vector<std::string>& sets, const std::string& from) {
    Job j = part;
    j.dir = part.dir + "/" + name;
    fs::create_directories(j.dir);
    return std::make_pair(j, fit(world, j, sets, from));
  };

  auto [ddp, rd] = resume("to_ddp", 2, with({"trainer.strategy=ddp", "data.batch_size=3"}), aside + "/last.ckpt");
  for (auto& r : rd) ASSERT_EQ(r.exit_code, 0) << describe(rd);
  EXPECT_EQ(count_lines_with(slurp(ddp.dir + "/rank0.stdout"),
                             "(step 3) on 3 process(es) -> 2, the global batch 12 kept (data.batch_size 2 -> 3)"), 1)
      << slurp(ddp.dir + "/rank0.stdout");
  expect_close(ddp.dir + "/params1.pt", "3 ranks zero2 -> 2 ranks ddp");
  auto [one, r1] = resume("to_one", 1, with({"trainer.strategy=zero2", "data.batch_size=6"}), aside + "/last.ckpt");
  ASSERT_EQ(r1[0].exit_code, 0) << describe(r1);
  expect_close(one.dir + "/params0.pt", "3 ranks zero2 -> 1 process");

  // Resumed in the checkpoint's own run directory, killed twice on the way.
  const auto two = with({"trainer.strategy=zero2", "data.batch_size=3"});
  for (const char* fault : {"zero2_recut@3", "zero2_shard_written@6"}) {
    ::setenv("STROBE_FAULT_AT", fault, 1);
    auto [k, rk] = resume(std::string("kill-") + fault, 2, two, ckpt);
    ::unsetenv("STROBE_FAULT_AT");
    ASSERT_EQ(rk[0].exit_code, 128 + SIGKILL) << fault << "\n" << describe(rk);
    ASSERT_NE(rk[1].exit_code, 0) << fault << "\n" << describe(rk);
    auto d = checkpoint::load_checkpoint_file(ckpt);
    EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["global_step"], 3) << fault;
    auto files = nlohmann::json::parse(d.blob("zero2"))["files"];
    ASSERT_EQ(files.size(), 3u) << fault;
    for (const auto& f : files) EXPECT_TRUE(fs::exists(ckpt_dir + "/" + f.get<std::string>())) << fault << " " << f;
  }
  auto [z2, rz] = resume("to_zero2", 2, two, ckpt);
  for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << describe(rz);
  expect_close(z2.dir + "/params0.pt", "3 ranks zero2 -> 2 ranks zero2, after two kills");
  EXPECT_TRUE(torch::equal(load_params(z2.dir + "/params0.pt")[0], load_params(z2.dir + "/params1.pt")[0]));
  auto last = nlohmann::json::parse(checkpoint::load_checkpoint_file(ckpt).blob("zero2"));
  EXPECT_EQ(last["files"].size(), 2u);
  std::vector<std::string> tags;
  for (const auto& e : fs::directory_iterator(ckpt + ".zero2")) tags.push_back(e.path().filename().string());
  EXPECT_EQ(tags, std::vector<std::string>{last["tag"].get<std::string>()}) << "the 3-rank and the killed saves' shards are gone";
  // Resumed in place by one process under ddp (one more step): a whole file replaces the sharded
  // one, and its shards go with it.
  auto [whole, rw] = resume("whole", 1, with({"trainer.strategy=ddp", "data.batch_size=6", "trainer.max_steps=7"}), ckpt);
  ASSERT_EQ(rw[0].exit_code, 0) << describe(rw);
  EXPECT_EQ(read_json(whole.dir + "/rank0.json")["global_step"], 7);
  EXPECT_TRUE(checkpoint::load_checkpoint_file(ckpt).has_blob("optimizer"));
  EXPECT_FALSE(fs::exists(ckpt + ".zero2"));

  // The copy's shard of rank 1 replaced by rank 0's: not what the manifest names.
  auto manifest = nlohmann::json::parse(checkpoint::load_checkpoint_file(aside + "/last.ckpt").blob("zero2"));
  fs::copy_file(aside + "/" + manifest["files"][0].get<std::string>(), aside + "/" + manifest["files"][1].get<std::string>(),
                fs::copy_options::overwrite_existing);
  expect_refused_resume(part, "swapped", with({"trainer.strategy=ddp", "data.batch_size=3"}), aside + "/last.ckpt",
                        "rank1.ckpt is not rank 1's optimizer shard of this checkpoint");
  checkpoint::remove_tree(full.dir);
  checkpoint::remove_tree(part.dir);
}

// SIGTERM reaching rank 1 alone stops both ranks after the same step, with exit 143, and rank 0 saves
// last.ckpt at that step.
void sigterm_on_one_rank_stops_every_rank(const std::string& strategy) {
  Job job = new_job("term-" + strategy);
  auto rs = fit(2, job, {"model.fault=term", "model.fault_rank=1", "model.fault_call=3", "trainer.max_steps=20",
                         "trainer.strategy=" + strategy});
  ASSERT_EQ(rs[0].exit_code, 143) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 143) << describe(rs);
  auto j0 = read_json(job.dir + "/rank0.json"), j1 = read_json(job.dir + "/rank1.json");
  const int64_t step = j0["global_step"];
  EXPECT_EQ(j1["global_step"], step);
  EXPECT_LT(step, 20);
  const std::string run_dir = j0["run_dir"];
  auto d = checkpoint::load_checkpoint_file(run_dir + "/checkpoints/last.ckpt");
  EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["global_step"], step);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "SIGTERM received; saved"), 1) << rs[0].stderr_text;
  if (strategy == "zero2") EXPECT_TRUE(d.has_blob("zero2")) << "the SIGTERM save is a sharded one";
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, SigtermOnOneRankStopsEveryRankAtTheSameStep) { sigterm_on_one_rank_stops_every_rank("ddp"); }
TEST(TrainerZero2, SigtermOnOneRankStopsEveryRankAtTheSameStep) { sigterm_on_one_rank_stops_every_rank("zero2"); }

// A rank killed in the middle of training ends the other with one clear line within the timeout.
// The timeout is short to keep the test quick, but not so short that a loaded machine's start-up
// (the rendezvous and the setup broadcasts share it) could exceed it before the kill.
void killed_rank_ends_the_other(const std::string& strategy) {
  Job job = new_job("kill-" + strategy);
  constexpr double kTimeout = 10.0;
  auto rs = fit(2, job, {"model.fault=kill", "model.fault_rank=1", "model.fault_call=3", "trainer.max_steps=1000",
                         "trainer.max_epochs=-1", fmt::format("trainer.dist_timeout={}", kTimeout), "trainer.strategy=" + strategy},
                std::nullopt, 60);
  EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL) << describe(rs);
  ASSERT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe: rank 0 of 2: distributed job failed: rank 1 stopped responding"), 1)
      << rs[0].stderr_text;
  EXPECT_LT(rs[0].seconds - rs[1].seconds, kTimeout + 2.0) << describe(rs);
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, KilledRankEndsTheOtherWithinTheTimeout) { killed_rank_ends_the_other("ddp"); }

// A rank that leaves out one collective (STROBE_SKIP_COLLECTIVE, the record's test hook): the ranks
// end within trainer.dist_timeout, rank 0 naming where they diverged (rank 1 issued the next
// collective where rank 0 waits in the one rank 1 left out) and each rank the collective it waits
// in, rank 0 last; each rank's record is in the run directory, its last entry the collective it
// ended in, its status the line it printed. A skip that leaves both ranks waiting is a hang, found
// when no collective moved for the hang deadline (10 s - 8 heartbeats of 0.5 s = 6 s); one the
// test double fails at once (sizes that disagree, as NCCL may) is found when the collective fails.
struct Skipped {
  std::string spec;      // STROBE_SKIP_COLLECTIVE
  std::string strategy;  // trainer.strategy
  std::string how;       // "hung" or "failed"
  std::string skipped;   // the collective rank 0 waits in
};
void a_skipped_collective_is_named(const Skipped& k) {
  Job job = new_job("skip-" + k.strategy);
  ::setenv("STROBE_SKIP_COLLECTIVE", k.spec.c_str(), 1);
  auto rs = fit(2, job, {"trainer.max_steps=1000", "trainer.max_epochs=-1", "trainer.dist_timeout=10",
                         "trainer.strategy=" + k.strategy},
                std::nullopt, 60);
  ::unsetenv("STROBE_SKIP_COLLECTIVE");
  ASSERT_EQ(rs[0].exit_code, 1) << k.spec << "\n" << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 1) << k.spec << "\n" << describe(rs);
  const auto lines0 = strobe::testing::split_any(rs[0].stderr_text, "\n");
  std::string line0, line1;
  for (const auto& l : lines0)
    if (l.rfind("strobe: ", 0) == 0) line0 = l;
  for (const auto& l : strobe::testing::split_any(rs[1].stderr_text, "\n"))
    if (l.rfind("strobe: ", 0) == 0) line1 = l;
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe:"), 1) << rs[0].stderr_text;
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "strobe:"), 1) << rs[1].stderr_text;
  const std::string head0 = "strobe: rank 0 of 2: distributed job " + k.how + ": ";
  EXPECT_EQ(line0.rfind(head0, 0), 0u) << line0;
  EXPECT_NE(line0.find(" as collective "), std::string::npos) << line0;
  EXPECT_NE(line0.find("where rank 0 issued " + k.skipped), std::string::npos) << line0;
  EXPECT_NE(line0.find("rank 1 issued "), std::string::npos) << line0;
  EXPECT_NE(line0.find("this rank waits in collective "), std::string::npos) << line0;
  EXPECT_EQ(line1.rfind("strobe: rank 1 of 2: distributed job " + k.how + ": this rank waits in collective ", 0), 0u) << line1;
  // Within the timeout: rank 0 reported while waiting in its collective for less than dist_timeout
  // (the processes' start-up, slow on a loaded machine, does not count).
  const auto waited_at = line0.find(" for ", line0.find("this rank waits in collective "));
  ASSERT_NE(waited_at, std::string::npos) << line0;
  EXPECT_LT(std::stod(line0.substr(waited_at + 5)), 10.0) << line0;
  EXPECT_GE(rs[0].seconds + 0.05, rs[1].seconds) << "rank 0's line comes last: " << describe(rs);
  // Both ranks' records, in the run directory rank 0's line names.
  const std::string run_dir = job.root + "/ddp/version_0";
  EXPECT_NE(line0.find(run_dir + "/collectives_rank<r>.json"), std::string::npos) << line0;
  int64_t at = -1;
  for (int r = 0; r < 2; ++r) {
    auto j = read_json(fmt::format("{}/collectives_rank{}.json", run_dir, r));
    ASSERT_TRUE(j.is_object()) << "rank " << r << "'s record";
    EXPECT_EQ(j["rank"], r);
    EXPECT_EQ(j["world_size"], 2);
    const std::string status = j["status"];
    EXPECT_NE((r == 0 ? line0 : line1).find(status), std::string::npos) << status;
    ASSERT_FALSE(j["collectives"].empty());
    const auto& last = j["collectives"].back();
    if (r == 0) {
      EXPECT_EQ(last["kind"], k.skipped) << j.dump(1);
      at = last["seq"];
    } else {
      EXPECT_EQ(last["seq"], at) << "the same collective number, another kind: " << j.dump(1);
      EXPECT_NE(last["kind"], k.skipped);
    }
    EXPECT_EQ(last["returned_ns"], 0) << "waiting in it";
  }
  // strobe hang reads both records: the ranks parted at that number, rank 1 first (2 ranks: rank 0's
  // kind is the reference).
  auto h = strobe::testing::strobe_cmd("hang " + run_dir);
  ASSERT_EQ(h.code, 0) << h.err;
  EXPECT_NE(h.out.find(fmt::format("collective {}:\n  rank 0 issued {} (", at, k.skipped)), std::string::npos) << h.out;
  EXPECT_NE(h.out.find(fmt::format("diverged first: rank 1 (the others issued there: {})", k.skipped)), std::string::npos) << h.out;
  EXPECT_NE(h.out.find(fmt::format("the ranks agree up to collective {},", at - 1)), std::string::npos) << h.out;
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, ASkippedStopAgreementIsNamedWithTheRankThatLeftItOut) {
  a_skipped_collective_is_named({"stop agreement@1#3", "ddp", "failed", "stop agreement"});
}
TEST(TrainerDDP, ASkippedMetricSyncIsNamedWithTheRankThatLeftItOut) {
  a_skipped_collective_is_named({"metric sync@1#1", "ddp", "failed", "metric sync"});
}
TEST(TrainerDDP, ASkippedCheckpointGatherIsAHangNamedWithTheRankThatLeftItOut) {
  a_skipped_collective_is_named({"host gather@1#1", "ddp", "hung", "host gather"});
}
TEST(TrainerZero2, ASkippedReduceScatterIsAHangNamedWithTheRankThatLeftItOut) {
  a_skipped_collective_is_named({"gradient reduce-scatter@1#2", "zero2", "hung", "gradient reduce-scatter"});
}

// A peer lost where the collective fails at once (NCCL over a network sees the closed socket in
// about a second, long before a heartbeat is stale): the survivor still names the dead rank, within
// a few heartbeats (1 s each here; a heartbeat would otherwise be stale only after 15 s).
TEST(TrainerDDP, ACollectiveThatFailsBecauseAPeerDiedNamesThatPeer) {
  Job job = new_job("lost-peer");
  auto rs = fit(2, job, {"model.fault=lost_peer", "model.fault_rank=1", "model.fault_call=3", "trainer.max_steps=1000",
                         "trainer.max_epochs=-1", "trainer.dist_timeout=30"},
                std::nullopt, 60);
  EXPECT_EQ(rs[1].exit_code, 128 + SIGKILL) << describe(rs);
  ASSERT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe: rank 0 of 2: distributed job failed: rank 1 stopped responding"), 1)
      << rs[0].stderr_text;
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe:"), 1) << rs[0].stderr_text;
  EXPECT_LT(rs[0].seconds - rs[1].seconds, 8.0) << describe(rs);
  checkpoint::remove_tree(job.dir);
}

// A collective that fails on one rank while every peer lives: that rank ends saying so, and the
// other ends naming it.
TEST(TrainerDDP, ACollectiveThatFailsWithEveryPeerAliveIsThatRanksError) {
  Job job = new_job("collective-error");
  auto rs = fit(2, job, {"model.fault=collective_error", "model.fault_rank=0", "model.fault_call=3", "trainer.max_steps=1000",
                         "trainer.max_epochs=-1", "trainer.dist_timeout=30"},
                std::nullopt, 60);
  ASSERT_EQ(rs[0].exit_code, 1) << describe(rs);
  ASSERT_EQ(rs[1].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[0].stderr_text, "strobe: rank 0 of 2: distributed job failed: a collective failed on this "
                                                "rank: NCCL error in: ProcessGroupNCCL.cpp:3780, remote process exited"),
            1)
      << rs[0].stderr_text;
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "strobe: rank 1 of 2: distributed job failed: rank 0 failed: NCCL error in:"), 1)
      << rs[1].stderr_text;
  checkpoint::remove_tree(job.dir);
}
TEST(TrainerZero2, KilledRankEndsTheOtherWithinTheTimeout) { killed_rank_ends_the_other("zero2"); }

// An exception inside a step on rank 1 with on_exception_checkpoint: rank 1 writes the checkpoint of
// the failed step's start without any collective and ends with its error; rank 0, blocked in the
// step's all-reduce, ends within the timeout naming that error (not a timeout of its own).
// Under zero2 the rank's file holds its parameters and its own optimizer shard (no gather).
void an_exception_on_one_rank_saves_its_checkpoint(const std::string& strategy) {
  Job job = new_job("throw-" + strategy);
  auto rs = fit(2, job, {"model.fault=throw", "model.fault_rank=1", "model.fault_call=5", "trainer.max_steps=1000",
                         "trainer.max_epochs=-1", "trainer.dist_timeout=30", "trainer.accumulate_grad_batches=1",
                         "callbacks=[{name: on_exception_checkpoint}]", "trainer.strategy=" + strategy},
                std::nullopt, 90);
  ASSERT_EQ(rs[1].exit_code, 1) << describe(rs);
  ASSERT_EQ(rs[0].exit_code, 1) << describe(rs);
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "probe failure on rank 1 at call 5"), 1) << rs[1].stderr_text;
  EXPECT_EQ(count_lines_with(rs[0].stderr_text,
                             "strobe: rank 0 of 2: distributed job failed: rank 1 failed: probe failure on rank 1 at call 5"),
            1)
      << rs[0].stderr_text;
  EXPECT_LT(rs[0].seconds, 20.0) << "rank 0 waited for a timeout instead of hearing rank 1's error: " << describe(rs);
  // Rank 1 wrote the file into the run directory (rank 0's choice, broadcast at setup).
  std::string ckpt;
  for (const auto& line : strobe::testing::split_any(rs[1].stderr_text, "\n"))
    if (auto at = line.find("saved "); at != std::string::npos) ckpt = line.substr(at + 6, line.find(" at step") - at - 6);
  ASSERT_TRUE(ckpt.size() > 30 && ckpt.substr(ckpt.size() - 30) == "/checkpoints/on_exception.ckpt") << rs[1].stderr_text;
  EXPECT_EQ(ckpt.rfind(job.root, 0), 0u) << ckpt << " is not in the job's run directory under " << job.root;
  EXPECT_EQ(count_lines_with(rs[1].stderr_text, "at step 4 (the failed step's start)"), 1) << rs[1].stderr_text;
  auto d = checkpoint::load_checkpoint_file(ckpt);
  EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["global_step"], 4);
  EXPECT_EQ(parse_loop_state(d.blob("loop")).global_step, 4);
  if (strategy == "zero2") {
    EXPECT_EQ(nlohmann::json::parse(d.blob("zero2_shard"))["rank"], 1);
    EXPECT_TRUE(d.tensors.count("model/fc1.weight") && d.tensor("model/fc1.weight").size(0) == 32) << "the whole parameter";
  }
  EXPECT_EQ(nlohmann::json::parse(d.blob("meta"))["rank_alone"], 1);
  if (strategy == "ddp") {  // one rank's state: no resume on another number of processes
    Job single = job;
    single.dir = job.dir + "/single";
    fs::create_directories(single.dir);
    auto r1 = fit(1, single, {"trainer.accumulate_grad_batches=1", "data.batch_size=8"}, ckpt);
    EXPECT_EQ(r1[0].exit_code, 2) << describe(r1);
    EXPECT_EQ(count_lines_with(r1[0].stderr_text, "written by 2 process(es), but this run has 1: it holds rank 1's state alone"), 1)
        << r1[0].stderr_text;
  }
  checkpoint::remove_tree(job.dir);
}

TEST(TrainerDDP, AnExceptionOnOneRankSavesItsCheckpointAndEndsTheOtherNamingTheError) {
  an_exception_on_one_rank_saves_its_checkpoint("ddp");
}
TEST(TrainerZero2, AnExceptionOnOneRankSavesItsOwnStateAndEndsTheOtherNamingTheError) {
  an_exception_on_one_rank_saves_its_checkpoint("zero2");
}

// The CLI: a bad trainer.dist_timeout, a malformed launch variable and multi-process on CPU (no CPU
// process group in the product) are each refused with exit 2 and one line, before any socket opens.
TEST(TrainerDDP, CliRefusesBadDistTimeoutAndLaunchWithOneLine) {
  Job job = new_job("cli");
  const std::string cfg = job.dir + "/ddp.yaml";
  std::ofstream(cfg) << yaml(job.root);
  const std::string env2 = "WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ";
  struct Case {
    std::string prefix, args, expect;
  } cases[] = {
      {"", "--set trainer.dist_timeout=0", "trainer.dist_timeout: expected a number in [1, 604800], got 0"},
      {"", "--set trainer.dist_timeout=soon", "trainer.dist_timeout: expected a number, got 'soon'"},
      {env2 + "RANK=one ", "", "RANK"},
      {env2 + "RANK=0 ", "", "multi-process training runs on CUDA (NCCL)"},
  };
  for (const auto& c : cases) {
    // The product's binary has no test model: an MLP of the same shape.
    auto r = st::shell_cmd(c.prefix, "fit -c " + cfg + " --set 'model={name: mlp, in_features: 64, hidden: [32], num_classes: 4}' " + c.args);
    EXPECT_EQ(r.code, 2) << c.prefix << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.prefix << c.args << "\n" << r.err;
    EXPECT_EQ(st::count_lines(r.err), 1) << r.err;
  }
  EXPECT_FALSE(fs::exists(job.root + "/ddp")) << "nothing may be written for a refused run";
  checkpoint::remove_tree(job.dir);
}

// trainer.strategy fsdp over the Llama: the decoder layers' parameters sharded as well (each rank
// holds its rows, gathered per layer for the forward and the backward), the embedding tied to the head
// and the final norm kept gathered; untied, the embedding (not gathered for its backward) and the
// head (through the logits or the fused loss) are units of their own; under trainer.fp8 the layers'
// float8 GEMMs read the gathered weights. The gradients reach the same shards as zero2's (the test double
// reduces every element in rank order, whatever the buckets), so the run ends on bitwise zero2's
// weights, validation loss and optimizer shards: in fp32 and bf16-master, with the layers freed after
// the forward or kept for the backward, with activation checkpointing, on 2, 3 and 4 ranks (zero2
// itself ends where ddp and one process end: TrainerZero2, TrainerDDP).
TEST(TrainerFsdp, LlamaEndsOnBitwiseZero2sWeightsWithTheLayersShardedBetweenSteps) {
  struct Variant {
    std::string precision;
    bool reshard;
    bool checkpointing;
    int world = 2;
    bool untied = false;      // the embedding and the head units of their own
    bool fused_head = false;  // task.fused_linear_loss: the head's loss in its unit
    bool fp8 = false;         // trainer.fp8: the layers' GEMMs in float8 on the gathered weights
  };
  for (const Variant& v : {Variant{"32", true, false}, Variant{"bf16-master", true, true}, Variant{"bf16-master", false, false},
                           Variant{"32", true, false, 3}, Variant{"bf16-master", true, false, 4},
                           Variant{"bf16-master", true, true, 2, true, true}, Variant{"32", true, false, 3, true},
                           Variant{"bf16-master", true, false, 2, false, false, true}}) {
    const std::string variant = v.precision + (v.reshard ? "-reshard" : "-keep") + (v.checkpointing ? "-ac" : "") +
                                (v.untied ? "-untied" : "") + (v.fused_head ? "-fused-head" : "") + (v.fp8 ? "-fp8" : "") +
                                "-w" + std::to_string(v.world);
    auto sets = llama_sets();
    sets.push_back("trainer.precision=" + v.precision);
    if (v.checkpointing) sets.push_back("model.activation_checkpointing=blocks");
    if (v.untied) sets.push_back("model.tie_embeddings=false");
    if (v.fused_head) sets.push_back("task.fused_linear_loss=true");
    if (v.fp8) sets.push_back("trainer.fp8={min_size: 0}");
    Job zero2 = new_job("fsdp-z2-" + variant), fsdp = new_job("fsdp-" + variant);
    auto rz = fit(v.world, zero2, joined(sets, {"trainer.strategy=zero2"}));
    for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << variant << "\n" << describe(rz);
    auto rf = fit(v.world, fsdp, joined(sets, {"trainer.strategy=fsdp", std::string("trainer.reshard_after_forward=") + (v.reshard ? "true" : "false")}));
    for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << variant << "\n" << describe(rf);
    auto jz = read_json(zero2.dir + "/rank0.json"), jf0 = read_json(fsdp.dir + "/rank0.json"), jf1 = read_json(fsdp.dir + "/rank1.json");
    ASSERT_GT(jf0["global_step"].get<int>(), 0) << variant;
    EXPECT_EQ(jf0["global_step"], jz["global_step"]) << variant;
    EXPECT_EQ(jf0["optimizer_numel"], jz["optimizer_numel"]) << variant << ": the optimizer's shards are zero2's";
    // 2 layers x 9 parameters freed; the tied embedding and the final norm kept gathered (untied:
    // the embedding and the head freed too, the final norm alone kept).
    const int freed = v.untied ? 20 : 18;
    EXPECT_EQ(jf0["freed_params"], freed) << variant;
    EXPECT_EQ(jf1["freed_params"], freed) << variant;
    EXPECT_EQ(jz["freed_params"], 0) << variant;
    auto a = model_tensors(jz["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    auto b = model_tensors(jf0["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    ASSERT_EQ(a.size(), b.size()) << variant;
    for (auto& [k, t] : b) EXPECT_TRUE(torch::equal(t, a.at(k))) << variant << " " << k << " differs from zero2's";
    const double vz = jz["metrics"]["val/loss"], vf = jf0["metrics"]["val/loss"];
    std::cout << "[ fsdp ] " << variant << ": val/loss zero2 " << vz << ", fsdp " << vf << "\n";
    EXPECT_EQ(vf, vz) << variant;
    EXPECT_EQ(jf1["metrics"]["val/loss"].get<double>(), vf) << variant;
    if (v.precision == "bf16-master" && v.reshard && v.world == 2 && !v.fp8) {
      // Stopped at step 3 and resumed to 6, under fsdp and under zero2 on 2 ranks: bitwise the
      // uninterrupted run's weights (the root unit takes the checkpoint's values too); one process
      // resumes it as well.
      auto fsets = joined(sets, {"trainer.strategy=fsdp"});
      Job part = new_job("fsdp-part-" + variant);
      auto rp = fit(2, part, joined(fsets, {"trainer.max_steps=3"}));
      for (auto& r : rp) ASSERT_EQ(r.exit_code, 0) << describe(rp);
      const std::string saved = part.dir + "/step3";
      fs::copy(read_json(part.dir + "/rank0.json")["run_dir"].get<std::string>() + "/checkpoints", saved, fs::copy_options::recursive);
      for (const std::string strategy : {"fsdp", "zero2"}) {
        Job again = new_job("fsdp-resume-" + strategy + "-" + variant);
        auto rr = fit(2, again, joined(sets, {"trainer.strategy=" + strategy}), saved + "/last.ckpt");
        for (auto& r : rr) ASSERT_EQ(r.exit_code, 0) << strategy << "\n" << describe(rr);
        auto jr = read_json(again.dir + "/rank0.json");
        EXPECT_EQ(jr["global_step"], 6) << strategy;
        auto c = model_tensors(jr["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
        for (auto& [k, t] : b) EXPECT_TRUE(torch::equal(t, c.at(k))) << "resumed under " << strategy << ": " << k;
        EXPECT_EQ(jr["metrics"]["val/loss"].get<double>(), vf) << strategy;
        checkpoint::remove_tree(again.dir);
      }
      // On 4 ranks under fsdp, keeping the global batch (4 x 2): the optimizer shards re-cut for 4,
      // near the uninterrupted run (other reductions).
      {
        Job four = new_job("fsdp-resume-four-" + variant);
        auto r4 = fit(4, four, joined(fsets, {"data.batch_size=2"}), saved + "/last.ckpt");
        for (auto& r : r4) ASSERT_EQ(r.exit_code, 0) << describe(r4);
        auto j4 = read_json(four.dir + "/rank0.json");
        EXPECT_EQ(j4["global_step"], 6);
        EXPECT_EQ(j4["freed_params"], freed);
        EXPECT_NEAR(j4["metrics"]["val/loss"].get<double>(), vf, 1e-3 * vf);
        checkpoint::remove_tree(four.dir);
      }
      // The uninterrupted run's step-6 checkpoint on one process: `strobe validate` runs (its loss
      // near the run's last validation, at step 4), `strobe predict`'s mean over the test split's
      // tokens is `strobe test`'s loss, `strobe export` writes the checkpoint's weights.
      {
        const std::string ckpt = jf0["run_dir"].get<std::string>() + "/checkpoints/last.ckpt", cfg = fsdp.dir + "/cli.yaml";
        std::ofstream(cfg) << yaml(fsdp.dir + "/cli-root");
        std::string args = " -c " + cfg + " --ckpt " + ckpt;
        for (const auto& s : sets) args += " --set '" + s + "'";
        auto val = st::strobe_cmd("validate" + args);
        ASSERT_EQ(val.code, 0) << val.err;
        const auto at = val.out.find("val/loss");
        ASSERT_NE(at, std::string::npos) << val.out;
        const double v1 = std::stod(val.out.substr(val.out.find_first_of("0123456789", at + 8)));
        EXPECT_NEAR(v1, vf, 1e-2 * vf) << val.out;
        auto test = st::strobe_cmd("test" + args);
        ASSERT_EQ(test.code, 0) << test.err;
        const auto tat = test.out.find("test/loss");
        ASSERT_NE(tat, std::string::npos) << test.out;
        const double t1 = std::stod(test.out.substr(test.out.find_first_of("0123456789", tat + 9)));
        auto pred = st::strobe_cmd("predict" + args + " -o " + fsdp.dir + "/pred.safetensors");
        ASSERT_EQ(pred.code, 0) << pred.err;
        double predicted = std::numeric_limits<double>::quiet_NaN();
        for (const auto& [k, t] : safetensors::read_file(fsdp.dir + "/pred.safetensors").tensors)
          if (k == "token_loss") predicted = t.mean().item<double>();
        std::cout << "[ fsdp ] one process: validate " << v1 << " (the run's at step 4: " << vf << "), test " << t1
                  << ", predict " << predicted << "\n";
        EXPECT_NEAR(predicted, t1, 1e-5 * t1) << "predict's mean token loss over the test split";
        auto ex = st::strobe_cmd("export " + ckpt + " -o " + fsdp.dir + "/w.safetensors");
        ASSERT_EQ(ex.code, 0) << ex.err;
        const auto exported = safetensors::read_file(fsdp.dir + "/w.safetensors").tensors;
        EXPECT_EQ(exported.size(), b.size());
        for (const auto& [k, t] : exported) EXPECT_TRUE(torch::equal(t, b.at("model/" + k))) << "exported " << k;
      }
      Job one = new_job("fsdp-resume-one-" + variant);
      auto r1 = fit(1, one, fsets, saved + "/last.ckpt");
      EXPECT_EQ(r1[0].exit_code, 0) << describe(r1);
      EXPECT_EQ(read_json(one.dir + "/rank0.json")["global_step"], 6);
      checkpoint::remove_tree(one.dir);
      checkpoint::remove_tree(part.dir);
    }
    checkpoint::remove_tree(zero2.dir);
    checkpoint::remove_tree(fsdp.dir);
  }
}


// The ema and swa callbacks under fsdp: each rank averages its rows of the fp32 values, validation
// runs on the averages swapped into the rows the units gather from, and checkpoints hold the
// averages whole: in fp32 (where zero2's weights are the same fp32 values, whole) they end on
// bitwise zero2's averages, weights and validation losses on both ranks; `strobe export --ema|--swa`
// writes them; an ema run stopped at step 3 and resumed under fsdp (the averages cut again from the
// whole ones) ends on the uninterrupted run's averages.
TEST(TrainerFsdp, EmaAndSwaAverageTheRowsAndEndOnZero2sAverages) {
  struct Variant {
    std::string name, prefix;
    std::vector<std::string> sets;
  };
  for (const Variant& v : {Variant{"ema", "ema/", {"callbacks=[{name: ema, decay: 0.8}]"}},
                           Variant{"swa", "swa/", {"callbacks=[{name: swa, swa_lrs: 0.005, swa_epoch_start: 1, annealing_epochs: 1}]",
                                                    "trainer.max_steps=12"}}}) {
    auto sets = joined(llama_sets(), v.sets);
    sets.push_back("model.tie_embeddings=false");
    Job zero2 = new_job("avg-z2-" + v.name), fsdp = new_job("avg-fsdp-" + v.name);
    auto rz = fit(2, zero2, joined(sets, {"trainer.strategy=zero2"}));
    for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << v.name << "\n" << describe(rz);
    auto rf = fit(2, fsdp, joined(sets, {"trainer.strategy=fsdp"}));
    for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << v.name << "\n" << describe(rf);
    auto jz = read_json(zero2.dir + "/rank0.json"), jf0 = read_json(fsdp.dir + "/rank0.json"), jf1 = read_json(fsdp.dir + "/rank1.json");
    EXPECT_EQ(jf0["freed_params"], 20) << v.name;
    const auto tz = checkpoint::load_checkpoint_file(jz["run_dir"].get<std::string>() + "/checkpoints/last.ckpt").tensors;
    const std::string fsdp_last = jf0["run_dir"].get<std::string>() + "/checkpoints/last.ckpt";
    const auto tf = checkpoint::load_checkpoint_file(fsdp_last).tensors;
    int64_t averages = 0;
    for (const auto& [k, t] : tz) {
      if (k.rfind(v.prefix, 0) != 0 && k.rfind("model/", 0) != 0) continue;
      averages += k.rfind(v.prefix, 0) == 0;
      ASSERT_TRUE(tf.count(k)) << v.name << ": the fsdp checkpoint lacks " << k;
      EXPECT_EQ(tf.at(k).sizes(), t.sizes()) << k;
      EXPECT_TRUE(torch::equal(tf.at(k), t)) << v.name << ": " << k << " differs from zero2's";
    }
    EXPECT_EQ(averages, 21) << v.name << ": every parameter's average (20 in freed units, the final norm kept)";
    // The averages moved away from the weights (validation on them is not validation on the weights).
    EXPECT_FALSE(torch::equal(tf.at(v.prefix + "layers.0.mlp.up_proj.weight"), tf.at("model/layers.0.mlp.up_proj.weight")));
    const double vz = jz["metrics"]["val/loss"], vf = jf0["metrics"]["val/loss"];
    std::cout << "[ fsdp ] " << v.name << ": val/loss zero2 " << vz << ", fsdp " << vf << "\n";
    EXPECT_EQ(vf, vz) << v.name;
    EXPECT_EQ(jf1["metrics"]["val/loss"].get<double>(), vf) << v.name;
    auto ex = st::strobe_cmd("export " + fsdp_last + " --" + v.name + " -o " + fsdp.dir + "/avg.safetensors");
    ASSERT_EQ(ex.code, 0) << ex.err;
    const auto exported = safetensors::read_file(fsdp.dir + "/avg.safetensors").tensors;
    EXPECT_EQ(exported.size(), 21u) << v.name;
    for (const auto& [k, t] : exported) EXPECT_TRUE(torch::equal(t, tf.at(v.prefix + k))) << "exported " << k;
    if (v.name == "ema") {
      Job part = new_job("avg-part");
      auto fsets = joined(sets, {"trainer.strategy=fsdp"});
      auto rp = fit(2, part, joined(fsets, {"trainer.max_steps=3"}));
      for (auto& r : rp) ASSERT_EQ(r.exit_code, 0) << describe(rp);
      const std::string saved = part.dir + "/step3";
      fs::copy(read_json(part.dir + "/rank0.json")["run_dir"].get<std::string>() + "/checkpoints", saved, fs::copy_options::recursive);
      Job again = new_job("avg-resume");
      auto rr = fit(2, again, fsets, saved + "/last.ckpt");
      for (auto& r : rr) ASSERT_EQ(r.exit_code, 0) << describe(rr);
      auto jr = read_json(again.dir + "/rank0.json");
      EXPECT_EQ(jr["global_step"], 6);
      const auto tr = checkpoint::load_checkpoint_file(jr["run_dir"].get<std::string>() + "/checkpoints/last.ckpt").tensors;
      for (const auto& [k, t] : tf)
        if (k.rfind("ema/", 0) == 0) EXPECT_TRUE(torch::equal(tr.at(k), t)) << "resumed: " << k;
      EXPECT_EQ(jr["metrics"]["val/loss"].get<double>(), vf);
      // On 4 ranks keeping the global batch (4 x 2): the whole averages cut for 4, near the
      // uninterrupted run's (other reductions).
      Job four = new_job("avg-resume-four");
      auto r4 = fit(4, four, joined(fsets, {"data.batch_size=2"}), saved + "/last.ckpt");
      for (auto& r : r4) ASSERT_EQ(r.exit_code, 0) << describe(r4);
      auto j4 = read_json(four.dir + "/rank0.json");
      const auto t4 = checkpoint::load_checkpoint_file(j4["run_dir"].get<std::string>() + "/checkpoints/last.ckpt").tensors;
      for (const auto& [k, t] : tf)
        if (k.rfind("ema/", 0) == 0) EXPECT_LT((t4.at(k) - t).abs().max().item<double>(), 1e-3 * (1 + t.abs().max().item<double>())) << "on 4: " << k;
      checkpoint::remove_tree(four.dir);
      checkpoint::remove_tree(again.dir);
      checkpoint::remove_tree(part.dir);
    }
    checkpoint::remove_tree(zero2.dir);
    checkpoint::remove_tree(fsdp.dir);
  }
}

// optimizer.param_groups.freeze under fsdp: an untied Llama's embedding and first layer (two whole
// units) frozen through epoch 0 and unfrozen at epoch 1 (step 4): their units' reduce-scatter buckets
// are passed over while frozen, the unfreeze hooks their gradients, and the run ends on bitwise the
// weights and validation loss of zero2 with the same freeze (whose freeze ends where one process's
// does: TrainerDDP.AnUnfreezeRebuildsTheReducer...); never unfrozen, they end as they started.
TEST(TrainerFsdp, AFrozenEmbeddingAndLayerUnfreezeAsUnderZero2) {
  for (const std::string unfreeze : {"1", "-1"}) {
    auto sets = llama_sets();
    sets.push_back("model.tie_embeddings=false");
    sets.push_back("trainer.precision=bf16-master");
    sets.push_back("optimizer.weight_decay=0.1");
    sets.push_back("optimizer.param_groups={no_decay: auto, layer_decay: 0.7, freeze: ['embed_tokens.*', 'layers.0.*']" +
                   (unfreeze == "1" ? std::string(", unfreeze_at_epoch: 1}") : std::string("}")));
    Job zero2 = new_job("fsdp-freeze-z2-" + unfreeze), fsdp = new_job("fsdp-freeze-" + unfreeze), init = new_job("fsdp-freeze-init-" + unfreeze);
    auto rz = fit(2, zero2, joined(sets, {"trainer.strategy=zero2"}));
    for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << unfreeze << "\n" << describe(rz);
    auto rf = fit(2, fsdp, joined(sets, {"trainer.strategy=fsdp"}));
    for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << unfreeze << "\n" << describe(rf);
    const auto out = slurp(fsdp.dir + "/rank0.stdout");
    EXPECT_EQ(out.find("strobe fit: epoch 1: unfroze 10 parameter tensors") != std::string::npos, unfreeze == "1") << out;
    auto jz = read_json(zero2.dir + "/rank0.json"), jf = read_json(fsdp.dir + "/rank0.json");
    EXPECT_EQ(jf["global_step"], 6);
    EXPECT_EQ(jf["freed_params"], 20);
    auto a = model_tensors(jz["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    auto b = model_tensors(jf["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    ASSERT_EQ(a.size(), b.size());
    for (auto& [k, t] : b) EXPECT_TRUE(torch::equal(t, a.at(k))) << unfreeze << " " << k << " differs from zero2's";
    EXPECT_EQ(jf["metrics"]["val/loss"].get<double>(), jz["metrics"]["val/loss"].get<double>()) << unfreeze;
    if (unfreeze == "-1") {  // frozen throughout: the initial weights (those of a run of one step)
      auto r0 = fit(2, init, joined(sets, {"trainer.strategy=fsdp", "trainer.max_steps=1"}));
      for (auto& r : r0) ASSERT_EQ(r.exit_code, 0) << describe(r0);
      auto c = model_tensors(read_json(init.dir + "/rank0.json")["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
      for (const std::string k : {"model/embed_tokens.weight", "model/layers.0.mlp.up_proj.weight"})
        EXPECT_TRUE(torch::equal(b.at(k), c.at(k))) << k << " moved while frozen";
      EXPECT_FALSE(torch::equal(b.at("model/layers.1.mlp.up_proj.weight"), c.at("model/layers.1.mlp.up_proj.weight")));
    }
    checkpoint::remove_tree(zero2.dir);
    checkpoint::remove_tree(fsdp.dir);
    checkpoint::remove_tree(init.dir);
  }
}

// vit's and decoder_lm's blocks are units too (decoder_lm's output head as well): each ends on
// bitwise zero2's weights (fp32), its units' parameters holding no data between steps.
TEST(TrainerFsdp, VitAndDecoderLmEndOnBitwiseZero2sWeights) {
  struct Case {
    std::string name;
    std::vector<std::string> sets;
    int freed;  // the blocks' parameters
  };
  const std::vector<Case> cases = {
      {"vit", {"model={name: vit, img_size: 8, patch_size: 4, in_channels: 1, num_classes: 4, embed_dim: 16, depth: 2, num_heads: 2}"}, 2 * 12},
      {"decoder_lm",
       {"model={name: decoder_lm, vocab_size: 97, max_seq_len: 24, embed_dim: 32, depth: 2, num_heads: 2}",
        "data={name: synthetic_tokens, vocab_size: 97, max_seq_len: 24, fixed_length: true, num_samples: 64, "
        "num_val_samples: 16, batch_size: 4, collate: pad_to_max, num_workers: 0}"},
       2 * 10 + 2},
  };
  for (const auto& c : cases) {
    Job zero2 = new_job("fsdp-z2-" + c.name), fsdp = new_job("fsdp-" + c.name);
    auto rz = fit(2, zero2, joined(c.sets, {"trainer.strategy=zero2"}));
    for (auto& r : rz) ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << describe(rz);
    auto rf = fit(2, fsdp, joined(c.sets, {"trainer.strategy=fsdp"}));
    for (auto& r : rf) ASSERT_EQ(r.exit_code, 0) << c.name << "\n" << describe(rf);
    auto jz = read_json(zero2.dir + "/rank0.json"), jf = read_json(fsdp.dir + "/rank0.json");
    EXPECT_EQ(jf["freed_params"], c.freed) << c.name;
    EXPECT_EQ(read_json(fsdp.dir + "/rank1.json")["freed_params"], c.freed) << c.name;
    auto a = model_tensors(jz["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    auto b = model_tensors(jf["run_dir"].get<std::string>() + "/checkpoints/last.ckpt");
    ASSERT_EQ(a.size(), b.size()) << c.name;
    for (auto& [k, t] : b) EXPECT_TRUE(torch::equal(t, a.at(k))) << c.name << " " << k << " differs from zero2's";
    EXPECT_EQ(jf["metrics"]["val/loss"].get<double>(), jz["metrics"]["val/loss"].get<double>()) << c.name;
    checkpoint::remove_tree(zero2.dir);
    checkpoint::remove_tree(fsdp.dir);
  }
}

}  // namespace
}  // namespace strobe
