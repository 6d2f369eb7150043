// tensor_file + the regression task: configs/regression_tensor_file.yaml learns a noisy linear map
// from a safetensors file (val/mse far below the target's variance); the mapped reader gives the
// file's tensors; the checks before training are one line and exit 2 naming the problem: a missing
// tensor, fields of different lengths, non-finite values (counted under allow_nonfinite), a target
// width or a feature width the model does not have, a float label; a classification over an integer
// label field trains.
#include <gtest/gtest.h>

#include <filesystem>

#include <torch/torch.h>

#include "strobe/checkpoint/safetensors.h"
#include "tests/cli/cli_test_util.h"
#include "tests/source_path.h"

namespace strobe::testing {
namespace {

namespace fs = std::filesystem;

std::string write_tensors(const std::string& dir, const std::string& name, const safetensors::NamedTensors& t) {
  const std::string p = dir + "/" + name;
  safetensors::write_file(p, t);
  return p;
}


}  // namespace

TEST(TensorFile, TheRegressionExampleLearnsAndTheChecksComeFirst) {
  const std::string dir = temp_dir("tensor-file");
  torch::manual_seed(0);
  const auto x = torch::randn({2000, 8});
  const auto w = torch::randn({8});
  const auto y = (x.matmul(w) + 0.1 * torch::randn({2000})).contiguous();
  const std::string data = write_tensors(dir, "reg.safetensors", {{"x", x}, {"y", y}});
  // The mapped reader: the file's tensors, bit for bit.
  const auto mapped = safetensors::map_file(data);
  ASSERT_EQ(mapped.tensors.size(), 2u);
  EXPECT_TRUE(torch::equal(mapped.tensors[0].second, x));
  EXPECT_TRUE(torch::equal(mapped.tensors[1].second, y));

  const std::string cfg = source_path("configs/regression_tensor_file.yaml");
  const std::string base = "-c " + cfg + " --set data.path=" + data + " --set trainer.device=cpu --set trainer.enable_progress_bar=false";
  auto fit = strobe_cmd("fit " + base + " --set optimizer.lr=0.01 --set trainer.max_epochs=20 --run-dir " + dir + "/run");
  ASSERT_EQ(fit.code, 0) << fit.err;
  auto val = strobe_cmd("validate " + base + " --ckpt " + dir + "/run/checkpoints/last.ckpt");
  ASSERT_EQ(val.code, 0) << val.err;
  const double mse = printed_metric(val.out, "val/mse"), var = y.var().item<double>();
  EXPECT_LT(mse, 0.05 * var) << val.out << "(target variance " << var << ")";
  EXPECT_TRUE(std::isfinite(printed_metric(val.out, "val/mae"))) << val.out;
  // The other losses are what they say: l1's val/loss is the mean absolute error; huber's, with a
  // delta no error reaches, half the mean squared error.
  for (const auto& [loss, sets] : std::vector<std::pair<std::string, std::string>>{{"l1", "--set task.loss=l1"},
                                                                                    {"huber", "--set task.loss=huber --set task.delta=1e6"}}) {
    auto v = strobe_cmd("validate " + base + " " + sets + " --ckpt " + dir + "/run/checkpoints/last.ckpt");
    ASSERT_EQ(v.code, 0) << loss << ": " << v.err;
    const double got = printed_metric(v.out, "val/loss");
    const double want = loss == "l1" ? printed_metric(v.out, "val/mae") : 0.5 * printed_metric(v.out, "val/mse");
    EXPECT_NEAR(got, want, 2e-6 + 1e-5 * want) << loss << "\n" << v.out;
  }

  // The checks, each one line and exit 2 before training.
  auto bad_nan = x.clone();
  bad_nan[37][2] = NAN;
  const std::string nan_file = write_tensors(dir, "nan.safetensors", {{"x", bad_nan}, {"y", y}});
  const std::string short_file = write_tensors(dir, "short.safetensors", {{"x", x}, {"y", y.narrow(0, 0, 1999).contiguous()}});
  const std::string wide_file = write_tensors(dir, "wide.safetensors", {{"x", x}, {"y", torch::randn({2000, 3})}});
  struct Case {
    std::string sets, expect;
  };
  const std::vector<Case> cases = {
      {"--set data.fields.target=z", data + ": fields.target: no tensor 'z' (the file holds: x, y)"},
      {"--set data.path=" + short_file, short_file + ": fields.target: tensor 'y' has 1999 rows but 'x' has 2000"},
      {"--set data.path=" + nan_file, nan_file + ": fields.image: tensor 'x' holds 1 non-finite value (the first in row 37)"},
      {"--set data.path=" + wide_file,
       "model.num_classes: 1 outputs per sample, but the regression target holds 3 values per sample"},
      {"--set model.in_features=7", "model.in_features: 7, but data 'tensor_file' has 8 values per sample"},
      {"--set data.val_path=" + data, "data.val_fraction: give either val_path or val_fraction, not both"},
      {"--set task.delta=2", "task.delta: applies to loss: huber"},
  };
  for (const auto& c : cases) {
    auto r = strobe_cmd("fit " + base + " " + c.sets + " --run-dir " + temp_dir("tensor-file-bad") + "/run");
    EXPECT_EQ(r.code, 2) << c.sets << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.sets << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  // allow_nonfinite: counted and said, then training goes on.
  auto counted = strobe_cmd("fit " + base + " --set data.path=" + nan_file +
                            " --set data.allow_nonfinite=true --set trainer.max_steps=2 --run-dir " + dir + "/counted");
  EXPECT_EQ(counted.code, 0) << counted.err;
  EXPECT_NE(counted.out.find("fields.image: 1 non-finite values (allow_nonfinite: true)"), std::string::npos) << counted.out;

  // Classification from an integer label field: the classes come from the labels and are checked.
  const auto labels = (x.select(1, 0) > 0).to(torch::kInt64) + (x.select(1, 1) > 0).to(torch::kInt64);
  const std::string cls = write_tensors(dir, "cls.safetensors", {{"x", x}, {"y", labels}, {"yf", labels.to(torch::kFloat32)}});
  const std::string cbase = "-c " + cfg + " --set data.path=" + cls +
                            " --set 'data.fields={image: x, label: y}' --set task.name=classification --set task.loss=cross_entropy"
                            " --set trainer.device=cpu --set trainer.enable_progress_bar=false --set trainer.max_epochs=10 --set optimizer.lr=0.01";
  auto two = strobe_cmd("fit " + cbase + " --set model.num_classes=2 --run-dir " + dir + "/cls2");
  EXPECT_EQ(two.code, 2) << two.err;
  EXPECT_NE(two.err.find("model.num_classes: 2 classes, but data 'tensor_file' has 3 classes"), std::string::npos) << two.err;
  auto flt = strobe_cmd("fit " + cbase + " --set model.num_classes=3 --set 'data.fields={image: x, label: yf}' --run-dir " + dir + "/clsf");
  EXPECT_EQ(flt.code, 2) << flt.err;
  EXPECT_NE(flt.err.find("fields.label: tensor 'yf' must be a vector of integer class indices"), std::string::npos) << flt.err;
  auto three = strobe_cmd("fit " + cbase + " --set model.num_classes=3 --run-dir " + dir + "/cls3");
  ASSERT_EQ(three.code, 0) << three.err;
  auto test = strobe_cmd("test " + cbase + " --set model.num_classes=3 --ckpt " + dir + "/cls3/checkpoints/last.ckpt");
  ASSERT_EQ(test.code, 0) << test.err;
  EXPECT_GT(printed_metric(test.out, "test/acc"), 0.8) << test.out;
}

}  // namespace strobe::testing

namespace strobe::testing {

// The fine-tuning walk-through of docs/MODELS.md at a small scale (random images in the layout
// scripts/fashion_mnist_tensors.py writes): pre-train with configs/vit_fmnist.yaml, export, fine-tune
// with configs/finetune_vit_fmnist.yaml (init_from without the head, no_decay + layer decay, the patch
// embedding frozen for epoch 0, ema) and export the averaged weights, which `strobe test` evaluates.
TEST(TensorFile, TheFineTuningWalkThroughRuns) {
  const std::string dir = temp_dir("finetune-fmnist");
  torch::manual_seed(1);
  for (const char* part : {"a", "b"})
    for (const char* split : {"train", "test"}) {
      std::filesystem::create_directories(dir + "/" + part);
      write_tensors(dir + "/" + part, std::string(split) + ".safetensors",
                    {{"x", torch::rand({40, 1, 28, 28})}, {"y", torch::randint(0, 5, {40}, torch::kInt64)}});
    }
  const std::string quiet = " --set trainer.device=cpu --set trainer.enable_progress_bar=false --set data.batch_size=16";
  auto pre = strobe_cmd("fit -c " + source_path("configs/vit_fmnist.yaml") + quiet + " --set trainer.max_epochs=1 --set data.path=" + dir +
                        "/a/train.safetensors --set data.test_path=" + dir + "/a/test.safetensors --run-dir " + dir + "/pre");
  ASSERT_EQ(pre.code, 0) << pre.err;
  auto ex = strobe_cmd("export " + dir + "/pre/checkpoints/last.ckpt -o " + dir + "/pre.safetensors");
  ASSERT_EQ(ex.code, 0) << ex.err;
  const std::string ft = "-c " + source_path("configs/finetune_vit_fmnist.yaml") + quiet + " --set model.init_from.path=" + dir +
                         "/pre.safetensors --set data.path=" + dir + "/b/train.safetensors --set data.test_path=" + dir +
                         "/b/test.safetensors";
  auto fine = strobe_cmd("fit " + ft + " --run-dir " + dir + "/ft");
  ASSERT_EQ(fine.code, 0) << fine.err;
  EXPECT_NE(fine.out.find("ignored 2: head.weight, head.bias"), std::string::npos) << fine.out;
  EXPECT_NE(fine.out.find("strobe fit: epoch 1: unfroze 2 parameter tensors"), std::string::npos) << fine.out;
  EXPECT_NE(slurp(dir + "/ft/param_groups.txt").find("default/layer_0/frozen"), std::string::npos);
  auto ema = strobe_cmd("export " + dir + "/ft/checkpoints/last.ckpt --ema -o " + dir + "/ema.safetensors");
  ASSERT_EQ(ema.code, 0) << ema.err;
  auto test = strobe_cmd("test " + ft + " --set model.init_from.path=" + dir + "/ema.safetensors --set 'model.init_from.ignore=[]'");
  ASSERT_EQ(test.code, 0) << test.err;
  EXPECT_NE(test.out.find("test/acc"), std::string::npos) << test.out;
}

}  // namespace strobe::testing

namespace strobe::testing {
namespace {

// The training file truncated while the run reads it (it is memory-mapped: the next read of a lost
// page raises SIGBUS): one line naming the file, exit 1, never a bare "Bus error".
TEST(TensorFile, AFileTruncatedUnderTheRunEndsItNamingTheFile) {
  const std::string dir = temp_dir("tensor-file-truncated");
  torch::manual_seed(0);
  const std::string data = dir + "/big.safetensors";
  safetensors::write_file(data, {{"x", torch::randn({20000, 64})}, {"y", torch::randn({20000, 1})}});
  const std::string cfg = source_path("configs/regression_tensor_file.yaml");
  const std::string run = dir + "/run";
  const std::string script =
      "(" + bin() + " fit -c " + cfg + " --set data.path=" + data + " --set model.in_features=64 --set trainer.device=cpu" +
      " --set trainer.enable_progress_bar=false --set trainer.max_steps=1000000 --set trainer.max_epochs=-1"
      " --set trainer.log_every_n_steps=1 --set data.batch_size=8 --set data.val_fraction=0 --set trainer.enable_checkpointing=false"
      " --run-dir " + run + " > " + dir + "/out 2> " + dir + "/err; echo $? > " + dir + "/rc) & "
      "for i in $(seq 1 2400); do [ -s " + run + "/metrics.csv ] && [ $(wc -l < " + run + "/metrics.csv) -gt 5 ] && break; "
      "sleep 0.05; done; truncate -s 0 " + data + "; wait";
  ASSERT_EQ(std::system(("timeout 300 bash -c '" + script + "'").c_str()), 0);
  EXPECT_EQ(slurp(dir + "/rc"), "1\n") << slurp(dir + "/err");
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("strobe: error: " + data + ": the file changed under the run (truncated or rewritten while it was read)"),
            std::string::npos)
      << err;
}

}  // namespace
}  // namespace strobe::testing
