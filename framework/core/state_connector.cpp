#include "framework/core/state_connector.h"

#include <stdexcept>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "framework/checkpoint/checkpoint_io.h"

namespace strobe {

void StateConnector::add(std::string name, SaveFn save, LoadFn load, Kind kind) {
  for (const auto& e : entries_)
    if (e.name == name) throw std::logic_error(fmt::format("state connector: '{}' registered twice", name));
  entries_.push_back(Entry{std::move(name), std::move(save), std::move(load), kind});
}

void StateConnector::save(checkpoint::CheckpointData& out, const StepStart* step_start) const {
  for (const auto& e : entries_)
    if (e.save) e.save(out, step_start);
}

void StateConnector::load(const checkpoint::CheckpointData& in, bool training_state, const std::string& source) const {
  for (const auto& e : entries_) {
    if (!e.load || (e.kind == Kind::TrainingOnly && !training_state)) continue;
    try {
      e.load(in);
    } catch (const checkpoint::CheckpointError& ex) {
      throw checkpoint::CheckpointError(fmt::format("{}: {}", source, ex.what()));
    } catch (const c10::Error& ex) {
      throw checkpoint::CheckpointError(
          fmt::format("{}: cannot restore the {} state: {}", source, e.name, ex.what_without_backtrace()));
    } catch (const std::exception& ex) {
      throw checkpoint::CheckpointError(fmt::format("{}: cannot restore the {} state: {}", source, e.name, ex.what()));
    }
  }
}

std::vector<std::string> StateConnector::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

}  // namespace strobe
