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

This VM's speed drifts between minutes, so for figures to compare, interleave the sides:

    python benches/compare_data.py --root DIR --backend both --rounds 3 --rust-exe target/release/data

runs torchvision's tensor path, its PIL path and the Rust bench in turn, three times, and prints
the medians and the ratio of each round.

--backend pil (default) is torchvision's PIL path (transforms v1 on PIL images, as Horovod's
example); --backend tensor is the reference recipe's `--backend tensor --use-v2`:
torchvision.io.decode_jpeg + transforms.v2 on uint8 tensors (decode-only then times decode_jpeg).
"""
import argparse
import json
import os
import resource
import statistics
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


def setups_for(backend, size):
    """pipeline name -> (transform, collate, loader) of torchvision's `backend` path."""
    resize = round(size * 256 / 224)
    norm = transforms.Normalize(MEAN, STD)
    list_collate = lambda batch: ([b[0] for b in batch], [b[1] for b in batch])
    if backend == "tensor":
        # The recipe's tensor backend: decode_jpeg to uint8 CHW, transforms.v2 on uint8.
        head = [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
        tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
        return {
            "decode": (already_decoded, list_collate, tensor_loader),
            "train": (v2.Compose(head + tail), None, tensor_loader),
            "train_ta_wide": (v2.Compose(head + [v2.TrivialAugmentWide()] + tail), None, tensor_loader),
            "train_ta_wide_erase": (v2.Compose(head + [v2.TrivialAugmentWide()] + tail + [v2.RandomErasing(0.1)]),
                                    None, tensor_loader),
            "val": (v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(size)] + tail), None,
                    tensor_loader),
        }
    train_t = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), norm])
    ta_t = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                               transforms.TrivialAugmentWide(), transforms.ToTensor(), norm])
    return {
        "decode": (decode_only, list_collate, None),
        "train": (train_t, None, None),
        "train_ta_wide": (ta_t, None, None),
        "train_ta_wide_erase": (transforms.Compose(ta_t.transforms + [transforms.RandomErasing(0.1)]), None, None),
        "val": (transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(size), transforms.ToTensor(),
                                    norm]), None, None),
    }


def run_rust(args, pipelines):
    """One run of the Rust bench over `pipelines`: its JSON object."""
    common = ["--root", os.path.abspath(args.root), "--workers", str(args.workers), "--size", str(args.size),
              "--batch-size", str(args.batch_size), "--repeat", str(args.repeat), "--no-stages", "--json",
              "--pipelines", ",".join(pipelines)]
    if args.rust_exe:
        cmd, cwd = [args.rust_exe] + common, None
    else:
        cmd = ["cargo", "run", "--release", "-q", "-p", "benches", "--no-default-features", "--bin", "data",
               "--"] + common
        cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="ImageFolder root (e.g. made by the Rust bench's --generate)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=2, help="timed passes, best reported")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved rounds (each backend, then Rust); medians and per-round ratios")
    p.add_argument("--rust-json", help="saved output of the Rust bench --json (skips running it; one round)")
    p.add_argument("--rust-exe", help="the built Rust bench binary (default: cargo run --release)")
    p.add_argument("--skip-rust", action="store_true")
    p.add_argument("--pipelines", default="decode,train,train_ta_wide,train_ta_wide_erase,val",
                   help="comma-separated subset of decode,train,train_ta_wide,train_ta_wide_erase,val")
    p.add_argument("--backend", choices=["pil", "tensor", "both"], default="pil")
    p.add_argument("--rust-also", default="",
                   help="more Rust-only pipelines to time in each round (e.g. decode_crop,train_full_decode)")
    args = p.parse_args()
    if args.rust_json and args.rounds > 1:
        p.error("--rust-json is one saved run; --rounds needs live runs (use --rust-exe)")

    torch.set_num_threads(1)
    backends = ["tensor", "pil"] if args.backend == "both" else [args.backend]
    pipelines = [x for x in args.pipelines.split(",") if x]
    setups = {b: setups_for(b, args.size) for b in backends}
    # tv[backend][pipeline] and rust[pipeline]: one (img/s, img/CPU-s) per round.
    tv = {b: {name: [] for name in pipelines} for b in backends}
    also = [x for x in args.rust_also.split(",") if x]
    rust = {name: [] for name in pipelines + also}
    n = 0
    for _ in range(args.rounds):
        for b in backends:
            for name in pipelines:
                transform, collate, loader = setups[b][name]
                result, n = time_loader(args.root, transform, args.workers, args.batch_size, args.repeat,
                                        collate, loader)
                tv[b][name].append(result)
        if args.skip_rust:
            continue
        if args.rust_json:
            with open(args.rust_json) as f:
                got = json.load(f)
        else:
            got = run_rust(args, pipelines + also)
        nan = float("nan")
        for name in pipelines + also:
            rust[name].append((got.get(f"{name}_img_per_s", nan), got.get(f"{name}_img_per_cpu_s", nan)))

    median = statistics.median
    print(f"# {n} images in {args.root}, {args.workers} workers, size {args.size}, batch {args.batch_size}, "
          f"torch {torch.__version__}, {args.rounds} interleaved round(s), best of {args.repeat} passes each")
    for b in backends:
        print(f"# torchvision backend {b}: medians over rounds; ratio = rust / torchvision")
        print(f"# {'pipeline':<20} {'torchvision_img_per_s':>22} {'rust_img_per_s':>15} {'ratio':>7}"
              f" {'torchvision_img_per_cpu_s':>26} {'rust_img_per_cpu_s':>19} {'cpu_ratio':>9}  per-round ratios")
        for name in pipelines:
            w = median(r[0] for r in tv[b][name])
            c = median(r[1] for r in tv[b][name])
            if rust[name]:
                r = median(x[0] for x in rust[name])
                rc = median(x[1] for x in rust[name])
                rounds = [x[0] / t[0] for x, t in zip(rust[name], tv[b][name])]
            else:
                r = rc = float("nan")
                rounds = []
            per_round = " ".join(f"{x:.2f}" for x in rounds)
            print(f"  {name:<20} {w:>22.1f} {r:>15.1f} {r / w:>7.2f} {c:>26.1f} {rc:>19.1f} {rc / c:>9.2f}  "
                  f"{per_round}")
    if also and rust[also[0]]:
        print("# Rust only: median img/s (rounds)")
        for name in also:
            rounds = " ".join(f"{x[0]:.1f}" for x in rust[name])
            print(f"  {name:<28} {median(x[0] for x in rust[name]):>9.1f}  ({rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
