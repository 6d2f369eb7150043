// Best-fit packing (data.packing: best_fit, docs/DATA.md "Packing"): an epoch's samples placed into
// rows of row_len tokens, each row a run of whole samples (documents, or the pieces of one longer
// than a row), never split and never cropped; what a row cannot hold is padding.
//
// The plan of an epoch is a pure function of the epoch's order of samples and their lengths (so of
// seed, epoch and the data): best fit decreasing. Samples are taken longest first (equal lengths in
// the epoch's order) and each goes into the open row whose free space is the smallest that holds it,
// or into a new row when none does. Then the rows are shuffled by (seed, epoch) (kept in the order
// they were opened without shuffling). A batch is batch_size consecutive rows of the plan, so a
// position in the epoch (rows consumed) is all a resume or another number of processes needs.
#pragma once

#include <cstdint>
#include <vector>

namespace strobe::data {

struct RowPlan {
  std::vector<int64_t> samples;    // every row's samples, one row after another
  std::vector<int64_t> row_begin;  // row r holds samples[row_begin[r], row_begin[r + 1])
  int64_t row_len = 0;
  int64_t tokens = 0;  // the samples' tokens, all rows

  int64_t rows() const { return static_cast<int64_t>(row_begin.size()) - 1; }
  int64_t padding() const { return rows() * row_len - tokens; }
};

// `order`: the epoch's samples; `length(i)`: sample i's tokens, 1..row_len (std::invalid_argument
// otherwise, naming the sample). Shuffles the rows with (seed, epoch) when `shuffle`.
RowPlan best_fit_rows(const std::vector<int64_t>& order, const std::vector<int64_t>& length, int64_t row_len, uint64_t seed,
                      int64_t epoch, bool shuffle);

}  // namespace strobe::data
