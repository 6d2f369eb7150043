// CheckpointView, the one reader of the checkpoint layout: meta with its defaults (missing, not an
// object, wrong types), the model's tensors without their prefix and nothing else, the config and
// hf_config blobs, callback states, and errors that name the checkpoint. The keys a real checkpoint
// writes are tests/trainer/resume_fixture_test.cpp's golden list; this reads them through the view.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/core/checkpoint_view.h"

namespace strobe {
namespace {

using checkpoint::CheckpointData;

TEST(CheckpointView, ReadsTheLayoutAndDefaultsWhatAnOlderCheckpointLacks) {
  CheckpointData d;
  d.tensors["model/blocks.0.weight"] = torch::ones({2, 3});
  d.tensors["model/head.bias"] = torch::zeros({4});
  d.tensors["modelx/other"] = torch::ones({1});  // another entry sharing the prefix's letters
  d.tensors["optimizer/state"] = torch::ones({1});
  d.blobs["config"] = "model: {name: vit}\n";
  d.blobs["meta"] = R"({"format_version": 1, "strobe_version": "0.1.0", "device": "cuda:0", "precision": "bf16-master",
                        "global_step": 42, "world_size": 2, "epoch": 3})";
  d.blobs["callbacks"] = R"({"early_stopping": {"wait": 2}})";
  const CheckpointView v(d, "run/last.ckpt");
  const CheckpointMeta m = v.meta();
  EXPECT_EQ(m.format_version, 1);
  EXPECT_EQ(m.strobe_version, "0.1.0");
  EXPECT_EQ(m.device, "cuda:0");
  EXPECT_EQ(m.precision, "bf16-master");
  EXPECT_EQ(m.global_step, 42);
  EXPECT_EQ(m.epoch, 3);
  EXPECT_EQ(m.world_size, 2);
  const auto model = v.model_tensors();
  ASSERT_EQ(model.size(), 2u);
  EXPECT_TRUE(model.count("blocks.0.weight") && model.count("head.bias"));
  ASSERT_NE(v.model_tensor("head.bias"), nullptr);
  EXPECT_EQ(v.model_tensor("head.bias")->numel(), 4);
  EXPECT_EQ(v.model_tensor("other"), nullptr);
  ASSERT_NE(v.config(), nullptr);
  EXPECT_EQ(v.require_config(), "model: {name: vit}\n");
  EXPECT_EQ(v.hf_config(), nullptr);
  EXPECT_EQ(v.callback_states().at("early_stopping").at("wait"), 2);

  // What a checkpoint of an earlier build may lack, or hold malformed: the defaults, never a throw.
  for (const char* meta : {"", "not json", "[1, 2]", R"({"global_step": "6", "world_size": 2.5, "device": 7})"}) {
    CheckpointData e;
    if (*meta) e.blobs["meta"] = meta;
    const CheckpointMeta dm = CheckpointView(e, "old.ckpt").meta();
    EXPECT_EQ(dm.world_size, 1) << meta;
    EXPECT_FALSE(dm.global_step.has_value()) << meta;
    EXPECT_EQ(dm.device, "") << meta;
    EXPECT_EQ(dm.format_version, 0) << meta;
  }
  CheckpointData bare;
  const CheckpointView bv(bare, "old.ckpt");
  EXPECT_EQ(bv.config(), nullptr);
  EXPECT_TRUE(bv.model_tensors().empty());
  EXPECT_TRUE(bv.callback_states().empty());
  try {
    (void)bv.require_config();
    ADD_FAILURE() << "no error";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_STREQ(e.what(), "old.ckpt: holds no saved config (blob 'config')");
  }
  bare.blobs["callbacks"] = "[]";
  try {
    (void)bv.callback_states();
    ADD_FAILURE() << "no error";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_STREQ(e.what(), "old.ckpt: its callback states (blob 'callbacks') are not a JSON object");
  }
}

}  // namespace
}  // namespace strobe
