#!/usr/bin/env python3
"""Compare burn-dist's host all-reduce with torch.distributed Gloo and Open MPI (run by hand, never
by tests).

    python3 benches/compare_allreduce.py --nproc 2 [--max-bytes 268435456] [--skip-build]
    python3 benches/compare_allreduce.py --exe before=/path/to/old/allreduce --exe after=target/release/allreduce

Each `--exe LABEL=PATH` adds one of our binaries to the same run (e.g. before and after a change;
`LABEL=PATH@VAR=VALUE` also sets an environment variable for it, e.g. `tcp=...@BURN_DIST_SHM=0`).

Runs the same sweep as `benches/src/bin/allreduce.rs` (in-place f32 sum, 8 B .. max ×2, warm-up,
then timed iterations; busbw = algbw * 2(n-1)/n as nccl-tests) with Gloo on 127.0.0.1 using
`--nproc` processes, runs our binary with `--json`, and prints the tables and the busbw ratios.
`--rounds N` (default 3) runs every side N times, interleaved in a rotating order, and reports
medians and the median (min-max) of the ratios taken within each round: on a VM the same binary
can run 4x faster or slower from one minute to the next (whether the host keeps both vCPUs on
one cache), so a single pass per side does not rank them.
Needs `pip install torch`. The Open MPI column runs when `mpirun` and mpi4py are there (Debian:
`apt install openmpi-bin libopenmpi-dev`, then `pip install mpi4py numpy`), with Open MPI's own
defaults for one machine (shared memory through its `vader` transport and `coll/tuned`); it is
skipped, and says so, otherwise.
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iterations(nbytes, max_iters):
    return min(max(5, (2 << 30) // max(nbytes, 1)), max(5, max_iters))


def gloo_worker(rank, nproc, port, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    rows = []
    nbytes = max(args.min_bytes, 4)
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        idx = torch.arange(count, dtype=torch.int64)
        buf = ((idx % 13).float() + 1.0) * (rank + 1) * 1e-3
        iters = iterations(nbytes, args.iters)
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        check = ((idx % 13).float() + 1.0) * (rank + 1)
        dist.all_reduce(check)
        expect = ((idx % 13).float() + 1.0) * (nproc * (nproc + 1) / 2)
        wrong = torch.tensor([int((check != expect).sum())])
        dist.all_reduce(wrong)
        t = float(t[0])
        algbw = nbytes / t / 1e9
        rows.append({"size": nbytes, "count": count, "type": "float", "time_us": t * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (nproc - 1) / nproc, "wrong": int(wrong[0])})
        nbytes *= 2
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run_gloo(args):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_worker, args=(r, args.nproc, port, args, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


def mpi_worker(args):
    """One rank under `mpirun`: the same sweep through mpi4py's in-place Allreduce."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, nproc = comm.Get_rank(), comm.Get_size()
    rows = []
    nbytes = max(args.min_bytes, 4)
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        idx = np.arange(count, dtype=np.int64)
        buf = (((idx % 13) + 1.0) * (rank + 1) * 1e-3).astype(np.float32)
        iters = iterations(nbytes, args.iters)
        for _ in range(args.warmup):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t = comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)
        check = (((idx % 13) + 1.0) * (rank + 1)).astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)
        expect = (((idx % 13) + 1.0) * (nproc * (nproc + 1) / 2)).astype(np.float32)
        wrong = comm.allreduce(int((check != expect).sum()), op=MPI.SUM)
        algbw = nbytes / t / 1e9
        rows.append({"size": nbytes, "count": count, "type": "float", "time_us": t * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * 2 * (nproc - 1) / nproc, "wrong": wrong})
        nbytes *= 2
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)


def run_mpi(args):
    """Open MPI's rows, or None (and why) when mpirun or mpi4py is missing."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "no mpirun on PATH"
    probe = subprocess.run([sys.executable, "-c", "import mpi4py, numpy"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, "mpi4py or numpy missing for " + sys.executable
    cmd = [mpirun, "-np", str(args.nproc), "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, os.path.abspath(__file__), "--mpi-worker",
            "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
            "--warmup", str(args.warmup), "--iters", str(args.iters)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")], None


def run_ours(args, exe, env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([exe, "--nproc", str(args.nproc), "--backend", "host", "--json",
                          "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
                          "--warmup", str(args.warmup), "--iters", str(args.iters)],
                         check=True, capture_output=True, text=True, env=env)
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def binaries(args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not args.exe:
        if not args.skip_build:
            subprocess.run(["cargo", "build", "--release", "-p", "benches", "--bin", "allreduce",
                            "--no-default-features"], cwd=root, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
        return [("ours", os.path.join(target, "release", "allreduce"), {})]
    out = []
    for spec in args.exe:
        label, _, rest = spec.partition("=")
        path, _, var = rest.partition("@")
        env = dict([var.split("=", 1)]) if var else {}
        out.append((label, path, env))
    return out


def table(title, rows):
    print(f"# {title}")
    print(f"# {'size(B)':>12} {'count':>12} {'type':>6} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>8}")
    for r in rows:
        print(f"  {r['size']:>12} {r['count']:>12} {r['type']:>6} {r['time_us']:>12.1f} {r['algbw_gbs']:>12.3f} "
              f"{r['busbw_gbs']:>12.3f} {r['wrong']:>8}")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--skip-build", action="store_true", help="use the existing target/release/allreduce")
    ap.add_argument("--only", choices=["ours", "gloo", "mpi"], action="append",
                    help="run only these sides (repeatable)")
    ap.add_argument("--exe", action="append", help="LABEL=PATH[@VAR=VALUE] of an allreduce binary; repeatable")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of every side; medians and per-round ratios are reported")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mpi_worker:
        return mpi_worker(args)
    sides = set(args.only or ["ours", "gloo", "mpi"])
    # Every side is a thunk returning one sweep's rows; each round runs them all, in an order
    # rotated per round, so a machine whose speed drifts between minutes (a VM whose cores the
    # host moves) weighs on every side alike, and ratios are taken within a round.
    runs = [("ours", label, lambda p=path, e=env: run_ours(args, p, e))
            for label, path, env in binaries(args)] if "ours" in sides else []
    first_mpi = None
    if "mpi" in sides:
        mpi, why = run_mpi(args)
        if mpi is None:
            print(f"# Open MPI skipped: {why}")
        else:
            runs.append(("anchor", "openmpi", lambda: run_mpi(args)[0]))
            first_mpi = mpi
    if "gloo" in sides:
        runs.append(("anchor", "gloo", lambda: run_gloo(args)))
    rounds = {label: [] for _, label, _ in runs}
    for r in range(args.rounds):
        shift = r % len(runs) if runs else 0
        for kind, label, sweep in runs[shift:] + runs[:shift]:
            rows = first_mpi if (label == "openmpi" and r == 0) else sweep()
            rounds[label].append(rows)
    ours = [label for kind, label, _ in runs if kind == "ours"]
    anchors = [label for kind, label, _ in runs if kind == "anchor"]
    for label in ours + anchors:
        what = f"burn-dist host ({label})" if label in ours else label
        table(f"{what}, {args.nproc} processes, median of {args.rounds} round(s)", medians(rounds[label]))
    # One line per size: every anchor's median busbw, then each of ours with the median (and the
    # range) of its per-round ratio to every anchor.
    if ours and anchors:
        heads = "".join(f" {label + ' busbw':>14}" for label in anchors)
        for label in ours:
            heads += f" {label + ' busbw':>14}" + "".join(f" {'/' + a:>18}" for a in anchors)
        print(f"# {'size(B)':>12}{heads}")
        for i, first in enumerate(rounds[anchors[0]][0]):
            cells = "".join(f" {median_busbw(rounds[a], i):>14.3f}" for a in anchors)
            for label in ours:
                cells += f" {median_busbw(rounds[label], i):>14.3f}"
                for a in anchors:
                    ratios = [o[i]["busbw_gbs"] / g[i]["busbw_gbs"]
                              for o, g in zip(rounds[label], rounds[a]) if g[i]["busbw_gbs"] > 0]
                    cell = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                            if ratios else "nan")
                    cells += f" {cell:>18}"
            print(f"  {first['size']:>12}{cells}")
    print(f"# load average at the end: {os.getloadavg()}")


def median_busbw(sweeps, i):
    return statistics.median(rows[i]["busbw_gbs"] for rows in sweeps)


def medians(sweeps):
    """One sweep's rows with every number the median over the rounds (`wrong` the maximum)."""
    out = []
    for i, first in enumerate(sweeps[0]):
        row = dict(first)
        for key in ("time_us", "algbw_gbs", "busbw_gbs"):
            row[key] = statistics.median(rows[i][key] for rows in sweeps)
        row["wrong"] = max(rows[i]["wrong"] for rows in sweeps)
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
