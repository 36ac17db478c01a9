#!/usr/bin/env python3
"""Runs GoogleTest binaries' cases in shards of a few dozen, several shards at a time.

ctest starts one process per case. Under ASan a process costs a fixed start and a leak check at
exit whatever its case does, and with over a thousand cases that fixed part was most of CI's
ASan step (docs/reliability.md, "CI"). A shard here is one process running up to --cases cases
of one binary, a suite's cases kept together; --jobs shards run at once, the largest binaries
first. A shard that fails prints its output and the command that reruns it; a shard still
running after --timeout seconds is killed with its children (its process group) and reported
as a failure. The exit status is 1 if any shard failed.

Shards are named by --gtest_filter lists, not by GTEST_TOTAL_SHARDS: a test that starts this
binary again for a child case (mpirun, a fork and exec) passes its own --gtest_filter, and an
inherited shard index would make the child skip the case it was started for.

Usage: run_shards.py --build BUILD [--filter GLOBS] [--jobs N] [--cases K] [--timeout S] TEST...
TEST: a binary's name under BUILD/tests. The environment, sanitizer options included, is passed
on.
"""

import argparse
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time


def list_cases(binary, gtest_filter):
    """The binary's cases that pass the filter, in its order, as (suite, name) pairs."""
    out = subprocess.run([binary, "--gtest_list_tests", f"--gtest_filter={gtest_filter}"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} --gtest_list_tests exited {out.returncode}:\n"
                           f"{out.stdout}{out.stderr}")
    cases, suite = [], None
    for line in out.stdout.splitlines():
        if not line.strip() or line.startswith("Running main"):
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip().rstrip(".")
        elif suite is not None:
            cases.append((suite, line.split("#")[0].strip()))
    return cases


def shard(cases, size, suite_sizes):
    """Filters of at most `size` cases each; a suite all of whose cases (suite_sizes: the
    binary's count per suite) fit in one is named as `Suite.*`."""
    by_suite = {}
    for suite, name in cases:
        by_suite.setdefault(suite, []).append(name)
    shards, current, count = [], [], 0
    for suite, names in by_suite.items():
        for start in range(0, len(names), size):
            part = names[start:start + size]
            if count + len(part) > size and current:
                shards.append((":".join(current), count))
                current, count = [], 0
            whole = len(part) == suite_sizes.get(suite)
            current += [f"{suite}.*"] if whole else [f"{suite}.{n}" for n in part]
            count += len(part)
    if current:
        shards.append((":".join(current), count))
    return shards


def run_shard(binary, gtest_filter, timeout):
    """(exit status or None on timeout, output, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([binary, "--gtest_brief=1", f"--gtest_filter={gtest_filter}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return rc, out, time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--filter", default="*", help="a --gtest_filter applied to every binary")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cases", type=int, default=40, help="cases per shard at most")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per shard")
    ap.add_argument("tests", nargs="+")
    args = ap.parse_args()

    binaries = [os.path.join(args.build, "tests", t) for t in args.tests]
    for binary in binaries:
        if not os.access(binary, os.X_OK):
            print(f"run_shards: {binary} is not built", file=sys.stderr)
            return 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        listed = list(pool.map(lambda b: list_cases(b, args.filter), binaries))
    work = []
    for binary, cases in zip(binaries, listed):
        # `Suite.*` would also select what --filter left out: then every case is named.
        sizes = {}
        for suite, _ in cases if args.filter == "*" else []:
            sizes[suite] = sizes.get(suite, 0) + 1
        work += [(len(cases), binary, f, n) for f, n in shard(cases, args.cases, sizes)]
    work.sort(key=lambda w: -w[0])  # the largest binaries first: they hold the long shards
    total = sum(w[3] for w in work)
    print(f"run_shards: {total} cases of {len(args.tests)} binaries in {len(work)} shards, "
          f"{args.jobs} at a time (filter {args.filter})", flush=True)

    lock = threading.Lock()
    failed, done, passed, skipped = [], [0], [0], [0]
    t0 = time.monotonic()

    def one(item):
        _, binary, gtest_filter, n = item
        rc, out, secs = run_shard(binary, gtest_filter, args.timeout)
        m = re.search(r"\[  PASSED  \] (\d+) test", out)
        s = re.search(r"\[  SKIPPED \] (\d+) test", out)
        cmd = f"{binary} --gtest_filter='{gtest_filter}'"
        with lock:
            done[0] += 1
            passed[0] += int(m.group(1)) if m else 0
            skipped[0] += int(s.group(1)) if s else 0
            name = os.path.basename(binary)
            if rc == 0:
                print(f"[{done[0]}/{len(work)}] {name}: {n} cases, {secs:.1f} s", flush=True)
                return
            why = f"timed out after {args.timeout:.0f} s" if rc is None else f"exit {rc}"
            failed.append(f"{name} ({why}): {cmd}")
            tail = "\n".join(out.splitlines()[-300:])
            print(f"[{done[0]}/{len(work)}] {name}: {n} cases, FAILED ({why}), {secs:.1f} s\n"
                  f"{tail}\n-- rerun: {cmd}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, work))

    print(f"run_shards: {passed[0]} passed and {skipped[0]} skipped of {total} cases, "
          f"{len(failed)} of {len(work)} shards failed, {time.monotonic() - t0:.0f} s")
    for f in failed:
        print(f"  failed: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
