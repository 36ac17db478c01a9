#!/usr/bin/python3
"""examples/gpt beside gpt_torch.py (PyTorch 1.13 or current), alternating runs, medians.

For each row (ranks, amp) it runs Ember's examples/gpt (through emberrun for 2 ranks) and
gpt_torch.py alternately, `--repeats` times each, every run training `--steps` steps with the
same model, initialisation scheme, data windows and optimizer, and reports the median training
tokens/s of both and their ratio, and the median validation loss after those steps. With
--memory it also reports the peak resident memory (largest ru_maxrss over the ranks) with and
without activation checkpointing. A configuration Ember refuses as "not available yet" (--amp
bf16 or --checkpoint-activations before autocast and nn::checkpoint are in) is shown as n/a.

    /usr/bin/python3 benchmarks/vs_pytorch/run_gpt.py --build build [--steps 200] [--repeats 3]
        [--torch-python /usr/bin/python3 --torch-python "$(benchmarks/vs_pytorch/setup_torch.sh)"]
        [--torch-compile] [--rows 2:off,2:bf16,2:off:fsdp]

Each --torch-python adds a PyTorch column (Debian's 1.13 by default: attention written out, as
it has no fused kernel; PyTorch 2 runs F.scaled_dot_product_attention); --torch-compile adds
each PyTorch 2's torch.compile beside its eager column. A row's shard (none, zero, fsdp) runs
examples/gpt --shard beside DDP, ZeroRedundancyOptimizer or FSDP2's fully_shard.

Threads per rank are cores / ranks for both. The machine is noisy: compare medians of
interleaved runs, never single runs.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys

import torch_sides

HERE = os.path.dirname(os.path.abspath(__file__))
KJV = "/usr/lib/bible.data"
NOT_YET = "not available yet"


def model_flags(a):
    return ["--layers", str(a.layers), "--heads", str(a.heads), "--dim", str(a.dim),
            "--context", str(a.context), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
            "--eval-every", "0", "--eval-batches", str(a.eval_batches), "--seed", str(a.seed)]


def ember_cmd(a, nproc, amp, ckpt):
    prog = [os.path.join(a.build, "examples", "gpt"), "--data", a.data, "--cache-dir", a.cache_dir,
            "--amp", amp] + model_flags(a) + (["--checkpoint-activations"] if ckpt else [])
    if nproc == 1:
        return prog
    return [os.path.join(a.build, "launcher", "emberrun"), "--standalone", "--nproc-per-node",
            str(nproc)] + prog


# Steps a torch.compile run leaves out of tokens/s (it compiles in them); the others count all.
COMPILE_WARMUP = 10


def torch_cmd(a, nproc, amp, ckpt, side=None):
    """gpt_torch.py's command; `side` is a Side (interpreter, version, compiled), Debian's 1.13
    when None. PyTorch 2 runs fused attention (SDPA), as Ember does; 1.13 has none."""
    side = side or torch_sides.Side(torch_sides.DEBIAN, "1.13", False)
    tokens = os.path.join(a.cache_dir, os.path.basename(a.data) + ".tokens")
    cmd = ([side.python, os.path.join(HERE, "gpt_torch.py"), "--tokens", tokens,
            "--nproc", str(nproc), "--amp", amp] + model_flags(a) +
           (["--checkpoint-activations"] if ckpt else []))
    if not side.is_1x:
        cmd += ["--attention", "fused"]
    if side.compiled:
        cmd += ["--compile", "--warmup-steps", str(min(COMPILE_WARMUP, a.steps // 2))]
    return cmd


def bench_env():
    """The environment both frameworks run in: threads per rank left to each (cores / ranks),
    OpenMP threads sleeping between parallel regions (spinning crawls on a busy 2-core VM)."""
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "EMBER_NUM_THREADS"):
        env.pop(k, None)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def value(out, key):
    m = re.search(r"(?:^|\n|: )" + key + r"=([0-9.]+)\n", out)
    return float(m[1]) if m else None


def run(cmd, env, limit_s, extra_keys=()):
    """The run's val_loss, tokens_per_s and peak_rss_mb (and extra_keys), or None when Ember
    refuses it as not available yet."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # a hung run dies with its ranks
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        sys.exit(f"run_gpt.py: {' '.join(cmd)} ran past {limit_s} s; killed")
    if proc.returncode != 0:
        if NOT_YET in out:
            return None
        sys.exit(f"run_gpt.py: {' '.join(cmd)} failed with status {proc.returncode}:\n{out[-3000:]}")
    r = {k: value(out, k) for k in ("val_loss", "tokens_per_s", "peak_rss_mb") + tuple(extra_keys)}
    if None in r.values():
        sys.exit(f"run_gpt.py: no result lines in the output of {' '.join(cmd)}:\n{out[-3000:]}")
    return r


def medians(runs, key):
    vals = [r[key] for r in runs if r is not None]
    return statistics.median(vals) if vals else None


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def ratio(e, t, spec=".2f"):
    return "n/a" if e is None or t is None else format(e / t, spec) + "x"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--data", default=KJV)
    ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                        os.path.expanduser("~/.cache"), "ember"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", default="1:off,2:off,1:bf16,2:bf16",
                    help="ranks:amp[:shard],... (shard none, zero or fsdp: examples/gpt --shard "
                         "beside DDP, ZeroRedundancyOptimizer or FSDP2's fully_shard)")
    torch_sides.add_arguments(ap, COMPILE_WARMUP)
    ap.add_argument("--memory", action="store_true",
                    help="also peak memory with and without activation checkpointing (2 ranks)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=3600, help="seconds one run may take")
    ap.add_argument("--json", default="", help="write every run's numbers here too")
    a = ap.parse_args()
    env = bench_env()
    cores = len(os.sched_getaffinity(0))
    sides = torch_sides.sides(a)
    print(f"# GPT (layers {a.layers}, heads {a.heads}, dim {a.dim}, context {a.context}, batch "
          f"{a.batch_size} per rank), Ember vs {', '.join(s.name for s in sides)}, {cores} cores, "
          f"{a.steps} steps per run, medians of {a.repeats} interleaved runs, load before: "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    results = []
    print("| ranks | amp | shard | Ember tok/s | " +
          " | ".join(f"{s.name} tok/s | ratio" for s in sides) +
          " | Ember val loss | " + " | ".join(f"{s.name} val loss" for s in sides) +
          " | Ember peak RSS MB | " + " | ".join(f"{s.name} peak RSS MB" for s in sides) + " |")
    print("|---|---|---|---|" + "---|---|" * len(sides) + "---|" + "---|" * len(sides) +
          "---|" + "---|" * len(sides))
    for row in a.rows.split(","):
        nproc, amp, shard = (row.split(":") + ["none"])[:3]
        nproc = int(nproc)
        shard_flags = [] if shard == "none" else ["--shard", shard]
        e_runs, t_runs = [], [[] for _ in sides]
        for _ in range(a.repeats):
            e_runs.append(run(ember_cmd(a, nproc, amp, False) + shard_flags, env, a.limit))
            for k, side in enumerate(sides):
                if shard == "fsdp" and side.is_1x:
                    t_runs[k].append(None)  # torch 1.13's FSDP does not import under Python 3.11
                    continue
                t_runs[k].append(run(torch_cmd(a, nproc, amp, False, side) + shard_flags, env,
                                     a.limit))
        e = medians(e_runs, "tokens_per_s")
        results.append(dict(ranks=nproc, amp=amp, shard=shard, ember=e_runs,
                            torch={s.name: r for s, r in zip(sides, t_runs)}))
        speed = " | ".join(f"{fmt(medians(r, 'tokens_per_s'), '.0f')} | "
                           f"{ratio(e, medians(r, 'tokens_per_s'))}" for r in t_runs)
        loss = " | ".join(fmt(medians(r, "val_loss"), ".4f") for r in t_runs)
        rss = " | ".join(fmt(medians(r, "peak_rss_mb"), ".0f") for r in t_runs)
        print(f"| {nproc} | {amp} | {shard} | {fmt(e, '.0f')} | {speed} | "
              f"{fmt(medians(e_runs, 'val_loss'), '.4f')} | {loss} | "
              f"{fmt(medians(e_runs, 'peak_rss_mb'), '.0f')} | {rss} |", flush=True)
    if a.memory:
        print("\n# peak resident memory (MB, largest over 2 ranks), with and without activation "
              "checkpointing")
        print("| checkpointing | Ember | PyTorch | ratio |")
        print("|---|---|---|---|")
        for ckpt in (False, True):
            e = run(ember_cmd(a, 2, "off", ckpt), env, a.limit)
            t = run(torch_cmd(a, 2, "off", ckpt), env, a.limit)
            em, tm = (e or {}).get("peak_rss_mb"), t["peak_rss_mb"]
            results.append(dict(checkpointing=ckpt, ember=e, torch=t))
            print(f"| {'on' if ckpt else 'off'} | {fmt(em, '.0f')} | {fmt(tm, '.0f')} | "
                  f"{ratio(em, tm)} |", flush=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
