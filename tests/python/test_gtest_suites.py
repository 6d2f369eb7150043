"""cmake/GtestSuites.cmake: each GoogleTest suite of a CPU test executable is one ctest test that runs
the whole suite in one process (`--gtest_filter=<Suite>.*`).

- Its listing parser, on a planted executable (a script printing a GoogleTest listing with plain,
  parameterized and typed suites and '#' comments): one test per suite, the filter naming the suite,
  COST = cases x COST_PER_TEST, the labels, the environment, the runner (cmake/gtest_suite.sh) and
  its skip code.
- The build tree: for every CPU test executable, the suites in its ctest file are exactly the suites
  it lists, in no CUDA executable's; the distributed tests' suites (which fork ranks) share one
  RESOURCE_LOCK and no other's do; through the runner ctest reports a suite whose every case skips
  as skipped, one with a failing case (all of them, or beside skips) as failed, the rest as passed.

Usage: test_gtest_suites.py (STROBE_SOURCE_DIR, STROBE_BUILD_DIR: the source and a built build tree)."""
import glob, os, re, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
SCRIPT = os.path.join(SRC, "cmake", "GtestSuites.cmake")
RUNNER = os.path.join(SRC, "cmake", "gtest_suite.sh")
LISTING = """Running main() from gtest_main.cc
Plain.
  First
  Second
Shapes/Param.
  Works/0  # GetParam() = (Float, 0)
  Works/1  # GetParam() = (Half, 1)
Typed/0.  # TypeParam = int
  Adds
Last.
  Only
"""
ADD = re.compile(r"^add_test\(\[=\[(.+?)\]=\] (.*)\)$")


def generate(tmp, listing, cost, lock=""):
    exe = os.path.join(tmp, "fake_test")
    with open(exe, "w") as f:
        f.write("#!/bin/sh\necho \"$STROBE_PLANTED $*\" > \"$0.args\"\ncat <<'EOF'\n" + listing + "EOF\n")
    os.chmod(exe, 0o755)
    out = os.path.join(tmp, "suites.cmake")
    r = subprocess.run(["cmake", f"-DEXE={exe}", f"-DOUT={out}", "-DENV=STROBE_PLANTED=yes|OTHER=1", "-DLABELS=cpu|fake",
                        f"-DCOST_PER_TEST={cost}", f"-DWORKDIR={tmp}", f"-DRUNNER={RUNNER}", f"-DRESOURCE_LOCK={lock}", "-P", SCRIPT],
                       capture_output=True, text=True)
    return r, exe, out


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        r, exe, out = generate(tmp, LISTING, 3)
        text = open(out).read() if r.returncode == 0 else ""
        adds = [ADD.match(l) for l in text.splitlines() if l.startswith("add_test(")]
        names = [m.group(1) for m in adds if m]
        if names != ["Plain", "Shapes/Param", "Typed/0", "Last"]:
            failures.append(f"suites {names}, want Plain, Shapes/Param, Typed/0, Last (exit {r.returncode}: {r.stderr})")
        for m in adds:
            if m and (f"[=[--gtest_filter={m.group(1)}.*]=]" not in m.group(2) or "[=[STROBE_PLANTED=yes]=]" not in m.group(2)
                      or not m.group(2).startswith(f"sh [=[{RUNNER}]=] ")
                      or "[=[OTHER=1]=]" not in m.group(2) or f"[=[{exe}]=]" not in m.group(2)):
                failures.append(f"{m.group(1)}: the command does not filter the suite or lacks the environment: {m.group(2)}")
        for name, cost in (("Plain", 6), ("Shapes/Param", 6), ("Typed/0", 3), ("Last", 3)):
            want = f"set_tests_properties([=[{name}]=] PROPERTIES LABELS [=[cpu;fake]=] COST {cost} "
            if want not in text:
                failures.append(f"{name}: no '{want}' in\n{text}")
        if text.count("SKIP_RETURN_CODE 77)") != 4 or "SKIP_REGULAR_EXPRESSION" in text:
            failures.append(f"not every suite skips by the runner's exit code alone:\n{text}")
        r, _, locked = generate(tmp, LISTING, 1, "forked_ranks")
        locked = open(locked).read() if r.returncode == 0 else ""
        if locked.count("SKIP_RETURN_CODE 77 RESOURCE_LOCK [=[forked_ranks]=])") != 4 or "RESOURCE_LOCK" in text:
            failures.append(f"RESOURCE_LOCK is not on every suite given one, or is on suites given none:\n{locked}")
        r, _, _ = generate(tmp, "Running main() from gtest_main.cc\n", 1)
        if r.returncode == 0 or "lists no test suite" not in r.stderr:
            failures.append(f"an executable listing no suite: exit {r.returncode}, {r.stderr!r}")

    # The build tree's files against the executables' own listings.
    files = sorted(glob.glob(os.path.join(BUILD, "tests", "test_*_suites.cmake")))
    if len(files) < 10 or any(os.path.basename(f).startswith("test_gpu") for f in files):
        failures.append(f"suite files {[os.path.basename(f) for f in files]}: want the CPU executables' and no CUDA one's")
    cases = 0
    env = dict(os.environ, STROBE_SOURCE_DIR=SRC, STROBE_BIN=os.path.join(BUILD, "bin", "strobe"))
    for f in files:
        exe = os.path.join(BUILD, "bin", os.path.basename(f)[:-len("_suites.cmake")])
        listing = subprocess.run([exe, "--gtest_list_tests"], capture_output=True, text=True, env=env).stdout
        suites = [l.split(".")[0] for l in listing.splitlines() if l and not l.startswith((" ", "Running main"))]
        cases += sum(1 for l in listing.splitlines() if l.startswith("  "))
        named = [m.group(1) for m in (ADD.match(l) for l in open(f).read().splitlines()) if m]
        if named != suites or not suites:
            failures.append(f"{os.path.basename(f)}: ctest runs suites {named}, {os.path.basename(exe)} lists {suites}")
    for f in files:  # the suites that fork ranks never run beside each other
        locked = "RESOURCE_LOCK [=[forked_ranks]=]" in open(f).read()
        if locked != os.path.basename(f).startswith("test_distributed"):
            failures.append(f"{os.path.basename(f)}: RESOURCE_LOCK forked_ranks {'set' if locked else 'missing'}")
    if cases < 400:
        failures.append(f"the CPU executables list {cases} cases: not a built tree")

    # ctest through the runner: every case skipped -> skipped; every case failed, or a failure beside
    # skips -> failed (gtest prints "[  PASSED  ] 0 tests." for both); a passing case -> passed.
    outputs = {
        "AllSkipped": ("[  PASSED  ] 0 tests.\n[  SKIPPED ] 2 tests, listed below:\n", 0),
        "AllFailed": ("[  PASSED  ] 0 tests.\n[  FAILED  ] 2 tests, listed below:\n", 1),
        "SkipAndFail": ("[  PASSED  ] 0 tests.\n[  SKIPPED ] 1 test, listed below:\n[  FAILED  ] 1 test, listed below:\n", 1),
        "SomePassed": ("[  PASSED  ] 1 test.\n[  SKIPPED ] 1 test, listed below:\n", 0),
    }
    want = {"AllSkipped": "Skipped", "AllFailed": "Failed", "SkipAndFail": "Failed", "SomePassed": "Passed"}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "CTestTestfile.cmake"), "w") as ct:
            for name, (out, rc) in outputs.items():
                fake = os.path.join(tmp, name)
                with open(fake, "w") as f:
                    f.write(f"#!/bin/sh\nprintf '{out}'\nexit {rc}\n")
                os.chmod(fake, 0o755)
                ct.write(f"add_test([=[{name}]=] sh [=[{RUNNER}]=] [=[{fake}]=])\n"
                         f"set_tests_properties([=[{name}]=] PROPERTIES SKIP_RETURN_CODE 77)\n")
        r = subprocess.run(["ctest"], cwd=tmp, capture_output=True, text=True)
        for name, verdict in want.items():
            if not re.search(rf"{name} \.+ *(\*+)?{verdict}", r.stdout):
                failures.append(f"ctest through the runner: {name} is not {verdict}:\n{r.stdout}")

    for f in failures:
        print(f)
    print(f"test_gtest_suites: {len(files)} executables, {cases} cases; {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
