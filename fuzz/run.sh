#!/usr/bin/env bash
# Runs each fuzz target for SECONDS from its seed corpus (fuzz/corpus/<target>/), keeping what
# it finds in BUILD/corpus/<target>/ (so the committed seeds stay small) and crashing inputs in
# BUILD/artifacts/<target>/. Prints one line per target (executions, corpus, result) and fails
# if any target found a crash, a leak, a hang or an out-of-memory input. FUZZ_JOBS targets run
# at a time (default: the number of cores).
# Usage: fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
set -uo pipefail
build=$1
seconds=$2
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(store_protocol safetensors idx launcher_config checkpoint_index)
src=$(cd "$(dirname "$0")" && pwd)
jobs=${FUZZ_JOBS:-$(nproc)}
# fuzz_one TARGET: runs one target, then writes its summary line to BUILD/fuzz-TARGET.result,
# prefixed "ok" or "FAILED".
fuzz_one() {
  local t=$1 bin=$build/fuzz/fuzz_$1 corpus=$build/corpus/$1 artifacts=$build/artifacts/$1
  local log=$build/fuzz-$1.log rc execs rate units result status=ok
  mkdir -p "$corpus" "$artifacts"
  # -timeout: one input running this long is a hang; -rss_limit_mb: a loader that allocates
  # what a header claims rather than what the file holds is an out-of-memory finding.
  "$bin" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$corpus" "$src/corpus/$t" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  units=$(find "$corpus" -type f | wc -l)
  if [ $rc -eq 0 ]; then
    result=ok
  else
    status=FAILED
    result="FAILED (exit $rc): $(ls "$artifacts" | tr '\n' ' ')see $log"
  fi
  printf '%s fuzz %-16s %4ss  %9s execs  %6s/s  corpus %5s  %s\n' "$status" "$t" "$seconds" \
    "${execs:-?}" "${rate:-?}" "$units" "$result" >"$build/fuzz-$t.result"
}
# Each target is one process on one core: FUZZ_JOBS (the cores, by default) of them at a time.
for t in "${targets[@]}"; do
  rm -f "$build/fuzz-$t.result"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  fuzz_one "$t" &
done
wait
failed=()
for t in "${targets[@]}"; do
  line=$(cat "$build/fuzz-$t.result" 2>/dev/null || echo "FAILED fuzz $t: no result")
  echo "${line#* }"
  [ "${line%% *}" = ok ] || failed+=("$t")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in ${failed[*]}: reproduce with $build/fuzz/fuzz_TARGET ARTIFACT" >&2
  exit 1
fi
