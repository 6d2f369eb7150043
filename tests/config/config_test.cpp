// The config loader: typed reads, defaults written back, and one clear line for every kind of bad
// input (unknown key with did-you-mean, wrong type, out of range, missing file, bad --set syntax).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <fmt/format.h>

#include "strobe/config/experiment.h"
#include "strobe/config/experiment_parse.h"
#include "strobe/config/resume_check.h"
#include "strobe/config/saved_config.h"
#include "tests/config/yaml_types.h"

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
  EXPECT_EQ(e.trainer.precision, strobe::Precision::kBf16Mixed);
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
  EXPECT_NE(err.find("trainer.precision: expected one of 32, bf16-mixed, 16-mixed, bf16-master, got 'bf16' (did you mean 'bf16-mixed'?)"),
            std::string::npos)
      << err;
}

// A value quoted in a message is one printable line: control characters and NUL escaped, bytes that
// are not UTF-8 as \xNN (UTF-8 kept), a long one cut to its start and its length.
TEST(Config, QuotedValuesAreEscapedAndCut) {
  EXPECT_EQ(strobe::config::shown(std::string("vi\nt\0x\t\x7f", 8)), "vi\\nt\\0x\\t\\x7f");
  EXPECT_EQ(strobe::config::shown("caf\xc3\xa9 \xff\xfe"), "caf\xc3\xa9 \\xff\\xfe");
  EXPECT_EQ(strobe::config::shown(std::string(1000000, 'a')), std::string(60, 'a') + "... (1000000 characters)");
  std::string err = error_of(std::string(kBase) + "trainer:\n  precision: \"bf\\n16\"\n");
  EXPECT_NE(err.find("got 'bf\\n16'"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
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
  EXPECT_EQ(e.trainer.precision, strobe::Precision::kBf16Mixed);
  EXPECT_EQ(e.model.get_int("depth", 18), 34);
}

// --set of another component name drops the old component's keys that came from the file, in one
// note; keys an earlier --set gave stay (so a typo still fails); the same name, or the experiment's
// own name, drops nothing.
TEST(Config, SetOfAnotherComponentNameDropsTheOldOnesFileKeys) {
  const std::string yaml = "name: exp\nscheduler: {name: cosine, warmup_steps: 30, max_steps: 100}\n"
                           "callbacks:\n  - name: early_stopping\n    patience: 3\n";
  auto doc = Document::load_string(yaml, "exp.yaml");
  doc.apply_override("scheduler.name=none");
  EXPECT_EQ(YAML::Dump(doc.root().node()["scheduler"]), "{name: none}");
  ASSERT_EQ(doc.notes().size(), 1u);
  EXPECT_EQ(doc.notes()[0], "--set scheduler.name=none: dropped scheduler.warmup_steps, scheduler.max_steps (cosine's keys from exp.yaml)");

  auto kept = Document::load_string(yaml, "exp.yaml");
  kept.apply_override("scheduler.warmup_stpes=5");
  kept.apply_override("scheduler.name=linear_warmup");
  EXPECT_EQ(YAML::Dump(kept.root().node()["scheduler"]), "{name: linear_warmup, warmup_stpes: 5}");
  kept.apply_override("callbacks.0.name=ema");
  EXPECT_FALSE(kept.root().node()["callbacks"][0]["patience"].IsDefined());
  ASSERT_EQ(kept.notes().size(), 2u);
  EXPECT_EQ(kept.notes()[1], "--set callbacks.0.name=ema: dropped callbacks[0].patience (early_stopping's keys from exp.yaml)");
  std::string err;
  try {
    strobe::config::Section s = kept.root().child("scheduler");
    s.get_string("name", "");
    s.finish();
  } catch (const ConfigError& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("--set scheduler.warmup_stpes=5"), std::string::npos) << err;

  auto same = Document::load_string(yaml, "exp.yaml");
  same.apply_override("scheduler.name=cosine");
  same.apply_override("name=other");
  EXPECT_TRUE(same.notes().empty());
  EXPECT_EQ(same.root().node()["scheduler"]["warmup_steps"].as<int>(), 30);
}

// Several -c files compose in order: mappings merge, lists and values replace, another component
// name drops the earlier files' keys of that section (one note), and every key's errors name the
// file it came from with its line and column.
TEST(Config, SeveralConfigFilesComposeInOrder) {
  const auto dir = std::filesystem::temp_directory_path() / ("strobe-compose-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string a = (dir / "a.yaml").string(), b = (dir / "b.yaml").string();
  std::ofstream(a) << "name: exp\ntrainer: {max_epochs: 2, log_every_n_steps: 5}\nmodel: {name: mlp, hidden: [32, 16]}\n"
                      "scheduler: {name: cosine, warmup_steps: 30}\ncallbacks:\n  - name: early_stopping\n";
  std::ofstream(b) << "trainer: {max_epochs: 3}\nmodel: {hidden: [8]}\nscheduler: {name: linear_warmup}\ncallbacks: []\n"
                      "data: {name: x, batch_sise: 4}\n";
  auto doc = Document::load_files({a, b});
  const YAML::Node root = doc.root().node();
  EXPECT_EQ(root["trainer"]["max_epochs"].as<int>(), 3);
  EXPECT_EQ(root["trainer"]["log_every_n_steps"].as<int>(), 5);
  EXPECT_EQ(YAML::Dump(root["model"]["hidden"]), "[8]");
  EXPECT_EQ(root["model"]["name"].as<std::string>(), "mlp");
  EXPECT_EQ(YAML::Dump(root["scheduler"]), "{name: linear_warmup}");
  EXPECT_EQ(root["callbacks"].size(), 0u);
  ASSERT_EQ(doc.notes().size(), 1u);
  EXPECT_EQ(doc.notes()[0], b + " sets scheduler.name: linear_warmup: dropped scheduler.warmup_steps (cosine's keys from " + a + ")");
  auto where = [&](const std::string& section, const std::string& key) { return doc.root().child(section).location(key); };
  EXPECT_EQ(where("trainer", "log_every_n_steps"), a + ":2:26");
  EXPECT_EQ(where("trainer", "max_epochs"), b + ":1:11");
  EXPECT_EQ(where("data", "batch_sise"), b + ":5:17");
  // A --set after them still wins, and names itself.
  doc.apply_override("trainer.max_epochs=4");
  EXPECT_EQ(where("trainer", "max_epochs"), "--set trainer.max_epochs=4");
  std::filesystem::remove_all(dir);
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

using strobe::testing::flat;

TEST(ConfigResolved, DefaultsKeepTheirTypeWhenWrittenAndReadAgain) {
  auto doc = Document::load_string(kBase, "exp.yaml");
  auto e = parse_experiment(doc);
  const std::string resolved = doc.emit();
  auto f = flat(resolved);
  // 1.0 written as "1" would read back as the count 1: every batch instead of every epoch.
  EXPECT_EQ(f[".trainer.val_check_interval"], "float:1") << resolved;
  EXPECT_EQ(f[".trainer.limit_train_batches"], "float:1") << resolved;
  EXPECT_EQ(f[".trainer.precision"], "str:32") << resolved;
  EXPECT_EQ(f[".trainer.gradient_clip_val"], "float:0") << resolved;
  auto again = Document::load_string(resolved, "config.yaml");
  auto e2 = parse_experiment(again);
  EXPECT_FALSE(e2.trainer.val_check_interval.is_count);
  EXPECT_DOUBLE_EQ(e2.trainer.val_check_interval.fraction, 1.0);
  EXPECT_FALSE(e2.trainer.limit_train_batches.is_count);
  EXPECT_EQ(e2.trainer.precision, strobe::Precision::k32);
  EXPECT_EQ(flat(again.emit()), f);
}

TEST(ConfigResolved, UserValuesKeepTypeAndSpelling) {
  auto doc = Document::load_string(std::string(kBase) +
                                       "trainer:\n  precision: \"32\"\n  val_check_interval: 1.0\n  limit_val_batches: 1\n"
                                       "  max_time: \"10\"\n  default_root_dir: \"yes\"\n",
                                   "exp.yaml");
  parse_experiment(doc);
  auto f = flat(doc.emit());
  EXPECT_EQ(f[".trainer.precision"], "str:32");
  EXPECT_EQ(f[".trainer.val_check_interval"], "float:1");
  EXPECT_EQ(f[".trainer.limit_val_batches"], "int:1");
  EXPECT_EQ(f[".trainer.max_time"], "str:10");
  EXPECT_EQ(f[".trainer.default_root_dir"], "str:yes");
}

TEST(ConfigResolved, DoubleDefaultsAreFloatsForPyYamlToo) {
  auto doc = Document::load_string(kBase, "exp.yaml");
  auto s = doc.root().child("model");
  s.get_double("eps", 1e-8);
  s.get_double("lr", 3.0);
  s.get_double("tiny", 0.1);
  const std::string out = doc.emit();
  // PyYAML reads 1e-08 (no dot) as a string.
  EXPECT_NE(out.find("eps: 1.0e-08"), std::string::npos) << out;
  EXPECT_NE(out.find("lr: 3.0"), std::string::npos) << out;
  EXPECT_NE(out.find("tiny: 0.1\n"), std::string::npos) << out;
}

TEST(Config, DuplicateKeyNamesBothLines) {
  EXPECT_EQ(error_of(std::string(kBase) + "trainer:\n  max_steps: 3\n  precision: bf16-mixed\n  max_steps: 5\n"),
            "exp.yaml:9:3: trainer.max_steps: duplicate key (first defined at line 7)");
  EXPECT_EQ(error_of(std::string(kBase) + "name: again\n"), "exp.yaml:6:1: name: duplicate key (first defined at line 1)");
  EXPECT_EQ(error_of(kBase, {"data={name: x, name: y}"}), "--set data={name: x, name: y}: data.name: duplicate key (first defined at line 1)");
}

TEST(Config, EmptySetValueIsAnError) {
  EXPECT_EQ(error_of(kBase, {"trainer.max_steps="}),
            "--set trainer.max_steps=: empty value (to reset a key to its default write trainer.max_steps=null)");
  EXPECT_EQ(error_of(kBase, {"trainer.max_steps=null"}), "");
}

TEST(Config, UnknownKeyMadeBySetBlamesTheSet) {
  EXPECT_EQ(error_of(kBase, {"foo.bar=3"}), "--set foo.bar=3: foo: unknown key (known keys: callbacks, data, logger, model, "
                                            "name, optimizer, plugins, scheduler, seed, task, trainer)");
  EXPECT_EQ(error_of(kBase, {"trainer.bogus.x=3"}), "--set trainer.bogus.x=3: trainer.bogus: unknown key (known keys: "
                                                    "accumulate_grad_batches, check_val_every_n_epoch, cuda_graphs, default_root_dir, "
                                                    "deterministic, device, dist_timeout, enable_checkpointing, enable_model_summary, enable_progress_bar, "
                                                    "fast_dev_run, fp8, gradient_clip_algorithm, gradient_clip_val, "
                                                    "limit_predict_batches, limit_test_batches, limit_train_batches, "
                                                    "limit_val_batches, log_every_n_steps, max_epochs, max_steps, max_time, memory_check, "
                                                    "num_sanity_val_steps, overfit_batches, precision, profiler, strategy, val_check_interval)");
}

TEST(Config, BadListElementValueFromSetNamesTheSet) {
  auto doc = Document::load_string(std::string(kBase) + "callbacks:\n  - name: early_stopping\n", "exp.yaml");
  doc.apply_override("callbacks.0.patience=abc");
  auto e = parse_experiment(doc);
  try {
    e.callbacks[0].get_int("patience", 3, 0);
    FAIL() << "no error";
  } catch (const ConfigError& err) {
    EXPECT_EQ(std::string(err.what()), "--set callbacks.0.patience=abc: callbacks[0].patience: expected an integer >= 0, got 'abc'");
  }
}

TEST(Config, DirectoryOrEmptyFileSaysSo) {
  const std::string dir = ::testing::TempDir() + "/strobe-config-dir";
  std::filesystem::create_directories(dir);
  try {
    Document::load_file(dir);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), dir + ": is a directory, not a config file");
  }
  for (const char* text : {"", "\n# only a comment\n"}) {
    const std::string empty = dir + "/empty.yaml";
    std::ofstream(empty) << text;
    try {
      Document::load_file(empty);
      FAIL() << "no error for '" << text << "'";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), empty + ": the config is empty (expected a mapping with at least 'model' and 'data')");
    }
  }
}

// The one flattening of a config (the resume check and TensorBoard's hparams): document order, dotted
// paths, [i] for list elements, a list of scalars as one leaf, null spelled out.
TEST(ResumeCheck, AConfigFlattensOneWay) {
  const auto flat = strobe::config::flatten_config(
      "name: t\nmodel:\n  hidden: [32, 16]\n  init_from: null\ncallbacks:\n  - name: ema\n    decay: 0.9\n  - {name: lr_monitor}\n");
  const std::vector<std::pair<std::string, std::string>> want = {
      {"name", "t"}, {"model.hidden", "[32, 16]"}, {"model.init_from", "null"},
      {"callbacks[0].name", "ema"}, {"callbacks[0].decay", "0.9"}, {"callbacks[1].name", "lr_monitor"}};
  EXPECT_EQ(flat, want);
  EXPECT_TRUE(strobe::config::flatten_config("").empty());
}

TEST(ResumeCheck, SortsChangesIntoIncompatibleModelAndAllowed) {
  using strobe::config::compare_for_resume;
  const std::string saved =
      "name: t\ntrainer:\n  max_steps: 24\n  precision: \"32\"\nmodel:\n  name: mlp\n  hidden: [32, 16]\n  dropout: 0.2\n"
      "optimizer:\n  name: adamw\n  lr: 0.01\ncallbacks:\n  - name: model_checkpoint\n    every_n_steps: 6\n";
  // Nothing changed: nothing to say.
  auto same = compare_for_resume(saved, saved);
  EXPECT_TRUE(same.incompatible.empty() && same.model_changes.empty() && same.allowed.empty());

  const std::string now =
      "name: t\ntrainer:\n  max_steps: 48\n  precision: bf16-mixed\n  log_every_n_steps: 5\nmodel:\n  name: mlp\n"
      "  hidden: [8]\n  dropout: 0.2\noptimizer:\n  name: sgd\n  lr: 0.005\ncallbacks:\n  - name: model_checkpoint\n"
      "    every_n_steps: 3\n";
  auto r = compare_for_resume(saved, now);
  ASSERT_EQ(r.incompatible.size(), 2u);
  EXPECT_EQ(r.incompatible[0].text(), "optimizer.name: adamw -> sgd");
  EXPECT_NE(r.incompatible[0].why.find("optimizer state"), std::string::npos);
  EXPECT_EQ(r.incompatible[1].text(), "trainer.precision: 32 -> bf16-mixed");
  ASSERT_EQ(r.model_changes.size(), 1u);
  EXPECT_EQ(r.model_changes[0].text(), "model.hidden: [32, 16] -> [8]");
  // optimizer.lr follows from the other optimizer: not listed on its own.
  EXPECT_EQ(strobe::config::join_changes(r.allowed),
            "callbacks[0].every_n_steps: 6 -> 3, trainer.log_every_n_steps: (absent) -> 5, trainer.max_steps: 24 -> 48");
}

// A section written out on one side and a plain value on the other is one change, in its direction
// (the groups removed: the section -> null, never "(absent) -> null").
// Numbers compare as numbers: an integer and a float of one value, a float printed in full, a list
// of them, YAML's infinities; another value, or text, is a change.
TEST(ResumeCheck, NumbersCompareAsNumbers) {
  const auto r = strobe::config::compare_for_resume(
      "model: {rope_theta: 10000, norm_eps: 1.0000000000000001e-05, hidden: [32, 16], clip: .inf, act: gelu}\nseed: 7\n",
      "model: {rope_theta: 10000.0, norm_eps: 1.0e-05, hidden: [32.0, 16], clip: +.inf, act: gelu}\nseed: 7\n");
  EXPECT_TRUE(r.incompatible.empty() && r.model_changes.empty() && r.allowed.empty())
      << strobe::config::join_changes(r.incompatible) << " | " << strobe::config::join_changes(r.model_changes);
  const auto d = strobe::config::compare_for_resume("model: {rope_theta: 10000, hidden: [32, 16], act: gelu}\nseed: 7\n",
                                                    "model: {rope_theta: 10001, hidden: [32, 17], act: Gelu}\nseed: 7.5\n");
  EXPECT_EQ(strobe::config::join_changes(d.incompatible), "model.rope_theta: 10000 -> 10001");
  EXPECT_EQ(strobe::config::join_changes(d.model_changes), "model.act: gelu -> Gelu, model.hidden: [32, 16] -> [32, 17]");
  EXPECT_EQ(strobe::config::join_changes(d.allowed), "seed: 7 -> 7.5");
  EXPECT_FALSE(strobe::config::same_config_value("1e5x", "1e5"));
  EXPECT_FALSE(strobe::config::same_config_value("nan", "nan2"));
  EXPECT_FALSE(strobe::config::same_config_value("[1, 2]", "[1, 2, 3]"));
}

TEST(ResumeCheck, ASectionReplacedByAValueIsOneChangeInItsDirection) {
  using strobe::config::compare_for_resume;
  const std::string with = "optimizer:\n  name: adamw\n  param_groups:\n    groups: [{params: 'fc*', lr: 0.1}]\n";
  const std::string without = "optimizer:\n  name: adamw\n  param_groups: null\n";
  auto removed = compare_for_resume(with, without);
  ASSERT_EQ(removed.incompatible.size(), 1u) << strobe::config::join_changes(removed.allowed);
  EXPECT_EQ(removed.incompatible[0].text(), "optimizer.param_groups: {groups[0].lr: 0.1, groups[0].params: fc*} -> null");
  auto added = compare_for_resume(without, with);
  ASSERT_EQ(added.incompatible.size(), 1u);
  EXPECT_EQ(added.incompatible[0].text(), "optimizer.param_groups: null -> {groups[0].lr: 0.1, groups[0].params: fc*}");
}

TEST(ConfigParse, AParamGroupThatIsNotAMappingSaysWhatAGroupIs) {
  auto doc = Document::load_string(std::string(kBase) + "", "exp.yaml");
  doc.apply_override("optimizer.param_groups={groups: [5]}");
  try {
    parse_experiment(doc);
    ADD_FAILURE() << "a group of 5 was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("optimizer.param_groups.groups[0]: expected a mapping {params: GLOB, lr: X, weight_decay: Y}"),
              std::string::npos)
        << what;
    EXPECT_EQ(what.find("'name'"), std::string::npos) << what;
  }
}

TEST(ConfigResolved, EmptyListsAndComponentDoublesReadBackTheSame) {
  auto doc = Document::load_string(kBase, "exp.yaml");
  parse_experiment(doc);
  // What components do: a list of doubles written with yaml-cpp's 17 digits.
  YAML::Node betas(YAML::NodeType::Sequence);
  betas.push_back(0.9);
  betas.push_back(0.999);
  doc.root().child("optimizer").node()["betas"] = betas;
  const std::string once = doc.emit();
  EXPECT_NE(once.find("callbacks: []\n"), std::string::npos) << once;
  EXPECT_NE(once.find("    - 0.9\n    - 0.999\n"), std::string::npos) << once;
  auto again = Document::load_string(once, "config.yaml");
  EXPECT_EQ(again.emit(), once);
  EXPECT_EQ(again.root().child("optimizer").node()["betas"][0].as<double>(), 0.9);
}

TEST(ResumeCheck, AnotherOptimizerHidesTheKeysThatComeWithIt) {
  auto r = strobe::config::compare_for_resume(
      "optimizer:\n  name: adamw\n  lr: 0.01\n  betas: [0.9, 0.999]\n  weight_decay: 0.01\ntrainer:\n  max_steps: 2\n",
      "optimizer:\n  name: sgd\n  lr: 0.01\n  momentum: 0.0\n  weight_decay: 0.0\ntrainer:\n  max_steps: 5\n");
  ASSERT_EQ(r.incompatible.size(), 1u);
  EXPECT_EQ(r.incompatible[0].text(), "optimizer.name: adamw -> sgd");
  EXPECT_EQ(strobe::config::join_changes(r.allowed), "trainer.max_steps: 2 -> 5");
  // The same optimizer with other hyper-parameters: its saved state would restore the old ones.
  auto hyper = strobe::config::compare_for_resume("optimizer:\n  name: adamw\n  lr: 0.01\n  weight_decay: 0.01\n",
                                                  "optimizer:\n  name: adamw\n  lr: 0.001\n  weight_decay: 0.01\n");
  ASSERT_EQ(hyper.incompatible.size(), 1u);
  EXPECT_EQ(hyper.incompatible[0].text(), "optimizer.lr: 0.01 -> 0.001");
  EXPECT_NE(hyper.incompatible[0].why.find("keeps the checkpoint's hyper-parameters"), std::string::npos);
  EXPECT_TRUE(hyper.allowed.empty());
  auto lists = strobe::config::compare_for_resume("model:\n  hidden:\n    - 32\n    - 16\n", "model:\n  hidden: [8]\n");
  ASSERT_EQ(lists.model_changes.size(), 1u);
  EXPECT_EQ(lists.model_changes[0].text(), "model.hidden: [32, 16] -> [8]");
}

// A "billion laughs": nine levels of nine aliases each expand to 9^9 nodes. Refused at once, naming
// the file, from a config file and from a --set alike, instead of walking the expansion for minutes.
TEST(Config, NestedAliasesAreRefusedBeforeTheyExpand) {
  auto laughs = [](const std::string& sep) {
    std::string y = "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]" + sep;
    for (char c = 'b'; c <= 'i'; ++c) {
      y += std::string(1, c) + ": &" + c + " [";
      for (int k = 0; k < 9; ++k) y += std::string(k ? "," : "") + "*" + static_cast<char>(c - 1);
      y += "]" + sep;
    }
    return y;
  };
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(error_of(std::string(kBase) + laughs("\n")),
            "exp.yaml: the YAML expands to more than 100000 nodes (aliases that nest aliases?); a config this large is refused");
  const std::string set = "model.extra={" + laughs(", ").substr(0, laughs(", ").size() - 2) + "}";
  EXPECT_EQ(error_of(kBase, {set}).rfind("--set " + set + ": the YAML expands to more than 100000 nodes", 0), 0u)
      << error_of(kBase, {set}).substr(0, 300);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  // Aliases that stay small are still YAML like any other, and nesting has a bound too.
  EXPECT_EQ(error_of(std::string(kBase) + "trainer: {max_steps: &n 3, max_epochs: *n}\n"), "");
  std::string deep = std::string(kBase) + "deep: " + std::string(70, '[') + std::string(70, ']') + "\n";
  EXPECT_EQ(error_of(deep).rfind("exp.yaml:6:", 0), 0u) << error_of(deep);
  EXPECT_NE(error_of(deep).find("nested deeper than 64 levels"), std::string::npos) << error_of(deep);
}

// The value tests run without std::regex (which recursed once per character and overflowed the
// stack past ~50,000): the same answers as the grammar on short text, and long text is no crash.
TEST(ConfigText, NumberTestsAgreeWithTheirGrammarAndTakeAnyLength) {
  const std::regex int_re(R"(^[-+]?(0|[1-9][0-9]*)$)");
  const std::regex float_re(R"(^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$)");
  const std::string alphabet = "0179+-.eE_x ";
  std::srand(7);
  int ints = 0, floats = 0;
  for (int trial = 0; trial < 40000; ++trial) {
    std::string s;
    for (int n = std::rand() % 7; n > 0; --n) s += alphabet[std::rand() % alphabet.size()];
    ASSERT_EQ(strobe::config::is_int_text(s), std::regex_match(s, int_re)) << "'" << s << "'";
    ASSERT_EQ(strobe::config::is_float_text(s), std::regex_match(s, float_re)) << "'" << s << "'";
    ints += strobe::config::is_int_text(s), floats += strobe::config::is_float_text(s);
  }
  EXPECT_GT(ints, 100);  // both answers were drawn many times
  EXPECT_GT(floats, 500);
  const std::string digits(500000, '7');
  EXPECT_TRUE(strobe::config::is_int_text(digits));
  EXPECT_TRUE(strobe::config::is_float_text("-" + digits + "." + digits + "e-" + digits));
  EXPECT_FALSE(strobe::config::is_float_text(digits + "x"));
  EXPECT_EQ(strobe::config::shown(digits), std::string(60, '7') + "... (500000 characters)");
}

// A string that a YAML reader would take for something else is written quoted in the resolved config
// (YAML 1.1 too: octal, hex, binary, '_' in digits, sexagesimal, .inf/.nan); other strings are plain.
TEST(ConfigResolved, StringsThatReadAsOtherTypesAreQuotedOthersArePlain) {
  const std::vector<std::string> quoted = {"0x1F", "0o17", "017", "0b101", "1_000", "-7", "+3.5", "1:30", "1:30:05.5", "2.",
                                           ".5",   "1e5",  ".inf", "-.Inf", ".NaN", "yes",  "Off", "~",    "null",      "1_0.2_5"};
  const std::vector<std::string> plain = {"abc", "1:75", "0x", "0xG", "1e", "e5", "1.2.3", "0b2", "v1", "1:3a", "cuda:0"};
  for (const auto& v : quoted) {
    auto doc = Document::load_string(std::string(kBase) + "trainer:\n  default_root_dir: \"" + v + "\"\n", "exp.yaml");
    parse_experiment(doc);
    EXPECT_NE(doc.emit().find("default_root_dir: \"" + v + "\"\n"), std::string::npos) << v << "\n" << doc.emit();
  }
  for (const auto& v : plain) {
    auto doc = Document::load_string(std::string(kBase) + "trainer:\n  default_root_dir: \"" + v + "\"\n", "exp.yaml");
    parse_experiment(doc);
    EXPECT_NE(doc.emit().find("default_root_dir: " + v + "\n"), std::string::npos) << v << "\n" << doc.emit();
  }
}

// The bounds of docs/CONFIG.md ("Limits"): each refused in one line naming where, never a crash.
TEST(ConfigLimits, LongValuesKeysAndNamesAreRefusedInOneLine) {
  const std::string big(100000, '9'), under(60000, '9');
  struct Case {
    std::string yaml;
    std::vector<std::string> sets;
    std::string want;
  };
  std::string deep = "a";
  for (int i = 0; i < 30000; ++i) deep += ".a";
  const std::vector<Case> cases = {
      {kBase, {"trainer.max_steps=" + big}, "a value of 100000 bytes; a value may hold at most 65536 bytes"},
      {kBase, {"trainer.max_steps=" + under}, "trainer.max_steps: expected an integer >= -1, got " + std::string(60, '9') +
                                                  "... (60000 characters)"},
      {kBase, {"optimizer.lr=0." + under}, ""},  // a long number under the bound reads
      {kBase, {deep + "=1"}, "a key of more than 64 dotted parts"},
      {kBase, {"trainer." + std::string(129, 'k') + "=1"}, "a key part of 129 characters"},
      {kBase, {"name=" + std::string(129, 'n')}, "name: a run name of 129 characters"},
      {std::string(kBase) + "trainer:\n  max_steps: " + big + "\n", {}, "exp.yaml:7:14: a value of 100000 bytes"},
      {std::string(kBase) + "trainer:\n  " + std::string(200, 'k') + ": 1\n", {}, "exp.yaml:7:3: a key of 200 characters"},
      {std::string(kBase) + "trainer:\n  max_epochs: " + under + "\n", {}, "trainer.max_epochs: expected an integer >= -1"},
      {std::string(kBase) + "trainer:\n  gradient_clip_val: " + under + "\n", {}, "trainer.gradient_clip_val: expected a number >= 0"},
      {std::string(kBase) + "trainer:\n  max_time: \"" + under + "\"\n", {}, "trainer.max_time: expected a duration"},
      {std::string(kBase) + "trainer:\n  device: cuda:" + under + "\n", {}, ""},
      {"name: \"" + std::string(60000, 'n') + "\"\n" + std::string(kBase).substr(8), {}, "a run name of 60000 characters"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.yaml, c.sets);
    if (c.want.empty()) {
      EXPECT_EQ(e, "") << e.substr(0, 300);
      continue;
    }
    EXPECT_NE(e.find(c.want), std::string::npos) << e.substr(0, 300) << "\nwanted: " << c.want.substr(0, 200);
    EXPECT_LT(e.size(), 400u) << "a message shows the start of a long value, not all of it";
    EXPECT_EQ(e.find('\n'), std::string::npos);
  }
}

// As Lightning: max_steps without max_epochs trains until max_steps (max_epochs resolves to -1 and the
// resolved config says so); neither means one epoch; a max_epochs given is kept.
TEST(Config, MaxStepsAloneResolvesMaxEpochsToUnlimited) {
  auto epochs = [](const std::string& trainer) {
    auto doc = Document::load_string(std::string(kBase) + "trainer:\n" + trainer, "exp.yaml");
    const auto e = parse_experiment(doc);
    EXPECT_NE(doc.emit().find(fmt::format("max_epochs: {}\n", e.trainer.max_epochs)), std::string::npos) << doc.emit();
    return e.trainer.max_epochs;
  };
  EXPECT_EQ(epochs("  max_steps: 40\n"), -1);
  EXPECT_EQ(epochs("  max_steps: 0\n"), -1);
  EXPECT_EQ(epochs("  max_steps: -1\n"), 1);
  EXPECT_EQ(epochs("  log_every_n_steps: 1\n"), 1);
  EXPECT_EQ(epochs("  max_steps: 40\n  max_epochs: 3\n"), 3);
  EXPECT_EQ(epochs("  max_steps: 40\n  max_epochs: null\n"), -1);
}

// A config file is one YAML document; a --set value YAML reads as nothing (a marker, a comment) is an
// error, not the default; null spelt out is the default.
TEST(Config, SecondDocumentsAndValuesYamlReadsAsNothingAreRefused) {
  EXPECT_NE(error_of(std::string(kBase) + "---\nname: other\n").find("exp.yaml:7:1: a second YAML document"), std::string::npos)
      << error_of(std::string(kBase) + "---\nname: other\n");
  EXPECT_NE(error_of(std::string(kBase) + "...\nname: other\n").find("a second YAML document"), std::string::npos);
  EXPECT_EQ(error_of("---\n" + std::string(kBase) + "...\n"), "");  // markers around one document
  for (const std::string v : {"---", "...", "# x", " # x", "--- # x"})
    EXPECT_NE(error_of(kBase, {"name=" + v}).find("YAML reads the value as no value"), std::string::npos) << v;
  EXPECT_NE(error_of(kBase, {"name=a\n---\nb"}).find("YAML reads the value as two documents"), std::string::npos);
  for (const std::string v : {"null", "~", " NULL "}) EXPECT_EQ(error_of(kBase, {"name=" + v}), "") << v;
  EXPECT_EQ(error_of(kBase, {"name='---'"}), "");
}

// Model keys that keep every shape but change the function the weights compute are incompatible
// changes on resume, each named; a model key that does neither (attention's implementation) is not.
TEST(ResumeCheck, KeysThatChangeTheModelsFunctionAreIncompatible) {
  const std::string before = "model: {name: llama, rope_theta: 500000, rope_scaling: {factor: 32}, norm_eps: 1.0e-5, attention: math}\n";
  const std::string after = "model: {name: llama, rope_theta: 10000, rope_scaling: {factor: 8}, norm_eps: 1.0e-6, attention: sdpa}\n";
  const auto r = strobe::config::compare_for_resume(before, after);
  std::vector<std::string> keys;
  for (const auto& c : r.incompatible) {
    keys.push_back(c.key);
    EXPECT_NE(c.why.find("changes the function the weights compute"), std::string::npos) << c.key;
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"model.norm_eps", "model.rope_scaling.factor", "model.rope_theta"}));
  ASSERT_EQ(r.model_changes.size(), 1u);
  EXPECT_EQ(r.model_changes[0].key, "model.attention");
}

TEST(Config, TrainerFp8IsOffUnwrittenOnWithTrueAndCheckedAsAMapping) {
  auto emitted = [](const std::string& yaml) {
    auto doc = Document::load_string(yaml, "exp.yaml");
    const auto e = parse_experiment(doc);
    return std::make_pair(e.trainer.fp8, doc.emit());
  };
  auto [off, off_text] = emitted(kBase);
  EXPECT_FALSE(off.enabled);
  EXPECT_EQ(off_text.find("fp8"), std::string::npos) << "an unwritten trainer.fp8 stays out of the resolved config";
  auto [on, on_text] = emitted(std::string(kBase) + "trainer:\n  fp8: true\n");
  EXPECT_TRUE(on.enabled);
  EXPECT_TRUE(on.skip.empty());
  EXPECT_EQ(on.min_size, 3072 * 1024);
  EXPECT_NE(on_text.find("min_size: 3145728"), std::string::npos) << on_text;
  auto [m, m_text] = emitted(std::string(kBase) + "trainer:\n  fp8: {skip: [\"layers.*.k_proj\"], min_size: 0}\n");
  EXPECT_TRUE(m.enabled) << "a written section is on unless enabled: false";
  EXPECT_EQ(m.skip, std::vector<std::string>{"layers.*.k_proj"});
  EXPECT_EQ(m.min_size, 0);
  EXPECT_FALSE(emitted(std::string(kBase) + "trainer:\n  fp8: false\n").first.enabled);

  EXPECT_NE(error_of(std::string(kBase) + "trainer:\n  fp8: {skip: k_proj}\n").find("trainer.fp8.skip"), std::string::npos);
  EXPECT_NE(error_of(std::string(kBase) + "trainer:\n  fp8: {min_size: -1}\n").find("trainer.fp8.min_size"), std::string::npos);
  EXPECT_NE(error_of(std::string(kBase) + "trainer:\n  fp8: [1]\n").find("trainer.fp8"), std::string::npos);
  const std::string typo = error_of(std::string(kBase) + "trainer:\n  fp8: {enable: true}\n");
  EXPECT_NE(typo.find("did you mean 'enabled'"), std::string::npos) << typo;
}

TEST(Config, AnOverrideOfACloneNeverReachesTheOriginal) {
  // yaml-cpp handles: assigning a clone to a handle the original shares rewrote the original's node.
  auto doc = Document::load_string(std::string(kBase) + "trainer:\n  precision: bf16-master\n", "exp.yaml");
  auto copy = doc.clone();
  copy.apply_override("trainer.precision=32");
  EXPECT_NE(doc.emit().find("precision: bf16-master"), std::string::npos) << doc.emit();
  EXPECT_NE(copy.emit().find("precision: 32"), std::string::npos) << copy.emit();
  const strobe::config::SavedConfig saved(doc.emit(), "saved");
  saved.document().apply_override("trainer.precision=16-mixed");
  EXPECT_NE(saved.document().emit().find("precision: bf16-master"), std::string::npos) << saved.document().emit();
}
