#!/usr/bin/env python3
"""torchvision vs the `data` crate on the same ImageFolder (run by hand, never by tests or CI).

    pip install torch torchvision pillow
    python benches/compare_data.py --root target/bench-data/imagenet-like-2000 --workers 2

Runs torchvision's ImageFolder + DataLoader(num_workers=N) with Horovod's example transforms
(train: RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize; val: Resize(256) +
CenterCrop(224) + ToTensor + Normalize; decode only: PIL open + convert("RGB")), the recipe's
train_ta_wide (+ TrivialAugmentWide after the flip) and train_ta_wide_erase (+ RandomErasing(0.1)
after Normalize), then the Rust
benchmark (`cargo run --release -p benches --no-default-features --bin data -- --json`, or
--rust-json FILE with its saved output), and prints both img/s figures and the ratio.

--backend pil (default) is torchvision's PIL path (transforms v1 on PIL images, as Horovod's
example); --backend tensor is the reference recipe's `--backend tensor --use-v2`:
torchvision.io.decode_jpeg + transforms.v2 on uint8 tensors (decode-only then times decode_jpeg).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, io, transforms
from torchvision.transforms import v2

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def decode_only(img):
    # PIL's loader already decoded the file (ImageFolder's pil_loader: open + convert("RGB")).
    img.load()
    return 0


def tensor_loader(path):
    return io.decode_jpeg(io.read_file(path), mode=io.ImageReadMode.RGB)


def already_decoded(img):
    return 0


def cpu_seconds():
    """User + system CPU of this process and its reaped children (the DataLoader workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def time_loader(root, transform, workers, batch_size, repeat, collate=None, loader=None):
    """Best img/s (wall) and best img per CPU-second over `repeat` epochs."""
    extra = {} if loader is None else {"loader": loader}
    ds = datasets.ImageFolder(root, transform=transform, **extra)
    best, best_cpu = 0.0, 0.0
    for _ in range(repeat):
        loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                            collate_fn=collate, drop_last=False)
        n = 0
        t, c = time.perf_counter(), cpu_seconds()
        it = iter(loader)
        for images, _labels in it:
            n += len(images)
        del it  # joins the workers, so RUSAGE_CHILDREN includes them
        best = max(best, n / (time.perf_counter() - t))
        best_cpu = max(best_cpu, n / max(cpu_seconds() - c, 1e-9))
    return (best, best_cpu), len(ds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="ImageFolder root (e.g. made by the Rust bench's --generate)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=2, help="timed passes, best reported")
    p.add_argument("--rust-json", help="saved output of the Rust bench --json (skips running it)")
    p.add_argument("--skip-rust", action="store_true")
    p.add_argument("--pipelines", default="decode,train,train_ta_wide,train_ta_wide_erase,val",
                   help="comma-separated subset of decode,train,train_ta_wide,train_ta_wide_erase,val")
    p.add_argument("--backend", choices=["pil", "tensor"], default="pil")
    args = p.parse_args()

    torch.set_num_threads(1)
    size = args.size
    resize = round(size * 256 / 224)
    norm = transforms.Normalize(MEAN, STD)
    train_t = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), norm])
    val_t = transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(size), transforms.ToTensor(), norm])
    ta_t = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                               transforms.TrivialAugmentWide(), transforms.ToTensor(), norm])
    ta_erase_t = transforms.Compose(ta_t.transforms + [transforms.RandomErasing(0.1)])
    loader = None
    if args.backend == "tensor":
        # The recipe's tensor backend: decode_jpeg to uint8 CHW, transforms.v2 on uint8.
        loader = tensor_loader
        decode_only_t = already_decoded
        head = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
        tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
        train_t = v2.Compose(head + tail)
        ta_t = v2.Compose(head + [v2.TrivialAugmentWide()] + tail)
        ta_erase_t = v2.Compose(head + [v2.TrivialAugmentWide()] + tail + [v2.RandomErasing(0.1)])
        val_t = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(size)] + tail)
    else:
        decode_only_t = decode_only
    list_collate = lambda batch: ([b[0] for b in batch], [b[1] for b in batch])

    pipelines = [x for x in args.pipelines.split(",") if x]
    setups = {"decode": (decode_only_t, list_collate), "train": (train_t, None), "val": (val_t, None),
              "train_ta_wide": (ta_t, None), "train_ta_wide_erase": (ta_erase_t, None)}
    tv = {}
    n = 0
    for name in pipelines:
        transform, collate = setups[name]
        tv[name], n = time_loader(args.root, transform, args.workers, args.batch_size, args.repeat, collate,
                                  loader)

    rust = None
    if args.rust_json:
        with open(args.rust_json) as f:
            rust = json.load(f)
    elif not args.skip_rust:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = ["cargo", "run", "--release", "-q", "-p", "benches", "--no-default-features", "--bin", "data", "--",
               "--root", os.path.abspath(args.root), "--workers", str(args.workers), "--size", str(size),
               "--batch-size", str(args.batch_size), "--repeat", str(args.repeat), "--json"]
        out = subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout
        rust = json.loads(out.strip().splitlines()[-1])

    print(f"# {n} images in {args.root}, {args.workers} workers, size {size}, batch {args.batch_size}, "
          f"torch {torch.__version__}, torchvision backend {args.backend}")
    print(f"# {'pipeline':<20} {'torchvision_img_per_s':>22} {'rust_img_per_s':>15} {'ratio':>7}"
          f" {'torchvision_img_per_cpu_s':>26} {'rust_img_per_cpu_s':>19} {'cpu_ratio':>9}")
    nan = float("nan")
    for name in pipelines:
        (w, c) = tv[name]
        r = rust.get(f"{name}_img_per_s", nan) if rust else nan
        rc = rust.get(f"{name}_img_per_cpu_s", nan) if rust else nan
        print(f"  {name:<20} {w:>22.1f} {r:>15.1f} {r / w:>7.2f} {c:>26.1f} {rc:>19.1f} {rc / c:>9.2f}")
    if rust:
        print("# rust per-stage in-worker time (ms per image): " + ", ".join(
            f"{k[:-len('_ms_per_img')]} {v:.3f}" for k, v in rust.items() if k.endswith("_ms_per_img")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
