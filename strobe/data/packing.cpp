#include "strobe/data/packing.h"

#include <algorithm>
#include <random>
#include <set>
#include <stdexcept>
#include <string>

namespace strobe::data {

RowPlan best_fit_rows(const std::vector<int64_t>& order, const std::vector<int64_t>& length, int64_t row_len, uint64_t seed,
                      int64_t epoch, bool shuffle) {
  if (row_len < 1) throw std::invalid_argument("packing: the row length must be >= 1");
  const int64_t n = static_cast<int64_t>(order.size());
  // Longest first, equal lengths in the epoch's order: a counting sort over the lengths.
  std::vector<int64_t> count(static_cast<size_t>(row_len) + 2, 0);
  for (int64_t i : order) {
    const int64_t len = (i >= 0 && i < static_cast<int64_t>(length.size())) ? length[i] : -1;
    if (len < 1 || len > row_len)
      throw std::invalid_argument("packing: sample " + std::to_string(i) + " has " + std::to_string(len) +
                                  " tokens; a row holds 1 to " + std::to_string(row_len));
    ++count[static_cast<size_t>(row_len - len + 1)];
  }
  for (size_t k = 1; k < count.size(); ++k) count[k] += count[k - 1];
  std::vector<int64_t> sorted(static_cast<size_t>(n));
  for (int64_t i : order) sorted[static_cast<size_t>(count[static_cast<size_t>(row_len - length[i])]++)] = i;

  // Best fit: the open rows by free space (a stack per amount, the amounts that have one in a set).
  std::vector<std::vector<int64_t>> free_rows(static_cast<size_t>(row_len));
  std::set<int64_t> free_amounts;
  std::vector<int64_t> row_of(static_cast<size_t>(n)), fill;
  RowPlan plan;
  plan.row_len = row_len;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t len = length[sorted[k]];
    int64_t row, space;
    auto it = free_amounts.lower_bound(len);
    if (it == free_amounts.end()) {
      row = static_cast<int64_t>(fill.size());
      fill.push_back(0);
      space = row_len;
    } else {
      space = *it;
      auto& stack = free_rows[static_cast<size_t>(space)];
      row = stack.back();
      stack.pop_back();
      if (stack.empty()) free_amounts.erase(it);
    }
    fill[row] += len;
    row_of[k] = row;
    if (const int64_t left = space - len; left > 0) {
      free_rows[static_cast<size_t>(left)].push_back(row);
      free_amounts.insert(left);
    }
    plan.tokens += len;
  }
  const int64_t rows = static_cast<int64_t>(fill.size());
  // The rows' order: opened order, or shuffled (Fisher-Yates over std::mt19937_64, the same on every
  // platform; the seed apart from the sampler's).
  std::vector<int64_t> rank(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) rank[r] = r;
  if (shuffle) {
    std::mt19937_64 rng((seed ^ 0x5EED0F9ACCu) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
    for (int64_t i = rows - 1; i > 0; --i) std::swap(rank[i], rank[rng() % static_cast<uint64_t>(i + 1)]);
  }
  std::vector<int64_t> position(static_cast<size_t>(rows));  // where each row goes
  for (int64_t p = 0; p < rows; ++p) position[rank[p]] = p;
  std::vector<int64_t> sizes(static_cast<size_t>(rows), 0);
  for (int64_t k = 0; k < n; ++k) ++sizes[position[row_of[k]]];
  plan.row_begin.assign(static_cast<size_t>(rows) + 1, 0);
  for (int64_t p = 0; p < rows; ++p) plan.row_begin[p + 1] = plan.row_begin[p] + sizes[p];
  std::vector<int64_t> next(plan.row_begin.begin(), plan.row_begin.end() - 1);
  plan.samples.resize(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) plan.samples[next[position[row_of[k]]]++] = sorted[k];
  return plan;
}

}  // namespace strobe::data
