// Trainer behaviour: hook order, gradient accumulation, clipping, schedulers, loop limits.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_keys.h"
#include "strobe/config/experiment_parse.h"
#include "strobe/core/callback.h"
#include "strobe/core/optim.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

std::vector<std::string>& hook_log() {
  static std::vector<std::string> log;
  return log;
}

class Recorder : public Callback, public InStepHooks {
 public:
  std::string name() const override { return "recorder"; }
  InStepHooks* in_step_hooks() override { return this; }
#define REC(hook, ...) \
  void hook(__VA_ARGS__) override { hook_log().push_back(#hook); }
  REC(setup, TrainerView&, Module&, Stage)
  REC(teardown, TrainerView&, Module&, Stage)
  REC(on_fit_start, TrainerView&, Module&)
  REC(on_fit_end, TrainerView&, Module&)
  REC(on_sanity_check_start, TrainerView&, Module&)
  REC(on_sanity_check_end, TrainerView&, Module&)
  REC(on_train_start, TrainerView&, Module&)
  REC(on_train_end, TrainerView&, Module&)
  REC(on_train_epoch_start, TrainerView&, Module&)
  REC(on_train_epoch_end, TrainerView&, Module&)
  REC(on_train_batch_start, TrainerView&, Module&, const Batch&, int64_t)
  REC(on_train_batch_end, TrainerView&, Module&, const torch::Tensor&, const Batch&, int64_t)
  REC(on_validation_start, TrainerView&, Module&)
  REC(on_validation_end, TrainerView&, Module&)
  REC(on_validation_epoch_start, TrainerView&, Module&)
  REC(on_validation_epoch_end, TrainerView&, Module&)
  REC(on_validation_batch_start, TrainerView&, Module&, const Batch&, int64_t)
  REC(on_validation_batch_end, TrainerView&, Module&, const Batch&, int64_t)
  REC(on_before_backward, TrainerView&, Module&, const torch::Tensor&)
  REC(on_after_backward, TrainerView&, Module&)
  REC(on_before_optimizer_step, TrainerView&, Module&, torch::optim::Optimizer&)
  REC(on_before_zero_grad, TrainerView&, Module&, torch::optim::Optimizer&)
  REC(on_save_checkpoint, TrainerView&, Module&, checkpoint::CheckpointData&)
#undef REC
};

std::shared_ptr<Callback> make_recorder(config::Section& cfg) {
  cfg.finish();
  return std::make_shared<Recorder>();
}
STROBE_REGISTER(callback_registry(), "recorder", make_recorder);

}  // namespace

TEST(Trainer, HooksRunInLightningOrder) {
  hook_log().clear();
  auto run = make_run(tiny_yaml() + "callbacks:\n  - name: recorder\n",
                      {"trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                       "trainer.accumulate_grad_batches=2", "trainer.enable_checkpointing=false"},
                      temp_dir("hooks"));
  ASSERT_EQ(run->trainer->fit(), 0);
  const std::vector<std::string> batch = {"on_train_batch_start", "on_before_backward", "on_after_backward"};
  std::vector<std::string> expected = {"setup", "on_fit_start", "on_sanity_check_start", "on_validation_start",
                                       "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
                                       "on_validation_epoch_end", "on_validation_end", "on_sanity_check_end",
                                       "on_train_start", "on_train_epoch_start"};
  // Batch 0 accumulates; batch 1 completes the optimizer step.
  expected.insert(expected.end(), batch.begin(), batch.end());
  expected.push_back("on_train_batch_end");
  expected.insert(expected.end(), batch.begin(), batch.end());
  for (const char* h : {"on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end", "on_validation_start",
                        "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
                        "on_validation_epoch_end", "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end",
                        "teardown"})
    expected.push_back(h);
  EXPECT_EQ(hook_log(), expected);
}

TEST(Trainer, GradientAccumulationEqualsTheLargeBatchStep) {
  const std::vector<std::string> common = {"model.dropout=0.0",   "data.shuffle=false",     "optimizer.name=sgd",
                                           "optimizer.lr=0.5",    "scheduler={name: none}",    "trainer.max_steps=1",
                                           "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    auto run = make_run(tiny_yaml(), extra, temp_dir("accum"));
    EXPECT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(run->trainer->view().state().global_step, 1);
    return params_of(*run->module);
  };
  auto big = with({"data.batch_size=8", "trainer.accumulate_grad_batches=1"});
  auto small = with({"data.batch_size=4", "trainer.accumulate_grad_batches=2"});
  auto before = [&] {
    auto run = make_run(tiny_yaml(), common, temp_dir("accum0"));
    return params_of(*run->module);
  }();
  ASSERT_FALSE(bitwise_equal(big, before)) << "the step changed nothing";
  for (auto& kv : big) EXPECT_TRUE(torch::allclose(kv.second, small.at(kv.first), 1e-5, 1e-6)) << kv.first;
}

namespace {
// Parameters after one SGD step with lr 1, and the change relative to the initial parameters.
std::pair<double, double> step_change(const std::vector<std::string>& clip) {
  std::vector<std::string> sets = {"model.dropout=0.0", "optimizer.name=sgd",       "optimizer.lr=1.0",
                                   "optimizer.weight_decay=0.0", "scheduler={name: none}", "trainer.max_steps=1",
                                   "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false"};
  sets.insert(sets.end(), clip.begin(), clip.end());
  auto run = make_run(tiny_yaml(), sets, temp_dir("clip"));
  auto before = params_of(*run->module);
  EXPECT_EQ(run->trainer->fit(), 0);
  auto after = params_of(*run->module);
  double sq = 0, max_abs = 0;
  for (auto& kv : before) {
    auto d = (after.at(kv.first) - kv.second).to(torch::kFloat64);
    sq += d.pow(2).sum().item<double>();
    max_abs = std::max(max_abs, d.abs().max().item<double>());
  }
  return {std::sqrt(sq), max_abs};
}
}  // namespace

TEST(Trainer, ClipsGradientsByNorm) {
  auto [unclipped_norm, unused] = step_change({});
  ASSERT_GT(unclipped_norm, 0.02);
  auto [norm, max_abs] = step_change({"trainer.gradient_clip_val=0.01"});
  EXPECT_NEAR(norm, 0.01, 1e-5);
}

TEST(Trainer, ClipsGradientsByValue) {
  auto [n0, unclipped_max] = step_change({});
  ASSERT_GT(unclipped_max, 1e-3);
  auto [norm, max_abs] = step_change({"trainer.gradient_clip_val=0.001", "trainer.gradient_clip_algorithm=value"});
  EXPECT_NEAR(max_abs, 0.001, 1e-7);
}

TEST(Trainer, MaxStepsAndLimitsStopTheLoop) {
  auto run = make_run(tiny_yaml(), {"trainer.max_steps=5", "trainer.enable_checkpointing=false"}, temp_dir("limits"));
  ASSERT_EQ(run->trainer->fit(), 0);
  EXPECT_EQ(run->trainer->view().state().global_step, 5);
  auto run2 = make_run(tiny_yaml(), {"trainer.limit_train_batches=3", "trainer.max_epochs=3", "trainer.enable_checkpointing=false"},
                       temp_dir("limits2"));
  ASSERT_EQ(run2->trainer->fit(), 0);
  EXPECT_EQ(run2->trainer->view().state().global_step, 9);
  EXPECT_EQ(run2->trainer->view().state().epoch, 2);
}

TEST(Trainer, LogsLossesAndValidationMetricsToCsv) {
  std::string dir = temp_dir("csv");
  auto run = make_run(tiny_yaml(), {"trainer.max_epochs=1", "trainer.log_every_n_steps=4"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  std::ifstream in(dir + "/metrics.csv");
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, "step,epoch,train/loss,val/acc,val/f1,val/loss");
  auto loss = read_csv(dir + "/metrics.csv", "train/loss");
  std::vector<int64_t> steps;
  for (auto& kv : loss) steps.push_back(kv.first);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 4, 8, 12}));
  auto acc = read_csv(dir + "/metrics.csv", "val/acc");
  ASSERT_EQ(acc.size(), 1u);
  EXPECT_EQ(acc.begin()->first, 12);
  EXPECT_TRUE(std::filesystem::exists(dir + "/config.yaml"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoints/last.ckpt"));
}

TEST(Trainer, LearnsTheSyntheticTask) {
  auto run = make_run(tiny_yaml(), {"trainer.max_epochs=4", "model.dropout=0.0", "scheduler.max_steps=48",
                                    "trainer.enable_checkpointing=false"},
                      temp_dir("learn"));
  ASSERT_EQ(run->trainer->fit(), 0);
  EXPECT_GT(run->trainer->view().metrics().at("val/acc"), 0.9);
}

TEST(Scheduler, ValuesAtGivenSteps) {
  auto p = torch::zeros({1}, torch::requires_grad());
  auto lr_at = [&](const std::string& yaml, std::vector<int64_t> steps) {
    auto opt = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(1.0));
    auto doc = config::Document::load_string(yaml, "sched.yaml");
    auto sec = doc.root();
    auto s = build_scheduler(config::parse_scheduler(sec), *opt, 100);
    std::vector<double> out;
    for (auto st : steps) {
      s->step(st);
      out.push_back(get_lr(*opt));
    }
    return out;
  };
  auto cos = lr_at("name: cosine\nwarmup_steps: 10\n", {0, 5, 10, 55, 100, 150});
  std::vector<double> want = {0.0, 0.5, 1.0, 0.5, 0.0, 0.0};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(cos[i], want[i], 1e-12) << i;
  EXPECT_EQ(lr_at("name: multistep\nmilestones: [3, 6]\ngamma: 0.1\n", {2, 3, 5, 6}),
            (std::vector<double>{1.0, 0.1, 0.1, 0.1 * 0.1}));
  auto st = lr_at("name: step\nstep_size: 4\ngamma: 0.5\n", {3, 4, 8});
  EXPECT_DOUBLE_EQ(st[0], 1.0);
  EXPECT_DOUBLE_EQ(st[1], 0.5);
  EXPECT_DOUBLE_EQ(st[2], 0.25);
  auto lw = lr_at("name: linear_warmup\nwarmup_steps: 4\n", {0, 1, 4, 9});
  EXPECT_EQ(lw, (std::vector<double>{0.0, 0.25, 1.0, 1.0}));
}

TEST(Scheduler, ReduceOnPlateauAfterPatienceAndSurvivesStateDict) {
  auto p = torch::zeros({1}, torch::requires_grad());
  auto opt = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(1.0));
  auto doc = config::Document::load_string("name: reduce_on_plateau\npatience: 1\nfactor: 0.5\n", "s.yaml");
  auto sec = doc.root();
  auto s = build_scheduler(config::parse_scheduler(sec), *opt, -1);
  s->on_validation_end(1.0);
  s->on_validation_end(0.9);
  s->on_validation_end(0.95);
  EXPECT_DOUBLE_EQ(get_lr(*opt), 1.0);
  s->on_validation_end(0.96);
  EXPECT_DOUBLE_EQ(get_lr(*opt), 0.5);
  auto state = s->state_dict();
  auto opt2 = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(1.0));
  auto doc2 = config::Document::load_string("name: reduce_on_plateau\npatience: 1\nfactor: 0.5\n", "s.yaml");
  auto sec2 = doc2.root();
  auto s2 = build_scheduler(config::parse_scheduler(sec2), *opt2, -1);
  s2->load_state_dict(state);
  EXPECT_DOUBLE_EQ(get_lr(*opt2), 0.5);
}

TEST(Scheduler, CosineWithoutRunLengthIsAConfigError) {
  auto p = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(1.0));
  auto doc = config::Document::load_string("name: cosine\n", "s.yaml");
  auto sec = doc.root();
  EXPECT_THROW(build_scheduler(config::parse_scheduler(sec), opt, -1), config::ConfigError);
}

TEST(Trainer, BfloatMixedPrecisionTrainsOnCpu) {
  std::string dir = temp_dir("bf16");
  auto run = make_run(tiny_yaml(), {"trainer.precision=bf16-mixed", "model.dropout=0.0", "trainer.max_epochs=3",
                                    "scheduler.max_steps=36"},
                      dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  auto loss = read_csv(dir + "/metrics.csv", "train/loss");
  double first = std::stod(loss.begin()->second["train/loss"]), last = std::stod(loss.rbegin()->second["train/loss"]);
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first);
}

TEST(ModelCheckpoint, KeepsTheTopKByTheMonitoredMetricAndLast) {
  std::string dir = temp_dir("topk");
  auto run = make_run(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    monitor: val/loss\n    mode: min\n    save_top_k: 2\n",
                      {"trainer.val_check_interval=4"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  std::vector<double> kept;
  bool last = false;
  for (auto& e : std::filesystem::directory_iterator(dir + "/checkpoints")) {
    std::string f = e.path().filename().string();
    if (f == "last.ckpt") {
      last = true;
      continue;
    }
    auto pos = f.find("val_loss=");
    ASSERT_NE(pos, std::string::npos) << f;
    kept.push_back(std::stod(f.substr(pos + 9)));
  }
  EXPECT_TRUE(last);
  ASSERT_EQ(kept.size(), 2u);
  std::vector<double> all;
  for (auto& kv : read_csv(dir + "/metrics.csv", "val/loss")) all.push_back(std::stod(kv.second["val/loss"]));
  ASSERT_EQ(all.size(), 6u);  // 24 batches, validation every 4
  std::sort(all.begin(), all.end());
  std::sort(kept.begin(), kept.end());
  EXPECT_NEAR(kept[0], all[0], 1e-4);
  EXPECT_NEAR(kept[1], all[1], 1e-4);
}

namespace {

// The checkpoint files (besides last.ckpt) in a run's checkpoints/ folder, sorted.
std::vector<std::string> checkpoint_files(const std::string& run_dir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(run_dir + "/checkpoints"))
    if (e.path().filename() != "last.ckpt") out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// Without a monitor the k most recent checkpoints are kept (the score is the step), whatever `mode`.
TEST(ModelCheckpoint, WithoutAMonitorEveryNStepsKeepsTheMostRecent) {
  for (const std::string mode : {"", "    mode: min\n", "    mode: max\n"}) {
    std::string dir = temp_dir("topk-steps");
    auto run = make_run(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 3\n    save_top_k: 2\n" + mode,
                        {"trainer.max_steps=9"}, dir);
    ASSERT_EQ(run->trainer->fit(), 0);
    EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"step=6.ckpt", "step=9.ckpt"})) << mode;
    EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoints/last.ckpt"));
  }
}

// The default model_checkpoint (none configured) keeps the latest epoch's checkpoint.
TEST(ModelCheckpoint, TheDefaultCheckpointKeepsTheLatestEpoch) {
  std::string dir = temp_dir("topk-epochs");
  auto run = make_run(tiny_yaml(), {"trainer.max_epochs=3"}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  ASSERT_EQ(run->trainer->view().state().global_step, 36);  // 12 batches an epoch
  EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"epoch=2-step=36.ckpt"}));
}

// A checkpoint written before the top-k list was run-relative: its <run>/checkpoints files become
// run-relative (a copied run finds its own), any other path stays listed but is never deleted.
TEST(ModelCheckpoint, OlderStatesBecomeRunRelative) {
  auto run = make_run(tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    save_top_k: 2\n", {}, temp_dir("legacy"));
  std::shared_ptr<Callback> mc;
  for (const auto& cb : run->callbacks)
    if (cb->name() == "model_checkpoint") mc = cb;
  ASSERT_TRUE(mc);
  mc->load_state_dict({{"best_k", {{"/old/runs/t/version_0/checkpoints/epoch=1-step=24.ckpt", 24.0}, {"/elsewhere/e.ckpt", 12.0}}},
                       {"best_path", "/old/runs/t/version_0/checkpoints/epoch=1-step=24.ckpt"},
                       {"last_step_saved", 24},
                       {"monitor", ""}});
  const auto st = mc->state_dict();
  EXPECT_EQ(st.at("best_k"), nlohmann::json({{"checkpoints/epoch=1-step=24.ckpt", 24.0}, {"/elsewhere/e.ckpt", 12.0}})) << st.dump();
  EXPECT_EQ(st.at("best_path"), "checkpoints/epoch=1-step=24.ckpt");
  EXPECT_EQ(st.at("writers"), nlohmann::json({{"/elsewhere/e.ckpt", ""}}));
}

// The Trainer is built once from its parts (docs/ARCHITECTURE.md "The Trainer"); fit's own parts,
// the optimizer first, are built when fit runs, so validate builds none; the resolved config is
// whole before the Trainer exists (the optimizer's defaults are in it, fit or not).
TEST(Trainer, IsBuiltOnceFromItsPartsAndValidateBuildsNoOptimizer) {
  EXPECT_THROW(Trainer(TrainerParts{}), std::invalid_argument);
  const std::string dir = temp_dir("built-once");
  auto run = make_run(tiny_yaml(), {"trainer.max_steps=2", "optimizer={name: sgd}"}, dir);
  EXPECT_NE(run->resolved_yaml.find("momentum: 0"), std::string::npos) << run->resolved_yaml;
  EXPECT_EQ(run->trainer->validate(), 0);
  EXPECT_EQ(run->trainer->view().optimizer(), nullptr);
  ASSERT_EQ(run->trainer->fit(), 0);
  ASSERT_NE(run->trainer->view().optimizer(), nullptr);
  EXPECT_EQ(run->trainer->view().state().global_step, 2);
  // validate restores only the entries docs/ARCHITECTURE.md's state table marks "always" (the
  // weights, the loop counters): damaged training-only entries are never read there, and refused by
  // a resume.
  auto damaged = checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt");
  for (const char* key : {checkpoint_keys::kOptimizer, checkpoint_keys::kScheduler, checkpoint_keys::kAccumulation,
                          checkpoint_keys::kCallbacks, checkpoint_keys::kLogger})
    damaged.blobs[key] = "damaged";
  damaged.tensors.erase(checkpoint_keys::rng_cpu());
  auto evaluator = make_run(tiny_yaml(), {"trainer.max_steps=2", "optimizer={name: sgd}"}, "");
  EXPECT_EQ(evaluator->trainer->validate(damaged), 0);
  EXPECT_EQ(evaluator->trainer->view().state().global_step, 2) << "the loop counters are restored";
  for (const auto& p : evaluator->module->net().named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), damaged.tensors.at(checkpoint_keys::kModelPrefix + p.key()))) << p.key();
  auto resumer = make_run(tiny_yaml(), {"trainer.max_steps=3", "optimizer={name: sgd}"}, "");
  EXPECT_THROW(resumer->trainer->fit(damaged), checkpoint::CheckpointError) << "a resume read no training state";
  // The weights of that fit, evaluated by another run's validate: the checkpoint names itself.
  auto other = make_run(tiny_yaml(), {"model.hidden=[8]"}, "");
  try {
    other->trainer->validate(checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt"));
    ADD_FAILURE() << "the weights of another model were evaluated";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(dir + "/checkpoints/last.ckpt: the checkpoint's weights do not fit", 0), 0u)
        << e.what();
  }
}

// trainer.cuda_graphs captures CUDA work: on the CPU it is a config error naming the device, raised
// before any step runs (tests/gpu_trainer/cuda_graphs_test.cpp covers the CUDA side).
TEST(Trainer, CudaGraphsOnTheCpuIsAConfigErrorNamingTheDevice) {
  // fit builds its step first: the refusal comes before any step runs.
  try {
    auto run = make_run(tiny_yaml("  cuda_graphs: true\n"), {}, "");
    run->trainer->fit();
    ADD_FAILURE() << "cuda_graphs on the CPU trained";
  } catch (const config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("trainer.cuda_graphs: needs a CUDA device (this run's device is cpu)"), std::string::npos)
        << e.what();
  }
}

TEST(Trainer, CudaGraphsAutoOnTheCpuTrainsEagerly) {
  auto run = make_run(tiny_yaml("  cuda_graphs: auto\n"), {}, "");
  ASSERT_EQ(run->trainer->fit(), 0);
  EXPECT_EQ(run->trainer->view().state().global_step, 24);
  EXPECT_EQ(run->trainer->graph_counts().captures, 0);
}
