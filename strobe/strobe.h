// Strobe's public API in one include: what a component (a model, task, data module, dataset,
// callback or metric) is written against, and Strobe's operators (strobe::ops). The same path works
// in the source tree and in an installed package (include/strobe/...); docs/EXTENDING.md.
#pragma once

#include "strobe/checkpoint/stateful.h"
#include "strobe/config/config.h"
#include "strobe/config/experiment.h"
#include "strobe/config/precision.h"
#include "strobe/config/registry.h"
#include "strobe/core/activation_checkpoint.h"
#include "strobe/core/callback.h"
#include "strobe/core/datamodule.h"
#include "strobe/core/forensics.h"
#include "strobe/core/loop_state.h"
#include "strobe/core/model.h"
#include "strobe/core/module.h"
#include "strobe/core/step_pipeline.h"
#include "strobe/core/trainer_view.h"
#include "strobe/data/batch.h"
#include "strobe/data/dataset.h"
#include "strobe/data/loader.h"
#include "strobe/data/sampler.h"
#include "strobe/logging/log_sink.h"
#include "strobe/metrics/collection.h"
#include "strobe/metrics/metric.h"
#include "strobe/metrics/registry.h"
#include "strobe/ops/ops.h"
