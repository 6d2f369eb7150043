"""Strobe's image decoding and listing against torchvision on the same files: an image folder of real
JPEGs and PNGs made from Fashion-MNIST by strobe_data_tool (grey and colour, 4:2:0 JPEGs, a 112x112
JPEG for DCT scaling). Checks: the class index order and the sample list equal torchvision's
ImageFolder; RGB pixels equal torchvision.io.decode_jpeg (JPEG) and PIL's convert("RGB") (all) within
1 LSB; luminance equals PIL's convert("L") for grey files and colour PNGs within 1 LSB; a JPEG decoded
at 1/2 and 1/4 scale in the DCT domain equals PIL's draft() (the same libjpeg scaling) within 1 LSB.
Exit 77 (skip) only without torchvision/PIL or without Fashion-MNIST."""
import os, subprocess, sys, tempfile

try:
    import numpy as np
    import torch
    import torchvision
    from torchvision.datasets import ImageFolder
    from torchvision.io import decode_jpeg, read_file, ImageReadMode
    from PIL import Image
except ImportError as e:
    print(f"skip: {e}")
    sys.exit(77)

if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
    print("skip: dataset-fashion-mnist is not installed")
    sys.exit(77)

BUILD = os.environ.get("STROBE_BUILD_DIR", "build")
TOOL = os.path.join(BUILD, "bin", "strobe_data_tool")
assert os.path.exists(TOOL), f"{TOOL} is not built"

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def strobe_decode(paths, channels, min_scale=1.0):
    """Decodes every path in one tool call; returns {path: array [h, w, c]}."""
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([TOOL, "decode", str(channels), str(min_scale), out, *paths], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        result = {}
        for k, (path, line) in enumerate(zip(paths, r.stdout.splitlines())):
            w, h, c = map(int, line.split())
            result[path] = np.fromfile(os.path.join(out, f"{k}.raw"), dtype=np.uint8).reshape(h, w, c)
        assert len(result) == len(paths)
        return result


def max_diff(a, b):
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    return int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max())


with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "fashion")
    subprocess.run([TOOL, "fashion-folder", root, "10"], check=True)

    # Listing: class order and (path, target) pairs.
    lines = subprocess.run([TOOL, "list", root], check=True, capture_output=True, text=True).stdout.splitlines()
    classes = [l.split("\t")[2] for l in lines if l.startswith("class\t")]
    samples = [(l.split("\t", 2)[2], int(l.split("\t")[1])) for l in lines if l.startswith("sample\t")]
    tv = ImageFolder(root)
    check(classes == tv.classes, f"classes {classes} != torchvision {tv.classes}")
    check(samples == tv.samples, "sample list differs from torchvision's ImageFolder")
    check(classes[0] == "Ankle boot" and len(samples) == 100, f"unexpected fixture: {classes[:2]}, {len(samples)} samples")

    paths = [p for p, _ in samples]
    rgb_all = strobe_decode(paths, 3)
    gray_paths = [p for p in paths if Image.open(p).mode == "L" or p.lower().endswith(".png")]
    gray_all = strobe_decode(gray_paths, 1)
    big = [p for p in paths if Image.open(p).size == (112, 112)]
    scaled = {s: strobe_decode(big, 3, s) for s in (0.5, 0.25)}
    n_jpeg = n_png = 0
    for path in paths:
        rgb = rgb_all[path]
        pil = Image.open(path)
        d = max_diff(rgb, np.asarray(pil.convert("RGB")))
        check(d in (0, 1), f"{path}: RGB vs PIL: {d}")
        if path.lower().endswith((".jpg", ".jpeg")):
            n_jpeg += 1
            tvj = decode_jpeg(read_file(path), mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()
            d = max_diff(rgb, tvj)
            check(d in (0, 1), f"{path}: RGB vs torchvision decode_jpeg: {d}")
        else:
            n_png += 1
        if path in gray_all:
            d = max_diff(gray_all[path][:, :, 0], np.asarray(pil.convert("L")))
            check(d in (0, 1), f"{path}: luminance vs PIL convert('L'): {d}")
        if path in big:
            for scale in (0.5, 0.25):
                draft = Image.open(path)
                draft.draft("RGB", (int(112 * scale), int(112 * scale)))
                d = max_diff(scaled[scale][path], np.asarray(draft.convert("RGB")))
                check(d in (0, 1), f"{path}: DCT-scaled 1/{int(1 / scale)} vs PIL draft: {d}")
    check(len(big) >= 10 and len(gray_paths) >= 40, f"{len(big)} scaled JPEGs, {len(gray_paths)} luminance checks")
    check(n_jpeg >= 50 and n_png >= 30, f"{n_jpeg} JPEGs, {n_png} PNGs")

if failures:
    print("\n".join(failures[:20]))
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print(f"ok: listing equals ImageFolder; {n_jpeg} JPEGs and {n_png} PNGs decode within 1 LSB of torchvision/PIL")
