#!/bin/sh
# Runs one GoogleTest suite for ctest (cmake/GtestSuites.cmake): the command's output and exit
# status, except that a run in which no case passed and none failed (every case skipped) exits 77,
# which ctest reports as skipped (SKIP_RETURN_CODE). A failing case always fails the test.
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" -eq 0 ] && printf '%s\n' "$out" | grep -q '^\[  PASSED  \] 0 tests\.'; then
  exit 77
fi
exit "$rc"
