#!/usr/bin/python3
"""examples/gpt pipeline parallel (--pp 2) beside DDP at 2 ranks and beside PyTorch's own
pipelining (torch.distributed.pipelining on gloo), alternating runs, medians (issue 36's step
time targets).

Every variant trains the same GPT (--layers x --dim) on the same global batch per step: DDP
gives each of its 2 ranks half of it; the pipelines take all of it in --microbatches
micro-batches. Each run trains --steps steps and prints its training tokens/s (evaluation
excluded); the table shows each variant's median over --repeats rounds and the ratios. With
--link RATE (root; the ip and tc tools) DDP and the pipeline also run with their 2 ranks in two
network namespaces joined by a veth pair shaped to RATE (benchmarks/collectives/two_nodes.sh's
link): one "node" per rank, so DDP's gradient all-reduce and the pipeline's activations both
cross it.

    /usr/bin/python3 benchmarks/pipeline/run_gpt_pp.py --build build [--link 1gbit]
        [--torch build/torch-venv/bin/python] [--repeats 3] [--steps 6]

Threads per rank: 1 (2 ranks on 2 cores). The namespaces are removed on exit, also on error.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KJV = "/usr/lib/bible.data"


def model_flags(a, batch):
    return ["--layers", str(a.layers), "--heads", str(a.heads), "--dim", str(a.dim),
            "--context", str(a.context), "--batch-size", str(batch), "--steps", str(a.steps),
            "--eval-every", "0", "--eval-batches", "1", "--seed", "0"]


def gpt(a):
    return [os.path.join(a.build, "examples", "gpt"), "--data", KJV, "--cache-dir", a.cache_dir]


def pp_flags(a):
    return ["--pp", "2", "--microbatches", str(a.microbatches), "--schedule", a.schedule]


def tokens_per_s(out, what):
    m = re.search(r"tokens_per_s=([0-9.]+)", out)
    if not m:
        sys.exit(f"run_gpt_pp: {what} printed no tokens_per_s:\n{out}")
    return float(m.group(1))


def run(cmd, what, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"run_gpt_pp: {what} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def local(a, extra, batch):
    env = dict(os.environ, EMBER_NUM_THREADS="1")
    cmd = [os.path.join(a.build, "launcher", "emberrun"), "--standalone", "--nproc-per-node",
           "2"] + gpt(a) + model_flags(a, batch) + extra
    return tokens_per_s(run(cmd, " ".join(extra) or "ddp", env), cmd)


def torch_pp(a):
    tokens = os.path.join(a.cache_dir, os.path.basename(KJV) + ".tokens")
    cmd = [a.torch, os.path.join(ROOT, "benchmarks", "vs_pytorch", "gpt_torch.py"), "--tokens",
           tokens, "--nproc", "2", "--threads", "1", "--microbatches", str(a.microbatches),
           "--pp", "2", "--schedule", a.schedule, "--attention", "fused"] + model_flags(a, a.batch)
    return tokens_per_s(run(cmd, "torch pipelining"), cmd)


class Link:
    """Two namespaces, one veth pair shaped to `rate` at both ends."""

    def __init__(self, rate):
        tag = os.getpid() % 100000
        self.ns = [f"ember-pp-{tag}-a", f"ember-pp-{tag}-b"]
        self.dev = [f"epp{tag}a", f"epp{tag}b"]
        self.addr = [f"10.252.{tag % 250}.1", f"10.252.{tag % 250}.2"]
        self.port = 29700
        self.up = []
        for n in self.ns:
            subprocess.run(["ip", "netns", "add", n], check=True)
            self.up.append(n)
        subprocess.run(["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name",
                        self.dev[1]], check=True)
        for i in (0, 1):
            ns, dev = self.ns[i], self.dev[i]
            for c in (["ip", "link", "set", dev, "netns", ns],
                      ["ip", "-n", ns, "addr", "add", self.addr[i] + "/24", "dev", dev],
                      ["ip", "-n", ns, "link", "set", dev, "up"],
                      ["ip", "-n", ns, "link", "set", "lo", "up"],
                      ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                       "tbf", "rate", rate, "burst", "256kb", "latency", "10ms"]):
                subprocess.run(c, check=True)

    def close(self):
        for n in self.up:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                  text=True).stdout.split()
            for p in pids:
                subprocess.run(["kill", "-9", p], check=False)
            subprocess.run(["ip", "netns", "del", n], check=False)
        self.up = []

    def run(self, a, extra, batch):
        """One rank per namespace; node 0's output."""
        self.port += 1
        procs = []
        for node in (1, 0):
            cmd = ["ip", "netns", "exec", self.ns[node], "env", "EMBER_NUM_THREADS=1",
                   os.path.join(a.build, "launcher", "emberrun"), "--nnodes", "2",
                   "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                   self.addr[0], "--master-port", str(self.port)] + gpt(a) + \
                model_flags(a, batch) + extra
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            sys.exit("run_gpt_pp: a run across the link failed:\n" + "\n".join(outs))
        return tokens_per_s(outs[1], "across the link")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--cache-dir", default="")
    p.add_argument("--torch", default="", help="a python with torch >= 2.4 (default: "
                   "BUILD/torch-venv/bin/python if present; none: skip PyTorch)")
    p.add_argument("--link", default="", help="also across two namespaces at this rate (root)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="sequences per step, over all ranks")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    a.cache_dir = a.cache_dir or os.path.join(a.build, "bench-cache")
    if not a.torch:
        venv = os.path.join(a.build, "torch-venv", "bin", "python")
        a.torch = venv if os.path.exists(venv) else "none"
    variants = {"ddp": lambda: local(a, [], a.batch // 2),
                "pp": lambda: local(a, pp_flags(a), a.batch)}
    if a.torch != "none":
        variants["torch_pp"] = lambda: torch_pp(a)
    link = None
    try:
        if a.link:
            link = Link(a.link)
            variants["ddp_link"] = lambda: link.run(a, [], a.batch // 2)
            variants["pp_link"] = lambda: link.run(a, pp_flags(a), a.batch)
        got = {k: [] for k in variants}
        for r in range(a.repeats):
            for k, f in variants.items():
                got[k].append(f())
                print(f"round {r + 1}: {k} {got[k][-1]:.0f} tokens/s", flush=True)
    finally:
        if link:
            link.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\nGPT {a.layers} x {a.dim}, context {a.context}, {a.batch} sequences per step, "
          f"{a.microbatches} micro-batches ({a.schedule}), medians of {a.repeats}:")
    for k, v in med.items():
        print(f"  {k:10s} {v:8.0f} tokens/s")
    print(f"  pp / ddp:          {med['pp'] / med['ddp']:.2f}x")
    if "torch_pp" in med:
        print(f"  pp / torch pp:     {med['pp'] / med['torch_pp']:.2f}x")
    if link:
        print(f"  across {a.link}: pp / ddp {med['pp_link'] / med['ddp_link']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
