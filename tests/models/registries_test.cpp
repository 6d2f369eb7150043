// Every built-in component is registered in the library: a registration the linker drops (an object
// file left out of libstrobe) or a component renamed without its docs fails here. Adding a built-in
// component means adding its name below (and to the docs that list them).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "strobe/core/callback.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/core/weight_names.h"
#include "strobe/metrics/registry.h"

namespace strobe {
namespace {

using Names = std::vector<std::string>;

TEST(BuiltInComponents, EveryRegistryListsExactlyTheBuiltIns) {
  EXPECT_EQ(model_registry().names(), (Names{"decoder_lm", "face_detector", "llama", "mlp", "resnet", "vit"}));
  EXPECT_EQ(task_registry().names(), (Names{"classification", "detection", "language_modeling", "regression"}));
  EXPECT_EQ(data_registry().names(),
            (Names{"cifar10", "coco_boxes", "fashion_mnist", "image_folder", "synthetic_boxes", "synthetic_images",
                   "synthetic_tokens", "tensor_file", "text_file", "token_file"}));
  EXPECT_EQ(callback_registry().names(),
            (Names{"device_stats_monitor", "early_stopping", "ema", "lr_monitor", "model_checkpoint", "model_summary", "nan_capture", "on_exception_checkpoint", "progress_bar", "swa", "throughput_monitor"}));
  EXPECT_EQ(metrics::metric_registry().names(),
            (Names{"accuracy", "cat", "f1", "fbeta", "max", "mean", "mean_giou", "mean_iou", "min", "perplexity",
                   "precision", "recall", "sum", "token_accuracy"}));
  EXPECT_EQ(name_map_registry().names(), (Names{"llama:hf", "resnet:timm", "resnet:torchvision", "vit:timm", "vit:torchvision"}));
  EXPECT_EQ(hf_config_registry().names(), (Names{"llama"}));
}

TEST(BuiltInComponents, UnknownNamesGetTheClosestAndTheList) {
  EXPECT_EQ(metrics::metric_registry().unknown_message("f2"),
            "unknown metric 'f2'; did you mean 'f1'? (known: accuracy, cat, f1, fbeta, max, mean, mean_giou, mean_iou, "
            "min, perplexity, precision, recall, sum, token_accuracy)");
  EXPECT_EQ(model_registry().unknown_message("resnt"),
            "unknown model 'resnt'; did you mean 'resnet'? (known: decoder_lm, face_detector, llama, mlp, resnet, vit)");
}

}  // namespace
}  // namespace strobe
