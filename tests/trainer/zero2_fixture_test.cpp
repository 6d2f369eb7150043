// A zero2 checkpoint of two ranks (tests/fixtures/zero2) resumes in one process, its optimizer
// shards re-cut into a whole state: tests/trainer/zero2_fixture_check.h says what is checked.
#include "tests/trainer/zero2_fixture_check.h"

namespace strobe {
namespace {

TEST(Zero2Fixture, TwoRanksShardsResumeInOneProcessOnTheStraightRunsWeights) {
  testing::expect_zero2_fixture_resumes("cpu", 1e-5);
}

}  // namespace
}  // namespace strobe
