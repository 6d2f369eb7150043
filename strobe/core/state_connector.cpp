#include "strobe/core/state_connector.h"

#include <algorithm>
#include <stdexcept>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/core/checkpoint_view.h"

namespace strobe {

const std::vector<std::string>& StateConnector::kOrder() {
  static const std::vector<std::string> order = {checkpoint_keys::kModel, checkpoint_keys::kOptimizer, checkpoint_keys::kScheduler, checkpoint_keys::kScaler,
                                                 checkpoint_keys::kLoop, checkpoint_keys::kAccumulation, checkpoint_keys::kLogger,
                                                 checkpoint_keys::kStepGuard, checkpoint_keys::kRng, checkpoint_keys::kCallbacks, checkpoint_keys::kConfig,
                                                 checkpoint_keys::kHfConfig, checkpoint_keys::kMlflow, checkpoint_keys::kMeta};
  return order;
}

void StateConnector::add(const std::string& name, Stateful& object) {
  const auto& order = kOrder();
  const auto pos = std::find(order.begin(), order.end(), name);
  if (pos == order.end()) throw std::logic_error(fmt::format("state connector: '{}' is not a checkpoint entry", name));
  for (const auto& e : entries_)
    if (e.name == name) throw std::logic_error(fmt::format("state connector: '{}' registered twice", name));
  auto rank = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
  const auto at = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return rank(e.name) > pos - order.begin(); });
  entries_.insert(at, Entry{name, &object});
}

void StateConnector::save(checkpoint::CheckpointData& out, const StepStart* step_start) const {
  for (const auto& e : entries_) e.object->save(out, step_start);
}

void StateConnector::load(const checkpoint::CheckpointData& in, bool training_state, const std::string& source) const {
  for (const auto& e : entries_) {
    if (!e.object->restorable() || (e.object->training_only() && !training_state)) continue;
    try {
      e.object->load(in);
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
