#!/usr/bin/env python3
"""PyTorch on the CPU vs the `train_step` benchmark, same model and batch (run by hand only).

    python benches/compare_train_step.py --model resnet50 --batch 8 --image-size 224 --threads 2

Times torchvision's model with SGD (momentum 0.9): forward, cross-entropy, backward, step, on a
fixed random batch; then runs `cargo run --release -p benches --bin train_step -- --json --no-data`
with the same settings and prints both img/s figures and the ratio ours / PyTorch.

To compare builds or switches in the same run, name each binary (repeatable):

    python benches/compare_train_step.py --model resnet18 --batch 32 --image-size 32 --threads 2 \
        --exe before=/old/target/release/train_step --exe "after=target/release/train_step@--conv burn"

`LABEL=PATH[@EXTRA ARGS]`: extra arguments, split on spaces, are passed to that binary. Each
binary runs after PyTorch, one at a time, so they never share the cores.

On a shared machine, `--rounds N` repeats PyTorch and every binary N times, interleaved
(PyTorch, A, B, PyTorch, A, B, ...), and reports each one's median, every round, and the median
of the paired ratios (each round's figure over that round's PyTorch figure), so a slow minute on
the host moves one round and not the ratio.
"""
import argparse
import json
import shlex
import statistics
import subprocess
import time

import torch
import torchvision


def torch_img_per_sec(model_name, batch, size, steps, warmup, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    times.sort()
    return batch / times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rust-json", help="saved output of train_step --json instead of running it")
    p.add_argument("--exe", action="append",
                   help="LABEL=PATH[@EXTRA ARGS] of a train_step binary; repeatable")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved repetitions of every row; medians are reported")
    a = p.parse_args()

    common = ["--model", a.model, "--batch", str(a.batch), "--image-size", str(a.image_size),
              "--steps", str(a.steps), "--warmup", str(a.warmup), "--no-data", "--json"]

    def run_json(cmd):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])["step_img_per_sec"]

    runs = []  # (label, callable returning img/s)
    if a.rust_json:
        ips = json.load(open(a.rust_json))["step_img_per_sec"]
        runs.append(("burn flex (ours)", lambda ips=ips: ips))
    elif a.exe:
        for spec in a.exe:
            label, _, rest = spec.partition("=")
            path, _, extra = rest.partition("@")
            cmd = [path, *common, *shlex.split(extra)]
            runs.append((label, lambda cmd=cmd: run_json(cmd)))
    else:
        cmd = ["cargo", "run", "--release", "-q", "-p", "benches", "--bin", "train_step", "--", *common]
        runs.append(("burn flex (ours)", lambda cmd=cmd: run_json(cmd)))

    torch_label = "PyTorch " + torch.__version__
    figures = {torch_label: []}
    figures.update({label: [] for label, _ in runs})
    for _ in range(max(1, a.rounds)):
        figures[torch_label].append(
            torch_img_per_sec(a.model, a.batch, a.image_size, a.steps, a.warmup, a.threads))
        for label, run in runs:
            figures[label].append(run())

    theirs = statistics.median(figures[torch_label])
    print(f"# {a.model} batch {a.batch} at {a.image_size}x{a.image_size}, CPU, {a.threads} threads"
          + (f", median of {a.rounds} interleaved rounds" if a.rounds > 1 else ""))
    # With rounds, the paired ratio (each round's figure over the PyTorch figure of the same
    # round, minutes apart) is the one that cancels the host's drift; its median is reported.
    paired_head = f" {'paired ratio':>13}" if a.rounds > 1 else ""
    print(f"# {'impl':<28} {'step(img/s)':>12} {'ratio(vs torch)':>16}{paired_head}  rounds")
    for label, values in figures.items():
        ips = statistics.median(values)
        each = " ".join(f"{v:.2f}" for v in values) if len(values) > 1 else ""
        paired = ""
        if a.rounds > 1:
            ratios = [v / t for v, t in zip(values, figures[torch_label])]
            paired = f" {statistics.median(ratios):>12.2f}x"
        print(f"  {label:<28} {ips:>12.2f} {ips / theirs:>15.2f}x{paired}  {each}")

if __name__ == "__main__":
    main()
