#!/usr/bin/python3
"""Runs Ember's tensor benchmarks beside PyTorch in the same run and prints the ratios.

Three contenders per case, interleaved round by round (the machine is noisy, +-25% run to run,
so each round runs every contender once and the table shows medians over rounds):
  ember     build/benchmarks/bench_*       (Ember, C++)
  libtorch  build/benchmarks/ref_libtorch  (PyTorch 1.13 through its C++ API; `make bench`
                                            builds it from Debian's libtorch-dev)
  pytorch   this script's torch cases       (from Python: Debian's python3-torch 1.13, or
                                            --torch-python's, e.g. setup_torch.sh's current one)
Ratios are reference time / Ember time: above 1 means Ember is faster.
All run with one thread unless --threads says otherwise.

Usage: benchmarks/run_tensor_bench.py [--build build] [--rounds 3] [--filter S] [--threads 1]
       [--markdown FILE] [--torch-python "$(benchmarks/vs_pytorch/setup_torch.sh)"]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

EMBER_BENCHES = ["bench_memory", "bench_matmul", "bench_conv", "bench_elementwise", "bench_reduce",
                 "bench_indexing", "bench_autograd", "bench_nn"]
LINE = re.compile(r"BENCH name=(\S+) sec=(\S+) flops=(\S+) bytes=(\S+)")


def parse(out):
    res = {}
    for m in LINE.finditer(out):
        res[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
    return res


def run_exe(path, args, env):
    p = subprocess.run([path] + args, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        sys.stderr.write(f"{path} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}\n")
        return {}
    return parse(p.stdout)


# ---- PyTorch (Python) side: same case names, same timing method as bench_util.h --------------
def torch_cases():
    import torch
    import torch.nn.functional as F
    M16 = 16 << 20
    cases = {}

    def case(name, flops=0.0, nbytes=0.0):
        def deco(make):
            cases[name] = (make, flops, nbytes)
            return make
        return deco

    for n in (512, 1024, 2048):
        def make(n=n):
            a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
            return lambda: torch.mm(a, b, out=c)
        case(f"matmul_{n}_f32", 2.0 * n ** 3)(make)

    conv_flops = 2.0 * 64 * 64 * 28 * 28 * 32 * 9

    @case("conv2d_fwd_b64_c32_64_k3_28", conv_flops)
    def _():
        x, w, b = torch.randn(64, 32, 28, 28), torch.randn(64, 32, 3, 3) * 0.1, torch.randn(64)
        return lambda: F.conv2d(x, w, b, padding=1)

    @case("conv2d_fwdbwd_b64_c32_64_k3_28", 3 * conv_flops)
    def _():
        x = torch.randn(64, 32, 28, 28, requires_grad=True)
        w = (torch.randn(64, 32, 3, 3) * 0.1).requires_grad_()
        b = torch.randn(64, requires_grad=True)

        def f():
            y = F.conv2d(x, w, b, padding=1)
            y.backward(torch.ones_like(y))
            x.grad = w.grad = b.grad = None
        return f

    @case("maxpool2d_b64_c32_28", 0, 4.0 * 64 * 32 * 28 * 28 * 1.25)
    def _():
        x = torch.randn(64, 32, 28, 28)
        return lambda: F.max_pool2d(x, 2)

    @case("maxpool2d_idx_b64_c32_28")
    def _():
        x = torch.randn(64, 32, 28, 28)
        return lambda: F.max_pool2d(x, 2, return_indices=True)

    @case("exp_16M_f32_fresh", 0, 8.0 * M16)
    def _():
        a = torch.rand(M16)
        return lambda: torch.exp(a)

    @case("index_select_rows_1Mx64_f32")
    def _():
        table, idx = torch.rand(65536, 64), torch.randint(0, 65536, (65536,))
        return lambda: table.index_select(0, idx)

    @case("embedding_b64x128_d256")
    def _():
        table, ids = torch.rand(32768, 256), torch.randint(0, 32768, (64, 128))
        return lambda: F.embedding(ids, table)

    @case("add_16M_f32_out", 0, 12.0 * M16)
    def _():
        a, b, c = torch.rand(M16), torch.rand(M16), torch.empty(M16)
        return lambda: torch.add(a, b, out=c)

    @case("add_16M_f32_fresh", 0, 12.0 * M16)
    def _():
        a, b = torch.rand(M16), torch.rand(M16)
        return lambda: a + b

    @case("mul_scalar_16M_f32_out", 0, 8.0 * M16)
    def _():
        a, c = torch.rand(M16), torch.empty(M16)
        return lambda: torch.mul(a, 2.5, out=c)

    @case("sum_16M_f32", 0, 4.0 * M16)
    def _():
        a = torch.rand(M16)
        return lambda: a.sum()

    @case("sum_dim0_4096x4096_f32", 0, 4.0 * 4096 * 4096)
    def _():
        m = torch.rand(4096, 4096)
        return lambda: m.sum(0)

    @case("sum_dim1_4096x4096_f32", 0, 4.0 * 4096 * 4096)
    def _():
        m = torch.rand(4096, 4096)
        return lambda: m.sum(1)

    @case("softmax_4096x1024_f32", 0, 8.0 * 4096 * 1024)
    def _():
        s = torch.randn(4096, 1024)
        return lambda: torch.softmax(s, 1)

    @case("argmax_4096x1024_f32", 0, 4.0 * 4096 * 1024)
    def _():
        s = torch.randn(4096, 1024)
        return lambda: s.argmax(1)

    @case("rand_16M_f32", 0, 4.0 * M16)
    def _():
        c = torch.empty(M16)
        return lambda: c.uniform_()

    @case("randn_16M_f32", 0, 4.0 * M16)
    def _():
        c = torch.empty(M16)
        return lambda: c.normal_()

    @case("cat_2x8M_f32", 0, 8.0 * M16)
    def _():
        h1, h2 = torch.rand(M16 // 2), torch.rand(M16 // 2)
        return lambda: torch.cat([h1, h2])

    @case("add_1_f32")
    def _():
        a, b = torch.rand(1), torch.rand(1)
        return lambda: a + b

    @case("add_1_f32_inplace")
    def _():
        a, b = torch.rand(1), torch.rand(1)
        return lambda: a.add_(b)

    # ---- autograd overhead (bench_autograd.cpp) ----
    @case("autograd_chain100_fwdbwd")
    def _():
        x = torch.randn(16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)

        def f():
            h = x
            for i in range(100):
                k = i % 4
                if k == 0:
                    h = h * w
                elif k == 1:
                    h = h + w
                elif k == 2:
                    h = h.tanh()
                else:
                    h = h * 0.5
            h.sum().backward()
            x.grad = None
            w.grad = None
        return f

    @case("autograd_mlp_b64_fwdbwd", 3 * 2.0 * 64 * (784 * 256 + 256 * 128 + 128 * 10))
    def _():
        p = [torch.randn(784, 256) * 0.05, torch.zeros(256), torch.randn(256, 128) * 0.05,
             torch.zeros(128), torch.randn(128, 10) * 0.05, torch.zeros(10)]
        for t in p:
            t.requires_grad_(True)
        x = torch.randn(64, 784)
        y = torch.randint(0, 10, (64,))

        def f():
            h1 = torch.relu(torch.addmm(p[1], x, p[0]))
            h2 = torch.relu(torch.addmm(p[3], h1, p[2]))
            logits = torch.addmm(p[5], h2, p[4])
            loss = -torch.log_softmax(logits, 1).gather(1, y.unsqueeze(1)).mean()
            loss.backward()
            with torch.no_grad():
                for t in p:
                    t.add_(t.grad, alpha=-1e-4)
                    t.grad = None
        return f

    # ---- nn building blocks (bench_nn.cpp) ----
    @case("cross_entropy_b256_c1000_fwdbwd")
    def _():
        x = torch.randn(256, 1000, requires_grad=True)
        y = torch.randint(0, 1000, (256,))

        def f():
            F.cross_entropy(x, y).backward()
            x.grad = None
        return f

    @case("cross_entropy_b16384_c256_fwdbwd")
    def _():
        x = torch.randn(16384, 256, requires_grad=True)
        y = torch.randint(0, 256, (16384,))

        def f():
            F.cross_entropy(x, y).backward()
            x.grad = None
        return f

    @case("batch_norm2d_b32_c64_28_fwdbwd")
    def _():
        x = torch.randn(32, 64, 28, 28, requires_grad=True)
        w = torch.ones(64, requires_grad=True)
        b = torch.zeros(64, requires_grad=True)
        rm, rv = torch.zeros(64), torch.ones(64)

        def f():
            F.batch_norm(x, rm, rv, w, b, training=True).sum().backward()
            x.grad = w.grad = b.grad = None
        return f

    @case("layer_norm_b64x128_d512_fwdbwd")
    def _():
        x = torch.randn(64, 128, 512, requires_grad=True)
        w = torch.ones(512, requires_grad=True)
        b = torch.zeros(512, requires_grad=True)

        def f():
            F.layer_norm(x, (512,), w, b).sum().backward()
            x.grad = w.grad = b.grad = None
        return f

    @case("gelu_tanh_b32x128_d2048_fwdbwd")
    def _():
        x = torch.randn(32, 128, 2048, requires_grad=True)

        def f():
            F.gelu(x, approximate="tanh").sum().backward()
            x.grad = None
        return f

    @case("cnn_step_b64_28_fwdbwd")
    def _():
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                    torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                    torch.nn.Linear(16 * 14 * 14, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(64, 1, 28, 28)
        y = torch.randint(0, 10, (64,))

        def f():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return f

    @case("adam_step_1M", 0, 16.0 * 65536 * 4 * 7)
    def _():
        ps = []
        for _ in range(16):
            p = torch.randn(256, 256, requires_grad=True)
            p.grad = torch.randn(256, 256)
            ps.append(p)
        opt = torch.optim.Adam(ps, lr=1e-3, foreach=False)
        return opt.step

    return cases


def median_seconds(fn, samples, min_time, sync=lambda: None):
    """bench_util.h's timing for a Python callable: a warm-up call, batches calibrated to last
    about min_time, the median per-call time of `samples` batches; `sync` ends each batch."""
    fn()
    sync()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_time / 4 or calls >= 1 << 30:
            calls = max(1, int(calls * min_time / max(dt, 1e-9)))
            break
        calls *= 4
    per = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per.append((time.perf_counter() - t0) / calls)
    per.sort()
    return per[len(per) // 2]


def torch_worker(filt, samples, min_time, threads):
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    for name, (make, flops, nbytes) in torch_cases().items():
        if filt and filt not in name:
            continue
        grad = "fwdbwd" in name
        with torch.set_grad_enabled(grad):
            sec = median_seconds(make(), samples, min_time)
        print(f"BENCH name={name} sec={sec:.9g} flops={flops:.6g} bytes={nbytes:.6g}", flush=True)


def fmt_time(s):
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e9:.0f} ns"


def rate(sec, flops, nbytes):
    if flops:
        return f"{flops / sec / 1e9:.1f} GFLOP/s"
    if nbytes:
        return f"{nbytes / sec / 1e9:.2f} GB/s"
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--filter", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--markdown", help="also write the table as Markdown to this file")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="the interpreter whose torch is the PyTorch (Python) column (default this "
                         "one; benchmarks/vs_pytorch/setup_torch.sh makes a current one)")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(a.filter, a.samples, a.min_time, a.threads)
        return

    env = dict(os.environ, EMBER_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads),
               OPENBLAS_NUM_THREADS=str(a.threads))
    bdir = os.path.join(a.build, "benchmarks")
    common = ["--samples", str(a.samples), "--min-time", str(a.min_time)] + (
        ["--filter", a.filter] if a.filter else [])
    ember_exes = [os.path.join(bdir, b) for b in EMBER_BENCHES if os.path.exists(os.path.join(bdir, b))]
    ref = os.path.join(bdir, "ref_libtorch")
    have_ref = os.path.exists(ref)
    if not have_ref:
        print(f"note: {ref} not built (make bench builds it); libtorch column left empty")
    results = {"ember": {}, "libtorch": {}, "pytorch": {}}
    meta = {}
    version = subprocess.run([a.torch_python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True).stdout.strip().split("+")[0]
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds} ...", flush=True)
        got = {}
        for exe in ember_exes:
            got.update(run_exe(exe, common, env))
        contenders = [("ember", got)]
        if have_ref:
            contenders.append(("libtorch", run_exe(ref, common, env)))
        contenders.append(("pytorch", run_exe(a.torch_python, [os.path.abspath(__file__), "--torch-worker",
                                                               "--threads", str(a.threads)] + common, env)))
        for who, res in contenders:
            for name, (sec, flops, nbytes) in res.items():
                results[who].setdefault(name, []).append(sec)
                meta.setdefault(name, (flops, nbytes))

    names = list(dict.fromkeys(list(results["ember"]) + list(results["pytorch"]) + list(results["libtorch"])))
    rows = []
    hdr = ["case", "Ember", "libtorch C++", f"PyTorch {version} (Python)", "Ember rate",
           "vs libtorch", f"vs PyTorch {version}"]
    for n in names:
        flops, nbytes = meta[n]
        med = {w: statistics.median(results[w][n]) if n in results[w] else None for w in results}
        e = med["ember"]
        row = [n, fmt_time(e) if e else "-", fmt_time(med["libtorch"]) if med["libtorch"] else "-",
               fmt_time(med["pytorch"]) if med["pytorch"] else "-", rate(e, flops, nbytes) if e else "",
               f"{med['libtorch'] / e:.2f}x" if e and med["libtorch"] else "-",
               f"{med['pytorch'] / e:.2f}x" if e and med["pytorch"] else "-"]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    print()
    print(f"threads={a.threads} rounds={a.rounds} (medians; ratio = reference time / Ember time)")
    for row in [hdr] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr) + "\n")
            for row in rows:
                f.write("| " + " | ".join(row) + " |\n")


if __name__ == "__main__":
    main()
