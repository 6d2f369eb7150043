#!/usr/bin/env bash
# Builds the config loader's libFuzzer target with clang (ASan + UBSan + LeakSanitizer) and runs it
# for N seconds (default 60) on a seed corpus made of our configs. Fails on a crash, hang or leak.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-60}
out=${STROBE_BUILD_DIR:-build}/fuzz
mkdir -p "$out/corpus" "$out/artifacts"
clang++ -std=c++17 -O1 -DFMT_HEADER_ONLY -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
  framework/config/config.cpp framework/config/experiment.cpp tests/fuzz/config_fuzz.cpp \
  -lyaml-cpp -o "$out/config_fuzz"
find configs -name '*.yaml' -exec cp {} "$out/corpus/" \;
cp -r tests/fuzz/seeds/. "$out/corpus/" 2>/dev/null || true
echo "fuzz: config loader for ${seconds}s on $(ls "$out/corpus" | wc -l) seed inputs"
ASAN_OPTIONS=detect_leaks=1 "$out/config_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$out/corpus" 2>"$out/fuzz.log" || {
  tail -60 "$out/fuzz.log"; echo "fuzz: FAILED (artifacts in $out/artifacts)"; exit 1; }
grep -E "^stat::number_of_executed_units|^Done" "$out/fuzz.log" || true
echo "fuzz: no crash, hang or leak"
