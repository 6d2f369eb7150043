"""logger.mlflow (docs/CONFIG.md, "logger") against a real MLflow tracking server, read back with the
mlflow Python client. The test starts `mlflow server` on 127.0.0.1 (a free port, SQLite, a temporary
folder) and checks:
1. A fit: every metric value and step equal to metrics.csv's, the params (the resolved config,
   flattened), tags, status FINISHED, artifacts config.yaml and model_summary.txt (byte for byte).
2. A resume continues the same MLflow run (its id in the checkpoint), which ends FINISHED.
3. The server stopped (SIGSTOP) once the MLflow run exists and until the training ends: the steps
   after the stop (from the first checkpoint written after it to step 60, at least 24 steps) take as
   long as the same steps without the logger (under 2x + 1 s, a bound for a loaded CI machine: a
   logger that waited for the server would wait 2 s, its request timeout, on every step's row) and,
   once the server resumes, everything arrives.
4. The server killed mid-run: the fit ends normally, the rest is in mlflow_unsent.jsonl with one
   warning line; after a restart `strobe mlflow-sync` sends it (then metrics equal metrics.csv's) and
   removes the file.
5. An unreachable server at the start: one warning line, the run trains, the sync creates the run.
6. SIGTERM: the MLflow run ends KILLED.
7. Bad input (one line, exit 2, before training): a tracking_uri that is not http(s), an empty
   experiment name, on_unreachable: error with nothing listening; mlflow-sync without a spool file.

Usage: test_mlflow.py (STROBE_SOURCE_DIR, STROBE_BIN). Needs mlflow (scripts/setup.sh installs it):
without it the test fails under CI (CI=true), else it is skipped."""
import csv, math, os, signal, socket, subprocess, sys, tempfile, time, urllib.request

SRC = os.environ.get("STROBE_SOURCE_DIR", os.getcwd())
STROBE = os.environ.get("STROBE_BIN", os.path.join(SRC, "build", "bin", "strobe"))
try:
    import mlflow
    from mlflow.tracking import MlflowClient
except ImportError as e:
    print(f"test_mlflow: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)
MLFLOW = os.path.join(os.path.dirname(sys.executable), "mlflow")

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


tmp = tempfile.mkdtemp(prefix="strobe_mlflow_")
PORT = free_port()
URI = f"http://127.0.0.1:{PORT}"


def start_server():
    log = open(os.path.join(tmp, "server.log"), "a")
    p = subprocess.Popen([MLFLOW, "server", "--host", "127.0.0.1", "--port", str(PORT), "--workers", "1",
                          "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", f"{tmp}/artifacts"],
                         stdout=log, stderr=log, start_new_session=True)
    for _ in range(240):
        try:
            urllib.request.urlopen(URI + "/health", timeout=1)
            return p
        except Exception:
            if p.poll() is not None:
                break
            time.sleep(0.5)
    print(open(os.path.join(tmp, "server.log")).read()[-3000:])
    sys.exit("test_mlflow: mlflow server did not start")


def stop_server(p, sig=signal.SIGTERM):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def config(name, extra_logger="", epochs=2, samples=96, hidden="[32, 16]", features=64, image=8, channels=1):
    path = os.path.join(tmp, name + ".yaml")
    with open(path, "w") as f:
        f.write(f"""name: {name}
seed: 3
trainer: {{max_epochs: {epochs}, device: cpu, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false}}
model: {{name: mlp, in_features: {features}, hidden: {hidden}, num_classes: 4}}
data: {{name: synthetic_images, image_size: {image}, channels: {channels}, num_classes: 4, num_samples: {samples},
        num_val_samples: 16, batch_size: 8, num_workers: 0}}
optimizer: {{name: adamw, lr: 0.01}}
callbacks: [{{name: model_checkpoint, every_n_steps: 6, save_top_k: -1}}, {{name: lr_monitor}}]
logger:
  mlflow: {{tracking_uri: {URI}, experiment_name: strobe-test, tags: {{team: vision, purpose: "check"}}{extra_logger}}}
""")
    return path


def fit(cfg, rundir, *extra, wait=True):
    args = [STROBE, "fit", "-c", cfg, "--run-dir", rundir, *extra]
    if not wait:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, capture_output=True, text=True)


def csv_metrics(rundir):
    out = {}
    for r in csv.DictReader(open(os.path.join(rundir, "metrics.csv"))):
        for k, v in r.items():
            if k in ("step", "epoch") or v == "":
                continue
            out.setdefault(k, []).append((int(r["step"]), float(v)))
    return out


def run_of(rundir):
    client = MlflowClient(tracking_uri=URI)
    exp = client.get_experiment_by_name("strobe-test")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`strobe.run_dir` = '{os.path.abspath(rundir)}'")
    return client, (runs[0] if len(runs) == 1 else None), len(runs)


def same_metrics(client, run_id, rundir, label):
    want = csv_metrics(rundir)
    worst, missing = 0.0, []
    for key, rows in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        # A resumed run may have re-logged steps after its checkpoint: the latest value per step counts.
        latest = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            latest[m.step] = m.value
        if sorted(latest) != [s for s, _ in sorted(rows)]:
            missing.append(f"{key}: steps {sorted(latest)[:5]}... vs csv {[s for s, _ in rows][:5]}... ({len(latest)} vs {len(rows)})")
            continue
        for s, v in rows:
            worst = max(worst, abs(latest[s] - v) / max(abs(v), 1e-12))
    check(not missing and worst < 1e-8 and len(want) >= 3,
          f"{label}: {sum(len(r) for r in want.values())} values of {len(want)} metrics equal metrics.csv's "
          f"(worst relative difference {worst:.1e}){'; ' + '; '.join(missing[:3]) if missing else ''}")


server = start_server()
try:
    # 1. A fit.
    cfg = config("plain")
    rd = os.path.join(tmp, "plain")
    r = fit(cfg, rd)
    check(r.returncode == 0, f"fit exit {r.returncode} {r.stderr[-500:]}")
    client, run, n = run_of(rd)
    check(run is not None, f"one MLflow run for the run directory ({n})")
    if run:
        same_metrics(client, run.info.run_id, rd, "fit")
        check(run.info.status == "FINISHED", f"status {run.info.status}")
        check(run.data.tags.get("team") == "vision" and run.data.tags.get("purpose") == "check", f"tags {run.data.tags}")
        check(run.info.run_name == "plain", f"run name {run.info.run_name} (the run directory's)")
        p = run.data.params
        check(p.get("trainer.max_epochs") == "2" and p.get("model.hidden") == "[32, 16]" and p.get("callbacks.0.name") == "model_checkpoint"
              and p.get("logger.mlflow.experiment_name") == "strobe-test" and len(p) > 30,
              f"params: the resolved config flattened ({len(p)}: trainer.max_epochs={p.get('trainer.max_epochs')}, "
              f"callbacks.0.name={p.get('callbacks.0.name')})")
        arts = sorted(a.path for a in client.list_artifacts(run.info.run_id))
        check(arts == ["config.yaml", "model_summary.txt"], f"artifacts {arts}")
        if "config.yaml" in arts:
            got = open(client.download_artifacts(run.info.run_id, "config.yaml", tmp)).read()
            check(got == open(os.path.join(rd, "config.yaml")).read(), "config.yaml artifact equals the run directory's")
        check(not os.path.exists(os.path.join(rd, "mlflow_unsent.jsonl")), "nothing spooled")

    # 2. Resume continues the MLflow run.
    rd2 = os.path.join(tmp, "resumed")
    r = fit(cfg, rd2, "--set", "trainer.max_steps=12")
    r2 = fit(cfg, rd2 + "_2", "--ckpt", os.path.join(rd2, "checkpoints", "step=12.ckpt"))
    check(r.returncode == 0 and r2.returncode == 0, f"stopped and resumed fits exit {r.returncode}, {r2.returncode} {r2.stderr[-300:]}")
    _, first, _ = run_of(rd2)
    if first:
        runs = client.search_runs([first.info.experiment_id], filter_string=f"attributes.run_id = '{first.info.run_id}'")
        hist = sorted({m.step for m in client.get_metric_history(first.info.run_id, "train/loss")})
        check(hist == list(range(1, 25)) and runs[0].info.status == "FINISHED",
              f"the resume logged steps 13-24 into the same MLflow run ({hist[-1] if hist else None}, {runs[0].info.status})")
        _, other, n2 = run_of(rd2 + "_2")
        check(n2 == 0, f"no second MLflow run for the resume ({n2})")

    # 3. The server held still: training is not slowed.
    big = dict(hidden="[512, 512]", features=3072, image=32, channels=3, samples=480, epochs=1)
    cfg3 = config("held", ", request_timeout: 2, flush_timeout: 60", **big)
    cfg3b = os.path.join(tmp, "held_nolog.yaml")
    open(cfg3b, "w").write(open(cfg3).read().split("logger:")[0])
    def training_s(rundir, from_step):  # checkpoint `from_step` to the last one: the steps alone, startup and end aside
        ck = os.path.join(rundir, "checkpoints")
        return os.path.getmtime(os.path.join(ck, "step=60.ckpt")) - os.path.getmtime(os.path.join(ck, f"step={from_step}.ckpt"))
    r = fit(cfg3b, os.path.join(tmp, "nolog"))
    rd3 = os.path.join(tmp, "held")
    proc = fit(cfg3, rd3, wait=False)
    deadline = time.time() + 60
    run = None
    while time.time() < deadline and run is None:  # the run exists: hold the server
        _, run, _ = run_of(rd3)
        time.sleep(0.05)
    os.killpg(server.pid, signal.SIGSTOP)
    # The steps measured are those after the stop: from the first checkpoint written after it (a
    # loaded machine may have trained a few steps while the run was being looked up).
    from_step = 6
    while os.path.exists(os.path.join(rd3, "checkpoints", f"step={from_step}.ckpt")):
        from_step += 6
    while proc.poll() is None and not os.path.exists(os.path.join(rd3, "checkpoints", "step=60.ckpt")):
        time.sleep(0.02)
    time.sleep(1.0)
    os.killpg(server.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    check(proc.returncode == 0, f"held fit exit {proc.returncode} {err[-300:]}")
    enough = from_step <= 36
    held = training_s(rd3, from_step) if enough else float("nan")
    base = training_s(os.path.join(tmp, "nolog"), from_step) if enough else float("nan")
    check(enough and held < base * 2 + 1.0,
          f"steps {from_step + 1}-60 took {held:.2f} s with the server stopped before them, "
          f"{base:.2f} s without the logger (the stop came before step {from_step})")
    if run:
        same_metrics(client, run.info.run_id, rd3, "after the server resumed")

    # 4. The server killed mid-run, then the sync.
    cfg4 = config("killed", ", request_timeout: 1, flush_timeout: 2", epochs=6)
    rd4 = os.path.join(tmp, "killed")
    proc = fit(cfg4, rd4, wait=False)
    deadline = time.time() + 60
    run = None
    while time.time() < deadline and run is None:
        _, run, _ = run_of(rd4)
        time.sleep(0.05)
    stop_server(server, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    spool = os.path.join(rd4, "mlflow_unsent.jsonl")
    check(proc.returncode == 0 and os.path.exists(spool), f"killed server: fit exit {proc.returncode}, spool file {os.path.exists(spool)}")
    check(sum("mlflow" in line for line in err.splitlines()) == 1 and "strobe mlflow-sync" in err, f"one warning line: {err.strip()[-400:]!r}")
    server = start_server()
    s = subprocess.run([STROBE, "mlflow-sync", rd4], capture_output=True, text=True)
    check(s.returncode == 0 and not os.path.exists(spool), f"mlflow-sync exit {s.returncode}: {s.stdout.strip()} {s.stderr.strip()}")
    if run:
        same_metrics(client, run.info.run_id, rd4, "after mlflow-sync")
        check(client.get_run(run.info.run_id).info.status == "FINISHED", "the synced run ends FINISHED")

    # 5. Unreachable at the start.
    dead = f"http://127.0.0.1:{free_port()}"
    cfg5 = config("unreachable", f", request_timeout: 1, flush_timeout: 1")
    text5 = open(cfg5).read().replace(URI, dead)
    open(cfg5, "w").write(text5)
    rd5 = os.path.join(tmp, "unreachable")
    r = fit(cfg5, rd5)
    warn = [l for l in r.stderr.splitlines() if "logger.mlflow" in l]
    check(r.returncode == 0 and len(warn) == 2 and os.path.exists(os.path.join(rd5, "mlflow_unsent.jsonl")),
          f"unreachable: exit {r.returncode}, warning lines {warn}")
    s = subprocess.run([STROBE, "mlflow-sync", rd5, "--tracking-uri", URI], capture_output=True, text=True)
    check(s.returncode == 0, f"sync of a run never created: {s.stdout.strip()} {s.stderr.strip()}")
    _, run5, _ = run_of(rd5)
    if run5:
        same_metrics(client, run5.info.run_id, rd5, "a run created by the sync")
        check(run5.info.status == "FINISHED" and len(run5.data.params) > 30, f"synced run {run5.info.status}, {len(run5.data.params)} params")

    # 6. SIGTERM: KILLED.
    cfg6 = config("sigterm", epochs=2000)
    rd6 = os.path.join(tmp, "sigterm")
    proc = fit(cfg6, rd6, wait=False)
    while not os.path.exists(os.path.join(rd6, "checkpoints", "step=6.ckpt")) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    _, run6, _ = run_of(rd6)
    check(run6 is not None and run6.info.status == "KILLED", f"SIGTERM: exit {proc.returncode}, status {run6.info.status if run6 else None}")

    # 7. Bad input.
    for label, cfgtext, expect in [
        ("not http", open(cfg).read().replace(URI, "file:///tmp/mlruns"), "is not an http:// or https:// address"),
        ("empty experiment", open(cfg).read().replace("experiment_name: strobe-test", "experiment_name: ''"), "an empty experiment name"),
        ("unreachable is an error", text5.replace("flush_timeout: 1", "flush_timeout: 1, on_unreachable: error"),
         "on_unreachable: error"),
    ]:
        path = os.path.join(tmp, "bad.yaml")
        open(path, "w").write(cfgtext)
        bad_dir = os.path.join(tmp, "bad_" + label.replace(" ", "_"))
        r = fit(path, bad_dir)
        check(r.returncode == 2 and r.stderr.count("\n") == 1 and expect in r.stderr and not os.path.exists(os.path.join(bad_dir, "metrics.csv")),
              f"{label}: exit {r.returncode}, {r.stderr.strip()!r}")
    s = subprocess.run([STROBE, "mlflow-sync", rd], capture_output=True, text=True)
    check(s.returncode == 2 and s.stderr.count("\n") == 1 and "no such file" in s.stderr, f"sync without a spool: {s.returncode} {s.stderr.strip()!r}")
finally:
    stop_server(server)

if failures:
    sys.exit(f"test_mlflow: {len(failures)} check(s) failed")
print("test_mlflow: all checks passed")
