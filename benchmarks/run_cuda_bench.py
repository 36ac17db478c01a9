#!/usr/bin/env python3
"""Runs bench_cuda (Ember) and bench_cuda_torch.py (PyTorch) alternately on the same GPU, round
by round, and prints a table of medians over rounds with the ratio PyTorch time / Ember time
(above 1: Ember is faster), and the rate each reached (GB/s for memory-bound cases, TFLOP/s for
matmul and convolution).

    python3 benchmarks/run_cuda_bench.py --bench build/benchmarks/bench_cuda [--rounds 3]
        [--filter S] [--markdown FILE]

--filter gpt_ runs only the cases of one examples/gpt step (LayerNorm, GELU, bias add and its
column sum, causal softmax, cross_entropy, embedding, AdamW, clip_grad_norm_, a whole block).
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_tensor_bench import parse  # noqa: E402


def run(cmd):
    limit = int(os.environ.get("BENCH_TIMEOUT", "300"))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:  # keep the cases it finished
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        sys.stderr.write(f"{cmd[0]} did not finish in {limit} s (BENCH_TIMEOUT)\n")
        return parse(out)
    if p.returncode != 0:
        # The cases it finished before failing still count: GPU time is scarce.
        sys.stderr.write(f"{cmd[0]} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}\n")
    return parse(p.stdout)


def rate(name, sec, flops, nbytes):
    if name.startswith(("matmul", "conv")):
        return f"{flops / sec / 1e12:.1f} TFLOP/s"
    if nbytes:
        return f"{nbytes / sec / 1e9:.0f} GB/s"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="the bench_cuda command (may hold a wrapper)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--filter", default="")
    ap.add_argument("--markdown", default="")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    extra = ["--filter", a.filter] if a.filter else []
    ember, torch = {}, {}
    for r in range(a.rounds):
        for store, cmd in ((ember, shlex.split(a.bench) + extra),
                           (torch, [sys.executable, os.path.join(here, "bench_cuda_torch.py")] + extra)):
            for name, v in run(cmd).items():
                store.setdefault(name, []).append(v)
        # The table so far after every round, so a run cut short still leaves one.
        out = table(ember, torch)
        print(f"# after round {r + 1}/{a.rounds}\n{out}", flush=True)
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(out + "\n")


def table(ember, torch):
    lines = ["| case | Ember | PyTorch | PyTorch time / Ember time |",
             "| --- | --- | --- | --- |"]
    for name in ember:
        e = statistics.median(v[0] for v in ember[name])
        _, flops, nbytes = ember[name][0]
        if name not in torch:
            lines.append(f"| {name} | {e * 1e3:.3f} ms {rate(name, e, flops, nbytes)} | - | - |")
            continue
        t = statistics.median(v[0] for v in torch[name])
        lines.append(f"| {name} | {e * 1e3:.3f} ms {rate(name, e, flops, nbytes)} | "
                     f"{t * 1e3:.3f} ms {rate(name, t, flops, nbytes)} | {t / e:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
