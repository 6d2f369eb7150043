// MlflowLogger: the run's metrics, parameters, tags, status and artifacts in an MLflow tracking server
// (`mlflow server`), through its REST API (docs/CONFIG.md "logger"). Rank 0 alone logs.
//
// consume() only queues: a background thread sends what is queued in batches (runs/log-batch, at most
// 1,000 metric values, 100 parameters or 100 tags a request), retrying with a growing pause (0.5 s
// doubling to 15 s) while the server is unreachable, slow or answers 5xx/429, so a step never waits
// for the network. More than kMaxQueuedValues values waiting, or anything still unsent when the run
// ends (finish() waits up to flush_timeout), goes to <run_dir>/mlflow_unsent.jsonl, with one warning
// line, for `strobe mlflow-sync RUN_DIR` to send later: nothing is lost. A request the server refuses
// (4xx) is not retried; it goes to that file with the server's answer.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "strobe/config/experiment.h"
#include "strobe/logging/metric_row.h"

namespace strobe::logging {

inline constexpr const char* kMlflowSpoolFile = "mlflow_unsent.jsonl";

// strobe mlflow-sync's bad input (no spool file, one that does not parse): exit 2.
struct MlflowSyncInputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct MlflowError : std::runtime_error {
  MlflowError(const std::string& what, bool retryable) : std::runtime_error(what), retryable(retryable) {}
  bool retryable;  // no answer, 5xx, 429: the same request may succeed later
};

// Blocking calls of the tracking server's REST API (/api/2.0/mlflow/...); each throws MlflowError.
class MlflowClient {
 public:
  MlflowClient(std::string tracking_uri, double timeout_s);
  ~MlflowClient();
  // The id of the experiment of that name, created when the server has none.
  std::string experiment_id(const std::string& name);
  struct RunInfo {
    std::string run_id, artifact_uri;
  };
  RunInfo create_run(const std::string& experiment_id, const std::string& run_name, const nlohmann::json& tags, int64_t start_ms);
  RunInfo get_run(const std::string& run_id);
  // metrics [{key, value, timestamp, step}] (<= 1,000), params and tags [{key, value}] (<= 100 each).
  void log_batch(const std::string& run_id, const nlohmann::json& metrics, const nlohmann::json& params, const nlohmann::json& tags);
  void update_run(const std::string& run_id, const std::string& status, int64_t end_ms);
  // Through the server's artifact proxy (an artifact_uri of mlflow-artifacts:/...); another kind of
  // artifact store is an MlflowError (not retryable) naming it.
  void upload_artifact(const std::string& artifact_uri, const std::string& name, const std::string& bytes);
  const std::string& tracking_uri() const { return uri_; }

 private:
  nlohmann::json call(const std::string& method, const std::string& path, const nlohmann::json& body);
  std::string uri_;
  struct Http;
  std::unique_ptr<Http> http_;
};

// MLflow's rules for names: metric and parameter keys keep [A-Za-z0-9_-. /:] (others become '_',
// "a[0].b" becomes "a.0.b"), at most 250 characters.
std::string mlflow_key(const std::string& name);

class MlflowLogger : public MetricConsumer {
 public:
  static constexpr int64_t kMaxQueuedValues = 200000;
  static constexpr size_t kOverflowRows = 1000;  // rows past the queue's bound spooled at a time
  // `resumed_run_id`: the MLflow run a checkpoint continues ("" for a new run). Connects at once (one
  // request timeout): an unreachable server is one warning line and the run spools, or with
  // on_unreachable: error an MlflowError.
  MlflowLogger(config::MlflowConfig cfg, std::string run_dir, const std::string& config_yaml, std::string resumed_run_id);
  ~MlflowLogger() override;
  void consume(const MetricRow& row) override;
  // Ends the MLflow run with `status` (FINISHED, FAILED, KILLED): the artifacts (config.yaml,
  // model_summary.txt of the run directory) and the status are queued after the values, the sender
  // has flush_timeout to send them all, and what remains is written to the spool file. Idempotent.
  void finish(const std::string& status);
  std::string run_id() const;
  std::string experiment_id() const;
  const std::string& tracking_uri() const { return cfg_.tracking_uri; }

 private:
  void send_loop();
  bool ensure_run(MlflowClient& client);  // creates (or reopens) the run; false while unreachable
  void send(MlflowClient& client, std::vector<nlohmann::json>& ops);
  void spool(const std::vector<nlohmann::json>& ops, const std::string& why);
  nlohmann::json spool_header() const;
  nlohmann::json run_tags() const;  // the config's tags, strobe.run_dir, mlflow.source.name

  config::MlflowConfig cfg_;
  std::string run_dir_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<nlohmann::json> queue_;  // ops: {"op": "metrics"|"params"|"tags"|"artifact"|"status", ...}
  std::vector<nlohmann::json> overflow_;  // metric rows past kMaxQueuedValues, not yet spooled
  int64_t queued_values_ = 0;
  bool stopping_ = false, finished_ = false, resumed_ = false, warned_ = false;
  double deadline_ = 0;  // steady seconds by which finish() stops sending
  std::string run_id_, experiment_id_, artifact_uri_;
  int64_t start_ms_ = 0;
  std::thread thread_;
};

// strobe mlflow-sync: sends RUN_DIR's spool file (the run created first if it never was) and removes
// it; `tracking_uri` ("" : the one the file names) overrides the server. Returns a summary line.
// Throws MlflowError when the server fails part-way (the file then holds what is left) and
// MlflowSyncInputError for a missing or unreadable file.
std::string mlflow_sync(const std::string& run_dir, const std::string& tracking_uri, double timeout_s);

}  // namespace strobe::logging
