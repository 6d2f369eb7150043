"""One table of Strobe's step times (`strobe bench step --json`) beside the PyTorch anchors
(bench/pytorch_baselines.py's JSON): workload, Strobe median ms/step [p10-p90], input-wait median,
PyTorch eager, torch.compile, and the ratios Strobe / eager, Strobe / compiled (< 1: Strobe is faster).

  python3 bench/e2e/compare.py STROBE_STEP.json [PYTORCH_BASELINES.json] [--json OUT.json]
"""
import json
import sys

# Strobe workload -> (baseline section, eager key, compiled key or None, what the anchor is).
ANCHORS = {
    "vit_l16": ("vit", "vit_l16_b128.step_ms.eager", "vit_l16_b128.step_ms.compiled", "timm ViT-L/16 b128 bf16 SGD"),
    "face_detector_giou": ("detector", "face_detector_b1024.step_ms.eager", "face_detector_b1024.step_ms.compiled",
                           "seed FaceNet b1024 + padded GIoU"),
    "resnet50": ("resnet50", "resnet50_b128.step_ms.eager", "resnet50_b128.step_ms.compiled",
                 "torchvision resnet50 b128 bf16 SGD+momentum (NCHW)"),
    "lm_pack": ("lm", "lm_d24_b32.packed_varlen_attn.step_ms", None, "varlen_attn, packed"),
    "lm_pad_to_max": ("lm", "lm_d24_b32.padded_mask_sdpa.step_ms", None, "padded + mask SDPA"),
    "lm_pad_to_longest": ("lm", "lm_d24_b32.padded_causal_flash_nomask.step_ms", None, "causal flash, no mask"),
}
EXTRA = {"resnet50": [("channels_last eager", "resnet50_b128.step_ms.eager.channels_last"),
                      ("channels_last compiled", "resnet50_b128.step_ms.compiled.channels_last")]}


def main(argv):
    args, out_json = [], None
    i = 0
    while i < len(argv):
        if argv[i] == "--json":
            out_json = argv[i + 1]; i += 2
        else:
            args.append(argv[i]); i += 1
    if not args:
        sys.exit(__doc__)
    strobe = json.load(open(args[0]))
    base = json.load(open(args[1])) if len(args) > 1 else {}
    step = strobe["suites"]["step"]
    rows = []
    hdr = f"{'workload':<20} {'strobe ms':>9} {'[p10 - p90]':>17} {'wait ms':>8} {'eager ms':>9} {'compiled':>9} {'/eager':>7} {'/compiled':>9}  anchor"
    print(f"device: {strobe.get('device')}  (strobe {strobe.get('strobe_version')}, torch {base.get('torch', '?')} on {base.get('device', '?')})")
    print(hdr)
    print("-" * len(hdr))
    for w in step.get("workloads", []):
        name = w["name"]
        med, p10, p90 = w["ms"]["median"], w["ms"]["p10"], w["ms"]["p90"]
        wait = w["input_wait_ms"]["median"]
        sec, ek, ck, what = ANCHORS.get(name, (None, None, None, ""))
        s = base.get(sec, {}) if sec else {}
        eager = s.get(ek) if ek else None
        comp = s.get(ck) if ck else None
        err = s.get(next((k for k in s if k.endswith("error")), ""), None)
        r_e = med / eager if eager else None
        r_c = med / comp if comp else None
        f = lambda x, spec: format(x, spec) if x is not None else "-"
        print(f"{name:<20} {med:9.2f} {'[' + f'{p10:.2f} - {p90:.2f}' + ']':>17} {wait:8.2f} {f(eager, '9.1f'):>9} {f(comp, '9.1f'):>9} "
              f"{f(r_e, '7.3f'):>7} {f(r_c, '9.3f'):>9}  {what}{' (' + err + ')' if err else ''}")
        row = {"workload": name, "strobe_median_ms": med, "strobe_p10_ms": p10, "strobe_p90_ms": p90,
               "strobe_min_ms": w["ms"]["min"], "strobe_max_ms": w["ms"]["max"], "input_wait_median_ms": wait,
               "steps": w["steps"], "batch_size": w.get("batch_size"), "pytorch_eager_ms": eager,
               "pytorch_compiled_ms": comp, "ratio_vs_eager": r_e, "ratio_vs_compiled": r_c, "anchor": what}
        for label, key in EXTRA.get(name, []):
            if key in s:
                row[label.replace(" ", "_") + "_ms"] = s[key]
                print(f"{'':<20} {'':>9} {'':>17} {'':>8} {label}: {s[key]:.1f} ms, strobe / it = {med / s[key]:.3f}")
        rows.append(row)
    if out_json:
        json.dump({"device": strobe.get("device"), "date": strobe.get("date"), "rows": rows}, open(out_json, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
