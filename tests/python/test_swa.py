"""The swa callback (docs/CONFIG.md, "swa") against torch.optim.swa_utils, the real thing.

A ResNet-18 (torchvision's layout and names) trains 4 epochs on 64 random 16x16 images (a tensor_file,
in order) with SGD at a constant lr and swa from epoch 1 over 2 annealing epochs. Then, in PyTorch:
  - the weights Strobe wrote at the ends of epochs 1-3 (strobe export of each epoch's checkpoint),
    loaded into torchvision's resnet18 and fed to AveragedModel.update_parameters, and update_bn over
    the same training batches, give `strobe export --swa`'s parameters and BatchNorm statistics
    (loaded into torchvision's resnet18) to 1e-5 relative;
  - SWALR stepped once an epoch from the same lr gives the lr Strobe trained each epoch at (9 digits);
  - the exported averages differ from the last weights (a copy would fail the first check too).

Usage: test_swa.py (STROBE_SOURCE_DIR, STROBE_BIN). Needs torchvision and safetensors (scripts/setup.sh
installs them): without them the test fails under CI (CI=true), else it is skipped."""
import csv, os, subprocess, sys, tempfile

SRC = os.environ.get("STROBE_SOURCE_DIR", os.getcwd())
STROBE = os.environ.get("STROBE_BIN", os.path.join(SRC, "build", "bin", "strobe"))
try:
    import torch
    from torch.optim.swa_utils import AveragedModel, SWALR, update_bn
    from torchvision.models import resnet18
    from safetensors.torch import save_file, load_file
except ImportError as e:
    print(f"test_swa: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(*args):
    p = subprocess.run([STROBE, *args], capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
        sys.exit(f"strobe {' '.join(args)}: exit {p.returncode}")
    return p


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


tmp = tempfile.mkdtemp(prefix="strobe_swa_")
g = torch.Generator().manual_seed(5)
x = torch.randn(64, 3, 16, 16, generator=g)
y = torch.randint(0, 10, (64,), generator=g)
save_file({"x": x, "y": y}, os.path.join(tmp, "train.safetensors"))
save_file({"x": x[:16].clone(), "y": y[:16].clone()}, os.path.join(tmp, "val.safetensors"))
LR, SWA_LR, START, ANNEAL, EPOCHS = 0.05, 0.01, 1, 2, 4
cfg = os.path.join(tmp, "swa.yaml")
with open(cfg, "w") as f:
    f.write(f"""name: swa_check
seed: 3
trainer: {{max_epochs: {EPOCHS}, device: cpu, log_every_n_steps: 1, num_sanity_val_steps: 0, enable_progress_bar: false}}
model: {{name: resnet, depth: 18, width: 64, num_classes: 10, in_channels: 3, stem: imagenet}}
data: {{name: tensor_file, path: {tmp}/train.safetensors, val_path: {tmp}/val.safetensors, fields: {{image: x, label: y}},
        batch_size: 16, shuffle: false, num_workers: 0}}
optimizer: {{name: sgd, lr: {LR}, momentum: 0.9}}
scheduler: {{name: none}}
callbacks:
  - {{name: swa, swa_lrs: {SWA_LR}, swa_epoch_start: {START}, annealing_epochs: {ANNEAL}, annealing_strategy: cos}}
  - {{name: model_checkpoint, every_n_epochs: 1, save_top_k: -1}}
  - {{name: lr_monitor}}
""")
rundir = os.path.join(tmp, "run")
fit = run("fit", "-c", cfg, "--run-dir", rundir)
check("BatchNorm statistics recomputed over 4 training batch(es) (20 layer(s))" in fit.stdout,
      "fit says it recomputed the averages' BatchNorm statistics over the 4 batches")
ckpts = os.path.join(rundir, "checkpoints")


def exported(ckpt, *flags):
    out = os.path.join(tmp, os.path.basename(ckpt) + "".join(flags) + ".safetensors")
    run("export", ckpt, "-o", out, *flags)
    m = resnet18(num_classes=10)
    m.load_state_dict(load_file(out), strict=True)
    return m


# The weights at each SWA epoch's end, averaged by torch.
epochs = {}
for name in os.listdir(ckpts):
    if name.startswith("epoch="):
        epochs[int(name.split("-")[0][6:])] = os.path.join(ckpts, name)
check(sorted(epochs) == list(range(EPOCHS)), f"one checkpoint per epoch ({sorted(epochs)})")
averaged = None
for e in range(START, EPOCHS):
    m = exported(epochs[e])
    if averaged is None:
        averaged = AveragedModel(m)
    averaged.update_parameters(m)
loader = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
update_bn(((b, ) for b, _ in loader), averaged)
want = averaged.module.state_dict()

got = exported(os.path.join(ckpts, "last.ckpt"), "--swa").state_dict()
params = [n for n, _ in averaged.module.named_parameters()]
stats = [n for n in want if n.endswith("running_mean") or n.endswith("running_var")]
worst_p = max(rel(got[n], want[n]) for n in params)
worst_s = max(rel(got[n], want[n]) for n in stats)
check(worst_p < 1e-5, f"averaged parameters equal AveragedModel's (worst relative difference {worst_p:.2e})")
check(worst_s < 1e-4, f"BatchNorm statistics equal update_bn's (worst relative difference {worst_s:.2e}, {len(stats)} tensors)")
last = exported(os.path.join(ckpts, "last.ckpt")).state_dict()
check(max(rel(got[n], last[n]) for n in params) > 1e-3, "the averages are not the last weights")
with torch.no_grad():
    m = resnet18(num_classes=10)
    m.load_state_dict(got)
    out, ref = m.eval()(x), averaged.module.eval()(x)
check(rel(out, ref) < 1e-4, f"eval outputs of the exported averages equal torch's ({rel(out, ref):.2e})")

# The lr each epoch trained at, against SWALR stepped once an epoch (as Lightning steps it).
rows = list(csv.DictReader(open(os.path.join(rundir, "metrics.csv"))))
by_epoch = {}
for r in rows:
    if r.get("lr") and r.get("epoch"):
        by_epoch.setdefault(int(float(r["epoch"])), set()).add(round(float(r["lr"]), 12))
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
sched = None
for e in range(EPOCHS):
    if e == START:
        sched = SWALR(opt, swa_lr=SWA_LR, anneal_epochs=ANNEAL, anneal_strategy="cos")
    elif sched is not None:
        opt.step()
        sched.step()
    want_lr = opt.param_groups[0]["lr"]
    seen = by_epoch.get(e, set())
    check(len(seen) >= 1 and all(abs(v - want_lr) <= 1e-9 * want_lr for v in seen),
          f"epoch {e}: Strobe's lr {sorted(seen)} is SWALR's {want_lr:.9g}")

# export --swa of a checkpoint from before SWA began: one line, exit 2.
p = subprocess.run([STROBE, "export", epochs[0], "-o", os.path.join(tmp, "none.safetensors"), "--swa"], capture_output=True, text=True)
check(p.returncode == 2 and "--swa: " in p.stderr and "holds no weight average" in p.stderr and p.stderr.count("\n") == 1,
      f"export --swa without averages: exit {p.returncode}, {p.stderr.strip()!r}")

if failures:
    sys.exit(f"test_swa: {len(failures)} check(s) failed")
print("test_swa: all checks passed")
