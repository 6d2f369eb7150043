#include "strobe/logging/csv_logger.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"

namespace strobe::logging {

CsvLogger::CsvLogger(std::string path, int64_t keep_until_step) : path_(std::move(path)) {
  if (keep_until_step >= 0 && std::filesystem::exists(path_)) {
    std::ifstream in(path_);
    std::string header;
    std::getline(in, header);
    std::vector<std::string> cols;
    std::stringstream hs(header);
    for (std::string c; std::getline(hs, c, ',');) cols.push_back(c);
    for (std::string line; std::getline(in, line);) {
      std::vector<std::string> cells;
      std::stringstream ls(line);
      for (std::string c; std::getline(ls, c, ',');) cells.push_back(c);
      if (cells.size() < 2) continue;
      MetricRow r;
      try {
        r.step = std::stoll(cells[0]);
        r.epoch = std::stoll(cells[1]);
        if (r.step > keep_until_step) continue;
        for (size_t i = 2; i < cells.size() && i < cols.size(); ++i)
          if (!cells[i].empty()) r.values.emplace_back(cols[i], std::stod(cells[i]));
      } catch (const std::exception&) {
        continue;  // a line cut short by a crash
      }
      for (auto& kv : r.values)
        if (std::find(columns_.begin(), columns_.end(), kv.first) == columns_.end()) columns_.push_back(kv.first);
      bool appended;
      merge(r, &appended);  // files of older versions have several rows per step
    }
    std::sort(columns_.begin(), columns_.end());
  }
  rewrite();
}

CsvLogger::~CsvLogger() {
  if (fd_ >= 0) ::close(fd_);
}

std::string CsvLogger::format_row(const MetricRow& row) const {
  std::string line = fmt::format("{},{}", row.step, row.epoch);
  for (const auto& c : columns_) {
    line += ',';
    for (const auto& kv : row.values)
      if (kv.first == c) {
        line += fmt::format("{:.9g}", kv.second);
        break;
      }
  }
  return line + "\n";
}

size_t CsvLogger::merge(const MetricRow& row, bool* appended) {
  *appended = false;
  size_t pos = rows_.size();
  while (pos > 0 && rows_[pos - 1].step > row.step) --pos;
  for (size_t j = pos; j > 0 && rows_[j - 1].step == row.step; --j) {
    MetricRow& r = rows_[j - 1];
    if (r.epoch != row.epoch) continue;
    for (const auto& kv : row.values) {
      auto it = std::find_if(r.values.begin(), r.values.end(), [&](const auto& v) { return v.first == kv.first; });
      if (it != r.values.end())
        it->second = kv.second;
      else
        r.values.push_back(kv);
    }
    return j - 1;
  }
  *appended = pos == rows_.size();
  rows_.insert(rows_.begin() + static_cast<std::ptrdiff_t>(pos), row);
  return pos;
}

void CsvLogger::rewrite() {
  std::string text = "step,epoch";
  for (const auto& c : columns_) text += ',' + c;
  text += '\n';
  offsets_.clear();
  for (const auto& r : rows_) {
    offsets_.push_back(text.size());
    text += format_row(r);
  }
  try {
    checkpoint::write_file_atomic(path_, text);
  } catch (const checkpoint::CheckpointError& e) {
    throw std::runtime_error(fmt::format("metrics.csv: {}", e.what()));
  }
  end_ = text.size();
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) throw std::runtime_error(fmt::format("{}: cannot open for writing ({})", path_, std::strerror(errno)));
}

void CsvLogger::rewrite_tail(size_t from) {
  if (from == 0) {
    rewrite();
    return;
  }
  offsets_.resize(rows_.size());  // rows before `from` kept their place
  uint64_t at = offsets_[from - 1] + format_row(rows_[from - 1]).size();
  const uint64_t start = at;
  std::string text;
  for (size_t k = from; k < rows_.size(); ++k) {
    offsets_[k] = at;
    std::string line = format_row(rows_[k]);
    at += line.size();
    text += line;
  }
  // One write of the changed tail (a few rows): the rows before `from` are never touched.
  if (::pwrite(fd_, text.data(), text.size(), static_cast<off_t>(start)) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error(fmt::format("{}: write failed ({})", path_, std::strerror(errno)));
  if (at < end_ && ::ftruncate(fd_, static_cast<off_t>(at)) != 0)
    throw std::runtime_error(fmt::format("{}: truncate failed ({})", path_, std::strerror(errno)));
  end_ = at;
}

void CsvLogger::consume(const MetricRow& row) {
  bool widened = false;
  for (const auto& kv : row.values)
    if (std::find(columns_.begin(), columns_.end(), kv.first) == columns_.end()) columns_.push_back(kv.first), widened = true;
  bool appended = false;
  const size_t changed = merge(row, &appended);
  if (widened) {
    std::sort(columns_.begin(), columns_.end());
    rewrite();
    return;
  }
  rewrite_tail(changed);
}

void CsvLogger::flush() {}

}  // namespace strobe::logging
