#!/usr/bin/python3
"""Issue 19's table: examples/gpt with --shard none (DDP), zero (DDP + ZeroRedundancyOptimizer)
and fsdp (fully_shard), at 2 and 4 ranks, beside gpt_torch.py (PyTorch 1.13) with DDP and with
its ZeroRedundancyOptimizer, in interleaved runs, medians.

For each world size every configuration runs once per round, `--repeats` rounds. Reported per
configuration: training tokens/s, Ember's allocator high-water mark on rank 0
(peak_memory_bytes: every live tensor byte, FSDP's gathered parameters included) and the largest
resident set over the ranks (peak_rss_mb, the one number both frameworks report). The model is
sized so that model state dominates (8 layers of 512 by default, short context, small batch).

    /usr/bin/python3 benchmarks/sharding/run_sharding.py --build build [--repeats 3] [--steps 20]

torch 1.13's FSDP is not measured: torch.distributed.fsdp does not import under Debian 12's
Python 3.11 (a dataclass with a mutable default), on any device.
"""
import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vs_pytorch"))
import run_gpt  # noqa: E402  (the runner, flags and formatting of benchmarks/vs_pytorch)

EMBER = ("none", "zero", "fsdp")
TORCH = ("none", "zero")


def ember_cmd(a, nproc, shard):
    return run_gpt.ember_cmd(a, nproc, "off", False) + ["--shard", shard]


def torch_cmd(a, nproc, shard):
    return run_gpt.torch_cmd(a, nproc, "off", False) + ["--shard", shard]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--data", default=run_gpt.KJV)
    ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                        os.path.expanduser("~/.cache"), "ember"))
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-batches", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=1800)
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    env = run_gpt.bench_env()
    cores = len(os.sched_getaffinity(0))
    torch_version = subprocess.run(["/usr/bin/python3", "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    print(f"# GPT (layers {a.layers}, heads {a.heads}, dim {a.dim}, context {a.context}, batch "
          f"{a.batch_size} per rank), {a.steps} steps per run, medians of {a.repeats} interleaved "
          f"rounds, {cores} cores, PyTorch {torch_version}, load before: {os.getloadavg()[0]:.2f}",
          flush=True)
    print("| ranks | framework | shard | tok/s | vs Ember DDP | peak_memory_bytes (rank 0) | vs DDP "
          "| peak RSS MB | val loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for nproc in (int(n) for n in a.ranks.split(",")):
        runs = {("ember", s): [] for s in EMBER}
        if not a.no_torch:
            runs.update({("torch", s): [] for s in TORCH})
        for _ in range(a.repeats):
            for (fw, shard), out in runs.items():
                cmd = ember_cmd(a, nproc, shard) if fw == "ember" else torch_cmd(a, nproc, shard)
                keys = ("peak_memory_bytes",) if fw == "ember" else ()
                out.append(run_gpt.run(cmd, env, a.limit, keys))
        med = {k: {key: run_gpt.medians(v, key) for key in
                   ("tokens_per_s", "peak_memory_bytes", "peak_rss_mb", "val_loss")}
               for k, v in runs.items() if k[0] == "ember"}
        med.update({k: {key: run_gpt.medians(v, key) for key in
                        ("tokens_per_s", "peak_rss_mb", "val_loss")}
                    for k, v in runs.items() if k[0] == "torch"})
        ddp = med[("ember", "none")]
        for (fw, shard), m in med.items():
            mem = m.get("peak_memory_bytes")
            print(f"| {nproc} | {'Ember' if fw == 'ember' else 'PyTorch'} | {shard} | "
                  f"{m['tokens_per_s']:.0f} | {run_gpt.ratio(m['tokens_per_s'], ddp['tokens_per_s'])} | "
                  f"{run_gpt.fmt(mem, '.0f')} | "
                  f"{run_gpt.ratio(mem, ddp['peak_memory_bytes']) if mem else 'n/a'} | "
                  f"{m['peak_rss_mb']:.0f} | {m['val_loss']:.4f} |", flush=True)
        if not a.no_torch:
            tz = med[("torch", "zero")]["tokens_per_s"]
            print(f"\nEmber FSDP / PyTorch ZeRO tok/s at {nproc} ranks: "
                  f"{run_gpt.ratio(med[('ember', 'fsdp')]['tokens_per_s'], tz)}; Ember ZeRO / "
                  f"PyTorch ZeRO: {run_gpt.ratio(med[('ember', 'zero')]['tokens_per_s'], tz)}\n",
                  flush=True)


if __name__ == "__main__":
    main()
