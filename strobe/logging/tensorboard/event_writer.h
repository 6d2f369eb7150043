#pragma once
// TensorBoard event files: scalars and text (hyperparameters as a markdown table through the text
// plugin), TFRecord-framed protobuf `Event` records, loadable by TensorBoard's own reader
// (EventAccumulator). No torch, no libprotobuf: the messages are encoded by a small wire writer
// whose output is byte-identical to protobuf's for these messages (the Python test re-serializes
// every record with tensorboard's generated classes and compares).
//
// Contract: the first record is the file version ("brain.Event:2"); records are appended in call
// order and reach the operating system on flush()/close(), when the stream buffer fills, and — after
// set_flush_interval(s) — within s seconds of being written (a background thread, like TensorFlow's
// and torch.utils.tensorboard's flush_secs), so a process killed with SIGKILL loses at most the last
// s seconds. One writer per file, calls from several threads are serialized by a mutex. Host values
// only: the caller reads device metrics through the pinned-memory ring first.
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace strobe::logging::tensorboard {

// Serialized `Event` messages (tensorflow/core/util/event.proto, summary.proto field numbers).
std::string encode_file_version_event(double wall_time, const std::string& version = "brain.Event:2");
std::string encode_scalar_event(const std::string& tag, float value, int64_t step, double wall_time);
std::string encode_text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time);
// SessionLog{status: START} at `step`: TensorBoard drops every event with a step >= `step` read
// before it (EventAccumulator's purge of orphaned data), as torch's SummaryWriter(purge_step=) and
// TensorFlow's supervisors write it on restart.
std::string encode_session_start_event(int64_t step, double wall_time, const std::string& checkpoint_path = "");
// TFRecord framing: u64 length, masked CRC32C of the length, data, masked CRC32C of the data.
std::string frame_record(const std::string& data);

// Markdown table of hyperparameters (| name | value |), as TensorBoard's text plugin renders it.
std::string hparams_markdown(const std::vector<std::pair<std::string, std::string>>& hparams);

class EventFileWriter {
 public:
  // Creates `log_dir` if needed and opens events.out.tfevents.<time>.<host>.<pid>.<n><suffix>.
  explicit EventFileWriter(const std::filesystem::path& log_dir, const std::string& filename_suffix = "");
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // wall_time < 0: now.
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = -1.0);
  void add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time = -1.0);
  // Written as text under the tag "hparams" at step 0.
  void add_hparams(const std::vector<std::pair<std::string, std::string>>& hparams);
  // A restart marker: the steps >= `step` that an earlier, crashed writer logged are not shown.
  void add_session_start(int64_t step, const std::string& checkpoint_path = "");
  // Starts the background flush every `seconds` (once; <= 0: off).
  void set_flush_interval(double seconds);
  void flush();
  void close();

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::filesystem::path path_;
  std::ofstream out_;
  std::mutex mutex_;
  bool dirty_ = false, closing_ = false;
  double flush_interval_s_ = 0;
  std::condition_variable flusher_cv_;
  std::thread flusher_;
};

double wall_time_now();

}  // namespace strobe::logging::tensorboard
