#!/usr/bin/env python3
"""Writes a timm model's weights as a safetensors file for Strobe's model.init_from (names: timm).

usage: timm_weights.py MODEL -o OUT.safetensors [--pretrained] [--num-classes N]

MODEL is a timm model name (vit_small_patch16_224, resnet50, ...). --pretrained takes timm's
pretrained weights (downloaded from the Hugging Face Hub, or its local cache); without it the weights
are timm's random initialisation, of the same names and shapes, to try a config offline. The file
carries the metadata timm.model, timm.pretrained and the normalisation the weights expect (mean, std),
and the script prints them: set data.mean / data.std to match (configs/finetune_vit.yaml)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import project_python  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="timm model name, e.g. vit_small_patch16_224")
    ap.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    ap.add_argument("--pretrained", action="store_true", help="timm's pretrained weights (Hugging Face Hub)")
    ap.add_argument("--num-classes", type=int, default=None, help="the head's classes (default: the model's)")
    args = ap.parse_args()
    project_python.require("timm", "safetensors")
    try:
        import timm
        from safetensors.torch import save_file
    except ImportError as e:
        print(f"timm_weights.py: {e} (pip install timm safetensors)", file=sys.stderr)
        return 2
    kwargs = {} if args.num_classes is None else {"num_classes": args.num_classes}
    try:
        model = timm.create_model(args.model, pretrained=args.pretrained, **kwargs)
    except Exception as e:  # an unknown name, no network for the download
        print(f"timm_weights.py: {args.model}: {e}", file=sys.stderr)
        return 2
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    mean, std = cfg.get("mean", (0.485, 0.456, 0.406)), cfg.get("std", (0.229, 0.224, 0.225))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {"format": "pt", "timm.model": args.model, "timm.pretrained": str(args.pretrained).lower(),
                "mean": str(list(mean)), "std": str(list(std))}
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = args.output + ".tmp"
    save_file(state, tmp, metadata=metadata)
    os.replace(tmp, args.output)  # whole or not at all
    print(f"{args.output}: {len(state)} tensors of timm {args.model} ({'pretrained' if args.pretrained else 'random'} "
          f"weights); data.mean: {list(mean)}, data.std: {list(std)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
