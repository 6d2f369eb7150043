// optimizer.param_groups: which parameters the optimizer's groups hold, the hyper-parameters each
// gets (weight decay 0 under no_decay), what the step does with them, the per-group floor of
// reduce_on_plateau, the run directory's param_groups.txt and lr_monitor's columns.
#include <gtest/gtest.h>

#include <algorithm>

#include "strobe/core/optim.h"
#include "strobe/core/trainer.h"
#include "strobe/core/trainer_view.h"
#include "tests/cli/cli_test_util.h"
#include "tests/trainer/trainer_test_util.h"

using namespace strobe;
using namespace strobe::testing;

namespace {

std::string vit_yaml(const std::string& param_groups) {
  return R"(name: groups
seed: 3
trainer: {max_steps: 2, log_every_n_steps: 1, num_sanity_val_steps: 0, limit_val_batches: 0, device: cpu,
          enable_progress_bar: false, enable_model_summary: false}
model: {name: vit, img_size: 16, patch_size: 8, in_channels: 3, num_classes: 4, embed_dim: 16, depth: 2, num_heads: 2}
data: {name: synthetic_images, image_size: 16, channels: 3, num_classes: 4, num_samples: 16, num_val_samples: 4, batch_size: 4, num_workers: 0}
optimizer: {name: adamw, lr: 0.01, weight_decay: 0.05)" +
         (param_groups.empty() ? "" : ", param_groups: " + param_groups) + R"(}
callbacks: [{name: lr_monitor}]
)";
}

// Group name -> its parameters' names, from the optimizer the trainer built (matched by tensor).
std::map<std::string, std::vector<std::string>> membership(Run& run) {
  auto& t = run.trainer->view();
  std::map<const void*, std::string> names;
  for (const auto& p : run.module->net().named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  std::map<std::string, std::vector<std::string>> out;
  const auto& groups = t.optimizer()->param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) out[t.param_group_names().at(g)].push_back(names.at(p.unsafeGetTensorImpl()));
  return out;
}

}  // namespace

// no_decay: auto takes the parameters of at most one dimension and vit's declared pos_embed and
// cls_token; a groups entry takes what its glob matches first, with its own lr and weight decay.
TEST(ParamGroups, NoDecayAutoAndGlobGroupsHoldTheRightParameters) {
  const std::string dir = temp_dir("groups");
  auto run = make_run(vit_yaml("{no_decay: auto, groups: [{params: 'head.*', lr: 0.1, weight_decay: 0.2}]}"), {}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  auto& t = run->trainer->view();
  EXPECT_EQ(t.param_group_names(), (std::vector<std::string>{"default", "default/no_decay", "groups[0]", "groups[0]/no_decay"}));
  const auto m = membership(*run);
  EXPECT_EQ(m.at("groups[0]"), (std::vector<std::string>{"head.weight"}));
  EXPECT_EQ(m.at("groups[0]/no_decay"), (std::vector<std::string>{"head.bias"}));
  for (const auto& n : m.at("default")) EXPECT_TRUE(n.find("weight") != std::string::npos && n.find("norm") == std::string::npos) << n;
  for (const char* n : {"pos_embed", "cls_token", "patch_embed.bias", "blocks.0.norm1.weight", "blocks.1.qkv.bias", "norm.bias"}) {
    const auto& nd = m.at("default/no_decay");
    EXPECT_NE(std::find(nd.begin(), nd.end(), n), nd.end()) << n;
  }
  const auto& groups = t.optimizer()->param_groups();
  const std::vector<std::pair<double, double>> want = {{0.01, 0.05}, {0.01, 0.0}, {0.1, 0.2}, {0.1, 0.0}};
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(groups[g].options());
    EXPECT_DOUBLE_EQ(o.lr(), want[g].first) << g;
    EXPECT_DOUBLE_EQ(o.weight_decay(), want[g].second) << g;
  }
  // The run directory lists them; lr_monitor logs one column per named group.
  const std::string listing = slurp(dir + "/param_groups.txt");
  EXPECT_NE(listing.find("groups[0]/no_decay"), std::string::npos) << listing;
  EXPECT_NE(listing.find("[default/no_decay]\ncls_token\npos_embed\n"), std::string::npos) << listing;
  EXPECT_EQ(read_csv(dir + "/metrics.csv", "lr/groups[0]").at(1).at("lr/groups[0]"), "0.1");
  EXPECT_EQ(read_csv(dir + "/metrics.csv", "lr/default/no_decay").count(2), 1u);
}

// The step: a fresh AdamW with zero gradients moves a parameter by the decoupled decay alone (its
// moments are zero), so a decayed parameter becomes p * (1 - lr * weight_decay) and a no_decay one
// stays bit for bit; without param_groups every parameter is decayed, as before.
TEST(ParamGroups, NoDecayParametersAreNotDecayedByTheStep) {
  for (const bool grouped : {true, false}) {
    auto run = make_run(vit_yaml(grouped ? "{no_decay: auto, groups: [{params: 'head.*', lr: 0.1, weight_decay: 0.2}]}" : ""), {}, "");
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (auto& p : run->module->net().named_parameters()) named.emplace_back(p.key(), p.value());
    const auto& cfg = run->experiment.optimizer;
    auto groups = make_param_groups(cfg, named, {"pos_embed", "cls_token"});
    EXPECT_EQ(groups.size(), grouped ? 4u : 1u);
    auto opt = build_optimizer(cfg, groups, torch::Device(torch::kCPU));
    std::map<std::string, torch::Tensor> before;
    for (auto& [name, p] : named) {
      before[name] = p.detach().clone();
      p.mutable_grad() = torch::zeros_like(p);
    }
    opt->step();
    for (auto& [name, p] : named) {
      const bool head = grouped && name.rfind("head.", 0) == 0;
      const bool decayed = !grouped || (p.dim() > 1 && name != "pos_embed" && name != "cls_token");
      const double lr = head ? 0.1 : 0.01, wd = head ? 0.2 : 0.05;
      const auto want = decayed ? before.at(name) * (1 - lr * wd) : before.at(name);
      EXPECT_TRUE(torch::allclose(p.detach(), want, 1e-6, 0)) << name << (grouped ? " (grouped)" : "");
      if (!decayed) EXPECT_TRUE(torch::equal(p.detach(), before.at(name))) << name;
    }
  }
}

// reduce_on_plateau's min_lr floors every group, and a group whose base lr is below it keeps its
// base (it is never raised).
TEST(ParamGroups, ReduceOnPlateauFloorsEachGroupAtMinLr) {
  auto a = torch::zeros({1}, torch::requires_grad()), b = torch::zeros({1}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a}, std::make_unique<torch::optim::SGDOptions>(0.1));
  groups.emplace_back(std::vector<torch::Tensor>{b}, std::make_unique<torch::optim::SGDOptions>(0.001));
  torch::optim::SGD opt(groups, torch::optim::SGDOptions(0.1));
  auto doc = config::Document::load_string("name: reduce_on_plateau\npatience: 0\nfactor: 0.5\nmin_lr: 0.02\n", "s.yaml");
  auto sec = doc.root();
  auto s = build_scheduler(config::parse_scheduler(sec), opt, -1);
  s->on_validation_end(1.0);
  for (double expect : {0.05, 0.025, 0.02, 0.02}) {
    s->on_validation_end(2.0);
    EXPECT_DOUBLE_EQ(get_lr(opt, 0), expect);
    EXPECT_DOUBLE_EQ(get_lr(opt, 1), 0.001);
  }
}

// A glob that selects nothing is refused before training, naming it; so is a malformed no_decay.
TEST(ParamGroups, GlobsThatMatchNothingAndBadValuesExitTwo) {
  struct Case {
    std::string groups, expect;
  };
  const std::vector<Case> cases = {
      {"{groups: [{params: 'heads.*', lr: 0.1}]}", "optimizer.param_groups: groups[0].params 'heads.*' matches no trainable parameter"},
      {"{no_decay: ['*.bias', 'nrom.*']}", "optimizer.param_groups: no_decay[1] 'nrom.*' matches no trainable parameter"},
      {"{no_decay: sometimes}", "optimizer.param_groups.no_decay: expected auto or a list of globs"},
      {"{groups: [{lr: 0.1}]}", "optimizer.param_groups.groups[0]"},
      {"{groups: [{params: 'head.*', lr: -1}]}", "optimizer.param_groups.groups[0].lr"},
      {"{grups: []}", "optimizer.param_groups.grups: unknown key"},
  };
  for (const auto& c : cases) {
    const std::string cfg = write_config(vit_yaml(c.groups));
    const std::string dir = temp_dir("badgroups");
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run");
    EXPECT_EQ(r.code, 2) << c.groups << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.groups << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
}
