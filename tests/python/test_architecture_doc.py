"""docs/ARCHITECTURE.md names what is in the code: a reader who follows a name finds it.

- The state table ('The state connector') lists the checkpoint's entries in the connector's one order:
  StateConnector::kOrder (strobe/core/state_connector.cpp), its names resolved through
  strobe/checkpoint/checkpoint_keys.h. The checkpoint layout table names every one of them.
- The floors table lists the floors in the order tests/python/test_floors.py enforces them.
- Every file the page names exists: a path (`strobe/core/loops.h`, tests/python/test_floors.py) in
  the tree, a bare file name (`fit_loop.cpp`) somewhere in it.
- Every qualified name the page spells as Class::member (`StepPipeline::step`, `Strategy::setup_optimizer`)
  is declared: the member's name appears in a project file that declares the class (or namespace).
- Every type the page spells in backticks as a CamelCase name (`FitLoop`, `CheckpointView`) is
  declared as a class, struct, enum or alias in the project's sources.

A self test plants a missing file, a missing member, a missing type and an entry out of order into a
copy of the page's text and requires exactly those four findings, so a check that cannot fail does not
pass.

Usage: test_architecture_doc.py (STROBE_SOURCE_DIR: the source tree; default: the working directory)."""
import os, re, subprocess, sys

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
DOC = "docs/ARCHITECTURE.md"
SOURCE_EXT = (".h", ".cpp", ".cu", ".cuh")
FILE_EXT = r"(?:h|cpp|cu|cuh|py|sh|yaml|md|txt|cmake|in|ckpt|json)"
# Names from outside the project the page may spell (libtorch, PyTorch, Lightning, CUDA).
EXTERNAL_NAMESPACES = {"at", "torch", "c10", "std", "cuda", "Strobe"}  # Strobe::: CMake's imported targets
# What a run writes (the run directory), not files of the tree.
RUN_FILES = {"last.ckpt", "config.yaml", "config.json", "metrics.csv"}
EXTERNAL_TYPES = {"CUDAGraph", "LightningModule", "GradScaler", "TCPStore", "DataLoader", "CMakeLists"}


def tree_files(src):
    """The project's files (git's list when the tree is a checkout, else a walk), relative paths."""
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, check=True).stdout
        files = [f for f in out.splitlines() if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("build")]
        files += [os.path.relpath(os.path.join(root, n), src) for n in names]
    return files


def read(src, rel):
    with open(os.path.join(src, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def table_after(text, header):
    """The rows (lists of cells) of the markdown table whose header line starts with `header`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    return None


def connector_order(src):
    keys = dict(re.findall(r'inline constexpr const char\* (k\w+) = "([^"]+)"', read(src, "strobe/checkpoint/checkpoint_keys.h")))
    body = re.search(r"kOrder\(\)\s*\{.*?=\s*\{(.*?)\};", read(src, "strobe/core/state_connector.cpp"), re.S).group(1)
    return [keys[k] for k in re.findall(r"checkpoint_keys::(k\w+)", body)]


def entries_of(cell):
    """The entry names of a table's first cell: its backticked words outside parentheses."""
    depth, outside = 0, ""
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            outside += ch
        depth -= ch == ")" and depth > 0
    ticked = re.findall(r"`([a-z_]+)`", outside)
    return ticked or [w.strip() for w in outside.split(",") if re.fullmatch(r"[a-z_]+", w.strip())]


def findings(text, src, files, sources):
    out = []
    # The state table, in the connector's order; the layout table, every entry.
    order = connector_order(src)
    state = table_after(text, "| entry | the object that saves it |")
    if state is None:
        out.append("no state table ('| entry | the object that saves it | restored |')")
    else:
        listed = [e for row in state for e in entries_of(row[0])]
        if listed != order:
            out.append(f"the state table lists {listed}, the connector's order (StateConnector::kOrder) is {order}")
    layout = table_after(text, "| entry | keys |")
    if layout is None:
        out.append("no checkpoint layout table ('| entry | keys |')")
    else:
        named = {e for row in layout for e in entries_of(row[0])}
        for e in order:
            if e not in named:
                out.append(f"the checkpoint layout table has no row for the entry '{e}'")
    # The floors, bottom up, as test_floors.py enforces them.
    floors_py = read(src, "tests/python/test_floors.py")
    enforced = re.findall(r'"([a-z ]+)"', re.search(r"FLOORS = \[(.*?)\]", floors_py, re.S).group(1))
    floors = table_after(text, "| floor | folders | target |")
    if floors is None:
        out.append("no floors table ('| floor | folders | target | ...')")
    elif [r[0] for r in floors] != enforced:
        out.append(f"the floors table lists {[r[0] for r in floors]}, test_floors.py enforces {enforced}")
    # Files.
    fileset = set(files)
    basenames = {os.path.basename(f) for f in files}
    dirs = {os.path.dirname(f) for f in files}
    for name in sorted(set(re.findall(r"(?<![\w/.$<-])((?:[\w.-]+/)*[\w.-]+\." + FILE_EXT + r")(?![\w/])", text))):
        if name.startswith(("../", "http")) or os.path.basename(name) in RUN_FILES:
            continue
        if "/" in name:
            ok = name in fileset or any(f.endswith("/" + name) for f in files)
        else:
            ok = name in basenames
        if not ok:
            out.append(f"{DOC} names the file {name}, which is not in the tree")
    for name in sorted(set(re.findall(r"`((?:strobe|tests|bench|runner|models|tasks|data|callbacks|apps|cmake|scripts|examples)/[\w/]*)/?`", text))):
        if name.rstrip("/") not in dirs and not any(d.startswith(name.rstrip("/") + "/") for d in dirs) and name not in fileset:
            out.append(f"{DOC} names the folder {name}, which is not in the tree")
    # Class::member.
    declared = {}
    for rel, body in sources.items():
        for kind, name in re.findall(r"\b(class|struct|namespace|enum class|enum)\s+(?:\w+::)*(\w+)", body):
            declared.setdefault(name, []).append(rel)
    types = set(declared) | {n for body in sources.values() for n in re.findall(r"\busing\s+(\w+)\s*=", body)}
    types |= {n for body in sources.values() for n in re.findall(r"\bTEST(?:_F|_P)?\((\w+),", body)}  # test suites
    for qual in sorted(set(re.findall(r"\b((?:[A-Za-z_]\w*::)+[A-Za-z_]\w*)", text))):
        parts = qual.split("::")
        if parts[0] in EXTERNAL_NAMESPACES:
            continue
        owner, member = parts[-2], parts[-1]
        if owner not in declared:
            out.append(f"{DOC} names {qual}, but no project file declares {owner}")
        elif not any(re.search(r"\b" + re.escape(member) + r"\b", sources[f]) for f in declared[owner]):
            out.append(f"{DOC} names {qual}, but no file declaring {owner} has '{member}'")
    # Types in backticks.
    for name in sorted(set(re.findall(r"`([A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]+)`", text))):
        if name in EXTERNAL_TYPES or name in types:
            continue
        out.append(f"{DOC} names the type {name}, which no project source declares")
    return out


def main():
    files = tree_files(SRC)
    sources = {f: read(SRC, f) for f in files
               if f.endswith(SOURCE_EXT) and not f.startswith(("build", "third_party")) and os.path.exists(os.path.join(SRC, f))}
    text = read(SRC, DOC)
    real = findings(text, SRC, files, sources)
    for f in real:
        print(f)
    # The self test: four planted faults, four findings.
    planted = text.replace("`model` (parameters and buffers)", "`model` (parameters and buffers), `rng`", 1)
    planted += ("\nPlanted: `strobe/core/no_such_file.h`, `StepPipeline::no_such_member`, `NoSuchType`.\n")
    self_found = [f for f in findings(planted, SRC, files, sources) if f not in real]
    expected = ["the state table lists", "no_such_file.h", "StepPipeline::no_such_member", "NoSuchType"]
    missed = [e for e in expected if not any(e in f for f in self_found)]
    if missed or len(self_found) != len(expected):
        print(f"self test: the planted faults were not reported exactly: missed {missed}, found {self_found}")
        return 1
    if real:
        return 1
    print(f"{DOC}: every file, Class::member and type it names exists; the state table is the connector's order; "
          f"the floors are test_floors.py's (self test: 4 planted faults found)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
