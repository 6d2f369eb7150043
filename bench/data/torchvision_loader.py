"""torchvision's DataLoader on an image folder, timed like bench_image_loader: ImageFolder (PIL
decode) + RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize (train), or
Resize(256) + CenterCrop(224) + ToTensor + Normalize (eval); batch, workers and epochs as given;
the first two batches of each epoch untimed. Prints one JSON line.
Usage: torchvision_loader.py ROOT WORKERS BATCH EPOCHS train|eval"""
import json, statistics, sys, time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms as T

root, workers, batch, epochs, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
tf = (T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]) if mode == "train"
      else T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
torch.set_num_threads(1)
ds = datasets.ImageFolder(root, transform=tf)
loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True, prefetch_factor=2 if workers else None,
                    persistent_workers=False)
rates = []
for e in range(epochs):
    n, t0 = 0, time.perf_counter()
    for k, (x, y) in enumerate(loader):
        if k == 1:
            t0 = time.perf_counter()
        if k >= 2:
            n += x.shape[0]
    rates.append(n / (time.perf_counter() - t0))
print(json.dumps({"loader": "torchvision", "transform": mode, "workers": workers, "batch": batch, "images": len(ds),
                  "rates": [round(r, 1) for r in rates], "median_images_per_s": round(statistics.median(rates), 1)}))
