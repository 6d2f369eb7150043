"""scripts/setup.sh's compiler choice (README, 'Build'): STROBE_COMPILER is clang or gcc; any other
value, or an explicit choice that disagrees with the compiler an existing build directory was
configured with, is refused with one line and exit 2 before anything is installed, configured or
built, and the build directory is left as it was."""
import os, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
failures = []


def setup(build, compiler):
    env = dict(os.environ, STROBE_BUILD_DIR=build, STROBE_COMPILER=compiler)
    return subprocess.run(["bash", os.path.join(SRC, "scripts", "setup.sh")], cwd=SRC, env=env,
                          capture_output=True, text=True, timeout=120)


def snapshot(d):
    return {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))}


with tempfile.TemporaryDirectory() as tmp:
    cases = [
        ("bogus", "/usr/bin/clang++", "setup: STROBE_COMPILER must be clang or gcc, not 'bogus'"),
        ("gcc", "/usr/bin/clang++", "setup: {build} is configured with /usr/bin/clang++, not gcc: remove it or set STROBE_BUILD_DIR"),
        ("clang", "/usr/bin/c++", "setup: {build} is configured with /usr/bin/c++, not clang: remove it or set STROBE_BUILD_DIR"),
        ("clang", "/usr/bin/g++-12", "setup: {build} is configured with /usr/bin/g++-12, not clang: remove it or set STROBE_BUILD_DIR"),
    ]
    for i, (compiler, configured, want) in enumerate(cases):
        build = os.path.join(tmp, f"build{i}")
        os.makedirs(build)
        with open(os.path.join(build, "CMakeCache.txt"), "w") as f:
            f.write(f"CMAKE_CXX_COMPILER:FILEPATH={configured}\n")
        before = snapshot(build)
        r = setup(build, compiler)
        lines = r.stderr.splitlines()
        want = want.format(build=build)
        if r.returncode != 2 or lines != [want] or r.stdout:
            failures.append(f"STROBE_COMPILER={compiler} on a build configured with {configured}: exit {r.returncode}, "
                            f"stdout {r.stdout!r}, stderr {r.stderr!r}; want exit 2 and {want!r}")
        if snapshot(build) != before:
            failures.append(f"STROBE_COMPILER={compiler}: the build directory changed")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
