#include "strobe/logging/tensorboard/event_writer.h"

#include "strobe/logging/tensorboard/crc32c.h"
#include "strobe/logging/tensorboard/proto_wire.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace strobe::logging::tensorboard {
namespace {

// Field numbers of tensorflow/core/util/event.proto, strobe/summary.proto, tensor.proto,
// tensor_shape.proto (the subset we write).
namespace event {
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
}
namespace session_log {
constexpr uint32_t kStatus = 1, kCheckpointPath = 2;
constexpr uint64_t kStart = 1;  // SessionLog.SessionStatus.START
}
namespace summary {
constexpr uint32_t kValue = 1;
}
namespace value {
constexpr uint32_t kTag = 1, kSimpleValue = 2, kTensor = 8, kMetadata = 9;
}
namespace metadata {
constexpr uint32_t kPluginData = 1;
}
namespace plugin_data {
constexpr uint32_t kPluginName = 1;
}
namespace tensor {
constexpr uint32_t kDtype = 1, kTensorShape = 2, kStringVal = 8;
constexpr uint64_t kDtString = 7;  // types.proto DT_STRING
}
namespace shape {
constexpr uint32_t kDim = 2, kDimSize = 1;
}

// Event{wall_time, step, summary{value{...}}}; proto3 omits zero wall_time / step.
std::string summary_event(const std::string& value_bytes, int64_t step, double wall_time) {
  ProtoWriter s;
  s.bytes_field(summary::kValue, value_bytes);
  ProtoWriter e;
  if (wall_time != 0.0) e.double_field(event::kWallTime, wall_time);
  if (step != 0) e.int64_field(event::kStep, step);
  e.bytes_field(event::kSummary, s.bytes());
  return e.take();
}

std::atomic<int> g_file_counter{0};

}  // namespace

double wall_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string encode_file_version_event(double wall_time, const std::string& version) {
  ProtoWriter e;
  if (wall_time != 0.0) e.double_field(event::kWallTime, wall_time);
  e.bytes_field(event::kFileVersion, version);
  return e.take();
}

std::string encode_session_start_event(int64_t step, double wall_time, const std::string& checkpoint_path) {
  ProtoWriter sl;
  sl.varint_field(session_log::kStatus, session_log::kStart);
  if (!checkpoint_path.empty()) sl.bytes_field(session_log::kCheckpointPath, checkpoint_path);
  ProtoWriter e;
  if (wall_time != 0.0) e.double_field(event::kWallTime, wall_time);
  if (step != 0) e.int64_field(event::kStep, step);
  e.bytes_field(event::kSessionLog, sl.bytes());
  return e.take();
}

std::string encode_scalar_event(const std::string& tag, float v, int64_t step, double wall_time) {
  ProtoWriter val;
  if (!tag.empty()) val.bytes_field(value::kTag, tag);
  val.float_field(value::kSimpleValue, v);  // oneof member: written even when 0
  return summary_event(val.bytes(), step, wall_time);
}

std::string encode_text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  // Same layout as torch.utils.tensorboard's summary.text(): a DT_STRING tensor of shape [1] and
  // plugin "text" (its TextPluginData, version 0, serializes to nothing).
  ProtoWriter dim;
  dim.int64_field(shape::kDimSize, 1);
  ProtoWriter shp;
  shp.bytes_field(shape::kDim, dim.bytes());
  ProtoWriter t;
  t.varint_field(tensor::kDtype, tensor::kDtString);
  t.bytes_field(tensor::kTensorShape, shp.bytes());
  t.bytes_field(tensor::kStringVal, text);
  ProtoWriter pd;
  pd.bytes_field(plugin_data::kPluginName, "text");
  ProtoWriter md;
  md.bytes_field(metadata::kPluginData, pd.bytes());
  ProtoWriter val;
  if (!tag.empty()) val.bytes_field(value::kTag, tag);
  val.bytes_field(value::kTensor, t.bytes());
  val.bytes_field(value::kMetadata, md.bytes());
  return summary_event(val.bytes(), step, wall_time);
}

std::string frame_record(const std::string& data) {
  std::string out;
  out.reserve(data.size() + 16);
  const uint64_t len = data.size();
  char header[8];
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  auto put_u32 = [&out](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  out.append(header, 8);
  put_u32(masked_crc32c(header, 8));
  out.append(data);
  put_u32(masked_crc32c(data.data(), data.size()));
  return out;
}

std::string hparams_markdown(const std::vector<std::pair<std::string, std::string>>& hparams) {
  // Pipes would end a markdown cell early.
  auto cell = [](const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '|') out += "\\|";
      else if (c == '\n') out += ' ';
      else out += c;
    }
    return out;
  };
  std::string md = "| hyperparameter | value |\n|---|---|\n";
  for (const auto& [k, v] : hparams) md += "| " + cell(k) + " | " + cell(v) + " |\n";
  return md;
}

EventFileWriter::EventFileWriter(const std::filesystem::path& log_dir, const std::string& filename_suffix) {
  std::filesystem::create_directories(log_dir);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = wall_time_now();
  // TensorBoard reads a directory's event files in name order: a file continuing a run (a resume
  // within the same second as the crashed writer started, say) must sort after the files already there.
  long long stamp = static_cast<long long>(now);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(log_dir, ec)) {
    const std::string n = e.path().filename().string();
    const std::string prefix = "events.out.tfevents.";
    if (n.rfind(prefix, 0) != 0) continue;
    const long long t = std::strtoll(n.c_str() + prefix.size(), nullptr, 10);
    if (t >= stamp) stamp = t + 1;
  }
  char name[512];
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.%d%s", stamp, host, static_cast<int>(getpid()),
                g_file_counter.fetch_add(1), filename_suffix.c_str());
  path_ = log_dir / name;
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("TensorBoard: cannot open event file " + path_.string() + " for writing");
  write_event(encode_file_version_event(now));
  flush();
}

EventFileWriter::~EventFileWriter() { close(); }

void EventFileWriter::write_event(const std::string& event) {
  const std::string record = frame_record(event);
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
  if (!out_) throw std::runtime_error("TensorBoard: write to " + path_.string() + " failed (disk full?)");
  dirty_ = true;
}

void EventFileWriter::set_flush_interval(double seconds) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (flusher_.joinable() || seconds <= 0) return;
    flush_interval_s_ = seconds;
  }
  flusher_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!closing_) {
      flusher_cv_.wait_for(lock, std::chrono::duration<double>(flush_interval_s_));
      if (dirty_ && out_.is_open()) {
        out_.flush();
        dirty_ = false;
      }
    }
  });
}

void EventFileWriter::add_session_start(int64_t step, const std::string& checkpoint_path) {
  std::lock_guard<std::mutex> lock(mutex_);
  write_event(encode_session_start_event(step, wall_time_now(), checkpoint_path));
}

void EventFileWriter::add_scalar(const std::string& tag, double v, int64_t step, double wall_time) {
  std::lock_guard<std::mutex> lock(mutex_);
  write_event(encode_scalar_event(tag, static_cast<float>(v), step, wall_time < 0 ? wall_time_now() : wall_time));
}

void EventFileWriter::add_text(const std::string& tag, const std::string& text, int64_t step, double wall_time) {
  std::lock_guard<std::mutex> lock(mutex_);
  write_event(encode_text_event(tag, text, step, wall_time < 0 ? wall_time_now() : wall_time));
}

void EventFileWriter::add_hparams(const std::vector<std::pair<std::string, std::string>>& hparams) {
  add_text("hparams", hparams_markdown(hparams), 0);
}

void EventFileWriter::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (out_.is_open()) out_.flush();
  dirty_ = false;
}

void EventFileWriter::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  flusher_cv_.notify_all();
  if (flusher_.joinable() && flusher_.get_id() != std::this_thread::get_id()) flusher_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  if (out_.is_open()) out_.close();
}

}  // namespace strobe::logging::tensorboard
