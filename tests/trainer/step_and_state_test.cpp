// The state connector: one registry of everything a checkpoint holds. A checkpoint taken in the middle
// of a gradient-accumulation window (partial gradients, the micro-batch count, the step's partial
// logged values, the RNG) continues bit for bit like an uninterrupted run.
#include <gtest/gtest.h>

#include <set>

#include <nlohmann/json.hpp>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/loop_state.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

std::vector<Batch> first_batches(Run& run, int n) {
  auto loader = run.datamodule->train_loader();
  loader->start(0, 0);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) out.push_back(*loader->next());
  loader->stop();
  return out;
}

// What the Trainer registers is checked by the keys a new checkpoint holds
// (ResumeFixture.ANewCheckpointWritesExactlyTheDocumentedKeys); here the connector's own rules.
TEST(StateConnector, TakesEachEntryOnceAndKeepsTheOneOrder) {
  EXPECT_EQ(StateConnector::kOrder(),
            (std::vector<std::string>{"model", "optimizer", "scheduler", "scaler", "loop", "accumulation", "logger",
                                      "step_guard", "rng", "callbacks", "config", "hf_config", "mlflow", "meta"}));
  struct Nothing : Stateful {
    void save(checkpoint::CheckpointData&, const StepStart*) override {}
    void load(const checkpoint::CheckpointData&) override {}
  } nothing;
  // Registered late, an object still takes its place in the order.
  StateConnector c;
  c.add("meta", nothing);
  c.add("model", nothing);
  c.add("scaler", nothing);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"model", "scaler", "meta"}));
  EXPECT_THROW(c.add("model", nothing), std::logic_error) << "registered twice";
  EXPECT_THROW(c.add("no_such_entry", nothing), std::logic_error) << "not an entry";
}

TEST(StateConnector, CheckpointMidAccumulationWindowContinuesBitwise) {
  const std::vector<std::string> sets = {"trainer.accumulate_grad_batches=2"};
  std::vector<Batch> batches;
  std::map<std::string, torch::Tensor> whole;
  std::vector<torch::Tensor> whole_losses;
  {
    auto a = make_run(tiny_yaml(), sets, "");
    batches = first_batches(*a, 4);
    for (int i = 0; i < 4; ++i) whole_losses.push_back(a->trainer->run_batch(batches[i], i));
    EXPECT_EQ(a->trainer->view().state().global_step, 2);
    whole = params_of(*a->module);
  }
  checkpoint::CheckpointData mid;
  {
    auto b = make_run(tiny_yaml(), sets, "");
    b->trainer->run_batch(batches[0], 0);
    EXPECT_EQ(b->trainer->view().accumulated_batches(), 1);
    mid = b->trainer->view().make_checkpoint();
  }
  int partial = 0;
  for (const auto& kv : mid.tensors) partial += kv.first.rfind("accumulation/grad/", 0) == 0;
  EXPECT_GT(partial, 0) << "the partial gradients of the window are not in the checkpoint";
  auto c = make_run(tiny_yaml(), sets, "");
  mid.source = "mid-window checkpoint";
  c->trainer->resume_state(mid);
  EXPECT_EQ(c->trainer->view().accumulated_batches(), 1);
  for (int i = 1; i < 4; ++i) {
    auto l = c->trainer->run_batch(batches[i], i);
    EXPECT_TRUE(torch::equal(l, whole_losses[i])) << "micro-batch " << i;
  }
  EXPECT_EQ(c->trainer->view().state().global_step, 2);
  EXPECT_TRUE(bitwise_equal(params_of(*c->module), whole));
}

TEST(StateConnector, StepLogsTheMeanOfItsMicroBatches) {
  std::string dir = temp_dir("accum-log");
  std::vector<double> micro;
  struct Recorder : Callback {
    std::vector<double>* out;
    std::string name() const override { return "recorder"; }
    void on_train_batch_end(TrainerView&, Module&, const torch::Tensor& loss, const Batch&, int64_t) override {
      out->push_back(loss.item<double>());
    }
  };
  auto rec = std::make_shared<Recorder>();
  rec->out = &micro;
  auto run = make_run(tiny_yaml(), {"trainer.accumulate_grad_batches=2", "trainer.max_steps=3", "model.dropout=0.0"}, dir,
                      std::nullopt, {rec});
  ASSERT_EQ(run->trainer->fit(), 0);
  auto rows = read_csv(dir + "/metrics.csv", "train/loss");
  ASSERT_GE(micro.size(), 6u);
  ASSERT_TRUE(rows.count(1) && rows.count(2));
  for (int64_t step = 1; step <= 2; ++step) {
    const double expect = (micro[2 * (step - 1)] + micro[2 * (step - 1) + 1]) / 2;
    EXPECT_NEAR(std::stod(rows[step]["train/loss"]), expect, 1e-6 * std::abs(expect)) << "step " << step;
  }
}

}  // namespace

namespace {

TEST(StepPipeline, FusedTrueThatCannotBeHadIsAConfigErrorNotASilentFallback) {
  // Refused when fit builds the optimizer, before any step.
  try {
    make_run(tiny_yaml(), {"optimizer.fused=true"}, "")->trainer->fit();
    FAIL() << "optimizer.fused=true on the CPU was accepted";
  } catch (const config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fused"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cpu"), std::string::npos) << e.what();
  }
  EXPECT_EQ(make_run(tiny_yaml(), {"optimizer.fused=auto", "trainer.max_steps=1"}, "")->trainer->fit(), 0);
  EXPECT_EQ(make_run(tiny_yaml(), {"optimizer.fused=false", "trainer.max_steps=1"}, "")->trainer->fit(), 0);
}

}  // namespace

// NaN capture's checkpoint of a step's start goes through the same connector entries as every
// checkpoint (loop_state.h: StepStart): the same keys, the start's loop counters, generators,
// buffers and schedule position, no partial accumulation, a clear step guard, the live weights.
TEST(StateConnector, AStepStartCheckpointHasEveryCheckpointsKeysWithTheStartsValues) {
  const std::vector<std::string> sets = {
      "trainer.accumulate_grad_batches=2",
      "model={name: resnet, depth: 18, width: 4, num_classes: 4, in_channels: 1, stem: cifar}",
      "scheduler={name: cosine, warmup_steps: 2, max_steps: 10}"};
  auto run = make_run(tiny_yaml(), sets, "");
  auto batches = first_batches(*run, 3);
  run->trainer->run_batch(batches[0], 0);
  run->trainer->run_batch(batches[1], 1);  // step 1 done
  StepStart start;
  start.loop = run->trainer->view().state();
  start.loop.batch_in_epoch = 2;  // (the epoch loop counts batches; run_training_batch alone does not)
  start.rng = snapshot_rng(torch::cuda::is_available());  // as NaN capture records it
  start.buffers["bn1.running_mean"] = torch::full({4}, 7.0f);
  run->trainer->run_batch(batches[2], 2);  // step 2 half way: partial gradients
  torch::rand({3});  // the generator moves on after the start
  ASSERT_EQ(run->trainer->view().accumulated_batches(), 1);

  const auto live = run->trainer->view().make_checkpoint();
  const auto at = run->trainer->view().step_access().make_checkpoint_at(start);
  auto keys = [](const checkpoint::CheckpointData& d, bool partial) {
    std::set<std::string> out;
    for (const auto& kv : d.tensors)
      if (partial || kv.first.rfind("accumulation/grad/", 0) != 0) out.insert(kv.first);
    for (const auto& kv : d.blobs) out.insert("blob:" + kv.first);
    return out;
  };
  EXPECT_EQ(keys(at, true), keys(live, false)) << "a step-start checkpoint has the keys of any checkpoint";
  EXPECT_GT(keys(live, true).size(), keys(live, false).size()) << "the live checkpoint holds the partial gradients";

  const TrainerState loop = parse_loop_state(at.blob("loop"));
  EXPECT_EQ(loop.global_step, 1);
  EXPECT_EQ(loop.batch_in_epoch, 2);
  EXPECT_EQ(parse_loop_state(live.blob("loop")).batch_in_epoch, 0);
  EXPECT_TRUE(torch::equal(at.tensor("rng/cpu"), start.rng.cpu));
  EXPECT_FALSE(torch::equal(live.tensor("rng/cpu"), start.rng.cpu)) << "the live generator moved on";
  EXPECT_EQ(nlohmann::json::parse(at.blob("scheduler")).at("step").get<int64_t>(), 1);
  EXPECT_EQ(nlohmann::json::parse(at.blob("accumulation")).at("micro_batches").get<int64_t>(), 0);
  EXPECT_EQ(nlohmann::json::parse(live.blob("accumulation")).at("micro_batches").get<int64_t>(), 1);
  EXPECT_TRUE(torch::equal(at.tensor("model/bn1.running_mean"), torch::full({4}, 7.0f)));
  EXPECT_TRUE(torch::equal(at.tensor("model/bn1.running_var"), live.tensor("model/bn1.running_var")));
  EXPECT_TRUE(torch::equal(at.tensor("model/conv1.weight"), live.tensor("model/conv1.weight")));
  EXPECT_EQ(at.blob("optimizer"), live.blob("optimizer"));
  EXPECT_EQ(at.tensors.count("rng/rank0/cpu"), 0u);
}

// A checkpoint inside an accumulation window holds partial gradients of batches of the old size: a
// resume with another data.batch_size is refused with one line, naming it (docs/DISTRIBUTED.md).
TEST(StateConnector, AMidWindowCheckpointRefusesAnotherBatchSize) {
  const std::vector<std::string> sets = {"trainer.accumulate_grad_batches=2"};
  checkpoint::CheckpointData mid;
  {
    auto b = make_run(tiny_yaml(), sets, "");
    auto batches = first_batches(*b, 1);
    b->trainer->run_batch(batches[0], 0);
    TrainerState s = b->trainer->view().state();
    s.batch_in_epoch = 1;  // as the fit loop counts it after the window's first micro-batch
    mid = b->trainer->view().make_checkpoint();
    mid.blobs["loop"] = serialize_loop_state(s);
  }
  const std::string path = temp_dir("mid-window") + "/mid.ckpt";
  checkpoint::save_checkpoint_file(path, mid);
  auto same = make_run(tiny_yaml(), sets, "", path);
  EXPECT_NO_THROW(same->trainer->resume_state(*same->checkpoint)) << "the same batch resumes mid-window";
  auto other = make_run(tiny_yaml(), {"trainer.accumulate_grad_batches=2", "data.batch_size=16"}, "", path);
  try {
    other->trainer->resume_state(*other->checkpoint);
    ADD_FAILURE() << "resumed";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("data.batch_size 8 -> 16: it was taken inside an accumulation window, whose "
                                         "gradients are of batches of 8; resume from a checkpoint at an optimizer step's end"),
              std::string::npos)
        << e.what();
  }
}
