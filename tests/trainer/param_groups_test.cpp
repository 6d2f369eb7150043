// optimizer.param_groups: which parameters the optimizer's groups hold, the hyper-parameters each
// gets (weight decay 0 under no_decay), what the step does with them, the per-group floor of
// reduce_on_plateau, the run directory's param_groups.txt and lr_monitor's columns.
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

#include "strobe/config/experiment_parse.h"
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
    auto groups = make_param_groups(cfg, named, dynamic_cast<const Model*>(&run->module->net()));
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

// layer_decay: the default group split by the model's layers, layer i at lr x decay^(L - 1 - i)
// (vit: embeddings 0, block i at i + 1, the final norm with the last block under token pooling,
// the head at L - 1), no_decay kept within each layer, a `groups` entry keeping its own lr; the
// run directory lists each group's multiplier.
TEST(ParamGroups, LayerDecayScalesEachLayersLr) {
  const std::string dir = temp_dir("layerdecay");
  auto run = make_run(vit_yaml("{no_decay: auto, layer_decay: 0.5, groups: [{params: 'head.bias', lr: 0.3}]}"), {}, dir);
  ASSERT_EQ(run->trainer->fit(), 0);
  auto& t = run->trainer->view();
  EXPECT_EQ(t.param_group_names(),
            (std::vector<std::string>{"default/layer_0", "default/layer_0/no_decay", "default/layer_1", "default/layer_1/no_decay",
                                      "default/layer_2", "default/layer_2/no_decay", "default/layer_3", "groups[0]/no_decay"}));
  // Each parameter's lr and weight decay, read off the optimizer (the schedule is constant).
  std::map<const void*, std::string> names;
  for (const auto& p : run->module->net().named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  std::map<std::string, std::pair<double, double>> got;
  for (const auto& g : t.optimizer()->param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(g.options());
    for (const auto& p : g.params()) got[names.at(p.unsafeGetTensorImpl())] = {o.lr(), o.weight_decay()};
  }
  const std::map<std::string, std::pair<double, double>> want = {
      {"cls_token", {0.00125, 0}},         {"pos_embed", {0.00125, 0}},         {"patch_embed.weight", {0.00125, 0.05}},
      {"patch_embed.bias", {0.00125, 0}},  {"blocks.0.qkv.weight", {0.0025, 0.05}}, {"blocks.0.norm1.bias", {0.0025, 0}},
      {"blocks.1.fc2.weight", {0.005, 0.05}}, {"norm.weight", {0.005, 0}},      {"head.weight", {0.01, 0.05}},
      {"head.bias", {0.3, 0}}};
  for (const auto& [name, lw] : want) {
    ASSERT_EQ(got.count(name), 1u) << name;
    EXPECT_DOUBLE_EQ(got.at(name).first, lw.first) << name;
    EXPECT_DOUBLE_EQ(got.at(name).second, lw.second) << name;
  }
  EXPECT_EQ(got.size(), run->module->net().parameters().size());
  const std::string listing = slurp(dir + "/param_groups.txt");
  EXPECT_NE(listing.find("lr_scale"), std::string::npos) << listing;
  EXPECT_NE(listing.find("[default/layer_0/no_decay]\ncls_token\npos_embed\npatch_embed.bias\n"), std::string::npos) << listing;
  EXPECT_EQ(read_csv(dir + "/metrics.csv", "lr/default/layer_1").at(1).at("lr/default/layer_1"), "0.0025");
}

// Each model's depth order, as layer_decay reads it.
TEST(ParamGroups, ModelsDeclareTheirDepthOrder) {
  auto build = [](const std::string& yaml) {
    auto doc = config::Document::load_string(yaml, "model");
    auto section = doc.root();
    return model_registry().create(section, "");
  };
  struct Case {
    std::string yaml;
    int64_t layers;
    std::map<std::string, int64_t> of;
  };
  const std::string vit = "{name: vit, img_size: 16, patch_size: 8, num_classes: 4, embed_dim: 16, depth: 3, num_heads: 2, ";
  const std::string llama = "{name: llama, vocab_size: 64, embed_dim: 16, depth: 2, num_heads: 2, num_kv_heads: 1, ";
  const std::vector<Case> cases = {
      {vit + "global_pool: token}", 5, {{"pos_embed", 0}, {"blocks.0.fc1.weight", 1}, {"blocks.2.qkv.bias", 3}, {"norm.weight", 3}, {"head.bias", 4}}},
      {vit + "class_token: false, global_pool: avg}", 5, {{"patch_embed.weight", 0}, {"blocks.1.proj.weight", 2}, {"norm.bias", 4}, {"head.weight", 4}}},
      {llama + "tie_embeddings: true}", 3, {{"embed_tokens.weight", 0}, {"layers.0.mlp.up_proj.weight", 1}, {"layers.1.input_layernorm.weight", 2}, {"norm.weight", 2}}},
      {llama + "tie_embeddings: false}", 4, {{"embed_tokens.weight", 0}, {"layers.1.self_attn.q_proj.weight", 2}, {"norm.weight", 2}, {"lm_head.weight", 3}}},
      {"{name: decoder_lm, vocab_size: 64, embed_dim: 16, depth: 2, num_heads: 2, max_seq_len: 8}", 4,
       {{"embedding.weight", 0}, {"positional_embedding.weight", 0}, {"blocks.1.fc1.bias", 2}, {"output.weight", 3}}},
      {"{name: resnet, depth: 18, num_classes: 4}", 6, {{"conv1.weight", 0}, {"bn1.bias", 0}, {"layer1.0.conv1.weight", 1}, {"layer4.1.bn2.weight", 4}, {"fc.bias", 5}}},
  };
  for (const auto& c : cases) {
    auto m = build(c.yaml);
    EXPECT_EQ(m->num_layers(), c.layers) << c.yaml;
    for (const auto& [name, layer] : c.of) EXPECT_EQ(m->layer_of(name), layer) << c.yaml << " " << name;
    // Every parameter lies in [0, num_layers).
    for (const auto& p : m->named_parameters()) {
      EXPECT_GE(m->layer_of(p.key()), 0) << p.key();
      EXPECT_LT(m->layer_of(p.key()), c.layers) << p.key();
    }
  }
  EXPECT_EQ(list_index("blocks.12.fc1.weight", "blocks"), 12);
  EXPECT_EQ(list_index("blocks12.fc1.weight", "blocks"), -1);
  EXPECT_EQ(list_index("blocks.x.fc1", "blocks"), -1);
  EXPECT_EQ(list_index("blocks.3", "blocks"), -1);
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
      {"{layer_decay: 0}", "optimizer.param_groups.layer_decay: expected a factor in (0, 1]"},
      {"{layer_decay: 1.5}", "optimizer.param_groups.layer_decay"},
  };
  for (const auto& c : cases) {
    const std::string cfg = write_config(vit_yaml(c.groups));
    const std::string dir = temp_dir("badgroups");
    auto r = strobe_cmd("fit -c " + cfg + " --run-dir " + dir + "/run");
    EXPECT_EQ(r.code, 2) << c.groups << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.groups << ": " << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  // A model without a depth order.
  const std::string mlp = R"(name: groups
trainer: {max_steps: 1, device: cpu, enable_progress_bar: false}
model: {name: mlp, in_features: 8, hidden: [8], num_classes: 2}
data: {name: synthetic_images, image_size: 2, channels: 2, num_classes: 2, num_samples: 8, batch_size: 4, num_workers: 0}
optimizer: {name: adamw, param_groups: {layer_decay: 0.75}}
)";
  const std::string dir = temp_dir("badgroups");
  auto r = strobe_cmd("fit -c " + write_config(mlp) + " --run-dir " + dir + "/run");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("optimizer.param_groups: layer_decay needs a model that declares its depth order (vit, llama, decoder_lm, "
                       "resnet); model 'Mlp' does not"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

// param_groups.txt's table: the name column is as wide as the longest group name, so every row's
// columns line up under the header however long a name is (layer decay's names run long).
TEST(ParamGroups, ListingColumnsLineUpUnderLongGroupNames) {
  std::vector<ParamGroup> groups(3);
  groups[0].name = "default", groups[1].name = "default/layer_11/no_decay", groups[2].name = "groups[12]/layer_3/no_decay_and_more";
  for (auto& g : groups) g.params = {torch::zeros({3})}, g.names = {"w"}, g.lr = 1e-3, g.weight_decay = 0.05;
  const std::string text = describe_param_groups(groups);
  std::istringstream in(text);
  std::string header;
  std::getline(in, header);
  for (size_t i = 0; i < groups.size(); ++i) {
    std::string row;
    std::getline(in, row);
    ASSERT_NE(row.find("  ("), std::string::npos) << row;
    EXPECT_EQ(row.substr(0, row.find("  (")).size(), header.size()) << "row " << i << " does not line up:\n" << text;
    EXPECT_EQ(row.rfind(groups[i].name + " ", 0), 0u) << row;
  }
}
