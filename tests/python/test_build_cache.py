"""The build cache works across checkouts (README, 'Build'): a second clone or CI compiles from what
another checkout put in ccache instead of from scratch. Checks, on this build's compile_commands.json:
- no compile command carries an absolute path of the checkout or of the build tree in a -D definition
  (such an object can never hit from another path);
- every compile goes through the launcher that gives ccache base_dir = this checkout and the
  sloppiness that lets it cache precompiled-header compiles;
- every translation unit that includes a precompiled header fails the build when it cannot use it
  (-Werror=invalid-pch) instead of silently compiling <torch/torch.h> again;
- with Clang, the .pch files hold no path of the checkout or the build tree;
- the unity batches (cmake/Unity.cmake) include their sources by relative paths, so a batch is the
  same text in every checkout;
and, with that launcher's own settings and the build's compiler, compiles a file that uses a
precompiled header (made as the build makes it) in one directory and then in a copy elsewhere, in a
private cache: the copy must be served from the cache.
Exit 77 (skip) only when the build does not use ccache (ccache not installed, or STROBE_CCACHE=OFF)."""
import json, os, re, shutil, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
failures = []

with open(os.path.join(BUILD, "compile_commands.json")) as f:
    commands = json.load(f)
assert len(commands) > 50, f"only {len(commands)} compile commands in {BUILD}"


def args_of(entry):
    return entry["arguments"] if "arguments" in entry else entry["command"].split()


# 1. No -D definition names the checkout or the build tree.
for e in commands:
    for a in args_of(e):
        if a.startswith("-D") and (SRC in a or BUILD in a):
            failures.append(f"{e['file']}: {a} compiles an absolute path in (read it at run time)")

# 2. The ccache launcher with base_dir and the precompiled-header sloppiness, on every compile rule.
cache_vars = {}
with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
    for line in f:
        m = re.match(r"(\w+):\w+=(.*)", line.strip())
        if m:
            cache_vars[m.group(1)] = m.group(2)
ccache_path = cache_vars.get("CCACHE_PROGRAM", "")
if not ccache_path or ccache_path.endswith("NOTFOUND") or cache_vars.get("STROBE_CCACHE", "ON").upper() in ("OFF", "0", "FALSE"):
    print("skip: this build does not compile through ccache (not installed, or STROBE_CCACHE=OFF)")
    sys.exit(77)
rules_file = os.path.join(BUILD, "CMakeFiles", "rules.ninja")
assert os.path.exists(rules_file), f"{rules_file} missing: the build is configured with Ninja (scripts/setup.sh)"
rules = re.findall(r"^rule ((?:CXX|CUDA)_COMPILER__\S+)\n(?:  .*\n)*?  command = (.*)$", open(rules_file).read(), re.M)
assert len(rules) > 10, f"only {len(rules)} compile rules in {rules_file}"
launcher = None
for name, cmd in rules:
    a = cmd.split()
    if ccache_path not in a:
        failures.append(f"{name}: not compiled through ccache: {cmd[:120]}")
        continue
    prefix = a[:a.index(ccache_path) + 1]
    env = {k: v for k, _, v in (x.partition("=") for x in prefix if "=" in x)}
    if os.path.realpath(env.get("CCACHE_BASEDIR", "")) != SRC:
        failures.append(f"{name}: CCACHE_BASEDIR is {env.get('CCACHE_BASEDIR')!r}, not the checkout {SRC}")
    slop = set(env.get("CCACHE_SLOPPINESS", "").split(","))
    if not {"pch_defines", "time_macros"} <= slop:
        failures.append(f"{name}: CCACHE_SLOPPINESS {sorted(slop)} lacks pch_defines,time_macros")
    if launcher is None and name.startswith("CXX"):
        launcher = (prefix, env)

# 3. A precompiled header that cannot be used fails the build.
pch_users = 0
for e in commands:
    a = args_of(e)
    # strobe_pch's own compiles build the header, or (Clang) are the flags' reference of the .pch
    if re.search(r"strobe_pch(_unoptimized)?\.dir", " ".join(a)) and \
            ("cmake_pch.hxx.cxx" in e["file"] or e["file"].endswith("cmake/pch.cpp")):
        continue
    if any(x.endswith("cmake_pch.hxx") for x in a) or "-include-pch" in a:
        pch_users += 1
        if "-Werror=invalid-pch" not in a:
            failures.append(f"{e['file']}: uses a precompiled header without -Werror=invalid-pch")
if pch_users < 30:
    failures.append(f"only {pch_users} translation units use the precompiled header")

# 4. Unity batches (cmake/Unity.cmake) name their sources by relative paths: a batch is the same text in
# every checkout. (CMake's own UNITY_BUILD writes absolute paths: nothing may use it.)
batch = int(cache_vars.get("STROBE_UNITY_BATCH", "1") or 1)
unity_files = []
for root, _, files in os.walk(os.path.join(BUILD, "unity")):
    unity_files += [os.path.join(root, f) for f in files if f.endswith(".cpp")]
if batch > 1 and len(unity_files) < 10:
    failures.append(f"STROBE_UNITY_BATCH={batch} but only {len(unity_files)} unity batches under {BUILD}/unity")
for u in unity_files:
    for line in open(u):
        m = re.match(r'#include "(.*)"', line)
        if m and os.path.isabs(m.group(1)):
            failures.append(f"{u}: includes {m.group(1)} by an absolute path")
for e in commands:
    if "/unity_" in e["file"] and "CMakeFiles" in e["file"]:
        failures.append(f"{e['file']}: CMake's UNITY_BUILD (absolute paths) is in use")

# 5. Two checkouts, one cache: the second compile of a PCH-using file at another path is a hit.
# With Clang the .pch is built by cmake/ClangPch.cmake (the script the build runs) and must hold no
# path of the checkout or the build tree (ccache hashes it into every compile that uses it).
ccache = shutil.which("ccache")
cxx = cache_vars.get("CMAKE_CXX_COMPILER", "")
clang = "clang" in os.path.basename(cxx)
if clang:
    pchs = [os.path.join(BUILD, "pch", f) for f in os.listdir(os.path.join(BUILD, "pch")) if f.endswith(".pch")] \
        if os.path.isdir(os.path.join(BUILD, "pch")) else []
    if len(pchs) != 2:
        failures.append(f"Clang build: expected the two .pch files under {BUILD}/pch, found {pchs}")
    for p in pchs:
        data = open(p, "rb").read()
        for path in {SRC, BUILD}:
            if path.encode() in data:
                failures.append(f"{p} holds the path {path}: another checkout's .pch differs and ccache misses")
if launcher and ccache and cxx:
    prefix, env = launcher
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        base_env = dict(os.environ, CCACHE_DIR=cache)
        for k in ("CCACHE_BASEDIR", "CCACHE_SLOPPINESS", "CCACHE_INODECACHE", "CCACHE_DISABLE", "CCACHE_RECACHE"):
            base_env.pop(k, None)
        stable = os.path.join(tmp, "stable")  # stands for torch's include directory
        os.makedirs(stable)
        with open(os.path.join(stable, "pre.h"), "w") as f:
            f.write("#include <vector>\n#include <string>\n#define STROBE_PROBE 3\n")

        def run(cmd, cwd, use_launcher, lp):
            r = subprocess.run((lp if use_launcher else []) + cmd, cwd=cwd, env=base_env, capture_output=True, text=True)
            assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"

        def build(root):
            b = os.path.join(root, "b")
            os.makedirs(b)
            with open(os.path.join(root, "a.cpp"), "w") as f:
                f.write('int probe() { std::vector<std::string> v(STROBE_PROBE); return (int)v.size(); }\n'
                        'const char* when() { return __DATE__; }\n')
            # the launcher exactly as the build runs it, with this checkout as base_dir
            lp = [f"CCACHE_BASEDIR={root}" if x.startswith("CCACHE_BASEDIR=") else x for x in prefix]
            flags = ["-std=gnu++17", "-O2", "-fPIC"]
            if clang:
                with open(os.path.join(b, "compile_commands.json"), "w") as f:
                    json.dump([{"directory": b, "file": os.path.join(root, "ref.cpp"), "output": "ref.o",
                                "command": " ".join([cxx] + flags + ["-o", "ref.o", "-c", os.path.join(root, "ref.cpp")])}], f)
                pch = os.path.join(b, "pre.pch")
                run(["cmake", f"-DCOMMANDS={b}/compile_commands.json", "-DREFERENCE=ref.o",
                     f"-DHEADER={stable}/pre.h", f"-DOUTPUT={pch}", f"-DDEPFILE={pch}.d",
                     "-P", os.path.join(SRC, "cmake", "ClangPch.cmake")], b, False, lp)
                run([cxx] + flags + ["-Winvalid-pch", "-Werror=invalid-pch", "-include-pch", pch,
                                      "-c", os.path.join(root, "a.cpp"), "-o", os.path.join(b, "a.o")], b, True, lp)
            else:
                shutil.copy(os.path.join(stable, "pre.h"), os.path.join(b, "pre.h"))
                run([cxx] + flags + ["-x", "c++-header", os.path.join(b, "pre.h"), "-o", os.path.join(b, "pre.h.gch")], b, True, lp)
                run([cxx] + flags + ["-Winvalid-pch", "-Werror=invalid-pch", "-include", os.path.join(b, "pre.h"),
                                      "-c", os.path.join(root, "a.cpp"), "-o", os.path.join(b, "a.o")], b, True, lp)

        def stats():
            out = subprocess.run([ccache, "--print-stats"], env=base_env, capture_output=True, text=True).stdout
            return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)}

        build(os.path.join(tmp, "one"))
        s1 = stats()
        build(os.path.join(tmp, "two", "elsewhere"))
        s2 = stats()
        hits = (s2.get("direct_cache_hit", 0) + s2.get("preprocessed_cache_hit", 0)) - \
               (s1.get("direct_cache_hit", 0) + s1.get("preprocessed_cache_hit", 0))
        misses = s2.get("cache_miss", 0) - s1.get("cache_miss", 0)
        want = 1 if clang else 2  # Clang: the .pch is built outside ccache, the same bytes everywhere
        print(f"{'clang' if clang else 'gcc'}: second checkout: {hits} hits, {misses} misses; uncacheable: "
              f"{s2.get('could_not_use_precompiled_header', 0)} could not use the precompiled header")
        if hits != want or misses != 0:
            failures.append(f"the second checkout's compiles were not served from the cache ({hits} hits, {misses} misses, "
                            f"{s2.get('could_not_use_precompiled_header', 0)} could not use the precompiled header)")
else:
    failures.append("no C++ compile command to take the launcher from, or no ccache/compiler")

for f in failures:
    print("FAIL:", f)
print(f"{len(commands)} compile commands, {pch_users} use the precompiled header: "
      f"{'ok' if not failures else f'{len(failures)} failure(s)'}")
sys.exit(1 if failures else 0)
