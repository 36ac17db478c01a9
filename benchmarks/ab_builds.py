#!/usr/bin/env python3
"""A/B two builds of Ember on the benchmarks a refactor must not slow down.

    benchmarks/ab_builds.py BEFORE_BUILD AFTER_BUILD [--rounds N]

Alternates the two builds' binaries N rounds (before, after, after, before, ...: each round
swaps who goes first, so drift in the machine's load hits both alike) on:
  - bench_ddp --np 2, MLP and CNN (ms per step, median over its blocks),
  - bench_collectives --np 2, allreduce/broadcast/allgather/reduce_scatter at 64 KiB, 1 MiB and
    16 MiB (us per call, pipelined),
  - examples/gpt under emberrun, 2 ranks, 30 steps (tokens_per_s),
and prints each figure's median per build and the after/before ratio. The machine is noisy
(+-25% run to run): read the medians, and rerun a row whose ratio is far from 1.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

SIZES = {65536: "64 KiB", 1048576: "1 MiB", 16777216: "16 MiB"}
OPS = ["allreduce", "broadcast", "allgather", "reduce_scatter"]


def run(cmd, timeout=600):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"ab_builds: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def ddp(build):
    out = run([f"{build}/benchmarks/ddp/bench_ddp", "--np", "2", "--model", "mlp,cnn",
               "--repeats", "3", "--steps", "30"])
    rows = {}
    for m in re.finditer(r"^(mlp|cnn)\s+2\s+\d+\s+\d+\s+\|\s+([\d.]+)", out, re.M):
        rows[f"bench_ddp {m.group(1)}, 2 ranks, ms/step"] = float(m.group(2))
    return rows


def collectives(build):
    out = run([f"{build}/benchmarks/bench_collectives", "--np", "2", "--op", ",".join(OPS),
               "--min-bytes", "65536", "--max-bytes", "16777216", "--iters", "50", "--pin"])
    rows, op = {}, None
    for line in out.splitlines():
        m = re.match(r"# bench_collectives: (\w+),", line)
        if m:
            op = m.group(1)
            continue
        f = line.split()
        if op and len(f) >= 3 and f[0].isdigit() and int(f[0]) in SIZES:
            rows[f"{op} {SIZES[int(f[0])]}, us"] = float(f[2])
    return rows


def gpt(build):
    out = run([f"{build}/launcher/emberrun", "--standalone", "--nproc-per-node", "2",
               f"{build}/examples/gpt", "--steps", "30", "--eval-every", "0", "--eval-batches",
               "1", "--log-every", "10"])
    m = re.search(r"tokens_per_s=([\d.]+)", out)
    return {"gpt 2 ranks, tokens/s": float(m.group(1))} if m else {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="ddp,collectives,gpt",
                    help="which benchmarks, comma-separated (default: all three)")
    args = ap.parse_args()
    benches = [{"ddp": ddp, "collectives": collectives, "gpt": gpt}[b]
               for b in args.only.split(",")]
    builds = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    results = {"before": {}, "after": {}}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for which in order:
            for bench in benches:
                for k, v in bench(builds[which]).items():
                    results[which].setdefault(k, []).append(v)
        print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"# medians of {args.rounds} alternating rounds; load average now "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'figure':36s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for k in results["before"]:
        b = statistics.median(results["before"][k])
        a = statistics.median(results["after"].get(k, [float("nan")]))
        print(f"{k:36s} {b:10.1f} {a:10.1f} {a / b:13.3f}")


if __name__ == "__main__":
    main()
