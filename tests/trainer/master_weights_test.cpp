// precision: bf16-master (strobe/core/master_weights.h): bf16 parameters for compute, fp32
// masters in the optimizer, BatchNorm kept fp32; checkpoints hold the masters; resume is exact.
#include <gtest/gtest.h>

#include "strobe/core/master_weights.h"
#include "strobe/core/trainer.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

struct Net : torch::nn::Module {
  Net() {
    lin = register_module("lin", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
    bn = register_module("bn", torch::nn::BatchNorm1d(3));
    scale = register_parameter("scale", torch::ones({3}));
  }
  torch::nn::Linear lin{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor scale;
};

TEST(MasterWeights, ConvertsAllButBatchNormAndKeepsExactFp32Masters) {
  torch::manual_seed(0);
  auto holder = std::make_shared<Net>();  // named_modules() needs the root in a shared_ptr
  Net& net = *holder;
  const auto before = net.lin->weight.detach().clone();
  const auto* impl = net.lin->weight.unsafeGetTensorImpl();
  MasterWeights masters(net);
  EXPECT_EQ(masters.converted(), 5u);  // lin.weight, lin.bias, norm.weight, norm.bias, scale
  EXPECT_EQ(net.lin->weight.unsafeGetTensorImpl(), impl) << "the parameter object must stay the same";
  for (auto* p : {&net.lin->weight, &net.lin->bias, &net.norm->weight, &net.norm->bias, &net.scale})
    EXPECT_EQ(p->scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net.bn->weight.scalar_type(), torch::kFloat32);
  EXPECT_EQ(net.bn->running_mean.scalar_type(), torch::kFloat32);
  const auto& master = masters.master_of(net.lin->weight);
  EXPECT_EQ(master.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(master, before)) << "the master must be the original fp32 value";
  EXPECT_TRUE(torch::equal(net.lin->weight, before.to(torch::kBFloat16)));
  // BatchNorm's parameters are their own masters.
  EXPECT_EQ(masters.master_of(net.bn->weight).unsafeGetTensorImpl(), net.bn->weight.unsafeGetTensorImpl());
  auto opt_params = masters.optimizer_params(net.parameters());
  ASSERT_EQ(opt_params.size(), net.parameters().size());
  for (const auto& p : opt_params) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
}

// The host-side build (zero2 with several processes): the same bf16 parameters and fp32 masters,
// bit for bit, as converting in place; each master is the parameter's own fp32 storage (no copy);
// BatchNorm stays as it was, for the trainer's move. (On CUDA the parameters land on the GPU and the
// masters stay on the host: TrainerCuda.TheHostSideBuildSendsTheGpuTheBf16WeightsOnly.)
TEST(MasterWeights, TheHostSideBuildKeepsTheHostValuesAsMastersWithTheSameBits) {
  torch::manual_seed(0);
  auto a = std::make_shared<Net>(), b = std::make_shared<Net>();
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  const void* storage = b->lin->weight.data_ptr();
  MasterWeights in_place(*a);
  MasterWeights host(*b, torch::kBFloat16, torch::Device(torch::kCPU));
  EXPECT_EQ(host.converted(), in_place.converted());
  EXPECT_EQ(host.master_of(b->lin->weight).data_ptr(), storage) << "the master is the host value itself";
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    const torch::Tensor pa = a->parameters()[i], pb = b->parameters()[i];
    EXPECT_EQ(pa.scalar_type(), pb.scalar_type()) << i;
    EXPECT_TRUE(torch::equal(pa, pb)) << i;
    EXPECT_TRUE(torch::equal(in_place.master_of(pa), host.master_of(pb))) << i;
  }
  EXPECT_EQ(b->bn->weight.scalar_type(), torch::kFloat32);
}

// Updates far below bf16's resolution accumulate in the fp32 masters and reach the bf16 weights
// once they add up; a bf16-only update would never move the weight.
TEST(MasterWeights, SmallUpdatesAccumulateInTheMasters) {
  torch::nn::Linear lin(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard ng;
    lin->weight.fill_(1.0);
  }
  MasterWeights masters(*lin);
  torch::optim::SGD opt(masters.optimizer_params(lin->parameters()), torch::optim::SGDOptions(1e-4));
  auto x = torch::ones({1, 1}, torch::kBFloat16);
  for (int step = 0; step < 100; ++step) {
    lin->zero_grad();
    lin->forward(x).sum().backward();  // d/dw = 1
    masters.attach_grads(/*fp32_copies=*/true);
    opt.step();
    masters.copy_to_model();
    masters.release_grads();
  }
  const double m = masters.master_of(lin->weight).item<double>();
  EXPECT_NEAR(m, 0.99, 1e-5);
  EXPECT_TRUE(torch::equal(lin->weight.detach(), masters.master_of(lin->weight).to(torch::kBFloat16)));
  EXPECT_LT(lin->weight.item<double>(), 1.0);
  // The same 100 updates applied to a bf16 weight directly leave it at 1.0.
  auto w = torch::ones({1}, torch::kBFloat16);
  for (int step = 0; step < 100; ++step) w.sub_(1e-4);
  EXPECT_EQ(w.item<double>(), 1.0);
}

std::string master_yaml() {
  return tiny_yaml() + "callbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n    save_top_k: -1\n";
}
const std::vector<std::string> kMasterSets = {"trainer.precision=bf16-master", "model.dropout=0.0"};

TEST(MasterWeights, TrainerTrainsAndCheckpointsHoldTheFp32Masters) {
  std::string dir = temp_dir("bf16-master");
  auto run = make_run(master_yaml(), kMasterSets, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  auto loss = read_csv(dir + "/metrics.csv", "train/loss");
  ASSERT_GE(loss.size(), 10u);
  double first = std::stod(loss.begin()->second["train/loss"]), last = std::stod(loss.rbegin()->second["train/loss"]);
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first);
  for (const auto& p : run->module->net().parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  auto saved = model_tensors(dir + "/checkpoints/last.ckpt");
  ASSERT_FALSE(saved.empty());
  int64_t differs_from_bf16 = 0;
  for (const auto& p : run->module->net().named_parameters()) {
    const auto& t = saved.at("model/" + p.key());
    ASSERT_EQ(t.scalar_type(), torch::kFloat32) << p.key();
    // The weights in use are the saved masters rounded to bf16...
    EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16), p.value().detach())) << p.key();
    // ...and the masters carry more than bf16 does.
    differs_from_bf16 += !torch::equal(t, p.value().detach().to(torch::kFloat32));
  }
  EXPECT_GT(differs_from_bf16, 0);
  // A "32" run loads the checkpoint: its fp32 weights are the masters.
  auto fp32 = make_run(tiny_yaml(), {}, "");
  fp32->trainer->validate(checkpoint::load_checkpoint_file(dir + "/checkpoints/last.ckpt"));
  for (const auto& p : fp32->module->net().named_parameters())
    EXPECT_TRUE(torch::equal(p.value().detach(), saved.at("model/" + p.key()))) << p.key();
}

TEST(MasterWeights, ResumeIsExact) {
  std::string a = temp_dir("bf16-master-straight"), b = temp_dir("bf16-master-resumed");
  auto straight = make_run(master_yaml(), kMasterSets, a);
  ASSERT_EQ(straight->trainer->fit(), 0);
  ASSERT_EQ(straight->trainer->view().state().global_step, 24);
  const std::string ckpt = a + "/checkpoints/step=12.ckpt";
  auto resumed = make_run(master_yaml(), kMasterSets, b, ckpt);
  ASSERT_EQ(resumed->trainer->fit(std::move(resumed->checkpoint)), 0);
  EXPECT_TRUE(bitwise_equal(params_of(*resumed->module), params_of(*straight->module)));
  EXPECT_TRUE(bitwise_equal(model_tensors(a + "/checkpoints/last.ckpt"), model_tensors(b + "/checkpoints/last.ckpt")))
      << "the fp32 masters differ after resuming";
  auto la = read_csv(a + "/metrics.csv", "train/loss"), lb = read_csv(b + "/metrics.csv", "train/loss");
  for (int64_t step = 13; step <= 24; ++step) EXPECT_EQ(la[step]["train/loss"], lb[step]["train/loss"]) << step;
}

TEST(MasterWeights, IsAPrecisionChoiceAndAMisspellingIsRefused) {
  auto run = make_run(tiny_yaml(), {"trainer.precision=bf16-master", "trainer.max_steps=1"}, "");
  EXPECT_EQ(run->trainer->fit(), 0);
  EXPECT_THROW(make_run(tiny_yaml(), {"trainer.precision=bf16-masters"}, ""), config::ConfigError);
}

}  // namespace
