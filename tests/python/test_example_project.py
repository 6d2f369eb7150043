"""examples/custom_model built by a user against the installed package, and everything the README and
docs/EXTENDING.md say it does.

- The steps of docs/EXTENDING.md "Your own project" run as written (read from the page): a copy of
  the example outside the source tree, configured with the prefix alone, built, and trained from its
  folder with `strobe fit -c spirals.yaml`; its build files name no path of the source tree.
  `scripts/build_example.sh` then installs into that prefix and builds the same copy again.
- With the user's launcher ccache, ccache can cache every compile of that build (strobe_add_plugin
  gives it the sloppiness the precompiled header needs), and a second copy of the project and the
  package, configured without a launcher (ccache then launches the plugin's compiles), is served
  from the cache: every compile a hit.
- The installed `strobe` trains the plugin's model, task, metric, data module and callback (spirals:
  validation accuracy >= 0.9 after the example's 144 steps).
- Stopped at step 50 and resumed, the run ends with the weights of the straight run, bit for bit (both
  exported with `strobe export` and read by the `safetensors` package), the same metrics.csv rows and
  the callback's state carried through the checkpoint (the same loss average after 144 batches).
- The example's fault (model.radius_floor) stops the run through NaN capture (exit 3); `strobe replay`
  reproduces the step exactly and names aten::sqrt in the plugin's module `radial`.
- On a GPU: under CUDA graphs the example logs bitwise the losses of an eager run (deterministic
  algorithms), and its fault is captured under graphs and replayed exactly on the GPU.
- A misspelt plugin model gets a did-you-mean of the plugin's name; a bad points file is one line and
  exit 2 naming the file and line, and so is a model with fewer classes than the file holds;
  `strobe validate` reports the plugin metric.

Usage: test_example_project.py (STROBE_SOURCE_DIR, STROBE_BUILD_DIR: the source and a built build tree).
Needs the `safetensors` package (scripts/setup.sh installs it): without it the test fails under CI
(CI=true) and is skipped elsewhere."""
import csv, json, os, shutil, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
failures = []

try:
    import torch
    from safetensors.torch import load_file
except ImportError as e:
    print(f"test_example_project: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)


def check(ok, what):
    if not ok:
        failures.append(what)
    return ok


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return {row["step"]: row["train/loss"] for row in csv.DictReader(f) if row.get("train/loss")}


def replay(strobe, run_dir, report):
    """`strobe replay` of the run's latest capture: the process, its JSON report and the report's
    first non-finite op ({} when the replay failed or found none)."""
    r = run([strobe, "replay", os.path.join(run_dir, "nan"), "--report", report])
    rep = {}
    if r.returncode == 0:
        with open(report) as f:
            rep = json.load(f)
    return r, rep, rep.get("first_nonfinite") or {}


def ccache_log(path):
    """ccache's stats log (CCACHE_STATSLOG): one "<file> <counter>..." string per compile."""
    log = open(path).read() if os.path.exists(path) else ""
    return [c for c in log.split("# ")[1:] if c.split()]


def documented_steps():
    """The shell block of docs/EXTENDING.md "Your own project", as its lines."""
    with open(os.path.join(SRC, "docs", "EXTENDING.md")) as f:
        page = f.read()
    section = page.split("## Your own project", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0].strip().splitlines()


def main():
    tmp = tempfile.mkdtemp(prefix="strobe-example-")
    project = os.path.join(tmp, "spirals")
    prefix = os.path.join(tmp, "prefix")
    r = run(["cmake", "--install", BUILD, "--prefix", prefix])
    if not check(r.returncode == 0, f"cmake --install failed:\n{r.stdout}{r.stderr}"):
        return finish(tmp)
    # The page's steps as written: the copy from the source tree's example into a folder of one's own
    # (the page's ~/spirals), the build with the prefix alone, the first training run.
    steps = documented_steps()
    check(len(steps) == 5 and steps[0] == "cp -r examples/custom_model ~/spirals" and steps[1] == "cd ~/spirals",
          f"the page's steps changed: {steps}")
    script = "set -e\n" + "\n".join(steps).replace("~/spirals", project)
    env = dict(os.environ, STROBE_PREFIX=prefix)
    if shutil.which("ccache"):  # the steps as written; the compiles shared with earlier runs of this test
        env.update(CMAKE_CXX_COMPILER_LAUNCHER="ccache", CCACHE_BASEDIR=tmp, CCACHE_STATSLOG=os.path.join(tmp, "first.statslog"))
    r = run(["bash", "-c", script], cwd=SRC, env=env)
    if not check(r.returncode == 0, f"the steps of docs/EXTENDING.md failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"):
        return finish(tmp)
    if shutil.which("ccache"):  # with the user's launcher ccache, every compile is one ccache can cache
        refused = [(c.split()[0], c.split()[1:]) for c in ccache_log(env["CCACHE_STATSLOG"])
                   if not {"cache_miss", "direct_cache_hit", "preprocessed_cache_hit"} & set(c.split()[1:])]
        check(not refused, f"ccache could not cache these compiles of the documented build: {refused}")
    first = [l for l in r.stdout.splitlines() if "final metrics" in l]
    check(bool(first) and "val/acc=" in first[0], f"the documented fit: {r.stdout}")
    out = os.path.join(project, "build")
    with open(os.path.join(out, "CMakeCache.txt")) as f:
        cache = f.read()
    generated = cache + "".join(open(os.path.join(d, n), errors="replace").read()
                                for d, _, names in os.walk(os.path.join(out, "CMakeFiles"))
                                for n in names if n in ("build.make", "flags.make", "link.txt"))
    check(SRC + "/" not in generated.replace(project, "<project>"),
          "the example's build names a path of the source tree: it must need the installed prefix alone")
    # strobe_add_plugin's precompiled <torch/torch.h> (docs/EXTENDING.md, "Build times"): built once
    # by strobe_plugin_pch and reused by the plugin's compiles.
    pch_dir = os.path.join(out, "CMakeFiles", "strobe_plugin_pch.dir")
    check(any(n.startswith("cmake_pch.hxx.") and n.endswith((".pch", ".gch")) for n in os.listdir(pch_dir))
          if os.path.isdir(pch_dir) else False, f"no precompiled header in {pch_dir}")
    flags = "".join(open(os.path.join(d, n), errors="replace").read()
                    for d, _, names in os.walk(os.path.join(out, "CMakeFiles", "strobe_example.dir"))
                    for n in names if n == "flags.make")
    check("strobe_plugin_pch.dir/cmake_pch.hxx" in flags, f"the plugin's compiles do not use the precompiled header:\n{flags}")
    # The steps ran with the user's launcher ccache; a second copy of the project and the package
    # (another folder, laid out alike), configured without a launcher (ccache, when installed, then
    # launches the plugin's compiles), is served from the cache the first build filled: every
    # compile a hit, the precompiled header's included.
    if shutil.which("ccache"):
        second = os.path.join(tmp, "second")
        copy = os.path.join(second, "spirals")
        shutil.copytree(project, copy, ignore=shutil.ignore_patterns("build"))
        r = run(["cmake", "--install", BUILD, "--prefix", os.path.join(second, "prefix")])
        check(r.returncode == 0, f"cmake --install into a second prefix failed:\n{r.stdout}{r.stderr}")
        env_bare = {k: v for k, v in os.environ.items() if k != "CMAKE_CXX_COMPILER_LAUNCHER"}
        env_bare.update(CCACHE_BASEDIR=second, CCACHE_STATSLOG=os.path.join(tmp, "second.statslog"))
        r = run(["cmake", "-S", copy, "-B", os.path.join(copy, "build"), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={os.path.join(second, 'prefix')}"], env=env_bare)
        rules = "".join(open(os.path.join(d, n), errors="replace").read()
                        for d, _, names in os.walk(os.path.join(copy, "build", "CMakeFiles", "strobe_example.dir"))
                        for n in names if n == "build.make")
        check(r.returncode == 0 and "CCACHE_SLOPPINESS=pch_defines,time_macros" in rules and "ccache" in rules,
              f"strobe_add_plugin did not make ccache the compiler launcher:\n{r.stderr}")
        r = run(["cmake", "--build", os.path.join(copy, "build"), "-j", "2"], env=env_bare)
        compiles = ccache_log(env_bare["CCACHE_STATSLOG"])
        missed = [c.split()[0] for c in compiles if not {"direct_cache_hit", "preprocessed_cache_hit"} & set(c.split()[1:])]
        check(r.returncode == 0 and len(compiles) >= 6 and not missed,
              f"ccache missed {len(missed)} of the second copy's {len(compiles)} compiles (exit {r.returncode}): {missed}")
    # scripts/build_example.sh (the README's route): installs again and builds the same copy.
    r = run(["bash", os.path.join(SRC, "scripts", "build_example.sh"), prefix, project],
            env=dict(os.environ, STROBE_BUILD_DIR=BUILD))
    check(r.returncode == 0, f"build_example.sh failed:\n{r.stdout}{r.stderr}")

    strobe = os.path.join(prefix, "bin", "strobe")
    plugin = os.path.join(out, "libstrobe_example.so")
    base = [strobe, "fit", "-c", os.path.join(project, "spirals.yaml"), f"--set=plugins=[{plugin}]",
            f"--set=data.path={os.path.join(project, 'spirals.pts')}", "--set=trainer.enable_progress_bar=false",
            "--set=trainer.device=cpu", "--set=trainer.log_every_n_steps=1"]

    # Straight, and stopped at 50 then resumed.
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    ra = run(base + ["--run-dir", a])
    if not check(ra.returncode == 0, f"fit failed: {ra.stderr}"):
        return finish(tmp)
    rb = run(base + ["--run-dir", b, "--set=trainer.max_steps=50"])
    check(rb.returncode == 0 and "after 50 batches" in rb.stdout, f"the first half failed: {rb.stdout}{rb.stderr}")
    rc = run(base + ["--ckpt", os.path.join(b, "checkpoints", "last.ckpt")])
    check(rc.returncode == 0, f"the resume failed: {rc.stderr}")
    ema = [l for l in ra.stdout.splitlines() if l.startswith("example_loss_ema:")]
    ema_resumed = [l for l in rc.stdout.splitlines() if l.startswith("example_loss_ema:")]
    check(len(ema) == 1 and ema[0].endswith("after 144 batches"), f"the callback's line: {ra.stdout}")
    check(ema == ema_resumed, f"the callback's state did not survive the resume: straight {ema}, resumed {ema_resumed}")
    la, lb = losses(a), losses(b)
    check(len(la) == 144 and la == lb, f"train/loss rows differ: {len(la)} straight, {len(lb)} resumed")
    final = [l for l in ra.stdout.splitlines() if "final metrics" in l]
    acc = float(final[0].split("val/acc=")[1].split()[0]) if final and "val/acc=" in final[0] else 0.0
    check(acc >= 0.9, f"the example does not learn the spirals: val/acc {acc} ({final})")

    weights = {}
    for name, d in (("straight", a), ("resumed", b)):
        st = os.path.join(tmp, f"{name}.safetensors")
        r = run([strobe, "export", os.path.join(d, "checkpoints", "last.ckpt"), "-o", st])
        if check(r.returncode == 0, f"export of the {name} run failed: {r.stderr}"):
            weights[name] = load_file(st)
    if len(weights) == 2:
        s, t = weights["straight"], weights["resumed"]
        check("radial.freq" in s and "blocks.1.fc2.weight" in s, f"the plugin model's names: {sorted(s)}")
        check(s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s),
              "the resumed run's weights are not bitwise those of the straight run")

    # The fault: NaN capture, then an exact replay naming the plugin's module.
    n = os.path.join(tmp, "nan")
    r = run(base + ["--run-dir", n, "--set=model.radius_floor=0.0025"])
    check(r.returncode == 3, f"the fault did not stop the run through NaN capture (exit {r.returncode}): {r.stderr}")
    r, rep, first = replay(strobe, n, os.path.join(tmp, "replay.json"))
    if check(r.returncode == 0, f"replay failed: {r.stderr}"):
        check(rep.get("exact") is True, f"replay is not exact: {rep}")
        check(first.get("module") == "radial" and "sqrt" in first.get("op", ""),
              f"replay names {first.get('op')} in {first.get('module')}, not aten::sqrt in radial")

    # Errors: one line, exit 2.
    r = run(base + ["--set=model.name=spiral_nett"])
    check(r.returncode == 2 and "did you mean 'spiral_net'?" in r.stderr and r.stderr.count("\n") == 1,
          f"a misspelt plugin model: exit {r.returncode}: {r.stderr}")
    bad = os.path.join(tmp, "bad.pts")
    with open(os.path.join(project, "spirals.pts")) as f:
        lines = f.read().splitlines()
    lines[9] = "7 0.1 0.2"
    with open(bad, "w") as f:
        f.write("\n".join(lines) + "\n")
    r = run(base + [f"--set=data.path={bad}"])
    check(r.returncode == 2 and f"{bad}:10: the label must be an integer in [0, 3)" in r.stderr and r.stderr.count("\n") == 1,
          f"a bad points file: exit {r.returncode}: {r.stderr}")
    r = run(base + ["--set=model.num_classes=2"])
    check(r.returncode == 2 and "model.num_classes: 2 classes, but data 'example_points' has 3 classes" in r.stderr,
          f"a model with fewer classes than the data: exit {r.returncode}: {r.stderr}")
    r = run([strobe, "validate"] + base[2:] + ["--ckpt", os.path.join(a, "checkpoints", "last.ckpt")])
    check(r.returncode == 0 and "val/worst_class_acc" in r.stdout, f"validate: exit {r.returncode}: {r.stdout}{r.stderr}")
    cuda(base, tmp, strobe)
    return finish(tmp, acc)


def cuda(base, tmp, strobe):
    """On a GPU: the example trains under CUDA graphs with bitwise the losses of an eager run (under
    deterministic algorithms), and its fault is captured under graphs and replayed exactly on the GPU."""
    if not torch.cuda.is_available():
        print("test_example_project: no CUDA device visible: the CUDA-graph part is skipped")
        return
    cu = base + ["--set=trainer.device=cuda", "--set=trainer.deterministic=true", "--set=data.num_workers=1"]
    runs = {}
    for graphs in ("false", "true"):
        d = os.path.join(tmp, f"cuda_graphs_{graphs}")
        r = run(cu + ["--run-dir", d, f"--set=trainer.cuda_graphs={graphs}"])
        if check(r.returncode == 0, f"cuda_graphs={graphs}: exit {r.returncode}: {r.stderr}"):
            runs[graphs] = losses(d)
    if len(runs) == 2:
        check(len(runs["true"]) == 144 and runs["true"] == runs["false"],
              "under CUDA graphs the example's losses are not bitwise those of the eager run")
    n = os.path.join(tmp, "cuda_nan")
    r = run(cu + ["--run-dir", n, "--set=trainer.cuda_graphs=true", "--set=model.radius_floor=0.0025"])
    check(r.returncode == 3, f"the fault under CUDA graphs: exit {r.returncode}: {r.stderr}")
    r, rep, first = replay(strobe, n, os.path.join(tmp, "cuda_replay.json"))
    if check(r.returncode == 0, f"replay on CUDA failed: {r.stderr}"):
        check(rep.get("exact") is True and first.get("module") == "radial",
              f"replay on CUDA: exact {rep.get('exact')}, module {first.get('module')}")
    print("test_example_project: CUDA graphs and CUDA replay checked")


def finish(tmp, acc=None):
    for f in failures:
        print("FAIL:", f)
    if failures or os.environ.get("STROBE_KEEP_TEST_DIRS"):
        print("files kept in", tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_example_project: val/acc {acc}; {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
