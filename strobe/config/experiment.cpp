#include "strobe/config/experiment.h"
#include "strobe/config/experiment_parse.h"
#include "strobe/config/saved_config.h"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>

namespace strobe::config {

std::optional<double> parse_duration(const std::string& text) {
  // [0-9]{1,6}(:[0-9]{1,6}){0,3}
  std::vector<double> f;
  for (size_t at = 0;;) {
    const size_t colon = text.find(':', at);
    const std::string part = text.substr(at, colon == std::string::npos ? std::string::npos : colon - at);
    if (!is_digits(part) || part.size() > 6 || f.size() == 4) return std::nullopt;
    f.push_back(std::stod(part));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  static const double unit[] = {86400, 3600, 60, 1};
  double s = 0;
  for (size_t i = 0; i < f.size(); ++i) s += f[i] * unit[4 - f.size() + i];
  return s;
}

namespace {

// trainer.profiler: absent, null or false = off; true or a mapping {steps, path, record_shapes} = on.
void parse_profiler(Section& t, ProfilerConfig& p) {
  t.accept("profiler");
  if (!t.has("profiler") || t.is_null("profiler")) return;
  if (t.node()["profiler"].IsScalar()) {
    p.enabled = t.get_bool("profiler", false);
    if (!p.enabled) return;
    t.node()["profiler"] = YAML::Node(YAML::NodeType::Map);  // resolved below with its defaults
  }
  if (!t.node()["profiler"].IsMap()) t.fail("profiler", "expected a mapping {steps: [first, last], path: DIR} or true/false");
  Section s = t.child("profiler");
  p.enabled = true;
  const std::vector<int64_t> steps = s.get_int_list("steps", {p.first_step, p.last_step});
  if (steps.size() != 2 || steps[0] < 1 || steps[0] > steps[1])
    s.fail("steps", fmt::format("expected two step numbers [first, last] with 1 <= first <= last (optimizer steps, "
                                "counted from 1 as in metrics.csv), got {} value(s){}",
                                steps.size(), steps.size() == 2 ? fmt::format(" [{}, {}]", steps[0], steps[1]) : ""));
  p.first_step = steps[0];
  p.last_step = steps[1];
  p.path = s.get_string("path", "");
  p.record_shapes = s.get_bool("record_shapes", false);
  s.finish();
}

// trainer.fp8: absent, null or false = off; true = on with the defaults; or a mapping
// {enabled, skip, min_size}, written back into the resolved config as a mapping. An absent section
// stays out of the resolved config (a config without it resolves as it did before it existed).
void parse_fp8(Section& t, Fp8Config& f) {
  t.accept("fp8");
  if (!t.has("fp8") || t.is_null("fp8")) return;
  if (t.node()["fp8"].IsScalar()) {
    const bool on = t.get_bool("fp8", false);
    t.node()["fp8"] = YAML::Node(YAML::NodeType::Map);
    t.node()["fp8"]["enabled"] = on;
  }
  if (!t.node()["fp8"].IsMap()) t.fail("fp8", "expected true/false or a mapping {enabled, skip, min_size}");
  Section s = t.child("fp8");
  f.enabled = s.get_bool("enabled", true);
  s.accept("skip");
  const YAML::Node sk = s.node()["skip"];
  if (sk.IsDefined() && !sk.IsNull()) {
    bool globs = sk.IsSequence();
    for (size_t i = 0; globs && i < sk.size(); ++i) globs = sk[i].IsScalar() && !sk[i].Scalar().empty();
    if (!globs) s.fail("skip", "expected a list of globs over linear layers' module paths, e.g. [\"layers.*.self_attn.k_proj\"]");
    for (const auto& g : sk) f.skip.push_back(g.Scalar());
  } else {
    s.node()["skip"] = YAML::Node(YAML::NodeType::Sequence);
  }
  f.min_size = s.get_int("min_size", f.min_size, 0);
  s.finish();
}

}  // namespace

std::optional<InitFrom> parse_init_from(Section& model) {
  model.accept("init_from");
  if (!model.has("init_from") || model.is_null("init_from")) return std::nullopt;
  YAML::Node node = model.node()["init_from"];
  if (node.IsScalar()) {
    YAML::Node m(YAML::NodeType::Map);
    m["path"] = node.Scalar();
    model.node()["init_from"] = m;
  } else if (!node.IsMap()) {
    model.fail("init_from", "expected a safetensors file or a mapping {path, names, strict, ignore}");
  }
  Section s = model.child("init_from");
  InitFrom f;
  f.path = s.require_string("path");
  if (f.path.empty()) s.fail("path", "expected the path of a safetensors file");
  f.names = s.get_string("names", "strobe");
  if (f.names.empty()) s.fail("names", "expected a name set (strobe, timm, torchvision)");
  f.strict = s.get_bool("strict", true);
  if (!s.has("ignore") || s.is_null("ignore")) s.node()["ignore"] = YAML::Node(YAML::NodeType::Sequence);
  s.accept("ignore");
  const YAML::Node ig = s.node()["ignore"];
  if (!ig.IsSequence()) s.fail("ignore", "expected a list of name globs, e.g. [\"head.*\"]");
  for (size_t i = 0; i < ig.size(); ++i) {
    if (!ig[i].IsScalar() || ig[i].Scalar().empty())
      s.fail("ignore", fmt::format("entry {} is not a name glob (a non-empty string such as \"head.*\")", i));
    f.ignore.push_back(ig[i].Scalar());
  }
  s.finish();
  return f;
}

static bool is_sha256_hex(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// `plugins: [PATH | {path: PATH, sha256: HEX}, ...]`: a relative path is taken from the config file's
// directory; the document then holds absolute paths (the resolved config records where they were).
static std::vector<PluginSpec> parse_plugins(Section& root, const std::string& config_file) {
  root.accept("plugins");
  std::vector<PluginSpec> out;
  if (!root.has("plugins") || root.is_null("plugins")) return out;
  YAML::Node list = root.node()["plugins"];
  const char* expected = "expected a list of plugin files (shared libraries built with strobe_add_plugin), each a path or "
                         "{path: PATH, sha256: HEX}";
  if (!list.IsSequence()) root.fail("plugins", expected);
  const std::filesystem::path base = std::filesystem::path(config_file).parent_path();
  YAML::Node resolved(YAML::NodeType::Sequence);
  for (size_t i = 0; i < list.size(); ++i) {
    const YAML::Node item = list[i];
    const std::string where = fmt::format("plugins[{}]", i);
    PluginSpec spec;
    if (!item.Mark().is_null())  // a node the YAML text holds (not one set by the program, e.g. recorded plugins)
      spec.listed_at = fmt::format("{}:{}:{}: {}", config_file, item.Mark().line + 1, item.Mark().column + 1, where);
    std::string given;
    if (item.IsScalar()) {
      given = item.Scalar();
    } else if (item.IsMap()) {
      for (auto it = item.begin(); it != item.end(); ++it) {
        const std::string key = it->first.Scalar();
        if (key != "path" && key != "sha256" && key != "replaced_sha256")
          root.fail(where, fmt::format("unknown key '{}' (a plugin entry holds path and sha256)", key));
        if (!it->second.IsScalar()) root.fail(where + "." + key, "expected a string");
      }
      if (item["path"]) given = item["path"].Scalar();
      for (auto [key, field] : {std::pair{"sha256", &spec.sha256}, std::pair{"replaced_sha256", &spec.replaced_sha256}}) {
        if (!item[key]) continue;
        *field = item[key].Scalar();
        if (!is_sha256_hex(*field))
          root.fail(where + "." + key, fmt::format("'{}' is not a SHA-256 (64 lowercase hex digits)", *field));
      }
      if (!spec.sha256.empty()) spec.recorded_by = config_file;
    } else {
      root.fail(where, expected);
    }
    if (given.empty()) root.fail(where, "expected a plugin file path");
    std::filesystem::path p = given;
    if (p.is_relative()) p = base / p;
    std::error_code ec;
    spec.path = std::filesystem::absolute(p, ec).lexically_normal().string();
    auto same = std::find_if(out.begin(), out.end(), [&](const PluginSpec& s) { return s.path == spec.path; });
    if (same != out.end()) {
      if (same->sha256.empty()) *same = spec;
      continue;
    }
    out.push_back(spec);
  }
  for (const auto& s : out) {
    if (s.sha256.empty()) {
      resolved.push_back(s.path);
      continue;
    }
    YAML::Node entry;
    entry["path"] = s.path;
    entry["sha256"] = s.sha256;
    if (!s.replaced_sha256.empty()) entry["replaced_sha256"] = s.replaced_sha256;
    resolved.push_back(entry);
  }
  root.node()["plugins"] = resolved;
  return out;
}

std::vector<PluginSpec> SavedConfig::plugins() const {
  Document doc = document();
  Section root = doc.root();
  std::vector<PluginSpec> out = parse_plugins(root, source());
  for (auto& spec : out) spec.listed_at.clear();  // a recorded entry is named by recorded_by, not a line of YAML text
  return out;
}

OptimizerConfig parse_optimizer(Section cfg) {
  OptimizerConfig o;
  o.name = cfg.get_choice("name", "adamw", {"sgd", "adam", "adamw"});
  o.lr = cfg.get_double("lr", 1e-3, 0.0);
  o.weight_decay = cfg.get_double("weight_decay", o.name == "adamw" ? 0.01 : 0.0, 0.0);
  // fused: auto (our multi-tensor CUDA step whenever it applies, torch::optim otherwise), true (the
  // fused step or an error saying why it cannot be had), false (torch::optim).
  o.fused = cfg.get_choice("fused", "auto", {"auto", "true", "false"});
  if (o.name == "sgd") {
    o.momentum = cfg.get_double("momentum", 0.0, 0.0, 1.0);
    o.nesterov = cfg.get_bool("nesterov", false);
    o.dampening = cfg.get_double("dampening", 0.0, 0.0, 1.0);
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      cfg.fail("nesterov", "nesterov momentum needs momentum > 0 and dampening 0");
  } else {
    auto betas = cfg.node()["betas"];
    cfg.accept("betas");
    if (betas.IsDefined() && !betas.IsNull()) {
      if (!betas.IsSequence() || betas.size() != 2) cfg.fail("betas", "expected [beta1, beta2]");
      try {
        o.beta1 = betas[0].as<double>(), o.beta2 = betas[1].as<double>();
      } catch (const YAML::Exception&) {
        cfg.fail("betas", "expected two numbers in [0, 1)");
      }
      if (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1) cfg.fail("betas", "expected two numbers in [0, 1)");
    } else {
      YAML::Node seq(YAML::NodeType::Sequence);
      seq.push_back(o.beta1);
      seq.push_back(o.beta2);
      cfg.node()["betas"] = seq;
    }
    o.eps = cfg.get_double("eps", 1e-8, 0.0);
    o.amsgrad = cfg.get_bool("amsgrad", false);
  }
  if (!cfg.is_null("param_groups")) {
    Section pg = cfg.child("param_groups");
    const YAML::Node nd = pg.node()["no_decay"];
    pg.accept("no_decay");
    if (nd.IsDefined() && !nd.IsNull()) {
      if (nd.IsScalar() && nd.Scalar() == "auto") {
        o.param_groups.no_decay_auto = true;
      } else if (nd.IsSequence()) {
        for (const auto& g : nd) {
          if (!g.IsScalar() || g.Scalar().empty()) pg.fail("no_decay", "expected auto or a list of globs over parameter names");
          o.param_groups.no_decay.push_back(g.Scalar());
        }
      } else {
        pg.fail("no_decay", "expected auto or a list of globs over parameter names");
      }
    }
    if (!pg.is_null("layer_decay")) {
      const double d = pg.get_double("layer_decay", 1.0, 0.0, 1.0);
      if (d <= 0) pg.fail("layer_decay", "expected a factor in (0, 1], e.g. 0.75");
      o.param_groups.layer_decay = d;
    } else {
      pg.accept("layer_decay");
    }
    // The freeze keys are stored into the resolved config only when written (a config without them
    // resolves as it did before they existed).
    const YAML::Node fr = pg.node()["freeze"];
    pg.accept("freeze");
    if (fr.IsDefined() && !fr.IsNull()) {
      if (!fr.IsSequence() || fr.size() == 0) pg.fail("freeze", "expected a non-empty list of globs over parameter names");
      for (const auto& g : fr) {
        if (!g.IsScalar() || g.Scalar().empty()) pg.fail("freeze", "expected a non-empty list of globs over parameter names");
        o.param_groups.freeze.push_back(g.Scalar());
      }
    }
    for (const char* key : {"unfreeze_at_epoch", "unfreeze_lr_scale", "train_bn"}) {
      if (pg.is_null(key)) {
        pg.accept(key);
        continue;
      }
      if (o.param_groups.freeze.empty()) pg.fail(key, "applies to the parameters `freeze` lists, and there is no freeze list");
      const std::string k = key;
      if (k == "unfreeze_at_epoch") o.param_groups.unfreeze_at_epoch = pg.get_int(key, -1, 1);
      else if (k == "unfreeze_lr_scale") o.param_groups.unfreeze_lr_scale = pg.get_double(key, 0.1, 1e-12);
      else o.param_groups.train_bn = pg.get_bool(key, true);
    }
    for (auto& g : pg.list("groups", "a mapping {params: GLOB, lr: X, weight_decay: Y}")) {
      ParamGroupSpec spec;
      spec.params = g.require_string("params");
      if (!g.is_null("lr")) spec.lr = g.get_double("lr", 0.0, 0.0);
      else g.accept("lr");
      if (!g.is_null("weight_decay")) spec.weight_decay = g.get_double("weight_decay", 0.0, 0.0);
      else g.accept("weight_decay");
      g.finish();
      o.param_groups.groups.push_back(spec);
    }
    pg.finish();
  } else {
    cfg.accept("param_groups");
  }
  cfg.finish();
  o.section = std::move(cfg);
  return o;
}

SchedulerConfig parse_scheduler(Section cfg) {
  SchedulerConfig s;
  s.name = cfg.get_choice("name", "none", {"none", "step", "multistep", "cosine", "linear_warmup", "reduce_on_plateau", "lr_range"});
  if (s.name == "step") {
    s.step_size = cfg.get_int("step_size", 1000, 1);
    s.gamma = cfg.get_double("gamma", 0.1, 0.0);
  } else if (s.name == "multistep") {
    s.milestones = cfg.get_int_list("milestones", {});
    if (s.milestones.empty()) cfg.fail("milestones", "expected a non-empty list of optimizer steps");
    for (size_t i = 1; i < s.milestones.size(); ++i)
      if (s.milestones[i] <= s.milestones[i - 1]) cfg.fail("milestones", "expected increasing optimizer steps");
    s.gamma = cfg.get_double("gamma", 0.1, 0.0);
  } else if (s.name == "cosine") {
    s.warmup_steps = cfg.get_int("warmup_steps", 0, 0);
    s.max_steps = cfg.get_int("max_steps", -1, -1);
    s.warmup_start_factor = cfg.get_double("warmup_start_factor", 0.0, 0.0, 1.0);
    s.min_lr_factor = cfg.get_double("min_lr_factor", 0.0, 0.0, 1.0);
  } else if (s.name == "linear_warmup") {
    s.warmup_steps = cfg.get_int("warmup_steps", 100, 1);
    s.warmup_start_factor = cfg.get_double("warmup_start_factor", 0.0, 0.0, 1.0);
  } else if (s.name == "reduce_on_plateau") {
    s.monitor = cfg.get_string("monitor", "val/loss");
    s.mode_max = cfg.get_choice("mode", "min", {"min", "max"}) == "max";
    s.factor = cfg.get_double("factor", 0.1, 0.0, 1.0);
    s.patience = cfg.get_int("patience", 10, 0);
    s.threshold = cfg.get_double("threshold", 1e-4, 0.0);
    s.cooldown = cfg.get_int("cooldown", 0, 0);
    s.min_lr = cfg.get_double("min_lr", 0.0, 0.0);
  } else if (s.name == "lr_range") {
    s.end_factor = cfg.get_double("end_factor", 1e8, 0.0);
    if (!(s.end_factor > 1.0)) cfg.fail("end_factor", fmt::format("expected a factor > 1, got {}", s.end_factor));
    s.range_steps = cfg.get_int("steps", 100, 2);
  }
  cfg.finish();
  s.section = std::move(cfg);
  return s;
}

Experiment parse_experiment(Document& doc) {
  Section root = doc.root();
  Experiment e;
  e.name = root.get_string("name", "experiment");
  // One safe path component (runs go to <default_root_dir>/<name>/version_N): no '/', and not '.' or '..'
  // (nor any name of dots only), which would put the run beside or above default_root_dir.
  if (e.name.size() > kMaxRunNameBytes)
    root.fail("name", fmt::format("a run name of {} characters ('{}'); a run name may hold at most {}", e.name.size(),
                                  shown(e.name), kMaxRunNameBytes));
  const bool name_chars = !e.name.empty() && std::all_of(e.name.begin(), e.name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.' || ch == '-';
  });
  if (!name_chars || e.name.find_first_not_of('.') == std::string::npos)
    root.fail("name", fmt::format("expected a run name of letters, digits, '_', '-', '.' (not dots alone), got '{}'", shown(e.name)));
  e.seed = root.get_int("seed", 0, 0, (int64_t(1) << 62));

  Section t = root.child("trainer");
  TrainerConfig& c = e.trainer;
  // As Lightning: max_steps set and max_epochs not means as many epochs as the steps take (-1, so
  // recorded in config.yaml); neither set means one epoch.
  const bool epochs_given = t.has("max_epochs") && !t.is_null("max_epochs");
  c.max_steps = t.get_int("max_steps", -1, -1);
  c.max_epochs = t.get_int("max_epochs", c.max_steps >= 0 && !epochs_given ? -1 : 1, -1);
  if (auto mt = t.get_optional_string("max_time")) {
    c.max_time_s = parse_duration(*mt);
    if (!c.max_time_s) t.fail("max_time", fmt::format("expected a duration \"DD:HH:MM:SS\", got '{}'", shown(*mt)));
  }
  c.precision = parse_precision(t.get_choice("precision", "32", {"32", "bf16-mixed", "16-mixed", "bf16-master"}));
  c.accumulate_grad_batches = t.get_int("accumulate_grad_batches", 1, 1);
  c.gradient_clip_val = t.get_double("gradient_clip_val", 0.0, 0.0);
  c.gradient_clip_algorithm = t.get_choice("gradient_clip_algorithm", "norm", {"norm", "value"});
  if (t.has("val_check_interval") && t.node()["val_check_interval"].IsScalar() &&
      t.node()["val_check_interval"].Scalar().find(':') != std::string::npos) {
    // A duration, as max_time spells it: validation by time.
    const std::string text = t.node()["val_check_interval"].Scalar();
    t.accept("val_check_interval");
    c.val_check_interval_s = parse_duration(text);
    if (!c.val_check_interval_s)
      t.fail("val_check_interval", fmt::format("expected a count >= 1, a fraction in (0, 1] or a duration \"DD:HH:MM:SS\", got '{}'", shown(text)));
    if (*c.val_check_interval_s <= 0)
      t.fail("val_check_interval", fmt::format("'{}' is a time interval of zero; give a duration of at least one second", shown(text)));
  } else {
    c.val_check_interval = t.get_count_or_fraction("val_check_interval", {false, 0, 1.0});
  }
  if (!c.val_check_interval.is_count && c.val_check_interval.fraction <= 0.0)
    t.fail("val_check_interval", "expected a count >= 1 or a fraction in (0, 1]");
  if (c.val_check_interval.is_count && c.val_check_interval.count < 1)
    t.fail("val_check_interval", "expected a count >= 1 or a fraction in (0, 1]");
  c.check_val_every_n_epoch = t.get_int("check_val_every_n_epoch", 1, 1);
  c.num_sanity_val_steps = t.get_int("num_sanity_val_steps", 2, -1);
  c.limit_train_batches = t.get_count_or_fraction("limit_train_batches", {false, 0, 1.0});
  c.limit_val_batches = t.get_count_or_fraction("limit_val_batches", {false, 0, 1.0});
  c.limit_test_batches = t.get_count_or_fraction("limit_test_batches", {false, 0, 1.0});
  c.limit_predict_batches = t.get_count_or_fraction("limit_predict_batches", {false, 0, 1.0});
  c.overfit_batches = t.get_count_or_fraction("overfit_batches", {false, 0, 0.0});
  if (t.has("fast_dev_run") && !t.is_null("fast_dev_run") && t.node()["fast_dev_run"].IsScalar() &&
      (t.node()["fast_dev_run"].Scalar() == "true" || t.node()["fast_dev_run"].Scalar() == "false")) {
    c.fast_dev_run = t.get_bool("fast_dev_run", false) ? 1 : 0;
  } else {
    c.fast_dev_run = t.get_int("fast_dev_run", 0, 0);
  }
  c.log_every_n_steps = t.get_int("log_every_n_steps", 50, 1);
  c.device = t.get_string("device", "auto");
  const bool device_ok = c.device == "auto" || c.device == "cpu" || c.device == "cuda" ||
                         (c.device.rfind("cuda:", 0) == 0 && is_digits(std::string_view(c.device).substr(5)));
  if (!device_ok) t.fail("device", fmt::format("expected auto, cpu, cuda or cuda:N, got '{}'", shown(c.device)));
  c.deterministic = t.get_bool("deterministic", false);
  c.default_root_dir = t.get_string("default_root_dir", "runs");
  c.enable_progress_bar = t.get_bool("enable_progress_bar", true);
  c.enable_checkpointing = t.get_bool("enable_checkpointing", true);
  c.enable_model_summary = t.get_bool("enable_model_summary", true);
  c.memory_check = t.get_bool("memory_check", true);
  parse_profiler(t, c.profiler);
  c.cuda_graphs = t.get_choice("cuda_graphs", "false", {"false", "true", "auto"});
  c.dist_timeout_s = t.get_double("dist_timeout", 600.0, 1.0, 604800.0);  // seconds, 1 s .. 7 days
  c.strategy = t.get_choice("strategy", "auto", {"auto", "ddp", "zero2", "fsdp"});
  if (c.strategy == "fsdp")  // the key exists (and is written into the resolved config) under fsdp only
    c.reshard_after_forward = t.get_bool("reshard_after_forward", true);
  else if (t.has("reshard_after_forward"))
    t.fail("reshard_after_forward", fmt::format("applies to trainer.strategy: fsdp, not {}", c.strategy));
  parse_fp8(t, c.fp8);
  t.finish();

  Section lg = root.child("logger");
  e.logger.csv = lg.get_bool("csv", true);
  e.logger.tensorboard = lg.get_bool("tensorboard", false);
  if (lg.has("mlflow") && !lg.is_null("mlflow")) {
    Section m = lg.child("mlflow");
    MlflowConfig c;
    c.tracking_uri = m.require_string("tracking_uri");
    if (c.tracking_uri.rfind("http://", 0) != 0 && c.tracking_uri.rfind("https://", 0) != 0)
      m.fail("tracking_uri", fmt::format("'{}' is not an http:// or https:// address of an MLflow tracking server (`mlflow server`)",
                                         shown(c.tracking_uri)));
    while (!c.tracking_uri.empty() && c.tracking_uri.back() == '/') c.tracking_uri.pop_back();
    c.experiment_name = m.get_string("experiment_name", e.name);
    if (c.experiment_name.find_first_not_of(" \t") == std::string::npos)
      m.fail("experiment_name", "an empty experiment name (MLflow needs one; the default is the config's name)");
    if (c.experiment_name.size() > 500) m.fail("experiment_name", "longer than MLflow's 500 characters");
    c.run_name = m.get_string("run_name", "");
    if (m.has("tags") && !m.is_null("tags")) {
      const YAML::Node tags = m.node()["tags"];
      if (!tags.IsMap()) m.fail("tags", "expected a mapping of tag names to values");
      for (const auto& kv : tags) {
        if (!kv.second.IsScalar()) m.fail("tags", fmt::format("tag '{}': expected a text or number value", shown(kv.first.Scalar())));
        c.tags.emplace_back(kv.first.Scalar(), kv.second.Scalar());
      }
      m.accept("tags");
    }
    c.unreachable_is_error = m.get_choice("on_unreachable", "warn", {"warn", "error"}) == "error";
    c.flush_timeout_s = m.get_double("flush_timeout", 30.0, 0.0, 86400.0);
    c.request_timeout_s = m.get_double("request_timeout", 10.0, 0.1, 3600.0);
    m.finish();
    e.logger.mlflow = std::move(c);
  }
  lg.finish();

  e.task = root.child("task");
  e.model = root.child("model");
  e.data = root.child("data");
  e.optimizer = parse_optimizer(root.child("optimizer"));
  e.scheduler = parse_scheduler(root.child("scheduler"));
  e.callbacks = root.list("callbacks");
  if (!e.model.has("name")) e.model.fail_here("missing required key 'name' (e.g. resnet, vit, decoder_lm, face_detector)");
  if (!e.data.has("name")) e.data.fail_here("missing required key 'name' (e.g. fashion_mnist, synthetic_images)");
  e.init_from = parse_init_from(e.model);
  e.plugins = parse_plugins(root, doc.file());
  root.finish();
  return e;
}

}  // namespace strobe::config
