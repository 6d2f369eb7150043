"""No include runs back up a floor (docs/ARCHITECTURE.md, 'Floors'). The framework is built in floors,
each allowed to include only its own floor and those below it; this check reads the real include graph
from the build's dependency data (`ninja -t deps`: the headers each object was compiled with, so an
include inside an #if counts exactly when it was compiled) and, for every project file an object was
compiled from, each `#include` line whose header that object also compiled. An include from a file of
one floor into a higher floor fails, printed as file:line with both floors.

After the real check, a self test plants a back include (strobe/data/batch.h including
runner/replay.h) into a copy of the real tree and graph and requires exactly that violation, so a check
that cannot fail does not pass. docs/ARCHITECTURE.md's floors table says which lower floors each floor
includes today: that column must be the graph's, floor by floor (a floor dropped from a row in a copy
of it must be reported). Last, no program that links libstrobe.so holds a second copy of its
code (a floor's objects linked into a program as well: two copies of its statics, registries included).

Usage: test_floors.py [--graph FILE] (FILE: saved `ninja -t deps` output instead of the build's)."""
import os, re, shutil, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.path.realpath(os.environ.get("STROBE_BUILD_DIR", "build"))

# Bottom up. A file's floor is that of the longest matching prefix; None: above every floor (the CLI,
# benchmarks, tests and helper programs may include anything).
FLOORS = ["ops", "config", "checkpoint", "metrics", "logging", "data core", "distributed", "core",
          "components", "runner"]
PREFIXES = {
    "strobe/ops/": "ops",
    "strobe/config/": "config",
    "strobe/checkpoint/": "checkpoint",
    "strobe/checkpoint/tools/": None,
    "strobe/metrics/": "metrics",
    "strobe/metrics/tools/": None,
    "strobe/logging/": "logging",
    "strobe/logging/tensorboard/tools/": None,
    "strobe/data/": "data core",
    "strobe/distributed/": "distributed",
    "strobe/core/": "core",
    "strobe/strobe.h": "core",  # the umbrella: the public headers of the core floor and below
    "models/": "components",
    "models/tools/": None,
    "tasks/": "components",
    "callbacks/": "components",
    "data/": "components",
    "data/tools/": None,
    "runner/": "runner",
    "apps/": None,
    "bench/": None,
    "tests/": None,
    "cmake/": None,
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]')


def floor_of(rel):
    """The floor of a path relative to the source tree; raises for a project file under no prefix."""
    best = None
    for prefix in PREFIXES:
        if rel.startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    if best is None:
        raise KeyError(rel)
    return PREFIXES[best]


def parse_deps(text, build):
    """`ninja -t deps` output -> {object: set of absolute, normalised paths}."""
    graph, current = {}, None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            current = line.split(": #deps")[0]
            graph[current] = set()
        else:
            graph[current].add(os.path.normpath(os.path.join(build, line.strip())))
    return graph


def violations(graph, src, build, edges=None):
    """[(file, line, included, floor, included floor, message)] for every include up a floor. `edges`,
    when given (a dict), gets floor -> the set of lower floors it includes."""
    src = src.rstrip("/") + "/"
    found, unplaced, includes = {}, set(), {}  # includes: path -> [(line, spelled)], each file read once
    for obj, deps in graph.items():
        for path in deps:
            if not path.startswith(src) or path.startswith(build.rstrip("/") + "/"):
                continue
            rel = path[len(src):]
            try:
                mine = floor_of(rel)
            except KeyError:
                unplaced.add(rel)
                continue
            if mine is None:
                continue
            if path not in includes:
                with open(path, errors="replace") as f:
                    includes[path] = [(number, m.group(1)) for number, m in
                                      ((n, INCLUDE.match(t)) for n, t in enumerate(f, 1)) if m]
            for number, spelled in includes[path]:
                # Project includes are spelled from the source root; a few are relative to the file.
                target = None
                for candidate in (os.path.join(src, spelled), os.path.join(os.path.dirname(path), spelled)):
                    candidate = os.path.normpath(candidate)
                    if candidate in deps:
                        target = candidate
                        break
                if target is None or not target.startswith(src):
                    continue  # a system header, or not compiled in this object (an inactive #if)
                theirs = floor_of(target[len(src):])
                if theirs is None:
                    found[(rel, number)] = (rel, number, target[len(src):], mine, "(above every floor)")
                elif FLOORS.index(theirs) > FLOORS.index(mine):
                    found[(rel, number)] = (rel, number, target[len(src):], mine, theirs)
                elif edges is not None and theirs != mine:
                    edges.setdefault(mine, set()).add(theirs)
    out = []
    for key in sorted(found):
        rel, number, inc, mine, theirs = found[key]
        out.append(f"{rel}:{number}: includes {inc}: floor '{mine}' includes floor '{theirs}' above it")
    out += [f"{rel}: in no floor (add its directory to tests/python/test_floors.py and docs/ARCHITECTURE.md)"
            for rel in sorted(unplaced)]
    return out


def documented_edges(text):
    """docs/ARCHITECTURE.md's floors table: floor -> the floors its 'includes today' cell names."""
    out, rows = {}, False
    for line in text.splitlines():
        if line.startswith("| floor | folders | target |"):
            rows = True
            continue
        if rows and line.startswith("| ---"):
            continue
        if rows and not line.startswith("|"):
            break
        if rows:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            bare = re.sub(r"\([^)]*\)", "", cells[3])
            out[cells[0]] = {w.strip() for w in bare.split(",") if w.strip() in FLOORS}
    return out


def edge_problems(real, documented):
    out = []
    for floor in FLOORS:
        have, said = real.get(floor, set()), documented.get(floor)
        if said is None:
            out.append(f"docs/ARCHITECTURE.md's floors table has no row for the floor '{floor}'")
        elif have != said:
            out.append(f"docs/ARCHITECTURE.md says floor '{floor}' includes {sorted(said) or 'no floor'}; "
                       f"the build's include graph says {sorted(have) or 'no floor'}")
    return out


def self_test(graph):
    """Plants strobe/data/batch.h -> runner/replay.h in a copy of the tree; only that may be found."""
    planted_from, planted_to = "strobe/data/batch.h", "runner/replay.h"
    src_abs, to_abs = os.path.join(SRC, planted_from), os.path.join(SRC, planted_to)
    users = [obj for obj, deps in graph.items() if src_abs in deps]
    if not users or not os.path.exists(to_abs):
        return [f"self test: no object compiles {planted_from} (or {planted_to} is gone): update the plant"]
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "src")
        files = {p for deps in graph.values() for p in deps if p.startswith(SRC + "/")
                 and not p.startswith(BUILD + "/")}
        for p in files | {to_abs}:
            dst = os.path.join(copy, os.path.relpath(p, SRC))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(p, dst)
        copied = {obj: {os.path.join(copy, os.path.relpath(p, SRC)) if p in files else p for p in deps}
                  for obj, deps in graph.items()}
        # A clean copy is clean; then the planted line, compiled where batch.h is (as the compiler
        # would list it), must be the one violation, at its line.
        before = violations(copied, copy, BUILD)
        if before:
            return ["self test: the copy of the tree is not clean:"] + before
        planted = os.path.join(copy, planted_from)
        with open(planted) as f:
            lines = f.readlines()
        at = next(i for i, l in enumerate(lines) if l.startswith("#include")) + 1
        lines.insert(at, f'#include "{planted_to}"\n')
        with open(planted, "w") as f:
            f.writelines(lines)
        for obj in users:
            copied[obj].add(os.path.join(copy, planted_to))
        got = violations(copied, copy, BUILD)
        want = [f"{planted_from}:{at + 1}: includes {planted_to}: floor 'data core' includes floor 'runner' above it"]
        if got != want:
            return ["self test: planted back include not reported as expected", f"  want: {want}", f"  got:  {got}"]
        # The same line in an inactive #if (the header not compiled with it) is not an include.
        for obj in users:
            copied[obj].discard(os.path.join(copy, planted_to))
        got = violations(copied, copy, BUILD)
        if got:
            return ["self test: an include that was not compiled was reported"] + got
    return []


def duplicated_code(bin_dir, library):
    """Programs that link `library` and also hold a strong definition of one of its C++ symbols (the
    objects of a floor linked into the program a second time: two copies of its statics)."""
    def strong(args):
        out = subprocess.run(["nm", "--defined-only", "-P"] + args, check=True, capture_output=True,
                             text=True).stdout
        return {f.split()[0] for f in out.splitlines() if len(f.split()) > 1 and f.split()[1] in "TDBR"
                and f.startswith("_Z")}
    mine = strong(["-D", library])
    found, checked = [], 0
    for name in sorted(os.listdir(bin_dir)):
        path = os.path.join(bin_dir, name)
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        if f"[{os.path.basename(library)}]" not in needed:
            continue
        checked += 1
        both = sorted(strong([path]) & mine)
        if both:
            names = subprocess.run(["c++filt"] + both[:3], capture_output=True, text=True).stdout.split("\n")
            found.append(f"{path}: {len(both)} symbols of {os.path.basename(library)} defined again, e.g. "
                         + "; ".join(n for n in names if n))
    return found, checked


def main():
    if "--graph" in sys.argv:
        with open(sys.argv[sys.argv.index("--graph") + 1]) as f:
            text = f.read()
    else:
        if not os.path.exists(os.path.join(BUILD, "build.ninja")):
            print(f"test_floors: {BUILD} is not a Ninja build (the check reads `ninja -t deps`)")
            return 1
        text = subprocess.run(["ninja", "-C", BUILD, "-t", "deps"], check=True, capture_output=True,
                              text=True).stdout
    graph = parse_deps(text, BUILD)
    objects = [o for o, deps in graph.items() if any(p.startswith(SRC + "/strobe/") for p in deps)]
    if len(objects) < 20:
        print(f"test_floors: only {len(objects)} objects with dependency data in {BUILD}: build it first")
        return 1
    problems = violations(graph, SRC, BUILD)
    for p in problems:
        print(p)
    print(f"test_floors: {len(graph)} objects, floors bottom up: {', '.join(FLOORS)}; "
          f"{len(problems)} include(s) up a floor")
    if problems:
        return 1
    # What each floor includes today, as the documentation's table says it; its self test: one floor
    # dropped from a row must be reported.
    edges = {}
    violations(graph, SRC, BUILD, edges)
    with open(os.path.join(SRC, "docs", "ARCHITECTURE.md")) as f:
        documented = documented_edges(f.read())
    problems = edge_problems(edges, documented)
    if problems:
        print("\n".join(problems))
        return 1
    planted = {k: set(v) for k, v in documented.items()}
    planted["runner"].discard("core")
    found = edge_problems(edges, planted)
    if len(found) != 1 or "floor 'runner'" not in found[0]:
        print(f"self test: a floor dropped from the table's 'includes today' was not reported as one problem: {found}")
        return 1
    print("test_floors: the floors table's 'includes today' is the build's include graph")
    problems = self_test(graph)
    if problems:
        print("\n".join(problems))
        return 1
    print("test_floors: self test: a planted back include is reported at its line")
    library = os.path.join(BUILD, "lib", "libstrobe.so")
    problems, checked = duplicated_code(os.path.join(BUILD, "bin"), library)
    for p in problems:
        print(p)
    if checked < 5:
        print(f"test_floors: only {checked} programs in {BUILD}/bin link {library}")
        return 1
    print(f"test_floors: {checked} programs link libstrobe.so, {len(problems)} hold a copy of its code")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
