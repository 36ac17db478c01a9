#!/usr/bin/env bash
# Issue 42's S12 attack as a soak: jobs of 2 ranks under emberrun (minimal_ddp with 0 epochs:
# the gloo group and its shared-memory segment are made, then the job ends) interrupted while
# they start, and /dev/shm checked after each for a name the job left:
#   - Ctrl-C: SIGINT to emberrun after a random delay spanning the start-up (--sigint N runs);
#   - SIGKILL of rank 0 between creating its segment and the other rank mapping it, every time
#     (EMBER_TEST_KILL_AFTER_SHM_CREATE; --sigkill N runs);
#   - SIGKILL of emberrun itself after a random delay (--kill-launcher N runs): nothing can
#     sweep then, so a name is left whenever rank 0 was inside that window; counted, not failed.
# Usage: benchmarks/launch/shm_kill_soak.sh [--build build] [--sigint 60] [--sigkill 15]
#        [--kill-launcher 15]. Exits 1 if a Ctrl-C or a rank's SIGKILL left a name. Not part of
# make test (minutes, and timing-dependent by design); docs/reliability.md has its results.
set -euo pipefail
build=build sigint=60 sigkill=15 kill_launcher=15
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --sigint) sigint="$2"; shift 2 ;;
    --sigkill) sigkill="$2"; shift 2 ;;
    --kill-launcher) kill_launcher="$2"; shift 2 ;;
    *) echo "shm_kill_soak: unknown option $1" >&2; exit 2 ;;
  esac
done
emberrun="$build/launcher/emberrun"
program="$build/examples/minimal_ddp"
for f in "$emberrun" "$program"; do
  [[ -x "$f" ]] || { echo "shm_kill_soak: $f is not built" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# left PID: the names of emberrun PID's job still in /dev/shm (and removes them).
left() {
  local n=0 f
  for f in /dev/shm/ember-j"$1"-*; do
    [[ -e "$f" ]] || continue
    n=$((n + 1))
    rm -f "$f"
  done
  echo "$n"
}

# run KIND: one job, interrupted as KIND says; prints the names it left.
run() {
  local kind=$1 pid
  case "$kind" in
    sigint|launcher)
      EMBER_NUM_THREADS=1 "$emberrun" --standalone --nproc-per-node 2 "$program" 0 \
        > "$work/out" 2>&1 &
      pid=$!
      # A delay over the start-up: emberrun's own start, the ranks' exec, the store, the group.
      sleep "0.$(printf '%03d' $((RANDOM % 1000)))"
      if [[ $kind == sigint ]]; then kill -INT "$pid" 2>/dev/null || true
      else kill -KILL "$pid" 2>/dev/null || true; fi
      wait "$pid" 2>/dev/null || true
      # After a launcher's SIGKILL its workers die with it (PR_SET_PDEATHSIG); wait for them.
      for ((w = 0; w < 200 && $(pgrep -fc "$program 0" || true) > 0; w++)); do sleep 0.05; done
      ;;
    sigkill)
      EMBER_NUM_THREADS=1 EMBER_TEST_KILL_AFTER_SHM_CREATE=1 "$emberrun" --standalone \
        --nproc-per-node 2 "$program" 0 > "$work/out" 2>&1 &
      pid=$!
      wait "$pid" 2>/dev/null || true
      grep -q "EMBER_TEST_KILL_AFTER_SHM_CREATE: rank 0 created" "$work/out" ||
        { echo "shm_kill_soak: rank 0 was not killed in the window" >&2; cat "$work/out" >&2; exit 1; }
      ;;
  esac
  left "$pid"
}

declare -A runs=([sigint]=$sigint [sigkill]=$sigkill [launcher]=$kill_launcher) leaks
for kind in sigint sigkill launcher; do
  leaks[$kind]=0
  for ((i = 0; i < runs[$kind]; i++)); do
    leaks[$kind]=$((leaks[$kind] + $(run "$kind")))
  done
  echo "shm_kill_soak: $kind: ${runs[$kind]} runs, ${leaks[$kind]} names left in /dev/shm"
done
[[ ${leaks[sigint]} -eq 0 && ${leaks[sigkill]} -eq 0 ]]
