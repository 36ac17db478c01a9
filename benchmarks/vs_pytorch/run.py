#!/usr/bin/python3
"""Ember's Fashion-MNIST job beside PyTorch's, in one benchmark run (issue 8's table).

For each row (model, ranks, communication hook) it runs examples/fashion_mnist (through emberrun
for 2 ranks) and fashion_mnist_torch.py alternately, `--repeats` times each, every run training
`--steps` steps per rank, and reports the median images/s of both and their ratio. Threads per
rank are cores / ranks for both. With --accuracy it also trains each framework for `--epochs`
epochs on the CNN with 2 ranks and reports test accuracy per epoch and the time to 90%.

    /usr/bin/python3 benchmarks/vs_pytorch/run.py --build build [--repeats 5] [--accuracy]
        [--torch-python /usr/bin/python3 --torch-python "$(benchmarks/vs_pytorch/setup_torch.sh)"]
        [--torch-compile]

Each --torch-python adds a PyTorch column (Debian's 1.13 by default); --torch-compile adds each
PyTorch 2's torch.compile beside its eager column.

The machine is noisy: compare medians of interleaved runs, never single runs.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch_sides

HERE = os.path.dirname(os.path.abspath(__file__))
EPOCH_RE = re.compile(r"epoch (\d+)/\d+: train loss ([0-9.]+), test loss ([0-9.]+), "
                      r"test accuracy ([0-9.]+)%, ([0-9.]+) s, ([0-9.]+) img/s")


def ember_cmd(build, nproc, model, hook, extra):
    prog = [os.path.join(build, "examples", "fashion_mnist"), "--model", model] + extra
    if hook != "none":
        prog += ["--comm-hook", hook]
    if hook == "powersgd":
        prog += ["--powersgd-rank", "2", "--powersgd-start", "10"]  # as the torch script
    if nproc == 1:
        return prog
    return [os.path.join(build, "launcher", "emberrun"), "--nproc-per-node", str(nproc)] + prog


def torch_cmd(nproc, model, hook, extra, python="/usr/bin/python3", compile_=False):
    cmd = [python, os.path.join(HERE, "fashion_mnist_torch.py"), "--nproc", str(nproc),
           "--model", model] + extra
    if compile_:
        cmd += ["--compile", "--warmup-steps", str(COMPILE_WARMUP)]
    if hook != "none":
        cmd += ["--comm-hook", hook]
    return cmd


# Steps torch.compile's runs leave out of img/s (they compile); Ember and eager runs count all.
COMPILE_WARMUP = 20


def run(cmd, env=None, attempts=2):
    t0 = time.perf_counter()
    # Own session, so that a hung run is killed with all its ranks (killing the launcher alone
    # left a torch rank spinning).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
        p = subprocess.CompletedProcess(cmd, proc.returncode, out)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        # torch 1.13's gloo job has been seen to hang at exit with one rank spinning; say so, retry
        print(f"# run.py: {' '.join(cmd)} hung for 300 s; killed" + (", retrying" if attempts > 1 else ""),
              flush=True)
        if attempts > 1:
            return run(cmd, env, attempts - 1)
        raise
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"run.py: {' '.join(cmd)} failed with status {p.returncode}:\n{p.stdout[-3000:]}")
    epochs = [dict(epoch=int(m[1]), train_loss=float(m[2]), test_loss=float(m[3]),
                   accuracy=float(m[4]) / 100, seconds=float(m[5]), ips=float(m[6]))
              for m in EPOCH_RE.finditer(p.stdout)]
    if not epochs:
        sys.exit(f"run.py: no epoch line in the output of {' '.join(cmd)}:\n{p.stdout[-3000:]}")
    return epochs, wall


def time_to(epochs, target):
    t = 0.0
    for e in epochs:
        t += e["seconds"]
        if e["accuracy"] >= target:
            return t
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300, help="steps per rank per throughput run")
    ap.add_argument("--rows", default="cnn:1:none,cnn:2:none,cnn:2:fp16,cnn:2:powersgd,"
                                      "mlp:1:none,mlp:2:none,mlp:2:fp16,mlp:2:powersgd",
                    help="model:ranks:hook,...")
    ap.add_argument("--accuracy", action="store_true", help="also the time-to-90%% runs")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--json", default="", help="write the results here too")
    torch_sides.add_arguments(ap, COMPILE_WARMUP)
    args = ap.parse_args()
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "EMBER_NUM_THREADS"):
        env.pop(k, None)
    # Both frameworks' OpenMP threads sleep between parallel regions (emberrun's default for its
    # workers; without it libgomp's spinning makes 2-thread runs crawl on a busy 2-core VM).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cores = len(os.sched_getaffinity(0))

    results = []
    # The PyTorch columns: each interpreter's torch eager, and compiled with --torch-compile.
    sides = torch_sides.sides(args)
    print(f"# Fashion-MNIST, Ember vs {', '.join(side.name for side in sides)}, "
          f"{cores} cores, {args.steps} steps per rank per run, medians of {args.repeats} interleaved runs")
    print("| model | ranks | hook | Ember img/s | " +
          " | ".join(f"{side.name} img/s | ratio" for side in sides) + " |")
    print("|---|---|---|---|" + "---|---|" * len(sides))
    for row in args.rows.split(","):
        model, nproc, hook = row.split(":")
        nproc = int(nproc)
        extra = ["--epochs", "1", "--max-steps", str(args.steps)]
        e_ips, t_ips = [], [[] for _ in sides]
        for _ in range(args.repeats):
            e_ips.append(run(ember_cmd(args.build, nproc, model, hook, extra), env)[0][0]["ips"])
            for k, side in enumerate(sides):
                t_ips[k].append(run(torch_cmd(nproc, model, hook, extra, side.python, side.compiled),
                                    env)[0][0]["ips"])
        e = statistics.median(e_ips)
        results.append(dict(model=model, ranks=nproc, hook=hook, ember_ips=e_ips,
                            torch_ips={side.name: t for side, t in zip(sides, t_ips)}))
        cells = " | ".join(f"{statistics.median(t):.0f} | {e / statistics.median(t):.2f}x"
                           for t in t_ips)
        print(f"| {model} | {nproc} | {hook} | {e:.0f} | {cells} |", flush=True)

    if args.accuracy:
        print(f"\n# CNN, 2 ranks, {args.epochs} epochs: test accuracy after each epoch, time to 90%")
        print("| framework | " + " | ".join(f"epoch {i + 1}" for i in range(args.epochs)) +
              " | time to 90% (training s) |")
        print("|---|" + "---|" * args.epochs + "---|")
        extra = ["--epochs", str(args.epochs)]
        for name, cmd in (("Ember", ember_cmd(args.build, 2, "cnn", "none", extra)),
                          ("PyTorch", torch_cmd(2, "cnn", "none", extra))):
            epochs, _ = run(cmd, env)
            t90 = time_to(epochs, 0.90)
            results.append(dict(framework=name, epochs=epochs, time_to_90=t90))
            print(f"| {name} | " + " | ".join(f"{100 * e['accuracy']:.2f}%" for e in epochs) +
                  f" | {'not reached' if t90 is None else f'{t90:.1f}'} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
