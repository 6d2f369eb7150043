"""tests/gpu_or_skip.sh, the launcher of the CUDA test executables (README, "GPU build"): where no GPU
device node exists a CUDA test is reported skipped by ctest without its process starting; where one
exists the executable runs with its arguments unchanged and its exit status is the test's; discovery
(--gtest_list_tests) always runs it. Every tests/gpu_* executable's ctest tests go through it and no
CPU test does.

Usage: test_gpu_or_skip.py (STROBE_SOURCE_DIR, STROBE_BUILD_DIR: the source and a built build tree)."""
import glob, os, re, subprocess, sys

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
WRAPPER = os.path.join(SRC, "tests", "gpu_or_skip.sh")
SKIP = re.compile(r"\[  SKIPPED \]")  # gtest_discover_tests' SKIP_REGULAR_EXPRESSION
failures = []


def wrapped(nodes, *cmd):
    env = dict(os.environ, STROBE_GPU_DEVICE_NODES=nodes)
    return subprocess.run(["sh", WRAPPER, *cmd], capture_output=True, text=True, env=env, timeout=60)


def main():
    echo = [sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(5)"]
    args = ["--gtest_filter=A.B", "two words", "--gtest_also_run_disabled_tests"]
    # No device node: skipped, the executable not started (it would print its arguments and exit 5).
    r = wrapped("/nonexistent/nvidia* /nonexistent/dxg", *echo, *args)
    if r.returncode != 0 or not SKIP.search(r.stdout) or "two words" in r.stdout or "not started" not in r.stdout:
        failures.append(f"no device node: exit {r.returncode}, stdout {r.stdout!r}: not a skip without starting")
    # A device node: the executable runs with its arguments as given and its exit status is the test's.
    r = wrapped("/nonexistent/nvidia* /dev/null", *echo, *args)
    if r.returncode != 5 or r.stdout.strip() != repr(args) or SKIP.search(r.stdout):
        failures.append(f"a device node: exit {r.returncode}, stdout {r.stdout!r}: the executable did not run as given")
    # Discovery always runs the executable.
    r = wrapped("/nonexistent/nvidia*", *echo, "--gtest_list_tests")
    if r.returncode != 5 or "--gtest_list_tests" not in r.stdout:
        failures.append(f"discovery without a device node: exit {r.returncode}, stdout {r.stdout!r}")

    # The build's ctest files: every gpu_* executable's tests launch through the wrapper, no other's do.
    gpu, cpu = 0, 0
    # (gtest_discover_tests' files for the CUDA executables, one test per case; cmake/GtestSuites.cmake's
    # for the others, one test per suite)
    files = glob.glob(os.path.join(BUILD, "tests", "test_gpu*_tests.cmake")) + \
        glob.glob(os.path.join(BUILD, "tests", "test_*_suites.cmake"))
    for f in files:
        name = os.path.basename(f)[len("test_"):].split("[")[0]
        with open(f) as fh:
            text = fh.read()
        adds = [l for l in text.splitlines() if l.startswith("add_test(")]
        through = [l for l in adds if "gpu_or_skip.sh" in l]
        if name.startswith("gpu"):
            gpu += len(adds)
            if len(through) != len(adds) or not adds:
                failures.append(f"{os.path.basename(f)}: {len(adds) - len(through)} of {len(adds)} CUDA tests not launched through gpu_or_skip.sh")
        else:
            cpu += len(adds)
            if through:
                failures.append(f"{os.path.basename(f)}: {len(through)} CPU tests launched through gpu_or_skip.sh")
    if gpu < 50 or cpu < 100:
        failures.append(f"found {gpu} CUDA tests and {cpu} CPU suites in {BUILD}/tests: not a built tree's ctest files")

    # ctest itself: on this machine a CUDA test is skipped without starting (no device node) or runs.
    has_node = any(glob.glob(p) for p in ("/dev/nvidia*", "/dev/dxg", "/dev/nvhost*", "/dev/nvgpu*"))
    r = subprocess.run(["ctest", "-R", r"^GpuFlashAttention\.Varlen$", "-V"], cwd=BUILD, capture_output=True, text=True, timeout=300)
    if has_node:
        ok = "not started" not in r.stdout and "[ RUN      ] GpuFlashAttention.Varlen" in r.stdout
    else:
        ok = r.returncode == 0 and "not started" in r.stdout and "***Skipped" in r.stdout and "[ RUN" not in r.stdout
    if not ok:
        failures.append(f"ctest -R GpuFlashAttention.Varlen (device node: {has_node}): exit {r.returncode}\n{r.stdout[-2000:]}")

    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print(f"test_gpu_or_skip: {gpu} CUDA tests launched through the wrapper, {cpu} CPU tests not; "
              f"{'a device node: the test ran' if has_node else 'no device node: skipped without starting'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
