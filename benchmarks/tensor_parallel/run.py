#!/usr/bin/python3
"""Tensor parallelism's targets (issue 35), alternating runs, medians:

  speed   examples/gpt --tp 2 over 2 processes against DDP at 2 ranks with the same global batch
          (target >= 0.8x), the sequence-parallel collectives overlapped with their matmuls in
          pieces (--tp-overlap K) against fused without overlap (--tp-overlap 1; target >= 1.1x)
          and unfused (--tp-overlap 0), and against PyTorch's parallelize_module on gloo with
          the same model and plan (gpt_tp_torch.py; target >= 1.5x);
  memory  the allocator's peak per rank at --tp 2 and --tp 4 against one process training the
          same model on the same batch (targets <= 0.6x and <= 0.4x).

    /usr/bin/python3 benchmarks/tensor_parallel/run.py --build build [--repeats 3] [--steps 20]

PyTorch comes from --torch-python (build/torch-venv/bin/python, made by
benchmarks/vs_pytorch/setup_torch.sh); without it the PyTorch row is skipped, saying so.
Threads per rank are cores / ranks for both frameworks. The machine is noisy: compare medians of
interleaved runs, never single runs.
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vs_pytorch"))
from run_gpt import KJV, bench_env, fmt, medians, run  # noqa: E402


def model_flags(a, batch):
    return ["--layers", str(a.layers), "--heads", str(a.heads), "--dim", str(a.dim),
            "--context", str(a.context), "--batch-size", str(batch), "--steps", str(a.steps)]


def ember(a, nproc, batch, extra=()):
    prog = ([os.path.join(a.build, "examples", "gpt"), "--data", a.data, "--cache-dir",
             a.cache_dir, "--eval-every", "0", "--eval-batches", "1"] + model_flags(a, batch) +
            list(extra))
    if nproc == 1:
        return prog
    return [os.path.join(a.build, "launcher", "emberrun"), "--standalone", "--nproc-per-node",
            str(nproc)] + prog


def torch_tp(a, nproc, tp, batch):
    tokens = os.path.join(a.cache_dir, os.path.basename(a.data) + ".tokens")
    return [a.torch_python, os.path.join(HERE, "gpt_tp_torch.py"), "--tokens", tokens,
            "--nproc", str(nproc), "--tp", str(tp)] + model_flags(a, batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--data", default=KJV)
    ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                        os.path.expanduser("~/.cache"), "ember"))
    ap.add_argument("--torch-python", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16, help="the global batch")
    ap.add_argument("--overlap", type=int, default=2, help="--tp-overlap K of the overlapped row")
    ap.add_argument("--limit", type=int, default=1800, help="seconds one run may take")
    ap.add_argument("--only", default="speed,memory")
    a = ap.parse_args()
    if not a.torch_python:
        a.torch_python = os.path.join(a.build, "torch-venv", "bin", "python")
    have_torch = os.path.exists(a.torch_python)
    env = bench_env()
    torch_version = "not installed"
    if have_torch:
        torch_version = subprocess.run([a.torch_python, "-c", "import torch; print(torch.__version__)"],
                                       capture_output=True, text=True).stdout.strip()
    B = a.batch_size
    print(f"# GPT (layers {a.layers}, heads {a.heads}, dim {a.dim}, context {a.context}), global "
          f"batch {B}, {len(os.sched_getaffinity(0))} cores, PyTorch {torch_version}, medians of "
          f"{a.repeats} interleaved runs of {a.steps} steps, load before: "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    if "speed" in a.only:
        rows = [
            ("DDP, 2 ranks", lambda: ember(a, 2, B // 2)),
            ("tp 2, fused, no overlap (--tp-overlap 1)", lambda: ember(a, 2, B, ["--tp", "2"])),
            (f"tp 2, overlapped in {a.overlap} (--tp-overlap {a.overlap})",
             lambda: ember(a, 2, B, ["--tp", "2", "--tp-overlap", str(a.overlap)])),
            ("tp 2, unfused (--tp-overlap 0)",
             lambda: ember(a, 2, B, ["--tp", "2", "--tp-overlap", "0"])),
        ]
        if have_torch:
            rows.append((f"PyTorch {torch_version} parallelize_module, tp 2",
                         lambda: torch_tp(a, 2, 2, B)))
        runs = {name: [] for name, _ in rows}
        for _ in range(a.repeats):
            for name, cmd in rows:
                runs[name].append(run(cmd(), env, a.limit))
        tps = {name: medians(r, "tokens_per_s") for name, r in runs.items()}
        print("\n| run | tokens/s (median) | all runs |")
        print("|---|---|---|")
        for name, r in runs.items():
            print(f"| {name} | {fmt(tps[name], '.0f')} | "
                  f"{', '.join(format(x['tokens_per_s'], '.0f') for x in r)} |")
        names = [n for n, _ in rows]
        print(f"\ntp 2 / DDP: {tps[names[1]] / tps[names[0]]:.2f}x (target >= 0.8x)")
        print(f"overlapped / no overlap: {tps[names[2]] / tps[names[1]]:.2f}x (target >= 1.1x); "
              f"fused / unfused: {tps[names[1]] / tps[names[3]]:.2f}x")
        if have_torch:
            print(f"Ember tp 2 / PyTorch tp 2: {tps[names[1]] / tps[names[4]]:.2f}x "
                  f"(target >= 1.5x)")
        else:
            print(f"PyTorch: {a.torch_python} is missing (benchmarks/vs_pytorch/setup_torch.sh)")
    if "memory" in a.only:
        steps = str(a.memory_steps)
        mem = {}
        for name, nproc, extra in [("one process", 1, []), ("tp 2", 2, ["--tp", "2"]),
                                   ("tp 4", 4, ["--tp", "4"])]:
            cmd = ember(a, nproc, B, extra + ["--steps", steps])
            mem[name] = run(cmd, env, a.limit, extra_keys=("peak_memory_bytes",))
        one = mem["one process"]["peak_memory_bytes"]
        print("\n| layout | peak allocated per rank (MB) | ratio to one process | peak RSS (MB) |")
        print("|---|---|---|---|")
        for name, r in mem.items():
            print(f"| {name} | {r['peak_memory_bytes'] / 2**20:.0f} | "
                  f"{r['peak_memory_bytes'] / one:.2f}x | {r['peak_rss_mb']:.0f} |")
        print("(targets: tp 2 <= 0.6x, tp 4 <= 0.4x)")
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
