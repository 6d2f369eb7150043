// Shared by tests/ops (CPU) and tests/gpu_ops (CUDA): the fused optimizers with the learning rate as
// a device tensor (FusedOptimizerBase::enable_device_lr, what trainer.cuda_graphs uses) give bitwise
// the weights of the same optimizers passing the host lr, while a schedule changes each group's lr
// every step; and the op rejects an lr_tensor of the wrong kind.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "strobe/ops/fused_optimizers.h"
#include "strobe/ops/ops.h"

namespace strobe::testing {

inline void check_device_lr_matches_host_lr(const torch::Device& device) {
  for (const std::string kind : {"sgd", "adamw"}) {
    std::vector<torch::Tensor> ph, pd;
    torch::manual_seed(11);
    // Sizes with vector bodies and scalar tails (the CUDA kernels' two paths).
    for (int64_t n : {7, 4096 + 3, 33, 1 << 15}) {
      auto p = torch::randn({n}, torch::TensorOptions(device));
      ph.push_back(p.clone().requires_grad_(true));
      pd.push_back(p.clone().requires_grad_(true));
    }
    auto groups = [](const std::vector<torch::Tensor>& ps, bool sgd) {
      std::vector<torch::optim::OptimizerParamGroup> gs;
      gs.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1]});
      if (sgd)
        gs.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3]}, std::make_unique<torch::optim::SGDOptions>(3e-3));
      else
        gs.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3]}, std::make_unique<torch::optim::AdamWOptions>(3e-3));
      return gs;
    };
    std::unique_ptr<ops::FusedOptimizerBase> host, dev;
    if (kind == "sgd") {
      auto o = torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(1e-4);
      host = std::make_unique<ops::FusedSGD>(groups(ph, true), o);
      dev = std::make_unique<ops::FusedSGD>(groups(pd, true), o);
    } else {
      auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.05);
      host = std::make_unique<ops::FusedAdamW>(groups(ph, false), o);
      dev = std::make_unique<ops::FusedAdamW>(groups(pd, false), o);
    }
    dev->enable_device_lr();
    ASSERT_TRUE(dev->device_lr_enabled());
    ASSERT_TRUE(dev->lr_tensor(1).defined());
    EXPECT_EQ(dev->lr_tensor(1).scalar_type(), torch::kDouble);
    for (int s = 0; s < 25; ++s) {
      for (auto* opt : {host.get(), dev.get()})
        for (auto& g : opt->param_groups()) g.options().set_lr(g.options().get_lr() * (0.9 + 0.003 * s));
      dev->sync_device_lr();
      for (size_t i = 0; i < ph.size(); ++i) {
        auto g = torch::randn(ph[i].sizes(), torch::TensorOptions(device));
        ph[i].mutable_grad() = g;
        pd[i].mutable_grad() = g.clone();
      }
      host->step();
      dev->step();
    }
    for (size_t i = 0; i < ph.size(); ++i)
      EXPECT_TRUE(torch::equal(ph[i], pd[i])) << kind << " param " << i << ": the device lr and the host lr disagree";
    // Not vacuous: the lr changed, and the host value is what the device tensor holds.
    EXPECT_EQ(dev->lr_tensor(0).item<double>(), dev->param_groups()[0].options().get_lr());
    EXPECT_NE(dev->param_groups()[0].options().get_lr(), 1e-2);
  }
  // The op's own checks: float64, 0-dim, on the parameters' device.
  auto p = torch::zeros({4}, torch::TensorOptions(device)), g = torch::ones({4}, torch::TensorOptions(device));
  ops::SgdArgs a;
  a.lr_tensor = torch::full({}, 0.1, torch::TensorOptions(device).dtype(torch::kFloat));
  try {
    ops::fused_sgd_({p}, {g}, {}, {}, a);
    ADD_FAILURE() << "a float32 lr_tensor was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lr_tensor must be a float64 scalar tensor"), std::string::npos) << e.what();
  }
  a.lr_tensor = torch::full({}, 0.5, torch::TensorOptions(device).dtype(torch::kDouble));
  ops::fused_sgd_({p}, {g}, {}, {}, a);
  EXPECT_TRUE(torch::allclose(p, torch::full({4}, -0.5, torch::TensorOptions(device)))) << "lr_tensor's 0.5, not lr's 1e-3";
}

}  // namespace strobe::testing
