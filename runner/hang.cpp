#include "runner/hang.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace strobe {

namespace fs = std::filesystem;

namespace {

struct Entry {
  int64_t seq = 0;
  std::string kind, op;
  int64_t bytes = 0, issued_ns = 0, returned_ns = 0;
};

// One entry of c10d's flight recorder (NCCL's own record: nccl_backend.h).
struct NcclEntry {
  int64_t seq = 0;  // collective_seq_id: NCCL's launches in the process group
  std::string name, state, sizes;  // profiling_name ("nccl:all_reduce"), scheduled/started/completed, input_sizes
};

struct Record {
  int64_t rank = 0, world = 0;
  std::string status, path;
  std::vector<Entry> entries;  // oldest first, consecutive numbers
  std::optional<std::vector<NcclEntry>> nccl;  // the flight recorder's collectives, by number
};

std::string what(const Entry& e) {
  return e.bytes > 0 ? fmt::format("{} ({}, {} B)", e.kind, e.op, e.bytes) : fmt::format("{} ({})", e.kind, e.op);
}

// "05:50:01.123 UTC" of a system-clock time in nanoseconds.
std::string clock_time(int64_t ns) {
  const std::time_t s = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  gmtime_r(&s, &tm);
  return fmt::format("{:02}:{:02}:{:02}.{:03} UTC", tm.tm_hour, tm.tm_min, tm.tm_sec, (ns / 1000000) % 1000);
}

Record read_record(const fs::path& path, int64_t rank) {
  auto bad = [&](const std::string& why) { throw HangError(fmt::format("{}: not a record of collectives ({})", path.string(), why)); };
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object()) bad("not JSON");
  Record r;
  r.path = path.string();
  try {
    r.rank = j.at("rank").get<int64_t>();
    r.world = j.at("world_size").get<int64_t>();
    r.status = j.at("status").get<std::string>();
    for (const auto& e : j.at("collectives"))
      r.entries.push_back({e.at("seq").get<int64_t>(), e.at("kind").get<std::string>(), e.at("op").get<std::string>(),
                           e.at("bytes").get<int64_t>(), e.at("issued_ns").get<int64_t>(), e.at("returned_ns").get<int64_t>()});
    if (j.contains("nccl")) {
      std::vector<NcclEntry> list;
      for (const auto& e : j.at("nccl").value("entries", nlohmann::json::array())) {
        if (e.value("is_p2p", false)) continue;
        list.push_back({e.at("collective_seq_id").get<int64_t>(), e.value("profiling_name", std::string("?")),
                        e.value("state", std::string("?")), e.contains("input_sizes") ? e.at("input_sizes").dump() : "?"});
      }
      std::sort(list.begin(), list.end(), [](const NcclEntry& a, const NcclEntry& b) { return a.seq < b.seq; });
      r.nccl = std::move(list);
    }
  } catch (const nlohmann::json::exception& e) {
    bad(e.what());
  }
  if (r.rank != rank) bad(fmt::format("it says rank {}", r.rank));
  if (r.world < 1 || r.rank >= r.world) bad(fmt::format("rank {} of {}", r.rank, r.world));
  for (size_t i = 1; i < r.entries.size(); ++i)
    if (r.entries[i].seq != r.entries[i - 1].seq + 1) bad("its collectives are not numbered in order");
  return r;
}

const Entry* at(const Record& r, int64_t seq) {
  if (r.entries.empty() || seq < r.entries.front().seq || seq > r.entries.back().seq) return nullptr;
  return &r.entries[static_cast<size_t>(seq - r.entries.front().seq)];
}

std::string nccl_what(const NcclEntry& e) { return fmt::format("{} {}", e.name, e.sizes); }

// NCCL's record beside Strobe's (under NCCL): the first NCCL collective the ranks enqueued
// differently or not at all, and each rank's oldest one not completed (where its GPU waits).
std::string explain_nccl(const std::map<int64_t, Record>& records) {
  bool any = false;
  for (const auto& [rank, r] : records) any |= r.nccl.has_value();
  if (!any) return "";
  std::string out = "NCCL's record (c10d's flight recorder; its numbers count NCCL's launches, the ddp Reducer's bucket "
                    "all-reduces included):\n";
  auto find = [](const std::vector<NcclEntry>& list, int64_t seq) -> const NcclEntry* {
    for (const auto& e : list)
      if (e.seq == seq) return &e;
    return nullptr;
  };
  int64_t from = 0, to = -1;
  bool first = true;
  for (const auto& [rank, r] : records) {
    if (!r.nccl || r.nccl->empty()) continue;
    from = first ? r.nccl->front().seq : std::max(from, r.nccl->front().seq);
    to = std::max(to, r.nccl->back().seq);
    first = false;
  }
  std::optional<int64_t> parted;
  for (int64_t s = from; s <= to && !parted; ++s) {
    std::optional<std::string> seen;
    for (const auto& [rank, r] : records) {
      const NcclEntry* e = r.nccl ? find(*r.nccl, s) : nullptr;
      if (!e || (seen && *seen != nccl_what(*e))) {
        parted = s;
        break;
      }
      seen = nccl_what(*e);
    }
  }
  if (parted) {
    out += fmt::format("  NCCL collective {}:", *parted);
    for (const auto& [rank, r] : records) {
      const NcclEntry* e = r.nccl ? find(*r.nccl, *parted) : nullptr;
      out += e ? fmt::format(" rank {} {} ({});", rank, nccl_what(*e), e->state)
               : fmt::format(" rank {} {};", rank, r.nccl ? "never enqueued it" : "has no NCCL record");
    }
    out.back() = '\n';
  } else if (to >= from) {
    out += fmt::format("  the ranks enqueued the same NCCL collectives, up to {}\n", to);
  }
  for (const auto& [rank, r] : records) {
    if (!r.nccl) continue;
    const NcclEntry* open = nullptr;
    for (const auto& e : *r.nccl)
      if (e.state != "completed") {
        open = &e;
        break;
      }
    out += open ? fmt::format("  rank {}: waits in NCCL collective {}, {} ({})\n", rank, open->seq, nccl_what(*open), open->state)
                : fmt::format("  rank {}: every NCCL collective it enqueued completed\n", rank);
  }
  return out;
}

}  // namespace

std::string explain_hang(const std::string& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) throw HangError(fmt::format("{} is not a directory", run_dir));
  static const std::regex name_re(R"(^collectives_rank([0-9]+)\.json$)");
  std::map<int64_t, Record> records;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, name_re)) continue;
    const int64_t rank = std::stoll(m[1].str());
    records.emplace(rank, read_record(e.path(), rank));
  }
  if (records.empty())
    throw HangError(fmt::format("{} holds no collectives_rank<r>.json (a multi-process run writes them into its run directory "
                                "when it hangs or its ranks' collectives diverge)",
                                run_dir));
  const int64_t world = records.begin()->second.world;
  for (const auto& [rank, r] : records)
    if (r.world != world)
      throw HangError(fmt::format("{} says {} processes, {} says {}: records of different runs", r.path, r.world,
                                  records.begin()->second.path, world));
  std::string out = fmt::format("strobe hang: {}: the records of {} of {} rank(s)\n", run_dir, records.size(), world);
  std::vector<int64_t> missing;
  for (int64_t r = 0; r < world; ++r)
    if (!records.count(r)) missing.push_back(r);
  if (!missing.empty())
    out += fmt::format("no record from rank(s) {} (a rank that died, or ended before it could write one)\n", fmt::join(missing, ", "));

  // From the first number every record holds to the last any holds: the first where a rank issued
  // another kind, or stopped short while others went on.
  int64_t from = 1, to = 0;
  for (const auto& [rank, r] : records) {
    if (!r.entries.empty()) from = std::max(from, r.entries.front().seq);
    if (!r.entries.empty()) to = std::max(to, r.entries.back().seq);
  }
  std::optional<int64_t> parted;
  for (int64_t s = from; s <= to && !parted; ++s) {
    std::optional<std::string> kind;
    for (const auto& [rank, r] : records) {
      const Entry* e = at(r, s);
      if (!e || (kind && *kind != e->kind)) {
        parted = s;
        break;
      }
      kind = e->kind;
    }
  }
  if (!parted) {
    out += to == 0 ? std::string("no rank recorded a collective\n")
                   : fmt::format("the ranks agree on every collective they recorded, up to collective {}, {}: none left "
                                 "out or issued differently by Strobe (a hang inside one collective is NCCL's to record)\n",
                                 to, what(*at(records.begin()->second, to)));
  } else {
    const int64_t s = *parted;
    if (s > from) {
      const Entry* agreed = at(records.begin()->second, s - 1);
      out += fmt::format("the ranks agree up to collective {}, {}, issued {}\n", s - 1, what(*agreed), clock_time(agreed->issued_ns));
    }
    // The kind most ranks issued at s (the lowest rank's on a tie) is the reference; the ranks with
    // another kind, or none, diverged.
    std::map<std::string, std::vector<int64_t>> by_kind;
    std::vector<int64_t> short_of;
    for (const auto& [rank, r] : records) {
      if (const Entry* e = at(r, s))
        by_kind[e->kind].push_back(rank);
      else
        short_of.push_back(rank);
    }
    std::string common;
    size_t most = 0;
    int64_t lowest = world;
    for (const auto& [k, ranks] : by_kind)
      if (ranks.size() > most || (ranks.size() == most && ranks.front() < lowest)) common = k, most = ranks.size(), lowest = ranks.front();
    out += fmt::format("collective {}:\n", s);
    std::vector<int64_t> diverged = short_of;
    for (const auto& [rank, r] : records) {
      if (const Entry* e = at(r, s)) {
        out += fmt::format("  rank {} issued {} at {}\n", rank, what(*e), clock_time(e->issued_ns));
        if (e->kind != common) diverged.push_back(rank);
      } else {
        const Entry& last = r.entries.back();
        out += fmt::format("  rank {} never reached it; its last: collective {}, {}\n", rank, last.seq, what(last));
      }
    }
    std::sort(diverged.begin(), diverged.end());
    out += fmt::format("diverged first: rank{} {} ({} there: {})\n", diverged.size() == 1 ? "" : "s", fmt::join(diverged, ", "),
                       by_kind.size() == 1 && short_of.empty() ? "all issued" : "the others issued", common);
  }
  for (const auto& [rank, r] : records) out += fmt::format("rank {}: {}\n", rank, r.status);
  out += explain_nccl(records);
  return out;
}

}  // namespace strobe
