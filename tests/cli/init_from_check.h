// model.init_from is loaded before the optimizer, the device move, channels_last and bf16-master see
// the weights: one optimizer step with lr 0 from a file must leave every parameter of the checkpoint
// (fp32 master weights under bf16-master) bit-equal to the file. Loaded later, the masters would hold
// bf16-rounded values and the check fails. Shared by tests/cli (CPU) and tests/gpu_trainer (CUDA).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include <torch/torch.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/config/config.h"
#include "strobe/core/model.h"
#include "tests/cli/cli_test_util.h"

namespace strobe::testing {

// `model` is a flow mapping of a resnet on the tiny config's data (1 channel, 8x8, 4 classes).
inline void expect_init_from_survives(const std::string& device, const std::string& precision, const std::string& model) {
  const std::string dir = temp_dir("init_from_precision");
  torch::manual_seed(99);  // not the run's seed: the file's weights differ from the model's own
  auto doc = config::Document::load_string(model, "model");
  auto section = doc.root();
  auto net = model_registry().create(section, "");
  safetensors::NamedTensors tensors;
  for (const auto& p : net->named_parameters()) tensors.emplace_back(p.key(), p.value().detach());
  for (const auto& b : net->named_buffers()) tensors.emplace_back(b.key(), b.value());
  const std::string path = dir + "/w.safetensors";
  safetensors::write_file(path, tensors);

  std::string m = model;
  m.insert(m.rfind('}'), ", init_from: " + path);
  const std::string cfg = write_config(tiny_yaml());
  auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run --set trainer.max_steps=1 --set optimizer.lr=0 " +
                      "--set trainer.device=" + device + " --set trainer.precision=" + precision + " --set 'model=" + m +
                      "'");
  ASSERT_EQ(r.code, 0) << r.err;
  auto data = checkpoint::load_checkpoint_file(dir + "/run/checkpoints/last.ckpt");
  int64_t compared = 0;
  for (const auto& p : net->named_parameters()) {
    const torch::Tensor saved = data.tensor("model/" + p.key());
    EXPECT_EQ(saved.scalar_type(), torch::kFloat32) << p.key();
    EXPECT_TRUE(torch::equal(saved.cpu().contiguous(), p.value().detach())) << p.key() << " under " << precision;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(net->parameters().size()));
}

}  // namespace strobe::testing
