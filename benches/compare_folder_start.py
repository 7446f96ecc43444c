#!/usr/bin/env python3
"""Start-up at ImageNet scale: torchvision's ImageFolder vs ours on the same 1.28 M-file tree (run
by hand, never by tests or CI).

    pip install torch torchvision
    python benches/compare_folder_start.py --rounds 3

Builds and runs `cargo run -p benches --bin folder_start -- --json` (which creates the tree of
empty, ImageNet-named files on first use: 1000 folders x 1281 files), then times
`torchvision.datasets.ImageFolder(root)` on the same tree (its constructor lists every folder,
as every rank of a torchrun job does), interleaving rounds so that both see the same page cache;
prints the best of each and the ratios. Pass --cargo-args "--release" for a release build, or
--ours-bin target/debug/folder_start for one already built.
"""
import argparse
import json
import shlex
import subprocess
import time

from torchvision import datasets


def ours(root, cargo_args, binary):
    run = [binary] if binary else (["cargo", "run", "-q"] + shlex.split(cargo_args)
                                   + ["-p", "benches", "--bin", "folder_start", "--"])
    cmd = run + ["--root", root, "--rounds", "1", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torchvision_seconds(root):
    start = time.perf_counter()
    ds = datasets.ImageFolder(root)
    return time.perf_counter() - start, len(ds.samples)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="target/bench-data/empty-imagenet-train")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cargo-args", default="")
    p.add_argument("--ours-bin", help="an already built folder_start binary (skips cargo)")
    a = p.parse_args()
    best = {"torchvision": float("inf"), "scan_s": float("inf"), "first_open_s": float("inf"),
            "index_read_s": float("inf")}
    ours(a.root, a.cargo_args, a.ours_bin)  # creates the tree, warms the page cache
    for _ in range(a.rounds):
        t, n_tv = torchvision_seconds(a.root)
        best["torchvision"] = min(best["torchvision"], t)
        r = ours(a.root, a.cargo_args, a.ours_bin)
        assert r["files"] == n_tv, (r, n_tv)
        for k in ("scan_s", "first_open_s", "index_read_s"):
            best[k] = min(best[k], r[k])
    tv = best["torchvision"]
    print(f"{n_tv} files in {a.root}, best of {a.rounds} interleaved rounds")
    print(f"{'':<40}{'seconds':>9}{'vs torchvision':>16}")
    print(f"{'torchvision ImageFolder(root)':<40}{tv:>9.3}{1.0:>15.2f}x")
    for k, name in [("scan_s", "ours: plain scan"), ("first_open_s", "ours: scan + write index"),
                    ("index_read_s", "ours: read index (other ranks, reruns)")]:
        print(f"{name:<40}{best[k]:>9.3}{tv / best[k]:>15.2f}x")


if __name__ == "__main__":
    main()
