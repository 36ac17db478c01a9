#!/usr/bin/python3
"""bench_checkpoint beside torch.distributed.checkpoint (dcp_torch.py), alternating rounds,
medians (issue 38's targets): Ember's save against dd's write, load against dd's read, the
async save's blocking time against the synchronous save, and both against PyTorch's.

    /usr/bin/python3 benchmarks/checkpoint/run.py --build build [--rounds 3] [--ranks 2]
        [--repeats 3] [--torch build/torch-venv/bin/python] [--cold]

--cold (as root) also loads and reads after dropping the page cache: the disk's read bandwidth.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def values(out, what):
    got = dict(re.findall(r"^(\w+)=([0-9.]+)$", out, re.M))
    if "save_s" not in got:
        sys.exit(f"run.py: {what} printed no results:\n{out}")
    return {k: float(v) for k, v in got.items()}


def run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"run.py: {what} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return values(r.stdout, what)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="saves and loads per process (each reports its median: the first save "
                        "of a process also pays for its staging buffers)")
    p.add_argument("--torch", default="")
    p.add_argument("--cold", action="store_true", help="also load from a dropped page cache")
    a = p.parse_args()
    torch_py = a.torch or os.path.join(a.build, "torch-venv", "bin", "python")
    ember, torch = [], []
    for r in range(a.rounds):
        ember.append(run([os.path.join(a.build, "benchmarks", "bench_checkpoint"), "--ranks",
                          str(a.ranks), "--repeats", str(a.repeats)] + (["--cold"] if a.cold else []),
                         "bench_checkpoint"))
        print(f"round {r + 1}: ember {ember[-1]}", flush=True)
        if os.path.exists(torch_py):
            torch.append(run([torch_py, os.path.join(HERE, "dcp_torch.py"), "--nproc", str(a.ranks),
                              "--repeats", str(a.repeats), "--threads", "1"], "dcp_torch.py"))
            print(f"round {r + 1}: torch {torch[-1]}", flush=True)
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    gb = med(ember, "gb")
    print(f"\n{gb:.2f} GB over {a.ranks} ranks, medians of {a.rounds} rounds of {a.repeats}:")
    print(f"  save  {med(ember, 'save_s'):.2f} s = {gb / med(ember, 'save_s'):.2f} GB/s; dd write "
          f"{gb / med(ember, 'dd_write_s'):.2f} GB/s; ratio {med(ember, 'dd_write_s') / med(ember, 'save_s'):.2f}x")
    print(f"  load  {med(ember, 'load_s'):.2f} s = {gb / med(ember, 'load_s'):.2f} GB/s; dd read "
          f"{gb / med(ember, 'dd_read_s'):.2f} GB/s; ratio {med(ember, 'dd_read_s') / med(ember, 'load_s'):.2f}x")
    if a.cold:
        print(f"  cold load {med(ember, 'cold_load_s'):.2f} s = {gb / med(ember, 'cold_load_s'):.2f} GB/s; "
              f"dd read {gb / med(ember, 'cold_dd_read_s'):.2f} GB/s; ratio "
              f"{med(ember, 'cold_dd_read_s') / med(ember, 'cold_load_s'):.2f}x")
    print(f"  async blocks {med(ember, 'async_block_s'):.3f} s = "
          f"{100 * med(ember, 'async_block_s') / med(ember, 'save_s'):.1f}% of the synchronous save")
    if torch:
        for k in ("save_s", "load_s", "async_block_s"):
            print(f"  torch {k} {med(torch, k):.3f} s; ember {med(ember, k):.3f} s; "
                  f"ember is {med(torch, k) / med(ember, k):.2f}x as fast")


if __name__ == "__main__":
    main()
