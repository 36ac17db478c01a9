#!/usr/bin/env bash
# fuzz/run.sh with stand-in fuzz targets (scripts that print libFuzzer's final statistics): every
# target runs, FUZZ_JOBS=2 of them at once (two targets that each wait for the other to start
# finish only if they overlap; a 20 s limit ends the wait otherwise), one line per target in the
# order given, and a target that exits non-zero with an artifact fails the run, named with it.
# Usage: fuzz_run_test.sh SOURCE_DIR
set -uo pipefail
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/fuzz"
fail() { echo "FAILED: $*"; exit 1; }
for t in a b c; do
  cat > "$tmp/fuzz/fuzz_$t" <<STUB
#!/usr/bin/env bash
touch "$tmp/started_$t"
other=\$( [ "$t" = a ] && echo b || echo a )
if [ "$t" != c ]; then
  for _ in \$(seq 200); do [ -e "$tmp/started_\$other" ] && break; sleep 0.1; done
  [ -e "$tmp/started_\$other" ] || echo "alone" > "$tmp/alone_$t"
fi
echo "stat::number_of_executed_units: 100"
echo "stat::average_exec_per_sec: 50"
if [ "$t" = c ]; then
  prefix=\$(printf '%s\n' "\$@" | sed -n 's/^-artifact_prefix=//p')
  touch "\${prefix}crash-1"
  exit 1
fi
STUB
  chmod +x "$tmp/fuzz/fuzz_$t"
done
out=$(FUZZ_JOBS=2 bash "$src/fuzz/run.sh" "$tmp" 1 a b c 2>&1)
rc=$?
echo "$out"
[ $rc -eq 1 ] || fail "exit $rc, want 1 (target c crashed)"
[ ! -e "$tmp/alone_a" ] && [ ! -e "$tmp/alone_b" ] || fail "targets a and b did not run at once"
[ "$(echo "$out" | grep -c '^fuzz ')" -eq 3 ] || fail "want one line per target"
echo "$out" | grep '^fuzz ' | awk '{print $2}' | tr '\n' ' ' | grep -qx 'a b c ' ||
  fail "lines not in the order given"
echo "$out" | grep -q '^fuzz a .*100 execs .* ok$' || fail "target a's line"
echo "$out" | grep -q '^fuzz c .*FAILED (exit 1): crash-1' || fail "target c's finding not named"
echo "$out" | grep -q 'findings in c:' || fail "no summary naming c"
echo "fuzz_run_test: passed"
