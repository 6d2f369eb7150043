// Checks, through the installed headers and libstrobe alone, that the components of
// consumer_components sit in libstrobe's registries beside the built-in ones, and that each works:
// the model trains a step, the metric computes, the callback's state round-trips. Prints one line
// per check; exit 1 naming the first that fails.
#include <cstdio>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "strobe/core/callback.h"
#include "strobe/core/model.h"
#include "strobe/metrics/registry.h"

namespace {
int fail(const char* what) {
  std::fprintf(stderr, "consumer: %s\n", what);
  return 1;
}
}  // namespace

int main() {
  using namespace strobe;
  if (!model_registry().contains("consumer_gated_mlp") || !model_registry().contains("mlp"))
    return fail("consumer_gated_mlp and the built-in mlp are not in one model registry");
  if (!metrics::metric_registry().contains("consumer_mae") || !callback_registry().contains("consumer_step_counter"))
    return fail("the metric or the callback did not register");
  auto doc = config::Document::load_string("name: consumer_gated_mlp\nin_features: 12\nhidden: 8\nnum_classes: 3\n", "<consumer>");
  auto section = doc.root();
  auto model = model_registry().create(section, "");
  torch::manual_seed(0);
  Batch batch;
  batch.tensors["image"] = torch::randn({5, 3, 2, 2});
  auto target = torch::randint(0, 3, {5});
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
  auto loss0 = torch::cross_entropy_loss(model->forward(batch), target);
  loss0.backward();
  opt.step();
  auto loss1 = torch::cross_entropy_loss(model->forward(batch), target);
  if (!(loss1.item<double>() < loss0.item<double>())) return fail("a step of SGD did not lower the model's loss");
  std::printf("model consumer_gated_mlp: loss %.6f -> %.6f after one step\n", loss0.item<double>(), loss1.item<double>());
  auto mae = metrics::make_metric("consumer_mae", metrics::MetricOptions{});
  mae->update(torch::tensor({1.0, 2.0, 4.0}), torch::tensor({1.5, 2.0, 3.0}));
  const double v = mae->compute().item<double>();
  if (std::abs(v - 0.5) > 1e-12) return fail("consumer_mae of (1,2,4) vs (1.5,2,3) is not 0.5");
  std::printf("metric consumer_mae: %.6f\n", v);
  auto cb_doc = config::Document::load_string("name: consumer_step_counter\n", "<consumer>");
  auto cb_section = cb_doc.root();
  auto cb = callback_registry().create(cb_section, "");
  cb->load_state_dict(nlohmann::json{{"steps", 7}});
  if (cb->state_dict().at("steps").get<int64_t>() != 7) return fail("the callback's state did not round-trip");
  std::printf("callback consumer_step_counter: state %s\n", cb->state_dict().dump().c_str());
  return 0;
}
