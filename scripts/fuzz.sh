#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + LeakSanitizer) and runs each for N seconds
# (default 60) on its seed corpus, the two side by side (one core each: a 2-core machine fuzzes both in
# the time of one). Fails on a crash, hang or leak.
#   config_fuzz       the config loader, seeded with our configs and tests/fuzz/seeds
#   safetensors_fuzz  the safetensors header parser, seeded with tests/fuzz/seeds_safetensors
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-60}
base=${STROBE_BUILD_DIR:-build}/fuzz
flags=(-std=c++17 -O1 -DFMT_HEADER_ONLY -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I.)

# run_fuzz NAME SECONDS MAX_LEN: runs $base/NAME/NAME on $base/NAME/corpus.
run_fuzz() {
  local name=$1 secs=$2 max_len=$3 out=$base/$1
  echo "fuzz: $name for ${secs}s on $(ls "$out/corpus" | wc -l) seed inputs"
  ASAN_OPTIONS=detect_leaks=1 "$out/$name" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
    -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$out/corpus" 2>"$out/fuzz.log" || {
    tail -60 "$out/fuzz.log"; echo "fuzz: $name FAILED (artifacts in $out/artifacts)"; exit 1; }
  grep -E "^stat::number_of_executed_units|^Done" "$out/fuzz.log" || true
  echo "fuzz: $name: no crash, hang or leak"
}

build_config() {
  local out=$base/config_fuzz
  mkdir -p "$out/corpus" "$out/artifacts"
  clang++ "${flags[@]}" strobe/config/config.cpp strobe/config/experiment.cpp tests/fuzz/config_fuzz.cpp \
    -lyaml-cpp -o "$out/config_fuzz" || return 1
  find configs -name '*.yaml' -exec cp {} "$out/corpus/" \;
  cp -r tests/fuzz/seeds/. "$out/corpus/"
}

build_safetensors() {
  local out=$base/safetensors_fuzz
  mkdir -p "$out/corpus" "$out/artifacts"
  clang++ "${flags[@]}" strobe/checkpoint/safetensors_format.cpp tests/fuzz/safetensors_fuzz.cpp -o "$out/safetensors_fuzz" || return 1
  cp -r tests/fuzz/seeds_safetensors/. "$out/corpus/"
}

# Each target built and run in its own process; its report printed whole once both are done.
mkdir -p "$base"
(build_config && run_fuzz config_fuzz "$seconds" 4096) > "$base/config_fuzz.out" 2>&1 &
config_pid=$!
(build_safetensors && run_fuzz safetensors_fuzz "$seconds" 4096) > "$base/safetensors_fuzz.out" 2>&1 &
safetensors_pid=$!
rc=0
wait "$config_pid" || rc=1
wait "$safetensors_pid" || rc=1
cat "$base/config_fuzz.out" "$base/safetensors_fuzz.out"
exit $rc
