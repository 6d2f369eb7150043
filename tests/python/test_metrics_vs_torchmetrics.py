"""Strobe's C++ metrics agree with TorchMetrics (CPU) on the same inputs.

Generates several hundred random cases (fresh seed each run, printed for reproduction; set
STROBE_METRICS_SEED to replay one): class-imbalanced multiclass data with classes absent from the
targets and/or predictions, top_k > 1, every averaging mode, ignore_index inside and outside the
class range, binary and multilabel (probabilities, logits, labels), aggregators with every NaN
strategy, matched-box IoU/GIoU with padding, perplexity and token accuracy. Each case is fed in
several update() calls. TorchMetrics computes the expected values; the C++ tool
$STROBE_BUILD_DIR/bin/strobe_metrics_eval computes ours from the same tensors (raw files). When a
GPU is visible, the tool also runs with --device cuda and must agree with the CPU results.
Exit code 77 (skipped) when torchmetrics/torchvision are not importable.
"""
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import warnings

import torch

try:
    import torchmetrics
    import torchmetrics.classification as tmc
    from torchmetrics.functional.detection import generalized_intersection_over_union, intersection_over_union
    from torchmetrics.text import Perplexity
except ImportError as e:  # pragma: no cover
    print(f"SKIP: torchmetrics (with torchvision) not importable: {e}")
    sys.exit(77)

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64", torch.int32: "int32"}


class Cases:
    def __init__(self, directory):
        self.dir = directory
        self.cases = []
        self.expected = {}
        self.nfiles = 0

    def tensor(self, t):
        if t is None:
            return None
        t = t.contiguous()
        name = f"t{self.nfiles}.bin"
        self.nfiles += 1
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(t.numpy().tobytes())
        return {"file": name, "dtype": DTYPES[t.dtype], "shape": list(t.shape)}

    def add(self, metric, options, updates, expected, rtol=1e-5, atol=1e-6, describe=""):
        cid = f"c{len(self.cases)}"
        self.cases.append(
            {"id": cid, "metric": metric, "options": options,
             "updates": [[self.tensor(a), self.tensor(b)] for a, b in updates]}
        )
        self.expected[cid] = (torch.as_tensor(expected, dtype=torch.float64).reshape(-1), rtol, atol,
                              f"{metric} {options} {describe}")


def split(n, parts):
    cuts = sorted(random.sample(range(1, n), parts - 1)) if parts > 1 and n > parts else []
    bounds = [0] + cuts + [n]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def imbalanced_targets(n, c, extra_shape=()):
    # Dirichlet-skewed class frequencies; about a third of the classes never appear as targets.
    probs = torch.distributions.Dirichlet(torch.full((c,), 0.4)).sample()
    absent = torch.rand(c) < 0.33
    absent[torch.randint(0, c, (1,))] = False
    probs = probs.masked_fill(absent, 0)
    probs = probs / probs.sum()
    return torch.multinomial(probs, n * int(torch.tensor(extra_shape).prod().item() if extra_shape else 1),
                             replacement=True).reshape(n, *extra_shape)


TM_CLASS = {
    "accuracy": ("MulticlassAccuracy", "BinaryAccuracy", "MultilabelAccuracy"),
    "precision": ("MulticlassPrecision", "BinaryPrecision", "MultilabelPrecision"),
    "recall": ("MulticlassRecall", "BinaryRecall", "MultilabelRecall"),
    "f1": ("MulticlassF1Score", "BinaryF1Score", "MultilabelF1Score"),
    "fbeta": ("MulticlassFBetaScore", "BinaryFBetaScore", "MultilabelFBetaScore"),
}


def run_tm(metric, updates):
    for a, b in updates:
        metric.update(a, b)
    return metric.compute()


def multiclass_cases(cs, count):
    for _ in range(count):
        c = random.choice([2, 3, 5, 10, 17, 50])
        n = random.choice([1, 7, 40, 200])
        extra = random.choice([(), (), (), (3,)])
        name = random.choice(list(TM_CLASS))
        average = random.choice(["micro", "macro", "weighted", "none"])
        top_k = random.choice([1, 1, 2, 3]) if c > 3 else 1
        as_labels = top_k == 1 and random.random() < 0.2
        ignore_index = random.choice([None, None, -100, 0])
        zero_division = random.choice([0.0, 0.0, 1.0])
        target = imbalanced_targets(n, c, extra)
        # Scores biased toward the target so that every count (tp/fp/fn) is non-trivial; some
        # classes are never predicted (large negative bias).
        scores = torch.randn(n, c, *extra)
        scores += 2.0 * torch.nn.functional.one_hot(target, c).movedim(-1, 1) * (torch.rand(n, 1, *extra) < 0.5)
        never = torch.rand(c) < 0.2
        scores[:, never] -= 10.0
        if ignore_index is not None:
            target = target.masked_fill(torch.rand(target.shape) < 0.15, ignore_index)
        preds = scores.argmax(1) if as_labels else scores
        kwargs = dict(num_classes=c, average=average, ignore_index=ignore_index)
        if name != "accuracy":
            kwargs["zero_division"] = zero_division
        if name in ("accuracy", "precision", "recall", "f1", "fbeta"):
            kwargs["top_k"] = top_k
        if name == "fbeta":
            kwargs["beta"] = 0.5
        tm = getattr(tmc, TM_CLASS[name][0])(**kwargs)
        updates = [(preds[a:b], target[a:b]) for a, b in split(n, random.randint(1, 4))]
        expected = run_tm(tm, updates)
        opts = {"task": "multiclass", "num_classes": c, "average": average, "top_k": top_k,
                "ignore_index": ignore_index, "zero_division": zero_division, "beta": 0.5 if name == "fbeta" else 1.0}
        cs.add(name, opts, updates, expected, describe=f"n={n} extra={extra} labels={as_labels}")


def binary_cases(cs, count):
    for _ in range(count):
        n = random.choice([1, 10, 100])
        name = random.choice(list(TM_CLASS))
        kind = random.choice(["probs", "logits", "labels"])
        threshold = random.choice([0.5, 0.3, 0.7])
        ignore_index = random.choice([None, -1])
        target = (torch.rand(n) < random.choice([0.1, 0.5, 0.9])).long()
        if kind == "probs":
            preds = torch.rand(n)
        elif kind == "logits":
            preds = torch.randn(n) * 3
        else:
            preds = (torch.rand(n) < 0.5).long()
        if ignore_index is not None:
            target = target.masked_fill(torch.rand(n) < 0.2, ignore_index)
        kwargs = dict(threshold=threshold, ignore_index=ignore_index)
        if name == "fbeta":
            kwargs["beta"] = 2.0
        tm = getattr(tmc, TM_CLASS[name][1])(**kwargs)
        updates = [(preds[a:b], target[a:b]) for a, b in split(n, random.randint(1, 3))]
        expected = run_tm(tm, updates)
        opts = {"task": "binary", "threshold": threshold, "ignore_index": ignore_index,
                "beta": 2.0 if name == "fbeta" else 1.0}
        cs.add(name, opts, updates, expected, describe=kind)


def multilabel_cases(cs, count):
    for _ in range(count):
        n = random.choice([1, 10, 80])
        labels = random.choice([2, 5, 12])
        name = random.choice(list(TM_CLASS))
        average = random.choice(["micro", "macro", "weighted", "none"])
        kind = random.choice(["probs", "logits", "labels"])
        threshold = random.choice([0.5, 0.4])
        ignore_index = random.choice([None, -1])
        target = (torch.rand(n, labels) < torch.rand(labels) * 0.6).long()
        preds = {"probs": torch.rand(n, labels), "logits": torch.randn(n, labels) * 2,
                 "labels": (torch.rand(n, labels) < 0.4).long()}[kind]
        if ignore_index is not None:
            target = target.masked_fill(torch.rand(n, labels) < 0.1, ignore_index)
        kwargs = dict(num_labels=labels, average=average, threshold=threshold, ignore_index=ignore_index)
        if name == "fbeta":
            kwargs["beta"] = 0.5
        tm = getattr(tmc, TM_CLASS[name][2])(**kwargs)
        updates = [(preds[a:b], target[a:b]) for a, b in split(n, random.randint(1, 3))]
        expected = run_tm(tm, updates)
        opts = {"task": "multilabel", "num_classes": labels, "average": average, "threshold": threshold,
                "ignore_index": ignore_index, "beta": 0.5 if name == "fbeta" else 1.0}
        cs.add(name, opts, updates, expected, describe=kind)


def aggregator_cases(cs, count):
    for _ in range(count):
        name = random.choice(["mean", "sum", "min", "max", "cat"])
        strategy = random.choice(["propagate", "ignore", "replace"])
        replacement = 2.5
        tm_strategy = {"propagate": "disable", "ignore": "ignore", "replace": replacement}[strategy]
        tm_cls = {"mean": torchmetrics.MeanMetric, "sum": torchmetrics.SumMetric, "min": torchmetrics.MinMetric,
                  "max": torchmetrics.MaxMetric, "cat": torchmetrics.CatMetric}[name]
        tm = tm_cls(nan_strategy=tm_strategy)
        updates = []
        for _ in range(random.randint(1, 4)):
            v = torch.randn(random.choice([1, 5, 30])) * 10
            if random.random() < 0.4:
                v[torch.rand(v.shape) < 0.3] = float("nan")
            w = None
            if name == "mean" and random.random() < 0.7:
                w = torch.rand(v.shape)
                if random.random() < 0.3:
                    w[0] = float("nan")
            updates.append((v, w))
            if name == "mean":
                tm.update(v.clone(), w.clone() if w is not None else 1.0)
            else:
                tm.update(v.clone())
        expected = tm.compute()
        if name == "mean" and strategy == "propagate":
            # TorchMetrics' nan_strategy="disable" drops the weights (its _cast_and_nan_check_input
            # sets them to 1); we keep them: expected = sum(v * w) / sum(w), NaN propagating.
            num = sum((v.double() * (w.double() if w is not None else 1.0)).sum() for v, w in updates)
            den = sum((w.double().sum() if w is not None else float(v.numel())) for v, w in updates)
            expected = num / den
        opts = {"nan_strategy": strategy, "nan_replacement": replacement}
        if name == "cat":
            opts["capacity"] = 200
            if isinstance(expected, list):  # TorchMetrics' CatMetric with nothing kept returns []
                expected = torch.empty(0)
            expected = torch.cat([expected.reshape(-1), torch.full((200 - expected.numel(),), float("nan"))])
        # fp32 sums of values ~10 can cancel to ~0.05: the rounding error then scales with the sum of
        # magnitudes, not with the result (a wrong NaN treatment is off by >= 1, far above this).
        finite = [v[torch.isfinite(v)].abs() for v, _ in updates]
        atol = 1e-6
        if name == "sum":
            atol = max(atol, 1e-6 * sum(float(f.sum()) for f in finite))
        elif name == "mean":
            atol = max(atol, 1e-6 * max((float(f.max()) for f in finite if f.numel()), default=0.0))
        cs.add(name, opts, updates, expected, atol=atol, describe=strategy)


def random_boxes(shape):
    xy = torch.rand(*shape, 2) * 10
    wh = torch.rand(*shape, 2) * 5 + 0.1
    return torch.cat([xy, xy + wh], -1)


def detection_cases(cs, count):
    for _ in range(count):
        generalized = random.random() < 0.5
        updates, pv, tv = [], [], []
        for _ in range(random.randint(1, 3)):
            b, n = random.choice([1, 4]), random.choice([1, 6, 20])
            pred = random_boxes((b, n))
            target = (pred + torch.randn(b, n, 4) * random.choice([0.2, 2.0])).clone()
            target[..., 2:] = torch.maximum(target[..., 2:], target[..., :2] + 0.05)
            target[..., 1].clamp_(min=0.01)
            target[..., 3].clamp_(min=0.1)
            pad = torch.rand(b, n) < 0.3
            target[pad] = 0.0
            updates.append((pred, target))
            valid = target[..., 3] > 0
            pv.append(pred[valid])
            tv.append(target[valid])
        pv, tv = torch.cat(pv), torch.cat(tv)
        fn = generalized_intersection_over_union if generalized else intersection_over_union
        expected = fn(pv, tv, aggregate=True) if len(pv) else torch.tensor(0.0)
        cs.add("mean_giou" if generalized else "mean_iou", {}, updates, expected, rtol=1e-5, atol=1e-5)


def lm_cases(cs, count):
    for _ in range(count):
        v = random.choice([5, 50, 256])
        ignore_index = random.choice([None, -100])
        updates = []
        perplexity = Perplexity(ignore_index=ignore_index)
        top_k = random.choice([1, 1, 3])
        acc = tmc.MulticlassAccuracy(num_classes=v, average="micro", top_k=top_k, ignore_index=ignore_index)
        for _ in range(random.randint(1, 3)):
            b, s = random.choice([1, 3]), random.choice([4, 17])
            logits = torch.randn(b, s, v) * 2
            target = torch.randint(0, v, (b, s))
            if ignore_index is not None:
                target[torch.rand(b, s) < 0.2] = ignore_index
            updates.append((logits, target))
            perplexity.update(logits, target)
            acc.update(logits.permute(0, 2, 1), target)
        cs.add("perplexity", {"ignore_index": ignore_index}, updates, perplexity.compute(), rtol=1e-4)
        cs.add("token_accuracy", {"ignore_index": ignore_index, "top_k": top_k}, updates, acc.compute())


def run_tool(tool, manifest, device):
    out = manifest + f".{device}.json"
    subprocess.run([tool, manifest, out, "--device", device], check=True)
    with open(out) as f:
        return json.load(f)


def values(result):
    assert "error" not in result, result.get("error")
    return torch.tensor([float(v) for v in result["value"]], dtype=torch.float64)


def main():
    # TorchMetrics' own NaN handling warns about masked_fill_ on broadcast weights; not ours.
    warnings.filterwarnings("ignore", category=UserWarning, module="torchmetrics")
    build = os.environ.get("STROBE_BUILD_DIR")
    assert build, "STROBE_BUILD_DIR is not set (ctest sets it)"
    tool = os.path.join(build, "bin", "strobe_metrics_eval")
    assert os.path.exists(tool), f"{tool} not built (strobe/metrics/tools/CMakeLists.txt)"
    seed = int(os.environ.get("STROBE_METRICS_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"seed {seed} (STROBE_METRICS_SEED={seed} replays this run)")
    random.seed(seed)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        cs = Cases(tmp)
        multiclass_cases(cs, 300)
        binary_cases(cs, 60)
        multilabel_cases(cs, 80)
        aggregator_cases(cs, 80)
        detection_cases(cs, 30)
        lm_cases(cs, 20)
        manifest = os.path.join(tmp, "manifest.json")
        with open(manifest, "w") as f:
            json.dump({"cases": cs.cases}, f)
        results = run_tool(tool, manifest, "cpu")
        failures = []
        for cid, (expected, rtol, atol, what) in cs.expected.items():
            try:
                got = values(results[cid])
                if got.shape != expected.shape or not torch.allclose(got, expected, rtol=rtol, atol=atol,
                                                                      equal_nan=True):
                    failures.append(f"{cid} {what}: strobe {got.tolist()} vs torchmetrics {expected.tolist()}")
            except AssertionError as e:
                failures.append(f"{cid} {what}: {e}")
        if torch.cuda.is_available():
            gpu = run_tool(tool, manifest, "cuda")
            for cid in cs.expected:
                a, b = values(results[cid]), values(gpu[cid])
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True):
                    failures.append(f"{cid}: cuda {b.tolist()} vs cpu {a.tolist()}")
        for f in failures[:30]:
            print("FAIL", f)
        if failures:
            print(f"{len(failures)} of {len(cs.expected)} cases differ (seed {seed})")
            sys.exit(1)
        print(f"OK: {len(cs.expected)} cases agree with TorchMetrics {torchmetrics.__version__}"
              + (" (and CUDA == CPU)" if torch.cuda.is_available() else ""))


if __name__ == "__main__":
    main()
