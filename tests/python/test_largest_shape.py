"""bench/distributed/largest_shape.sh (docs/PERFORMANCE.md, "The largest Llama that trains on 80 GB
GPUs") answers with the deepest model that trains: it bisects between LO and HI, counts a run that
ends out of memory as "does not fit", and stops (exit 1) on any other failure, which is no answer
about memory. Run here over a stand-in for `strobe bench step` on every rank that trains up to a
known depth and runs out of memory past it, as strobe does under --memory-limit-gib."""
import json, os, stat, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
SCRIPT = os.path.join(SRC, "bench", "distributed", "largest_shape.sh")
failures = []

FAKE = r"""#!/usr/bin/env bash
# A stand-in for strobe bench step: depth <= FIT trains, deeper runs out of memory; CRASH_AT crashes.
args="$*"
depth=$(echo "$args" | grep -o 'model.depth=[0-9]*' | cut -d= -f2)
json=$(echo "$args" | grep -o -- '--json [^ ]*' | cut -d' ' -f2)
echo "$args" | grep -q -- '--memory-limit-gib 78 ' || { echo "no cap in: $args" >&2; exit 9; }
echo "$RANK $depth" >> "$TRIALS"
if [ "$depth" = "${CRASH_AT:-none}" ]; then echo "strobe: error: something else broke" >&2; exit 1; fi
if [ "$depth" -le "$FIT" ]; then
  echo '{"suites":{"step":{"workloads":[{"ms":{"mean":1000},"peak_memory_gib":70,"peak_reserved_gib":72,"state_memory_gib":60,"device_used_gib":73.5,"reserved_gib":72}]}}}' > "$json"
  exit 0
fi
echo "strobe bench: out of memory under --memory-limit-gib 78 (CUDA out of memory. Tried to allocate 2.00 GiB)" >&2
exit 1
"""


def run(tmp, fit, lo, hi, crash_at=None):
    fake = os.path.join(tmp, "strobe")
    with open(fake, "w") as f:
        f.write(FAKE)
    os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
    trials = os.path.join(tmp, f"trials_{fit}_{lo}_{hi}_{crash_at}")
    env = dict(os.environ, FIT=str(fit), TRIALS=trials)
    if crash_at is not None:
        env["CRASH_AT"] = str(crash_at)
    out = os.path.join(tmp, f"out_{fit}_{lo}_{hi}_{crash_at}")
    p = subprocess.run(["bash", SCRIPT, fake, "2", out, "strobe", str(lo), str(hi)], env=env,
                       capture_output=True, text=True, timeout=30)
    lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    with open(trials) as f:
        tried = [tuple(map(int, l.split())) for l in f]
    return p, lines, tried


with tempfile.TemporaryDirectory() as tmp:
    # Bisection: 41 fits, 42 does not; both ranks run every trial.
    p, lines, tried = run(tmp, fit=41, lo=32, hi=56)
    if p.returncode != 0:
        failures.append(f"search exited {p.returncode}: {p.stderr[-500:]}")
    else:
        last = lines[-1]
        if last.get("largest_depth") != 41:
            failures.append(f"largest_depth {last.get('largest_depth')}, expected 41: {last}")
        d = 41
        if last.get("params") != d * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096:
            failures.append(f"params {last.get('params')} is not 41 layers of width 4096 with the untied vocabulary")
        depths = [r["depth"] for r in lines[:-1]]
        if depths != [32, 56, 44, 38, 41, 42]:
            failures.append(f"trials {depths}, expected the bisection 32, 56, 44, 38, 41, 42")
        if any(r["trains"] != (r["depth"] <= 41) for r in lines[:-1]):
            failures.append(f"a trial's verdict is wrong: {lines[:-1]}")
        if sorted(r for r, _ in tried) != sorted([0, 1] * len(depths)):
            failures.append(f"not every rank ran every trial: {tried}")
        fit_row = next(r for r in lines if r.get("depth") == 32)
        if abs(fit_row.get("outside_allocator_gib", -1) - 1.5) > 1e-9:
            failures.append(f"outside_allocator_gib is device_used - reserved (1.5): {fit_row}")

    # LO that does not fit: said, no bisection.
    p, lines, tried = run(tmp, fit=20, lo=32, hi=56)
    if p.returncode != 0 or lines[-1].get("largest_depth") is not None or len(lines) != 2:
        failures.append(f"LO out of memory: expected one trial and largest_depth null, got rc {p.returncode}: {lines}")

    # A crash that is not out of memory stops the search with exit 1 and shows the log.
    p, lines, tried = run(tmp, fit=41, lo=32, hi=56, crash_at=44)
    if p.returncode != 1 or "something else broke" not in p.stderr or any("largest_depth" in l for l in lines):
        failures.append(f"a crash at 44 must stop the search (exit 1, its log shown), got rc {p.returncode}: {lines} {p.stderr[-300:]}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
