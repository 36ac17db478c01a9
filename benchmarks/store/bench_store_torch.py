"""torch.distributed.TCPStore's side of benchmarks/store/bench_store.cpp: the same cases, printed
as the lines bench_store parses.

    ops OP CLIENTS LOADED OPS_PER_S      (LOADED: 0 an empty store, 1 with --idle connections
                                          open and --keys keys stored)
    probe P50_US P99_US MAX_US CALLS     (a client's set+get while --idle clients connect and
                                          --keys keys are set)

The server runs in this process (torch's TCPStore master runs it on threads of its own, off the
GIL); each measuring client is a process of its own, so that Python's GIL does not serialise
them (Ember's clients are threads, which hold no such lock).
"""
import argparse
import datetime
import multiprocessing as mp
import threading
import time

import torch.distributed as dist

HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=120)
VALUE = b"x" * 64


def client(port):
    return dist.TCPStore(HOST, port, None, False, TIMEOUT)


def do_op(store, op, tid, i):
    if op == "set":
        store.set(f"b/{tid}/{i % 1024}", VALUE)
    elif op == "get":
        store.get(f"pre/{i % 1024}")
    elif op == "add":
        store.add("counter", 1)
    elif op == "wait":  # on a key that exists: returns at once
        store.wait([f"pre/{i % 1024}"])


def worker(port, op, seconds, tid, ready, start, out):
    store = client(port)
    do_op(store, op, tid, 0)
    ready.release()
    start.wait()
    n, end = 0, time.perf_counter() + seconds
    while True:
        for _ in range(16):
            do_op(store, op, tid, n)
            n += 1
        if time.perf_counter() >= end:
            break
    out.put(n)


def rate(port, op, clients, seconds):
    ctx = mp.get_context("fork")
    ready, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(port, op, seconds, t, ready, start, out))
             for t in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise SystemExit(f"bench_store_torch: a {op} client did not start within 120 s")
    start.set()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def load_with_probe(port, idle, keys):
    """Opens `idle` clients and sets `keys` keys (from 4 processes) while a probe client times
    set+get; returns the probe's latencies in microseconds and the idle clients (kept open)."""
    probe, lat, loading = client(port), [], [True]

    def run_probe():
        i = 0
        while loading[0]:
            t0 = time.perf_counter()
            probe.set("probe", str(i))
            probe.get("probe")
            lat.append((time.perf_counter() - t0) * 1e6)
            i += 1

    t = threading.Thread(target=run_probe)
    t.start()
    held = [client(port) for _ in range(idle)]
    ctx = mp.get_context("fork")

    def setter(part):
        s = client(port)
        for k in range(part, keys, 4):
            s.set(f"key/{k}", f"value {k}")

    procs = [ctx.Process(target=setter, args=(p,)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    loading[0] = False
    t.join()
    return sorted(lat), held


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="set,get,add,wait")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=100000)
    a = ap.parse_args()
    master = dist.TCPStore(HOST, 0, None, True, TIMEOUT, wait_for_workers=False)
    port = master.port
    for i in range(1024):
        master.set(f"pre/{i}", VALUE)
    ops, counts = a.ops.split(","), [int(c) for c in a.clients.split(",")]
    for op in ops:
        for c in counts:
            print(f"ops {op} {c} 0 {rate(port, op, c, a.seconds):.0f}", flush=True)
    lat, held = load_with_probe(port, a.idle, a.keys)
    n = len(lat)
    print(f"probe {lat[n // 2]:.0f} {lat[n * 99 // 100]:.0f} {lat[-1]:.0f} {n}", flush=True)
    for op in ops:
        for c in counts:
            print(f"ops {op} {c} 1 {rate(port, op, c, a.seconds):.0f}", flush=True)
    del held


if __name__ == "__main__":
    main()
