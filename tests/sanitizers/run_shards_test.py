#!/usr/bin/env python3
"""Checks tests/sanitizers/run_shards.py against stand-in GoogleTest binaries (shell scripts that
answer --gtest_list_tests and --gtest_filter as a gtest binary does): every case runs once, in
shards of at most --cases named by filter, a --filter's exclusions kept; a failing case and a
hanging one (killed with the child it started) fail the run, each reported with the command that
reruns it.

Usage: run_shards_test.py (exit 0: passed)
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# A stand-in test binary: CASES (Suite.Name ...) listed in gtest's format; a run appends each
# case its filter selects, with its process id, to $LOG, and fails on a case named Fail or hangs (with a
# child of its own) on one named Hang.
FAKE = r"""#!/bin/bash
cases="@CASES@"
# selected CASE FILTER: gtest's filter, POSITIVE[-NEGATIVE], each a ':'-list of globs.
selected() {
  local pos=${2%%-*} neg="" hit=0 p
  [[ $2 == *-* ]] && neg=${2#*-}
  IFS=: read -ra ps <<< "$pos"
  for p in "${ps[@]}"; do [[ $1 == $p ]] && hit=1; done
  IFS=: read -ra ps <<< "$neg"
  for p in "${ps[@]}"; do [[ $1 == $p ]] && hit=0; done
  [ $hit = 1 ]
}
if [ "$1" = --gtest_list_tests ]; then
  prev=""
  for c in $cases; do
    selected "$c" "${2#--gtest_filter=}" || continue
    s=${c%%.*}; n=${c#*.}
    [ "$s" = "$prev" ] || echo "$s."
    echo "  $n"; prev=$s
  done
  exit 0
fi
rc=0
for c in $cases; do
  selected "$c" "${2#--gtest_filter=}" || continue
  echo "$(basename "$0") $c $$" >> "$LOG"
  case $c in
    *.Fail) echo "case $c failed"; rc=1 ;;
    *.Hang) sleep 600 & echo "$!" > "$LOG.child"; wait ;;
  esac
done
[ $rc = 0 ] && echo "[  PASSED  ] 1 test."
exit $rc
"""


def make_fake(tests_dir, name, cases):
    path = os.path.join(tests_dir, name)
    with open(path, "w") as f:
        f.write(FAKE.replace("@CASES@", " ".join(cases)))
    os.chmod(path, 0o755)


def run(build, log, *args):
    env = dict(os.environ, LOG=log)
    cmd = [sys.executable, os.path.join(HERE, "run_shards.py"), "--build", build, *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired as e:  # run_shards itself hung: a failure, not a crash
        return subprocess.CompletedProcess(cmd, None, str(e.stdout), f"run_shards hung: {e}")


def main():
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="run_shards_test.") as tmp:
        tests = os.path.join(tmp, "tests")
        os.makedirs(tests)
        big = [f"A.c{i}" for i in range(7)] + ["B.x", "B.y", "MpiJob.one", "MpiJob.two",
                                                "Net.local", "Net.Mpirun"]
        make_fake(tests, "big_test", big)
        make_fake(tests, "small_test", ["C.only"])
        log = os.path.join(tmp, "log")

        # All pass: each case once, shards of at most 3 cases.
        r = run(tmp, log, "--jobs", "2", "--cases", "3", "big_test", "small_test")
        out = r.stdout + r.stderr
        expect(r.returncode == 0, f"a passing run exited {r.returncode}:\n{out}")
        lines = [ln.split() for ln in open(log).read().splitlines()]
        ran = sorted(f"{b} {c}" for b, c, _ in lines)
        want = sorted([f"big_test {c}" for c in big] + ["small_test C.only"])
        expect(ran == want, f"cases run: {ran}, want each once: {want}")
        per_pid = {}
        for _, c, pid in lines:
            per_pid.setdefault(pid, []).append(c)
        expect(all(len(v) <= 3 for v in per_pid.values()) and len(per_pid) >= 5,
               f"shards of at most 3 cases wanted: {per_pid}")
        expect(re.search(r"14 cases of 2 binaries in \d+ shards", out) is not None,
               f"no summary line:\n{out}")

        # A --filter that leaves part of a suite out: only the rest of it runs.
        os.remove(log)
        r = run(tmp, log, "--filter", "A.*-A.c3", "big_test")
        ran = sorted(ln.split()[1] for ln in open(log).read().splitlines())
        expect(r.returncode == 0 and ran == sorted(c for c in big if c.startswith("A.") and
                                                   c != "A.c3"), f"filtered run ran {ran}")

        # A failing case and a hanging one: both reported with their rerun command, the hang's
        # child killed, exit 1.
        os.remove(log)
        make_fake(tests, "bad_test", ["D.ok", "D.Fail", "E.Hang"])
        r = run(tmp, log, "--jobs", "2", "--cases", "1", "--timeout", "3", "bad_test")
        out = r.stdout + r.stderr
        expect(r.returncode == 1, f"a failing run exited {r.returncode}:\n{out}")
        expect("FAILED (exit 1)" in out and "case D.Fail failed" in out,
               f"the failing case's output is missing:\n{out}")
        expect("FAILED (timed out after 3 s)" in out, f"the hang is not reported:\n{out}")
        expect("--gtest_filter='D.Fail'" in out and "--gtest_filter='E.*'" in out,
               f"no rerun commands:\n{out}")
        expect("2 of 3 shards failed" in out, f"wrong count:\n{out}")
        with open(log + ".child") as f:
            child = int(f.read())
        try:
            os.kill(child, 0)
            alive = open(f"/proc/{child}/stat").read().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        expect(not alive, f"the hanging case's child {child} outlived the run")

        # A binary that is not built is an error naming it.
        r = run(tmp, log, "missing_test")
        expect(r.returncode == 1 and "missing_test is not built" in r.stderr,
               f"missing binary: {r.returncode} {r.stderr}")

    for f in failures:
        print("FAILED:", f)
    print("run_shards_test:", "failed" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
