// Forensics of a step captured under trainer.fp8 (CPU, ATen's float8 GEMMs): replay traces float8
// tensors (libtorch has no isfinite for them) and reproduces the step exactly, and --diagnose
// replays it without the float8 GEMMs too, calling a step only float8 makes non-finite
// "precision (fp8)". The step is made on purpose: one token of the chosen batches carries an outlier
// (x 1e6), so fc's tensorwise e4m3 scale flushes every other token's inputs to zero and their
// log |h| is -inf; in bf16 those tokens keep their small values and the step stays finite.
#include <gtest/gtest.h>

#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runner/replay.h"
#include "strobe/core/fp8.h"
#include "strobe/core/model.h"
#include "tests/trainer/trainer_test_util.h"

namespace {

using namespace strobe;
using strobe::testing::batch_means;
using strobe::testing::make_run;
using strobe::testing::temp_dir;

class Fp8UnderflowProbe : public Model {
 public:
  explicit Fp8UnderflowProbe(double threshold)
      : Model("Fp8UnderflowProbe"),
        fc(register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)))),
        head(register_module("head", torch::nn::Linear(16, 4))),
        threshold(threshold) {}
  torch::Tensor forward(const Batch& batch) override {
    auto x = input(batch.at("image").flatten(1));
    // The chosen batches (mean input over `threshold`, known on the host from the data): row 0 x 1e6.
    const auto first_row = (torch::arange(x.size(0), x.options().dtype(torch::kLong)) == 0).unsqueeze(1);
    const auto outlier = torch::where(first_row.logical_and(x.mean() > threshold), 1e6, 1.0).to(x.scalar_type());
    const auto h = linear(fc, x * outlier);
    return linear(head, h) + 0 * torch::log(h.abs().sum(1, true));
  }
  std::string default_task() const override { return "classification"; }
  std::vector<std::string> fp8_layers() const override { return {"fc"}; }
  torch::nn::Linear fc, head;
  double threshold;
};
std::shared_ptr<Model> make_probe(config::Section& cfg) {
  auto threshold = cfg.get_double("threshold", 1e9);
  cfg.finish();
  return std::make_shared<Fp8UnderflowProbe>(threshold);
}
STROBE_REGISTER(model_registry(), "fp8_underflow_probe", make_probe);

std::string probe_yaml(double threshold) {
  return fmt::format(R"(name: fp8_probe
seed: 3
trainer:
  max_epochs: 1
  max_steps: 30
  precision: bf16-master
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  device: cpu
  fp8: {{min_size: 0}}
model:
  name: fp8_underflow_probe
  threshold: {:.17g}
data:
  name: synthetic_images
  image_size: 4
  channels: 1
  num_classes: 4
  num_samples: 256
  num_val_samples: 8
  batch_size: 8
  num_workers: 1
optimizer:
  name: adamw
  lr: 0.001
scheduler:
  name: none
callbacks: [{{name: nan_capture}}]
)",
                     threshold);
}

TEST(Fp8Forensics, AStepOnlyFloat8MakesNonFiniteReplaysExactlyAndIsDiagnosedPrecisionFp8) {
  // The first batch after the fourth whose mean input exceeds every earlier one's: the threshold
  // between them makes it the first bad step.
  const auto rise = strobe::testing::first_rise(batch_means(probe_yaml(1e9), 30), [](size_t i) { return i >= 4; });
  ASSERT_TRUE(rise.has_value());
  const size_t bad = rise->index;
  const double threshold = rise->threshold;
  {
    // Without float8 the same run trains through the chosen batch.
    auto run = make_run(probe_yaml(threshold), {"trainer.fp8=false"}, "");
    ASSERT_EQ(run->trainer->fit(), 0);
  }
  const std::string dir = temp_dir("fp8-underflow");
  {
    auto run = make_run(probe_yaml(threshold), {}, dir);
    ASSERT_EQ(run->trainer->fit(), 3) << "float8 makes step " << bad + 1 << " non-finite";
  }
  ASSERT_TRUE(std::filesystem::is_directory(dir + "/nan/step_" + std::to_string(bad + 1))) << "the chosen batch's step";
  const auto replay = capture::replay_capture(dir + "/nan", {});
  EXPECT_TRUE(replay["exact"].get<bool>()) << replay.dump(2);
  EXPECT_TRUE(replay["fp8"].get<bool>());
  ASSERT_FALSE(replay["first_nonfinite"].is_null()) << replay.dump(2);
  EXPECT_EQ(replay["first_nonfinite"]["op"], "aten::log") << replay.dump(2);
  EXPECT_NE(capture::format_replay_report(replay).find("precision bf16-master with trainer.fp8"), std::string::npos)
      << capture::format_replay_report(replay);

  const auto d = capture::diagnose_capture(dir + "/nan", {});
  std::cout << capture::format_diagnosis(d);
  EXPECT_EQ(d["verdict"], "precision (fp8)") << d.dump(2);
  ASSERT_GE(d["runs"].size(), 3u);
  EXPECT_EQ(d["runs"][2]["run"], "bf16-master without fp8");
  EXPECT_FALSE(d["runs"][2]["bad"].get<bool>()) << d.dump(2);
  EXPECT_TRUE(d["runs"][0]["bad"].get<bool>());
  EXPECT_NE(d["evidence"].dump().find("non-finite with trainer.fp8's float8 GEMMs and not in bf16-master without them"),
            std::string::npos)
      << d["evidence"].dump();
  EXPECT_TRUE(d["notes"].empty()) << "every run was made, the previous step's batch included: " << d["notes"].dump();
  EXPECT_EQ(d["runs"].back()["run"], "previous step's batch");
}

}  // namespace
