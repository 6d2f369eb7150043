// An optimizer's state re-cut for another sharding (strobe/core/optimizer_reshard.h): AdamW's whole
// state cut into zero2's 3 row shards (what each holds, the padding zero, the options and step kept;
// each loads into an AdamW over its shards and steps), those 3 re-cut into 2 and back to the whole
// state bit for bit; a source that does not fit is refused naming it.
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "strobe/core/optimizer_reshard.h"

namespace {

using strobe::OptimizerSharding;
using Shapes = std::vector<std::vector<std::vector<int64_t>>>;

// Group 0: a [5, 3] and a 0-d parameter; group 1 (its own lr): a [7].
const Shapes kShapes = {{{5, 3}, {}}, {{7}}};

std::unique_ptr<torch::optim::AdamW> adamw(const std::vector<std::vector<torch::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> pg;
  for (size_t g = 0; g < groups.size(); ++g)
    pg.emplace_back(groups[g], std::make_unique<torch::optim::AdamWOptions>(g == 0 ? 0.01 : 0.002));
  return std::make_unique<torch::optim::AdamW>(pg, torch::optim::AdamWOptions(0.01));
}

std::string save(torch::optim::Optimizer& o) {
  torch::serialize::OutputArchive a;
  o.save(a);
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

void load(torch::optim::Optimizer& o, const std::string& bytes) {
  torch::serialize::InputArchive a;
  std::istringstream is(bytes);
  a.load_from(is);
  o.load(a);
}

const torch::optim::AdamWParamState& state_of(torch::optim::Optimizer& o, const torch::Tensor& p) {
  return static_cast<const torch::optim::AdamWParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
}

std::vector<std::vector<torch::Tensor>> params_of(const OptimizerSharding& sh) {
  std::vector<std::vector<torch::Tensor>> out(kShapes.size());
  for (size_t g = 0; g < kShapes.size(); ++g)
    for (const auto& s : kShapes[g]) {
      std::vector<int64_t> shape = s;
      if (sh.sharded) {
        const int64_t dim0 = s.empty() ? 1 : s[0];
        shape = {(dim0 + sh.world - 1) / sh.world};
        shape.insert(shape.end(), s.begin() + std::min<size_t>(1, s.size()), s.end());
      }
      out[g].push_back(torch::zeros(shape, torch::kFloat64).requires_grad_());
    }
  return out;
}

std::vector<std::string> recut(const std::vector<std::string>& sources, const OptimizerSharding& from, const OptimizerSharding& to) {
  std::vector<std::string> out;
  for (int64_t r = 0; r < to.world; ++r)
    out.push_back(strobe::reshard_optimizer_state(
        kShapes, from, [&](int64_t k) { return sources.at(k); }, to, r, [](int64_t k) { return "shard " + std::to_string(k); }));
  return out;
}

TEST(OptimizerReshard, WholeToThreeShardsToTwoAndBackIsTheWholeStateBitForBit) {
  torch::manual_seed(3);
  const OptimizerSharding whole{1, false}, three{3, true}, two{2, true};
  auto wp = params_of(whole);
  auto w = adamw(wp);
  for (int step = 0; step < 2; ++step) {
    for (auto& g : wp)
      for (auto& p : g) p.mutable_grad() = torch::randn(p.sizes(), torch::kFloat64);
    w->step();
  }
  const std::string whole_bytes = save(*w);

  auto shards3 = recut({whole_bytes}, whole, three);
  for (int64_t r = 0; r < 3; ++r) {
    auto sp = params_of(three);
    auto s = adamw(sp);
    load(*s, shards3[r]);
    EXPECT_DOUBLE_EQ(s->param_groups()[1].options().get_lr(), 0.002);
    // a [5, 3]: 2 rows a shard (rank 2: row 4 and a zero row); the 0-d one: rank 0 alone; c [7]: 3 rows.
    const auto& a = state_of(*s, sp[0][0]);
    EXPECT_EQ(a.step(), 2);
    const int64_t n = std::min<int64_t>(2, 5 - 2 * r);
    EXPECT_TRUE(torch::equal(a.exp_avg().narrow(0, 0, n), state_of(*w, wp[0][0]).exp_avg().narrow(0, 2 * r, n))) << r;
    if (n < 2) EXPECT_TRUE(torch::equal(a.exp_avg_sq()[1], torch::zeros({3}, torch::kFloat64))) << "padding row";
    const auto& b = state_of(*s, sp[0][1]);
    EXPECT_EQ(b.exp_avg().sizes(), torch::IntArrayRef({1}));
    EXPECT_EQ(b.exp_avg().item<double>(), r == 0 ? state_of(*w, wp[0][1]).exp_avg().item<double>() : 0.0);
    const auto& c = state_of(*s, sp[1][0]);
    const int64_t m = std::min<int64_t>(3, 7 - 3 * r);
    EXPECT_TRUE(torch::equal(c.exp_avg_sq().narrow(0, 0, m), state_of(*w, wp[1][0]).exp_avg_sq().narrow(0, 3 * r, m)));
    // The shards step as an optimizer of shards does.
    for (auto& g : sp)
      for (auto& p : g) p.mutable_grad() = torch::ones(p.sizes(), torch::kFloat64);
    s->step();
    EXPECT_EQ(state_of(*s, sp[0][0]).step(), 3);
  }

  auto shards2 = recut(shards3, three, two);
  auto back = recut(shards2, two, whole);
  auto bp = params_of(whole);
  auto b = adamw(bp);
  load(*b, back[0]);
  for (size_t g = 0; g < wp.size(); ++g)
    for (size_t j = 0; j < wp[g].size(); ++j) {
      const auto &x = state_of(*w, wp[g][j]), &y = state_of(*b, bp[g][j]);
      EXPECT_EQ(x.step(), y.step());
      EXPECT_TRUE(torch::equal(x.exp_avg(), y.exp_avg())) << g << "," << j;
      EXPECT_TRUE(torch::equal(x.exp_avg_sq(), y.exp_avg_sq())) << g << "," << j;
      EXPECT_EQ(x.exp_avg().sizes(), y.exp_avg().sizes());
    }
}

TEST(OptimizerReshard, ASourceThatDoesNotFitIsRefusedNamingIt) {
  const OptimizerSharding whole{1, false}, two{2, true};
  auto wp = params_of(whole);
  auto w = adamw(wp);
  for (auto& g : wp)
    for (auto& p : g) p.mutable_grad() = torch::ones(p.sizes(), torch::kFloat64);
  w->step();
  const std::string bytes = save(*w);
  auto expect_refused = [&](const Shapes& shapes, const std::string& source, const std::string& why) {
    try {
      strobe::reshard_optimizer_state(shapes, whole, [&](int64_t) { return source; }, two, 0,
                                      [](int64_t) { return std::string("F.ckpt"); });
      ADD_FAILURE() << "accepted; expected: " << why;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("F.ckpt: " + why), std::string::npos) << e.what();
    }
  };
  expect_refused({{{5, 3}, {}}}, bytes, "it has 2 parameter group(s), this run's optimizer 1");
  expect_refused({{{5, 3}}, {{7}}}, bytes, "its parameter group 0 holds 2 tensor(s), this run's 1");
  expect_refused({{{5, 4}, {}}, {{7}}}, bytes, "parameter 0 of group 0's 'exp_avg' has shape [5, 3], not [5, 4]");
  expect_refused(kShapes, "not an archive", "it is not an optimizer state archive");
}

}  // namespace
