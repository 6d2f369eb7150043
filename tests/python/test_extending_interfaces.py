"""docs/EXTENDING.md lists the public members of every interface a plugin implements ('The
interfaces, member by member'): for each class, the block there holds exactly the declarations its
header has (comments, default bodies and parameter-name comments dropped), so the page cannot fall
behind the headers. `python3 tests/python/test_extending_interfaces.py --print` prints the blocks."""
import os, re, sys

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
INTERFACES = [  # (class, header): what a plugin implements
    ("Model", "strobe/core/model.h"),
    ("Module", "strobe/core/module.h"),
    ("DataModule", "strobe/core/datamodule.h"),
    ("Dataset", "strobe/data/dataset.h"),
    ("Callback", "strobe/core/callback.h"),
    ("Metric", "strobe/metrics/metric.h"),
]


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def class_body(text, name):
    m = re.search(r"\bclass\s+" + name + r"\b[^;{]*\{", text)
    if not m:
        raise SystemExit(f"class {name} not found")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def matching(text, i, open_, close):
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    while True:
        depth += (text[i] == open_) - (text[i] == close)
        i += 1
        if depth == 0:
            return i


def declarations(name, header):
    body = class_body(strip_comments(open(os.path.join(SRC, header)).read()), name)
    out, access, i, start = [], "private", 0, 0
    while i < len(body):
        c = body[i]
        m = re.match(r"\s*(public|protected|private)\s*:(?!:)", body[start:]) if i == start else None
        if m:
            access, i = m.group(1), start + m.end()
            start = i
            continue
        if c == "(":
            i = matching(body, i, "(", ")")
            continue
        if c in "{;":
            stmt = " ".join(body[start:i].split())
            if c == "{":
                i = matching(body, i, "{", "}")
                if i < len(body) and body[i] == ";":
                    i += 1
            else:
                i += 1
            start = i
            if access == "private" or "(" not in stmt or "operator" in stmt or stmt.endswith("= delete") or \
                    re.match(r"(using|friend|struct|enum|class|typedef|static_assert)\b", stmt):
                continue
            fn = re.search(r"([~\w]+)\s*\(", stmt).group(1)
            if fn in (name, "~" + name) or stmt.startswith("explicit "):
                continue  # constructors and the destructor
            stmt = stmt.replace("( ", "(").replace(" )", ")").replace(" ,", ",") + ";"
            out.append(stmt if access == "public" else "protected: " + stmt)
            continue
        i += 1
    return out


def doc_blocks():
    text = open(os.path.join(SRC, "docs", "EXTENDING.md")).read()
    blocks = {}
    for m in re.finditer(r"```cpp\n// strobe::(?:metrics::)?(\w+) \(([^)]*)\)\n(.*?)```", text, re.S):
        blocks[m.group(1)] = (m.group(2), [l for l in m.group(3).splitlines() if l.strip()])
    return blocks


def expected_block(name, header):
    ns = "strobe::metrics::" if "metrics/" in header else "strobe::"
    return f"```cpp\n// {ns}{name} ({header})\n" + "\n".join(declarations(name, header)) + "\n```"


if "--print" in sys.argv:
    for name, header in INTERFACES:
        print(expected_block(name, header) + "\n")
    sys.exit(0)

failures = []
blocks = doc_blocks()
for name, header in INTERFACES:
    want = declarations(name, header)
    if not want:
        failures.append(f"{header}: no public member of {name} found (the parser lost its way)")
    got = blocks.get(name)
    if got is None:
        failures.append(f"docs/EXTENDING.md has no block for {name}; it should read:\n{expected_block(name, header)}")
    elif got[0] != header or got[1] != want:
        missing = [d for d in want if d not in got[1]]
        extra = [d for d in got[1] if d not in want]
        failures.append(f"docs/EXTENDING.md's block for {name} is not {header}'s public members "
                        f"(missing {missing}, not in the header {extra}); it should read:\n{expected_block(name, header)}")
for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
