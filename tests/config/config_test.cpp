// The config loader: typed reads, defaults written back, and one clear line for every kind of bad
// input (unknown key with did-you-mean, wrong type, out of range, missing file, bad --set syntax).
#include <gtest/gtest.h>

#include <fstream>

#include "framework/config/experiment.h"

using strobe::config::ConfigError;
using strobe::config::Document;
using strobe::config::parse_experiment;

namespace {

std::string error_of(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  try {
    auto doc = Document::load_string(yaml, "exp.yaml");
    for (const auto& s : sets) doc.apply_override(s);
    parse_experiment(doc);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const char* kBase = "name: t\nmodel:\n  name: resnet\ndata:\n  name: synthetic_images\n";

}  // namespace

TEST(Config, ParsesTrainerKeysAndFillsDefaults) {
  auto doc = Document::load_string(std::string(kBase) + "trainer:\n  max_steps: 200\n  precision: bf16-mixed\n  limit_val_batches: 5\n  val_check_interval: 0.25\n", "exp.yaml");
  auto e = parse_experiment(doc);
  EXPECT_EQ(e.trainer.max_steps, 200);
  EXPECT_EQ(e.trainer.precision, "bf16-mixed");
  EXPECT_TRUE(e.trainer.limit_val_batches.is_count);
  EXPECT_EQ(e.trainer.limit_val_batches.count, 5);
  EXPECT_FALSE(e.trainer.val_check_interval.is_count);
  EXPECT_DOUBLE_EQ(e.trainer.val_check_interval.fraction, 0.25);
  EXPECT_EQ(e.trainer.log_every_n_steps, 50);
  // Defaults are written back: the resolved config names every trainer key.
  std::string resolved = doc.emit();
  EXPECT_NE(resolved.find("log_every_n_steps: 50"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("accumulate_grad_batches: 1"), std::string::npos);
}

TEST(Config, UnknownKeySuggestsClosestWithLineAndColumn) {
  std::string err = error_of(std::string(kBase) + "trainer:\n  max_stepz: 3\n");
  EXPECT_EQ(err, "exp.yaml:7:3: trainer.max_stepz: unknown key; did you mean 'max_steps'?");
}

TEST(Config, UnknownTopLevelKey) {
  std::string err = error_of(std::string(kBase) + "trainr:\n  max_steps: 3\n");
  EXPECT_NE(err.find("exp.yaml:6:1: trainr: unknown key; did you mean 'trainer'?"), std::string::npos) << err;
}

TEST(Config, WrongTypeNamesExpectation) {
  std::string err = error_of(std::string(kBase) + "trainer:\n  max_epochs: three\n");
  EXPECT_EQ(err, "exp.yaml:7:3: trainer.max_epochs: expected an integer >= -1, got 'three'");
  err = error_of(std::string(kBase) + "trainer:\n  deterministic: maybe\n");
  EXPECT_EQ(err, "exp.yaml:7:3: trainer.deterministic: expected true or false, got 'maybe'");
  err = error_of(std::string(kBase) + "trainer:\n  max_epochs: [1, 2]\n");
  EXPECT_NE(err.find("expected an integer, got a sequence"), std::string::npos) << err;
}

TEST(Config, OutOfRangeValue) {
  std::string err = error_of(std::string(kBase) + "trainer:\n  accumulate_grad_batches: 0\n");
  EXPECT_EQ(err, "exp.yaml:7:3: trainer.accumulate_grad_batches: expected an integer >= 1, got 0");
  err = error_of(std::string(kBase) + "trainer:\n  limit_train_batches: 1.5\n");
  EXPECT_NE(err.find("trainer.limit_train_batches: expected a count >= 0 or a fraction in [0, 1], got 1.5"), std::string::npos) << err;
}

TEST(Config, ChoiceSuggestsClosest) {
  std::string err = error_of(std::string(kBase) + "trainer:\n  precision: bf16\n");
  EXPECT_NE(err.find("trainer.precision: expected one of 32, bf16-mixed, 16-mixed, got 'bf16' (did you mean 'bf16-mixed'?)"),
            std::string::npos)
      << err;
}

TEST(Config, MissingFileIsOneLine) {
  try {
    Document::load_file("/nonexistent/exp.yaml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "/nonexistent/exp.yaml: cannot open config file (No such file or directory)");
  }
}

TEST(Config, InvalidYamlReportsPosition) {
  std::string err = error_of("name: [unclosed\n");
  EXPECT_NE(err.find("exp.yaml:"), std::string::npos);
  EXPECT_NE(err.find("invalid YAML"), std::string::npos) << err;
}

TEST(Config, MissingModelName) {
  std::string err = error_of("data:\n  name: x\n");
  EXPECT_NE(err.find("model: missing required key 'name'"), std::string::npos) << err;
}

TEST(Config, SetOverridesAnyKeyAndCreatesSections) {
  auto doc = Document::load_string(kBase, "exp.yaml");
  doc.apply_override("trainer.max_steps=200");
  doc.apply_override("model.depth=34");
  doc.apply_override("trainer.precision=bf16-mixed");
  auto e = parse_experiment(doc);
  EXPECT_EQ(e.trainer.max_steps, 200);
  EXPECT_EQ(e.trainer.precision, "bf16-mixed");
  EXPECT_EQ(e.model.get_int("depth", 18), 34);
}

TEST(Config, SetOverridesListElements) {
  auto doc = Document::load_string(std::string(kBase) + "callbacks:\n  - name: early_stopping\n    patience: 3\n", "exp.yaml");
  doc.apply_override("callbacks.0.patience=7");
  auto e = parse_experiment(doc);
  ASSERT_EQ(e.callbacks.size(), 1u);
  EXPECT_EQ(e.callbacks[0].get_int("patience", 3), 7);
}

TEST(Config, BadSetSyntax) {
  EXPECT_EQ(error_of(kBase, {"trainer.max_steps"}),
            "--set trainer.max_steps: expected KEY=VALUE with a dotted key, e.g. trainer.max_steps=100");
  EXPECT_EQ(error_of(kBase, {"trainer..x=1"}),
            "--set trainer..x=1: 'trainer..x' is not a dotted key (expected e.g. trainer.max_steps)");
  EXPECT_NE(error_of(kBase, {"name.x=1"}).find("'name' is a value, not a mapping"), std::string::npos);
}

TEST(Config, BadValueFromSetNamesTheOverride) {
  std::string err = error_of(kBase, {"trainer.max_steps=abc"});
  EXPECT_EQ(err, "--set trainer.max_steps=abc: trainer.max_steps: expected an integer >= -1, got 'abc'");
}

TEST(Config, MaxTimeDuration) {
  auto doc = Document::load_string(std::string(kBase) + "trainer:\n  max_time: \"00:01:30:00\"\n", "exp.yaml");
  auto e = parse_experiment(doc);
  ASSERT_TRUE(e.trainer.max_time_s.has_value());
  EXPECT_DOUBLE_EQ(*e.trainer.max_time_s, 5400.0);
  EXPECT_NE(error_of(std::string(kBase) + "trainer:\n  max_time: soon\n").find("expected a duration"), std::string::npos);
}

TEST(Config, ComponentSectionsRejectUnknownKeysOnFinish) {
  auto doc = Document::load_string("name: t\nmodel:\n  name: resnet\n  dept: 18\ndata:\n  name: x\n", "exp.yaml");
  auto e = parse_experiment(doc);
  e.model.accept("name");
  e.model.get_int("depth", 18, 1);
  try {
    e.model.finish();
    FAIL();
  } catch (const ConfigError& err) {
    EXPECT_EQ(std::string(err.what()), "exp.yaml:4:3: model.dept: unknown key; did you mean 'depth'?");
  }
}

TEST(Config, CountOrFractionResolve) {
  strobe::config::CountOrFraction f{false, 0, 0.25};
  EXPECT_EQ(f.resolve(10), 2);
  EXPECT_EQ(f.resolve(1), 1);
  strobe::config::CountOrFraction c{true, 5, 0};
  EXPECT_EQ(c.resolve(3), 3);
  EXPECT_EQ(c.resolve(10), 5);
}
