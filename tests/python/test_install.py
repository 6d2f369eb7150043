"""The installed package (README, 'Extending Strobe'; cmake/Install.cmake).

`cmake --install` puts the build into a temporary prefix; then:
- the installed headers are exactly closed under their project includes (every `#include "..."` of a
  project header names an installed one), hold no engine header (ENGINE_HEADERS: the trainer, the
  step pipeline, the loops, the strategy, ...) and declare no engine setter where a component could
  call it (ENGINE_SETTERS outside a `private:` section);
- the installed `strobe` runs from the prefix and lists what the build's lists;
- a project outside the tree (a copy of tests/install/consumer) configures with find_package(Strobe)
  and CMAKE_PREFIX_PATH = the prefix + libtorch, with no include path into the source tree, builds a
  component library with strobe_add_plugin and a program, and the program finds its model, metric and
  callback in libstrobe's registries beside the built-in ones (the model calls one of Strobe's
  operators, strobe::ops::swiglu, through the umbrella header strobe/strobe.h), trains the model a step, computes the
  metric and round-trips the callback's state;
- the installed `strobe` loads the consumer's library as a plugin (`--plugin`, `plugins:`), lists its
  model and trains it with its callback;
- a project asking for Strobe 0.1 does not find the package (0.2: the API changed);
- a package whose recorded libtorch version differs from the libtorch found is refused at configure
  time with one line naming both versions.
- a plugin rebuilt against installed headers that differ from the package's own (a virtual added to
  TrainerView) is refused by the installed `strobe` before it loads, with one line saying to rebuild.

Usage: test_install.py (STROBE_SOURCE_DIR, STROBE_BUILD_DIR: the source and a built build tree)."""
import csv, json, os, re, shutil, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
ACCESS = re.compile(r"^\s*(public:|protected:|private:)")
# The engine: what builds and runs a fit, never a component's business (docs/EXTENDING.md, "What is
# installed"). Each is refused in the installed package.
ENGINE_HEADERS = [
    "strobe/core/trainer.h", "strobe/core/step_pipeline.h", "strobe/core/engine_access.h", "strobe/core/loops.h",
    "strobe/core/step_runner.h", "strobe/core/graph_step.h", "strobe/core/state_connector.h", "strobe/core/run_state.h",
    "strobe/core/sharded_checkpoint.h", "strobe/core/resume_compat.h", "strobe/core/optim.h",
    "strobe/config/experiment_parse.h", "strobe/config/saved_config.h", "strobe/distributed/strategy.h",
    "strobe/distributed/zero2.h", "strobe/logging/log_collector.h", "runner/experiment_builder.h", "runner/plugins.h",
]
# Setters the trainer calls on public classes (Module, DataLoader), and the engine's config parsers.
ENGINE_SETTERS = ["attach", "set_current_batch_size", "set_metric_sync", "set_limit_batches", "set_pin_memory",
                  "set_shuffle", "exclude_from", "set_strategy", "set_sharded", "parse_experiment", "parse_optimizer",
                  "parse_scheduler"]
failures = []
CONSUMER_YAML = """name: consumer
plugins: [{plugin}]
trainer:
  max_steps: 4
  max_epochs: -1
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  limit_val_batches: 0
  enable_progress_bar: false
  device: cpu
model:
  name: consumer_gated_mlp
  in_features: 64
  hidden: 16
  num_classes: 4
data:
  name: synthetic_images
  image_size: 8
  channels: 1
  num_classes: 4
  num_samples: 64
  batch_size: 8
  num_workers: 1
callbacks:
  - name: consumer_step_counter
"""


def cache(key):
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    return ""


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)


def check_headers(prefix):
    inc = os.path.join(prefix, "include")
    installed = set()
    for root, _, files in os.walk(inc):
        for f in files:
            installed.add(os.path.relpath(os.path.join(root, f), inc))
    if len(installed) < 10:
        failures.append(f"only {len(installed)} headers installed under {inc}")
    for h in sorted(installed):
        with open(os.path.join(inc, h)) as f:
            for n, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if m and os.path.isfile(os.path.join(SRC, m.group(1))) and m.group(1) not in installed:
                    failures.append(f"{h}:{n}: includes {m.group(1)}, which is not installed")
    for internal in ENGINE_HEADERS:
        if internal in installed:
            failures.append(f"engine header {internal} is installed")
    # The engine's setters of public classes stay private there (their one friend: EngineAccess).
    for h in sorted(installed):
        access = "public:"
        with open(os.path.join(inc, h)) as f:
            for n, line in enumerate(f, 1):
                m = ACCESS.match(line)
                if m:
                    access = m.group(1)
                for name in ENGINE_SETTERS:
                    if re.search(r"\b" + name + r"\s*\(", line) and access != "private:":
                        failures.append(f"{h}:{n}: the engine's {name} is {access.rstrip(':')} in an installed header")
    return installed


def configure(consumer, build_dir, prefix):
    torch_prefix = cache("CMAKE_PREFIX_PATH")
    # The compiles shared with earlier runs of this test (ccache, paths taken from the temporary folder).
    launcher = ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []
    return run(["cmake", "-S", consumer, "-B", build_dir, "-G", cache("CMAKE_GENERATOR") or "Ninja", *launcher,
                f"-DCMAKE_CXX_COMPILER={cache('CMAKE_CXX_COMPILER')}", f"-DCMAKE_PREFIX_PATH={prefix};{torch_prefix}",
                "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                # Ubuntu's GCC links --as-needed by default, which drops a linked plugin no symbol of
                # which is used: the package must keep it on every toolchain.
                "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed"])


def main():
    if not os.path.exists(os.path.join(BUILD, "lib", "libstrobe.so")):
        print(f"test_install: {BUILD} has no lib/libstrobe.so: build it first")
        return 1
    with tempfile.TemporaryDirectory(prefix="strobe-install-") as tmp:
        os.environ["CCACHE_BASEDIR"] = tmp
        prefix = os.path.join(tmp, "prefix")
        r = run(["cmake", "--install", BUILD, "--prefix", prefix])
        if r.returncode != 0:
            print(f"cmake --install failed:\n{r.stdout}\n{r.stderr}")
            return 1
        installed = check_headers(prefix)
        print(f"test_install: {len(installed)} headers installed, closed under their includes")

        mine = run([os.path.join(prefix, "bin", "strobe"), "list", "models"])
        built = run([os.path.join(BUILD, "bin", "strobe"), "list", "models"])
        if mine.returncode != 0 or mine.stdout != built.stdout or "mlp\n" not in mine.stdout:
            failures.append(f"the installed strobe lists {mine.stdout!r} (exit {mine.returncode}: {mine.stderr.strip()}), "
                            f"the build's {built.stdout!r}")

        consumer = os.path.join(tmp, "consumer")
        shutil.copytree(os.path.join(SRC, "tests", "install", "consumer"), consumer)
        cbuild = os.path.join(tmp, "consumer-build")
        r = configure(consumer, cbuild, prefix)
        if r.returncode != 0:
            print(f"configuring the consumer against {prefix} failed:\n{r.stdout}\n{r.stderr}")
            return 1
        r = run(["cmake", "--build", cbuild])
        if r.returncode != 0:
            print(f"building the consumer failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
            return 1
        with open(os.path.join(cbuild, "compile_commands.json")) as f:
            for entry in json.load(f):
                if SRC in entry["command"]:
                    failures.append(f"the consumer compiles with a path into the source tree: {entry['command']}")
        r = run([os.path.join(cbuild, "consumer")])
        print(r.stdout, end="")
        want = ["model consumer_gated_mlp: loss", "metric consumer_mae: 0.500000", 'callback consumer_step_counter: state {"steps":7}']
        if r.returncode != 0 or any(w not in r.stdout for w in want):
            failures.append(f"the consumer program: exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}")

        # The installed strobe loads the consumer's library as a plugin and trains its model with its callback.
        lib = os.path.join(cbuild, "libconsumer_components.so")
        r = run([os.path.join(prefix, "bin", "strobe"), "list", "models", "--plugin", lib])
        if r.returncode != 0 or "consumer_gated_mlp\n" not in r.stdout:
            failures.append(f"strobe list models --plugin {lib}: exit {r.returncode}, {r.stdout!r} {r.stderr!r}")
        exp = os.path.join(tmp, "consumer.yaml")
        with open(exp, "w") as f:
            f.write(CONSUMER_YAML.format(plugin=lib))
        r = run([os.path.join(prefix, "bin", "strobe"), "fit", "-c", exp, "--run-dir", os.path.join(tmp, "run")])
        if r.returncode != 0:
            failures.append(f"the installed strobe could not train the consumer's model: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        else:
            print("test_install: the installed strobe trained consumer_gated_mlp (plugin) for 4 steps")
            # The plugin's callback read each step's loss from the step's device record through the
            # installed headers (step_record.h, device_readback.h): the last one is the logged train/loss.
            m = re.search(r"consumer_step_counter: 4 steps; the last step's loss read from the device: (\S+) \((\d+) reads\)", r.stdout)
            logged = None
            for root, _, files in os.walk(os.path.join(tmp, "run")):
                if "metrics.csv" in files:
                    with open(os.path.join(root, "metrics.csv")) as f:
                        rows = list(csv.DictReader(f))
                    losses = [row["train/loss"] for row in rows if row.get("step") == "4" and row.get("train/loss")]
                    logged = float(losses[-1]) if losses else None
            if not m or m.group(2) != "4" or logged is None or abs(float(m.group(1)) - logged) > 1e-6 * max(1.0, abs(logged)):
                failures.append(f"the plugin callback's device reads: {m.group(0) if m else r.stdout!r}; logged train/loss at step 4: {logged}")
            else:
                print(f"test_install: the plugin callback read the step's loss from the device: {m.group(1)} (train/loss {logged})")

        # Another libtorch than the package records: refused at configure time, one line.
        def edited_package(name, pattern, replacement):
            """A copy of the installed package whose StrobeConfig.cmake has `pattern`'s match replaced
            (None, None when the config holds no match)."""
            pkg = os.path.join(tmp, name)
            shutil.copytree(prefix, pkg, symlinks=True)
            config = os.path.join(pkg, "lib", "cmake", "Strobe", "StrobeConfig.cmake")
            text = open(config).read()
            m = re.search(pattern, text)
            if m:
                with open(config, "w") as f:
                    f.write(text.replace(m.group(0), replacement))
            return (pkg, m) if m else (None, None)

        def expect_refused(r, want, what):
            lines = [l for l in r.stderr.splitlines() if "Strobe:" in l]
            if r.returncode == 0 or len(lines) != 1 or want not in lines[0]:
                failures.append(f"{what}: exit {r.returncode}, lines {lines}; want one line with {want!r}")
            else:
                print(f"test_install: refused: {lines[0].strip()}")

        # A plugin project written for 0.1 does not find this package: the API changed in 0.2 and the
        # package accepts only its own minor version (docs/EXTENDING.md, moving a plugin to 0.2).
        old = os.path.join(tmp, "consumer-0.1")
        shutil.copytree(consumer, old)
        lists = os.path.join(old, "CMakeLists.txt")
        text = open(lists).read()
        if "find_package(Strobe 0.2 REQUIRED)" not in text:
            failures.append("tests/install/consumer asks for no Strobe 0.2")
        with open(lists, "w") as f:
            f.write(text.replace("find_package(Strobe 0.2 REQUIRED)", "find_package(Strobe 0.1 REQUIRED)"))
        r = configure(old, os.path.join(tmp, "consumer-0.1-build"), prefix)
        if r.returncode == 0 or 'compatible with requested version "0.1"' not in " ".join(r.stderr.split()):
            failures.append(f"a project asking for Strobe 0.1 configured against 0.2: exit {r.returncode}\n{r.stderr[-1500:]}")
        else:
            print("test_install: a project asking for Strobe 0.1 does not find this 0.2 package")

        other, recorded = edited_package("other-prefix", r'set\(Strobe_TORCH_VERSION "([^"]+)"\)', 'set(Strobe_TORCH_VERSION "2.0.1")')
        if not recorded:
            failures.append("StrobeConfig.cmake records no libtorch version")
        else:
            expect_refused(configure(consumer, os.path.join(tmp, "other-build"), other),
                           f"Strobe: this Strobe was built with libtorch 2.0.1, but CMAKE_PREFIX_PATH finds libtorch {recorded.group(1)}",
                           "a package built with another libtorch")

        # No libtorch in CMAKE_PREFIX_PATH: the package finds the one Strobe was built with where the
        # build found it; where that is gone, one line names the Python whose torch prints the prefix.
        def configure_without_torch(pkg, build_dir):
            return run(["cmake", "-S", consumer, "-B", build_dir, "-G", cache("CMAKE_GENERATOR") or "Ninja",
                        f"-DCMAKE_CXX_COMPILER={cache('CMAKE_CXX_COMPILER')}", f"-DCMAKE_PREFIX_PATH={pkg}"])
        r = configure_without_torch(prefix, os.path.join(tmp, "no-torch-prefix"))
        if r.returncode != 0:
            failures.append(f"configuring with the package alone (no torch prefix): exit {r.returncode}\n{r.stderr[-2000:]}")
        python = re.search(r'set\(Strobe_TORCH_PYTHON "([^"]+)"\)', open(os.path.join(prefix, "lib", "cmake", "Strobe", "StrobeConfig.cmake")).read())
        gone, recorded = edited_package("gone-prefix", r'set\(Strobe_TORCH_DIR "([^"]+)"\)', 'set(Strobe_TORCH_DIR "/nonexistent/torch")')
        if not recorded or not python:
            failures.append("StrobeConfig.cmake records no libtorch directory or no Python")
        else:
            expect_refused(configure_without_torch(gone, os.path.join(tmp, "gone-build")),
                           f"the Python this Strobe was built with prints it: {python.group(1)} -c 'import torch; ",
                           "no libtorch to be found")

        # Public headers that differ from the installed Strobe's own (a virtual added to TrainerView, as a
        # newer or edited Strobe would have): the plugin rebuilt against them is refused before it loads,
        # instead of crashing in a shifted vtable.
        view = os.path.join(prefix, "include", "strobe", "core", "trainer_view.h")
        text = open(view).read()
        head = "class TrainerView {\n public:\n"
        if head not in text:
            failures.append(f"{view} has no '{head.strip()}' to add a virtual to")
        else:
            with open(view, "w") as f:
                f.write(text.replace(head, head + "  virtual void added_by_another_strobe() {}\n"))
            r = run(["cmake", "--build", cbuild])
            if r.returncode != 0:
                failures.append(f"rebuilding the consumer against edited headers failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
            r = run([os.path.join(prefix, "bin", "strobe"), "list", "models", "--plugin", lib])
            want = f"strobe: plugin error: plugin {lib}: built against other Strobe headers (fingerprint "
            if r.returncode != 2 or r.stdout or not r.stderr.startswith(want) or r.stderr.count("\n") != 1 \
                    or "rebuild it against this installation" not in r.stderr:
                failures.append(f"a plugin built against edited headers: exit {r.returncode}, {r.stdout!r} {r.stderr!r}; "
                                f"want exit 2 and one line starting {want!r}")
            else:
                print(f"test_install: refused: {r.stderr.strip()}")
    for f in failures:
        print(f)
    print(f"test_install: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
