#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks, then configures and builds Strobe into build/.
# Usage: setup.sh [TARGET ...]: builds only the named targets (`setup.sh strobe`: the executable
# alone, what the quickstart runs), else everything (the tests, their plugins and helper programs).
# Idempotent and fast when everything is there: apt runs only for missing packages, pip only when
# the virtual environment lacks torch 2.11.0 or a comparison package.
# Env: STROBE_VENV (default ~/.cache/strobe/venv), STROBE_BUILD_DIR (default build), STROBE_JOBS,
# STROBE_COMPILER (clang, the default when installed, or gcc).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The compiler: Clang when it is installed (STROBE_COMPILER=gcc keeps GCC). Its precompiled header
# also holds the template instantiations that GCC redoes in every translation unit, which halves a
# build from scratch. It applies when the build directory is configured: an explicit setting that
# disagrees with an existing build directory is refused, before anything is installed or built.
build=${STROBE_BUILD_DIR:-build}
compiler=${STROBE_COMPILER:-clang}
if [ "$compiler" != clang ] && [ "$compiler" != gcc ]; then
  echo "setup: STROBE_COMPILER must be clang or gcc, not '$compiler'" >&2
  exit 2
fi
if [ -n "${STROBE_COMPILER:-}" ] && [ -f "$build/CMakeCache.txt" ]; then
  configured=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
  case "$compiler:$(basename "$configured")" in
    clang:clang*|gcc:g++*|gcc:c++) ;;
    *) echo "setup: $build is configured with $configured, not $compiler: remove it or set STROBE_BUILD_DIR" >&2
       exit 2 ;;
  esac
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
apt_pkgs=(build-essential cmake ninja-build ccache pkg-config python3 python3-venv zlib1g-dev
  libyaml-cpp-dev libfmt-dev libcereal-dev rapidjson-dev libgtest-dev libgmock-dev googletest
  libcli11-dev nlohmann-json3-dev libprotobuf-dev protobuf-compiler dataset-fashion-mnist fortunes
  clang libclang-rt-14-dev libturbojpeg0-dev libjpeg62-turbo-dev libpng-dev libcurl4-openssl-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

venv=${STROBE_VENV:-$HOME/.cache/strobe/venv}
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "setup: creating virtual environment $venv"
  python3 -m venv "$venv"
fi
if ! "$py" - <<'PY' 2>/dev/null
import importlib.metadata as m
assert m.version("torch") == "2.11.0"
for p in ("torchvision", "torchmetrics", "tensorboard", "numpy", "safetensors", "timm", "transformers", "lightning", "mlflow"):
    m.version(p)
PY
then
  echo "setup: installing torch 2.11.0 and the comparison packages into $venv"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "torch==2.11.0" "torchvision==0.26.0" torchmetrics tensorboard numpy safetensors timm "transformers==5.24.0" "lightning==2.6.6" "mlflow==3.17.2"
fi

prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
cmake_args=(-S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DSTROBE_PYTHON="$py")
if [ "$compiler" = clang ] && command -v clang++ >/dev/null; then
  cmake_args+=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
elif [ -n "${STROBE_COMPILER:-}" ] && [ "$compiler" = clang ]; then
  echo "setup: STROBE_COMPILER=clang, but clang++ is not installed" >&2
  exit 2
fi
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  cmake_args+=(-DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")
fi
if [ ! -f "$build/build.ninja" ]; then
  # libtorch's CMake files warn about settings Strobe makes on purpose: the output is shown only
  # when configuring fails.
  log=$(mktemp)
  if ! cmake "${cmake_args[@]}" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: configuring $build failed (above)" >&2
    exit 1
  fi
  rm -f "$log"
fi
jobs=${STROBE_JOBS:-$(nproc)}
targets=()
for t in "$@"; do
  if ! ninja -C "$build" -t query "$t" >/dev/null 2>&1; then
    echo "setup: '$t' is not a target of $build (strobe builds the executable; no target builds everything)" >&2
    exit 2
  fi
  targets+=(--target "$t")
done
echo "setup: building ${*:-everything} ($build, -j$jobs)"
cmake --build "$build" -j"$jobs" "${targets[@]}"
