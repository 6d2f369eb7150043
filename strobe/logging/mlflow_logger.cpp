#include "strobe/logging/mlflow_logger.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/config/resume_check.h"
#include "strobe/logging/http_client.h"

namespace strobe::logging {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMetricsPerBatch = 1000, kParamsPerBatch = 100;
constexpr size_t kMaxParamValue = 6000, kMaxTagValue = 8000;  // MLflow's limits (mlflow.utils.validation)

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}
double steady_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::string truncated(const std::string& value, size_t limit) {
  if (value.size() <= limit) return value;
  const std::string note = "... (truncated by strobe)";
  return value.substr(0, limit - note.size()) + note;
}

// A metric value as MLflow's protobuf JSON reads a double: non-finite values as their names.
nlohmann::json metric_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

std::string read_file_or_empty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int64_t values_of(const nlohmann::json& op) { return op.at("op") == "metrics" ? static_cast<int64_t>(op.at("metrics").size()) : 0; }

// One request's ops [first, last): consecutive metric rows (at most kMetricsPerBatch values together)
// or one other op; `run_dir` holds the artifacts. Used by the logger's sender and by the sync.
template <class It>
void send_request(MlflowClient& client, const std::string& run_id, const std::string& artifact_uri, const std::string& run_dir, It first,
                  It last) {
  const std::string kind = first->at("op");
  if (kind == "metrics") {
    nlohmann::json metrics = nlohmann::json::array();
    for (It op = first; op != last; ++op)
      for (const auto& m : op->at("metrics")) metrics.push_back(m);
    client.log_batch(run_id, metrics, {}, {});
  } else if (kind == "params") {
    client.log_batch(run_id, {}, first->at("params"), {});
  } else if (kind == "tags") {
    client.log_batch(run_id, {}, {}, first->at("tags"));
  } else if (kind == "artifact") {
    const std::string name = first->at("name");
    const std::string path = run_dir + "/" + name;
    if (fs::exists(path)) client.upload_artifact(artifact_uri, name, read_file_or_empty(path));  // model_summary.txt may be off
  } else if (kind == "status") {
    client.update_run(run_id, first->at("status"), first->value("end_time", int64_t{0}));
  }
}

}  // namespace

std::string mlflow_key(const std::string& name) {
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    const char ch = name[i];
    if (ch == '[') {
      out += '.';
    } else if (ch == ']') {
      continue;
    } else if (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.' || ch == ' ' || ch == '/' ||
               ch == ':') {
      out += ch;
    } else {
      out += '_';
    }
  }
  return out.size() > 250 ? out.substr(0, 250) : out;
}

// ---------------------------------------------------------------------------------------------
// MlflowClient

struct MlflowClient::Http {
  explicit Http(double timeout_s) : client(timeout_s) {}
  HttpClient client;
};

MlflowClient::MlflowClient(std::string tracking_uri, double timeout_s)
    : uri_(std::move(tracking_uri)), http_(std::make_unique<Http>(timeout_s)) {}
MlflowClient::~MlflowClient() = default;

nlohmann::json MlflowClient::call(const std::string& method, const std::string& path, const nlohmann::json& body) {
  const HttpResponse r = http_->client.request(method, uri_ + path, method == "GET" ? "" : body.dump());
  if (r.status == 0) throw MlflowError(fmt::format("{}: no answer ({})", uri_, r.error), true);
  if (!r.ok()) {
    std::string message = r.body;
    try {
      const auto j = nlohmann::json::parse(r.body);
      if (j.contains("message")) message = j.at("error_code").get<std::string>() + ": " + j.at("message").get<std::string>();
    } catch (const std::exception&) {
    }
    if (message.size() > 300) message = message.substr(0, 300) + "...";
    const bool retryable = r.status >= 500 || r.status == 429 || r.status == 408;
    throw MlflowError(fmt::format("{} {}: HTTP {}: {}", method, path, r.status, message), retryable);
  }
  if (r.body.empty()) return nlohmann::json::object();
  try {
    return nlohmann::json::parse(r.body);
  } catch (const std::exception&) {
    throw MlflowError(fmt::format("{} {}: the answer is not JSON (is {} an MLflow tracking server?)", method, path, uri_), false);
  }
}

std::string MlflowClient::experiment_id(const std::string& name) {
  try {
    const auto j = call("GET", "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + HttpClient::escape(name), {});
    return j.at("experiment").at("experiment_id").get<std::string>();
  } catch (const MlflowError& e) {
    if (e.retryable || std::string(e.what()).find("RESOURCE_DOES_NOT_EXIST") == std::string::npos) throw;
  }
  return call("POST", "/api/2.0/mlflow/experiments/create", {{"name", name}}).at("experiment_id").get<std::string>();
}

MlflowClient::RunInfo MlflowClient::create_run(const std::string& experiment_id, const std::string& run_name,
                                               const nlohmann::json& tags, int64_t start_ms) {
  const auto j = call("POST", "/api/2.0/mlflow/runs/create",
                      {{"experiment_id", experiment_id}, {"run_name", run_name}, {"start_time", start_ms}, {"tags", tags}});
  const auto& info = j.at("run").at("info");
  return {info.at("run_id").get<std::string>(), info.value("artifact_uri", std::string())};
}

MlflowClient::RunInfo MlflowClient::get_run(const std::string& run_id) {
  const auto j = call("GET", "/api/2.0/mlflow/runs/get?run_id=" + HttpClient::escape(run_id), {});
  const auto& info = j.at("run").at("info");
  return {info.at("run_id").get<std::string>(), info.value("artifact_uri", std::string())};
}

void MlflowClient::log_batch(const std::string& run_id, const nlohmann::json& metrics, const nlohmann::json& params,
                             const nlohmann::json& tags) {
  nlohmann::json body = {{"run_id", run_id}};
  if (!metrics.empty()) body["metrics"] = metrics;
  if (!params.empty()) body["params"] = params;
  if (!tags.empty()) body["tags"] = tags;
  call("POST", "/api/2.0/mlflow/runs/log-batch", body);
}

void MlflowClient::update_run(const std::string& run_id, const std::string& status, int64_t end_ms) {
  nlohmann::json body = {{"run_id", run_id}, {"status", status}};
  if (end_ms > 0) body["end_time"] = end_ms;
  call("POST", "/api/2.0/mlflow/runs/update", body);
}

void MlflowClient::upload_artifact(const std::string& artifact_uri, const std::string& name, const std::string& bytes) {
  const std::string scheme = "mlflow-artifacts:";
  if (artifact_uri.rfind(scheme, 0) != 0)
    throw MlflowError(fmt::format("artifact {}: the run's artifact store is {}, which only the server's artifact proxy "
                                  "(mlflow-artifacts:/, `mlflow server` serves it by default) can receive over HTTP",
                                  name, artifact_uri),
                      false);
  std::string path = artifact_uri.substr(scheme.size());
  // mlflow-artifacts:/1/RUN/artifacts or mlflow-artifacts://host:port/1/RUN/artifacts
  if (path.rfind("//", 0) == 0) path = path.substr(path.find('/', 2));
  while (!path.empty() && path.front() == '/') path.erase(0, 1);
  const HttpResponse r =
      http_->client.request("PUT", uri_ + "/api/2.0/mlflow-artifacts/artifacts/" + path + "/" + name, bytes, "application/octet-stream");
  if (r.status == 0) throw MlflowError(fmt::format("{}: no answer ({})", uri_, r.error), true);
  if (!r.ok())
    throw MlflowError(fmt::format("artifact {}: HTTP {}: {}", name, r.status, r.body.substr(0, 300)), r.status >= 500 || r.status == 429);
}

// ---------------------------------------------------------------------------------------------
// MlflowLogger

MlflowLogger::MlflowLogger(config::MlflowConfig cfg, std::string run_dir, const std::string& config_yaml, std::string resumed_run_id)
    : cfg_(std::move(cfg)), run_dir_(std::move(run_dir)), resumed_(!resumed_run_id.empty()), run_id_(std::move(resumed_run_id)) {
  start_ms_ = now_ms();
  if (cfg_.run_name.empty()) cfg_.run_name = fs::path(run_dir_).filename().string();
  if (!resumed_) {
    // The resolved config, flattened as the TensorBoard logger and the resume check spell it.
    std::vector<nlohmann::json> params;
    for (const auto& [key, value] : config::flatten_config(config_yaml))
      params.push_back({{"key", mlflow_key(key)}, {"value", truncated(value, kMaxParamValue)}});
    for (size_t i = 0; i < params.size(); i += kParamsPerBatch) {
      const auto first = params.begin() + static_cast<std::ptrdiff_t>(i);
      const auto last = params.begin() + static_cast<std::ptrdiff_t>(std::min(params.size(), i + kParamsPerBatch));
      queue_.push_back({{"op", "params"}, {"params", std::vector<nlohmann::json>(first, last)}});
    }
  }
  // Connect now, so that the run exists (and its id reaches the first checkpoint) before training.
  MlflowClient client(cfg_.tracking_uri, cfg_.request_timeout_s);
  std::string why;
  try {
    ensure_run(client);
  } catch (const std::exception& e) {  // MlflowError, or an answer without the fields MLflow's has
    why = e.what();
  }
  if (!why.empty()) {
    if (cfg_.unreachable_is_error) throw MlflowError(fmt::format("logger.mlflow: {} (on_unreachable: error)", why), false);
    fmt::print(stderr,
               "strobe: logger.mlflow: {} (the run trains; its values wait, and what is still unsent at the end goes to "
               "{}/{} for `strobe mlflow-sync`)\n",
               why, run_dir_, kMlflowSpoolFile);
    warned_ = true;
  }
  thread_ = std::thread([this] { send_loop(); });
}

MlflowLogger::~MlflowLogger() { finish("FAILED"); }

std::string MlflowLogger::run_id() const {
  std::lock_guard<std::mutex> g(mu_);
  return run_id_;
}
std::string MlflowLogger::experiment_id() const {
  std::lock_guard<std::mutex> g(mu_);
  return experiment_id_;
}

bool MlflowLogger::ensure_run(MlflowClient& client) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!run_id_.empty() && !artifact_uri_.empty()) return true;
  }
  std::string run_id;
  {
    std::lock_guard<std::mutex> g(mu_);
    run_id = run_id_;
  }
  if (!run_id.empty()) {  // resumed: the same run, running again
    const auto info = client.get_run(run_id);
    client.update_run(run_id, "RUNNING", 0);
    std::lock_guard<std::mutex> g(mu_);
    artifact_uri_ = info.artifact_uri.empty() ? "-" : info.artifact_uri;
    return true;
  }
  const std::string exp = client.experiment_id(cfg_.experiment_name);
  const auto info = client.create_run(exp, cfg_.run_name, run_tags(), start_ms_);
  std::lock_guard<std::mutex> g(mu_);
  experiment_id_ = exp;
  run_id_ = info.run_id;
  artifact_uri_ = info.artifact_uri.empty() ? "-" : info.artifact_uri;
  return true;
}

void MlflowLogger::consume(const MetricRow& row) {
  if (row.values.empty()) return;
  nlohmann::json metrics = nlohmann::json::array();
  const int64_t ts = now_ms();
  for (const auto& [name, value] : row.values)
    metrics.push_back({{"key", mlflow_key(name)}, {"value", metric_value(value)}, {"timestamp", ts}, {"step", row.step}});
  nlohmann::json op = {{"op", "metrics"}, {"metrics", std::move(metrics)}};
  std::unique_lock<std::mutex> g(mu_);
  if (finished_) return;
  if (queued_values_ + values_of(op) > kMaxQueuedValues) {
    // The server has been away for a long time: the bounded queue never grows past its limit, the
    // overflow goes to the spool file, kOverflowRows rows at a time (each spool rewrites the file),
    // and what is left of it at the end (finish()).
    overflow_.push_back(std::move(op));
    if (overflow_.size() < kOverflowRows) return;
    std::vector<nlohmann::json> rows;
    rows.swap(overflow_);
    g.unlock();
    spool(rows, "the queue for the MLflow server is full");
    return;
  }
  queued_values_ += values_of(op);
  queue_.push_back(std::move(op));
  g.unlock();
  cv_.notify_one();
}

void MlflowLogger::send_loop() {
  MlflowClient client(cfg_.tracking_uri, cfg_.request_timeout_s);
  double pause = 0.5, retry_at = 0;
  for (;;) {
    std::vector<nlohmann::json> batch;
    {
      std::unique_lock<std::mutex> g(mu_);
      for (;;) {
        const double now = steady_s();
        if (stopping_ && (queue_.empty() || now >= deadline_)) return;
        if (!queue_.empty() && now >= retry_at) break;
        const double until = queue_.empty() ? (stopping_ ? deadline_ : now + 3600) : (stopping_ ? std::min(retry_at, deadline_) : retry_at);
        cv_.wait_for(g, std::chrono::duration<double>(std::max(0.0, until - now)));
      }
      // One request's worth: consecutive metric rows up to 1,000 values, or one other op.
      if (queue_.front().at("op") == "metrics") {
        size_t n = 0;
        while (!queue_.empty() && queue_.front().at("op") == "metrics" &&
               (batch.empty() || n + queue_.front().at("metrics").size() <= kMetricsPerBatch)) {
          n += queue_.front().at("metrics").size();
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      } else {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    try {
      if (!ensure_run(client)) throw MlflowError("no run", true);
      send(client, batch);
      pause = 0.5;
      std::lock_guard<std::mutex> g(mu_);
      for (const auto& op : batch) queued_values_ -= values_of(op);
    } catch (const MlflowError& e) {
      std::unique_lock<std::mutex> g(mu_);
      if (e.retryable) {  // back to the front, in order, and a pause before the next try
        for (auto it = batch.rbegin(); it != batch.rend(); ++it) queue_.push_front(std::move(*it));
        retry_at = steady_s() + pause;
        pause = std::min(pause * 2, 15.0);
        continue;
      }
      for (const auto& op : batch) queued_values_ -= values_of(op);
      g.unlock();
      spool(batch, e.what());  // refused: kept with the server's answer, never retried here
    } catch (const std::exception& e) {  // an answer that is not MLflow's: kept, not retried
      {
        std::lock_guard<std::mutex> g(mu_);
        for (const auto& op : batch) queued_values_ -= values_of(op);
      }
      spool(batch, e.what());
    }
  }
}

void MlflowLogger::send(MlflowClient& client, std::vector<nlohmann::json>& ops) {
  std::string run_id, artifact_uri;
  {
    std::lock_guard<std::mutex> g(mu_);
    run_id = run_id_, artifact_uri = artifact_uri_;
  }
  send_request(client, run_id, artifact_uri, run_dir_, ops.begin(), ops.end());
}

nlohmann::json MlflowLogger::run_tags() const {
  nlohmann::json tags = nlohmann::json::array();
  for (const auto& [k, v] : cfg_.tags) tags.push_back({{"key", mlflow_key(k)}, {"value", truncated(v, kMaxTagValue)}});
  tags.push_back({{"key", "strobe.run_dir"}, {"value", truncated(fs::absolute(run_dir_).string(), kMaxTagValue)}});
  tags.push_back({{"key", "mlflow.source.name"}, {"value", "strobe"}});
  return tags;
}

nlohmann::json MlflowLogger::spool_header() const {
  std::lock_guard<std::mutex> g(mu_);
  return {{"strobe_mlflow_spool", 1},   {"tracking_uri", cfg_.tracking_uri}, {"experiment_name", cfg_.experiment_name},
          {"run_id", run_id_},          {"run_name", cfg_.run_name},         {"tags", run_tags()},
          {"start_time", start_ms_}};
}

void MlflowLogger::spool(const std::vector<nlohmann::json>& ops, const std::string& why) {
  if (ops.empty() || run_dir_.empty()) return;
  static std::mutex file_mu;
  std::lock_guard<std::mutex> g(file_mu);
  const std::string path = run_dir_ + "/" + kMlflowSpoolFile;
  // The file: a header line naming the server and the run (its id once the run exists), then one op
  // a line. Rewritten whole and atomically, so a kill leaves the old file or the new one.
  std::vector<std::string> lines;
  std::istringstream old(read_file_or_empty(path));
  for (std::string line; std::getline(old, line);)
    if (!line.empty()) lines.push_back(line);
  nlohmann::json header = spool_header();
  if (!lines.empty()) {
    try {  // an earlier header keeps its run unless this logger knows the run
      auto before = nlohmann::json::parse(lines.front());
      if (header.at("run_id").get<std::string>().empty()) header["run_id"] = before.value("run_id", std::string());
    } catch (const std::exception&) {
    }
    lines.erase(lines.begin());
  }
  int64_t values = 0;
  for (const auto& op : ops) {
    lines.push_back(op.dump());
    values += values_of(op);
  }
  std::string text = header.dump() + "\n";
  for (const auto& l : lines) text += l + "\n";
  checkpoint::write_file_atomic(path, text);
  std::lock_guard<std::mutex> w(mu_);
  if (!warned_) {  // one line while the run trains (the end says again what is left)
    fmt::print(stderr, "strobe: logger.mlflow: {}: {} request(s) ({} metric values) kept in {}; send them with `strobe mlflow-sync {}`\n",
               why, ops.size(), values, path, run_dir_);
    warned_ = true;
  }
}

void MlflowLogger::finish(const std::string& status) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (finished_) return;
    finished_ = true;
    for (const char* name : {"config.yaml", "model_summary.txt"}) queue_.push_back({{"op", "artifact"}, {"name", name}});
    queue_.push_back({{"op", "status"}, {"status", status}, {"end_time", now_ms()}});
    stopping_ = true;
    deadline_ = steady_s() + cfg_.flush_timeout_s;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // MLflow orders a metric by its step and time, not by arrival; the status stays last.
  std::vector<nlohmann::json> rest = std::move(overflow_);
  rest.insert(rest.end(), std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
  queue_.clear(), overflow_.clear();
  if (!rest.empty()) {
    warned_ = false;  // the end's line is always printed
    spool(rest, fmt::format("{} unreachable or slow for {:g} s at the run's end", cfg_.tracking_uri, cfg_.flush_timeout_s));
  }
}

// ---------------------------------------------------------------------------------------------
// strobe mlflow-sync

std::string mlflow_sync(const std::string& run_dir, const std::string& tracking_uri, double timeout_s) {
  const std::string path = run_dir + "/" + kMlflowSpoolFile;
  if (!fs::exists(path)) throw MlflowSyncInputError(fmt::format("{}: no such file (nothing is waiting to be sent)", path));
  std::vector<std::string> lines;
  std::istringstream in(read_file_or_empty(path));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  if (lines.empty()) throw MlflowSyncInputError(fmt::format("{}: empty", path));
  nlohmann::json header;
  std::vector<nlohmann::json> ops;
  try {
    header = nlohmann::json::parse(lines.front());
    if (!header.contains("strobe_mlflow_spool")) throw MlflowSyncInputError("no header");
    for (size_t i = 1; i < lines.size(); ++i) ops.push_back(nlohmann::json::parse(lines[i]));
  } catch (const std::exception&) {
    throw MlflowSyncInputError(fmt::format("{}: not a spool file strobe wrote (line {} does not parse)", path,
                                            ops.size() + (header.is_null() ? 1 : 2)));
  }
  MlflowClient client(tracking_uri.empty() ? header.at("tracking_uri").get<std::string>() : tracking_uri, timeout_s);
  std::string run_id = header.value("run_id", std::string());
  std::string artifact_uri;
  size_t sent = 0;
  int64_t values = 0;
  auto keep_rest = [&](const std::exception& e) {
    header["run_id"] = run_id;
    std::string text = header.dump() + "\n";
    for (size_t i = sent; i < ops.size(); ++i) text += ops[i].dump() + "\n";
    checkpoint::write_file_atomic(path, text);
    throw MlflowError(fmt::format("{} (sent {} of {} request(s); {} holds the rest)", e.what(), sent, ops.size(), path), true);
  };
  try {
    if (run_id.empty()) {
      const auto exp = client.experiment_id(header.at("experiment_name"));
      const auto info = client.create_run(exp, header.value("run_name", std::string()), header.value("tags", nlohmann::json::array()),
                                          header.value("start_time", int64_t{0}));
      run_id = info.run_id, artifact_uri = info.artifact_uri;
    } else {
      artifact_uri = client.get_run(run_id).artifact_uri;
    }
    while (sent < ops.size()) {
      size_t next = sent + 1;
      if (ops[sent].at("op") == "metrics") {
        size_t n = ops[sent].at("metrics").size();
        while (next < ops.size() && ops[next].at("op") == "metrics" && n + ops[next].at("metrics").size() <= kMetricsPerBatch)
          n += ops[next++].at("metrics").size();
        values += static_cast<int64_t>(n);
      }
      send_request(client, run_id, artifact_uri, run_dir, ops.begin() + static_cast<std::ptrdiff_t>(sent),
                   ops.begin() + static_cast<std::ptrdiff_t>(next));
      sent = next;
    }
  } catch (const MlflowError& e) {
    keep_rest(e);
  }
  fs::remove(path);
  return fmt::format("strobe mlflow-sync: sent {} request(s) ({} metric values) to run {} at {}; removed {}", ops.size(), values, run_id,
                     client.tracking_uri(), path);
}

}  // namespace strobe::logging
