#!/usr/bin/env python3
"""Launch overhead of emberrun beside torchrun, measured in the same run.

For N local ranks (2 and 4 by default), each launcher starts N trivial workers that call
init_process_group (gloo, env://), do one allreduce and exit:
  emberrun --standalone --nproc-per-node N build/launcher/test_workers/dist_worker DIR
  python3 -m torch.distributed.run --standalone --nproc_per_node N -r 0:1 -t 0:1
      --monitor_interval 0.1 worker.py DIR      (torch 1.13 knows only the underscore names)
Each worker writes DIR/init_<rank>: the wall-clock time init_process_group returned.
"ember-2n" is the same job started as two nodes on loopback (two emberruns, --nnodes 2, N/2
ranks each), so the multi-node rendezvous is included. Reported per launcher (medians over the
repetitions, interleaved so load changes hit all alike):
  init  time from starting the launcher to the last worker past init (the target: < 0.5 s)
  total time from starting the launcher to its exit
torchrun's numbers include its workers' `import torch` (printed separately): a Python worker
cannot init without it, so it is part of what a user waits for.

Usage: benchmarks/launch/launch_overhead.py [--build build] [--ranks 2 4] [--reps 10]
       [--torch-python "$(benchmarks/vs_pytorch/setup_torch.sh)"]
Needs the launcher tests built (the dist_worker target) and Debian's python3-torch for the
comparison (skipped with a note when missing). Check `uptime` first: on a busy machine the
numbers say little. Debian's torchrun (torch 1.13 on Python 3.11) fails without `-r 0:1 -t 0:1`.
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TORCH_WORKER = r"""
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], "init_%d" % dist.get_rank()), "w") as f:
    f.write(str(time.time_ns()))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
dist.destroy_process_group()
"""



def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(cmds, n):
    """Runs one launch (the commands side by side: one per node); returns (init_s, total_s)."""
    d = tempfile.mkdtemp(prefix="launch_overhead_")
    try:
        if callable(cmds):
            cmds = cmds()
        t0 = time.time_ns()
        procs = [subprocess.Popen(c + [d], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for c in cmds]
        errs = [p.communicate(timeout=120)[1] for p in procs]
        t1 = time.time_ns()
        for c, p, e in zip(cmds, procs, errs):
            if p.returncode != 0:
                raise RuntimeError("%s exited %d:\n%s" % (" ".join(c), p.returncode,
                                                          e.decode(errors="replace")[-2000:]))
        stamps = []
        for r in range(n):
            with open(os.path.join(d, "init_%d" % r)) as f:
                stamps.append(int(f.read()))
        return (max(stamps) - t0) / 1e9, (t1 - t0) / 1e9
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "../../build"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--torch-python", default="/usr/bin/python3",
                    help="the interpreter whose torchrun is measured (default Debian's, torch "
                         "1.13; benchmarks/vs_pytorch/setup_torch.sh makes a current one)")
    args = ap.parse_args()
    PYTHON = args.torch_python
    build = os.path.abspath(args.build)
    emberrun = os.path.join(build, "launcher/emberrun")
    worker = os.path.join(build, "launcher/test_workers/dist_worker")
    for f in (emberrun, worker):
        if not os.access(f, os.X_OK):
            sys.exit("missing %s: build the emberrun and launcher_dist_worker targets" % f)

    have_torch = os.access(PYTHON, os.X_OK) and subprocess.run(
        [PYTHON, "-c", "import torch.distributed.run"], capture_output=True).returncode == 0
    tmp = tempfile.mkdtemp(prefix="launch_overhead_worker_")
    torch_worker = os.path.join(tmp, "worker.py")
    with open(torch_worker, "w") as f:
        f.write(TORCH_WORKER)

    print("load average: %.2f %.2f %.2f (cores: %d)" % (os.getloadavg() + (os.cpu_count(),)))
    if have_torch:
        imp = []
        for _ in range(3):
            t0 = time.time()
            subprocess.run([PYTHON, "-c", "import torch"], check=True)
            imp.append(time.time() - t0)
        print("python3 -c 'import torch': %.3f s (median of 3)" % statistics.median(imp))
    else:
        print("torchrun comparison skipped: %s cannot import torch.distributed.run" % PYTHON)

    print("%-6s %-9s %10s %10s %10s %10s" % ("ranks", "launcher", "init med", "init min",
                                             "total med", "total min"))
    try:
        for n in args.ranks:
            launchers = {"emberrun": [[emberrun, "--standalone", "--nproc-per-node", str(n),
                                       worker]]}
            if n % 2 == 0:  # two agents on loopback, n/2 ranks each, through the rendezvous
                def two_nodes(n=n):
                    port = str(free_port())
                    return [[emberrun, "--nnodes", "2", "--node-rank", str(k), "--master-port",
                             port, "--nproc-per-node", str(n // 2), worker] for k in (0, 1)]
                launchers["ember-2n"] = two_nodes
            if have_torch:
                launchers["torchrun"] = [[PYTHON, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc_per_node", str(n), "-r", "0:1", "-t", "0:1",
                                         "--monitor_interval", "0.1", torch_worker]]
            results = {k: [] for k in launchers}
            for name, cmd in launchers.items():  # warm-up: page cache, first-run costs
                run_once(cmd, n)
            for _ in range(args.reps):  # interleaved
                for name, cmd in launchers.items():
                    results[name].append(run_once(cmd, n))
            med = {}
            for name, rs in results.items():
                init = [r[0] for r in rs]
                total = [r[1] for r in rs]
                med[name] = statistics.median(init)
                print("%-6d %-9s %9.3fs %9.3fs %9.3fs %9.3fs" % (
                    n, name, statistics.median(init), min(init), statistics.median(total),
                    min(total)))
            if "torchrun" in med:
                print("%-6d ratio    torchrun/emberrun (init, medians): %.1fx" % (
                    n, med["torchrun"] / med["emberrun"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
