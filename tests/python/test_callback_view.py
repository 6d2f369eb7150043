"""Callbacks compile against TrainerView only (strobe/core/trainer_view.h, docs/ARCHITECTURE.md).

Every source and header under callbacks/ is followed through its project #include lines, transitively;
reaching strobe/core/trainer.h from any of them fails, printed as the chain of includes that gets
there. The same rule holds for the headers a callback is written against (callback.h, trainer_view.h).

A self test then plants `#include "strobe/core/trainer.h"` two headers deep (into a copy of a header
a callback includes) and requires exactly that chain to be reported, so a check that cannot fail does
not pass.

The same rule holds for the step's path: the loops (loops.h, fit_loop.cpp, evaluation_loop.cpp), the
runners (step_runner.h/.cpp, graph_step.h/.cpp) and the step pipeline never reach trainer.h, and
their headers hold no std::function: the Trainer hands them objects (the runner, the optimizer, the
scheduler, the counters, the batch preparer, the strategy), never a callback of its own. Its self
test plants a std::function member into a copy of loops.h and requires it to be reported. Nor do
they reach trainer_view.h: they pass the callbacks' view on to the hooks (a forward-declared type)
but never call it, so nothing on the step's path calls back into the Trainer. Its self test plants
that include into a copy of fit_loop.cpp and requires the chain to be reported.

Second rule: the headers a component is written against (callback.h, datamodule.h and what they
include) bring no threading header (<thread>, <mutex>, <condition_variable>): the data loader's
workers stay behind its pimpl (strobe/data/loader.cpp). Its self test plants `#include <mutex>`
into a copy of strobe/data/loader.h and requires it to be reported.

Usage: test_callback_view.py (STROBE_SOURCE_DIR: the source tree; default: the working directory)."""
import os, re, shutil, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
FORBIDDEN = "strobe/core/trainer.h"
STEP_PATH = ["strobe/core/loops.h", "strobe/core/fit_loop.cpp", "strobe/core/evaluation_loop.cpp",
             "strobe/core/step_runner.h", "strobe/core/step_runner.cpp", "strobe/core/graph_step.h",
             "strobe/core/graph_step.cpp", "strobe/core/step_pipeline.h", "strobe/core/step_pipeline.cpp"]
ROOTS = ["callbacks", "strobe/core/callback.h", "strobe/core/trainer_view.h"] + STEP_PATH
STEP_PATH_HEADERS = [f for f in STEP_PATH if f.endswith(".h")]
CALLBACK_TYPE = re.compile(r"std::function\s*<")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
SYSTEM_INCLUDE = re.compile(r'^\s*#\s*include\s*<([^>]+)>')
COMPONENT_HEADERS = ["strobe/core/callback.h", "strobe/core/datamodule.h"]
THREADING = {"thread", "mutex", "condition_variable"}


def roots(src):
    out = []
    for r in ROOTS:
        path = os.path.join(src, r)
        if os.path.isdir(path):
            out += sorted(os.path.join(r, f) for f in os.listdir(path) if f.endswith((".cpp", ".h")))
        elif os.path.exists(path):
            out.append(r)
    return out


def includes(src, rel):
    """Project files `rel` includes: quoted includes that name a file of the tree (from its root or
    from rel's folder), as paths relative to the root."""
    out = []
    with open(os.path.join(src, rel), encoding="utf-8") as f:
        for line in f:
            m = INCLUDE.match(line)
            if not m:
                continue
            for cand in (m.group(1), os.path.normpath(os.path.join(os.path.dirname(rel), m.group(1)))):
                if os.path.isfile(os.path.join(src, cand)):
                    out.append(cand)
                    break
    return out


def chains(src, forbidden=FORBIDDEN, root_files=None):
    """[chain] for each root that reaches `forbidden`; a chain lists the files from the root to it."""
    found = []
    for root in (roots(src) if root_files is None else root_files):
        parent, todo = {root: None}, [root]
        while todo:
            cur = todo.pop()
            if cur == forbidden:
                chain = [cur]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                found.append(list(reversed(chain)))
                break
            for inc in includes(src, cur):
                if inc not in parent:
                    parent[inc] = cur
                    todo.append(inc)
    return found


def self_test(src):
    """Plants the forbidden include into a copy of strobe/core/loop_state.h (trainer_view.h includes
    it; every callback includes trainer_view.h) and requires every callback to report the chain."""
    tmp = tempfile.mkdtemp(prefix="strobe-callback-view-")
    try:
        for d in ("callbacks", "strobe", "models", "tasks", "data"):
            if os.path.isdir(os.path.join(src, d)):
                shutil.copytree(os.path.join(src, d), os.path.join(tmp, d),
                                ignore=shutil.ignore_patterns("*.cu", "*.cuh", "*.py", "*.md"))
        if chains(tmp):
            return ["self test: the copy of the tree already reaches trainer.h"]
        planted = os.path.join(tmp, "strobe/core/loop_state.h")
        with open(planted, "a", encoding="utf-8") as f:
            f.write('\n#include "strobe/core/trainer.h"\n')
        got = chains(tmp)
        reported = {c[0] for c in got}
        want = {r for r in roots(tmp) if r.startswith("callbacks/") and r.endswith(".cpp")}
        if not want or not want <= reported:
            return ["self test: a planted include of trainer.h was not reported for every callback",
                    f"  not reported: {sorted(want - reported)}"]
        for c in got:
            if c[-2:] != ["strobe/core/loop_state.h", FORBIDDEN]:
                return [f"self test: wrong chain {' -> '.join(c)}"]
        return []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


VIEW = "strobe/core/trainer_view.h"


def step_path_view_self_test(src):
    """Plants an include of trainer_view.h into a copy of fit_loop.cpp: exactly that chain is reported."""
    tmp = tempfile.mkdtemp(prefix="strobe-step-path-view-")
    try:
        shutil.copytree(os.path.join(src, "strobe"), os.path.join(tmp, "strobe"),
                        ignore=shutil.ignore_patterns("*.cu", "*.cuh", "*.py", "*.md"))
        if chains(tmp, VIEW, STEP_PATH):
            return ["self test: the copy of the tree already reaches trainer_view.h from the step path"]
        with open(os.path.join(tmp, "strobe/core/fit_loop.cpp"), "a", encoding="utf-8") as f:
            f.write('\n#include "strobe/core/trainer_view.h"\n')
        got = chains(tmp, VIEW, STEP_PATH)
        if got != [["strobe/core/fit_loop.cpp", VIEW]]:
            return [f"self test: a planted include of trainer_view.h in fit_loop.cpp was reported as {got}"]
        return []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def step_path_callbacks(src):
    """(header, line number) for each std::function in the step path's headers (comments aside)."""
    found = []
    for h in STEP_PATH_HEADERS:
        with open(os.path.join(src, h), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if CALLBACK_TYPE.search(line.split("//")[0]):
                    found.append((h, n))
    return found


def step_path_self_test(src):
    tmp = tempfile.mkdtemp(prefix="strobe-step-path-")
    try:
        os.makedirs(os.path.join(tmp, "strobe/core"))
        for h in STEP_PATH_HEADERS:
            shutil.copy(os.path.join(src, h), os.path.join(tmp, h))
        with open(os.path.join(tmp, "strobe/core/loops.h"), "a", encoding="utf-8") as f:
            f.write("\nstruct Planted { std::function<void()> run_batch; };\n")
        got = step_path_callbacks(tmp)
        if [h for h, _ in got] != ["strobe/core/loops.h"]:
            return [f"self test: a planted std::function in loops.h was reported as {got}"]
        return []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def threading_includes(src):
    """(header, system header) for each threading header reachable from COMPONENT_HEADERS."""
    found, seen, todo = [], set(COMPONENT_HEADERS), list(COMPONENT_HEADERS)
    while todo:
        cur = todo.pop()
        with open(os.path.join(src, cur), encoding="utf-8") as f:
            for line in f:
                m = SYSTEM_INCLUDE.match(line)
                if m and m.group(1) in THREADING:
                    found.append((cur, m.group(1)))
        for inc in includes(src, cur):
            if inc not in seen:
                seen.add(inc)
                todo.append(inc)
    return sorted(found)


def threading_self_test(src):
    tmp = tempfile.mkdtemp(prefix="strobe-component-headers-")
    try:
        for d in ("strobe", "data"):
            if os.path.isdir(os.path.join(src, d)):
                shutil.copytree(os.path.join(src, d), os.path.join(tmp, d),
                                ignore=shutil.ignore_patterns("*.cu", "*.cuh", "*.py", "*.md", "*.cpp"))
        with open(os.path.join(tmp, "strobe/data/loader.h"), "a", encoding="utf-8") as f:
            f.write("\n#include <mutex>\n")
        if ("strobe/data/loader.h", "mutex") not in threading_includes(tmp):
            return ["self test: a planted #include <mutex> in strobe/data/loader.h was not reported"]
        return []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    files = roots(SRC)
    if len([f for f in files if f.endswith(".cpp")]) < 5:
        print(f"test_callback_view: only {len(files)} callback files under {SRC}/callbacks")
        return 1
    found = chains(SRC)
    for c in found:
        print("callbacks compile against TrainerView only, but: " + " -> ".join(c))
    print(f"test_callback_view: {len(files)} files checked, {len(found)} reach {FORBIDDEN}")
    if found:
        return 1
    problems = self_test(SRC)
    if problems:
        print("\n".join(problems))
        return 1
    print("test_callback_view: self test: a planted include of trainer.h is reported with its chain")
    missing = [f for f in STEP_PATH if not os.path.exists(os.path.join(SRC, f))]
    if missing:
        print(f"the step path's files are not where this test looks: {missing}")
        return 1
    cbs = step_path_callbacks(SRC)
    for h, n in cbs:
        print(f"the step path is handed objects, not callbacks, but {h}:{n} holds a std::function")
    if cbs:
        return 1
    problems = step_path_self_test(SRC)
    if problems:
        print("\n".join(problems))
        return 1
    print(f"test_callback_view: the step path ({len(STEP_PATH)} files) holds no std::function; self test: a planted one is reported")
    up = chains(SRC, VIEW, STEP_PATH)
    for c in up:
        print("the step path never calls back into the Trainer, but: " + " -> ".join(c))
    if up:
        return 1
    problems = step_path_view_self_test(SRC)
    if problems:
        print("\n".join(problems))
        return 1
    print("test_callback_view: the step path does not reach trainer_view.h; self test: a planted include is reported")
    bad = threading_includes(SRC)
    for header, sys_header in bad:
        print(f"a component's headers include no threading header, but {header} includes <{sys_header}>")
    if bad:
        return 1
    problems = threading_self_test(SRC)
    if problems:
        print("\n".join(problems))
        return 1
    print("test_callback_view: no threading header under callback.h or datamodule.h; self test: a planted one is reported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
