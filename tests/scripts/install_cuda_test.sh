#!/usr/bin/env bash
# scripts/install-cuda.sh as a user runs it, without installing anything: --dry-run names the
# repository and every package for the default and another CUDA version; a system other than
# Debian 12 is refused by name; bad options are usage errors; shellcheck (where installed) is
# clean. Usage: install_cuda_test.sh SOURCE_DIR
set -euo pipefail
script="$1/scripts/install-cuda.sh"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ember_install_cuda_test_XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# expect STATUS NEEDLE... -- ARGS...: runs the script with ARGS, checks its status and output.
expect() {
  local want=$1; shift
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  local out status=0
  out=$(bash "$script" "$@" 2>&1) || status=$?
  [ "$status" -eq "$want" ] || fail "install-cuda.sh $*: status $status, expected $want; output:
$out"
  for n in "${needles[@]}"; do
    grep -qF -- "$n" <<<"$out" || fail "install-cuda.sh $*: output lacks '$n'; output:
$out"
  done
}

printf 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n' >"$tmp/debian12"
printf 'ID=ubuntu\nVERSION_ID="24.04"\n' >"$tmp/ubuntu"
printf 'ID=debian\nVERSION_ID="13"\n' >"$tmp/debian13"

export EMBER_OS_RELEASE="$tmp/debian12"
# Each package is named, whether it is to be installed or is there already.
expect 0 "repos/debian12/" "cuda-toolkit-13-0" "libcudnn9-dev-cuda-13" "libnccl2" "libnccl-dev" \
  "next: cmake" -- --dry-run
expect 0 "cuda-toolkit-12-8" "libcudnn9-dev-cuda-12" -- --dry-run --cuda 12.8
expect 0 "usage: scripts/install-cuda.sh" -- --help
expect 2 "unknown option '--wet-run'" -- --wet-run
expect 2 "--cuda expects MAJOR.MINOR such as 13.0, got '13'" -- --dry-run --cuda 13
expect 2 "--cuda needs a version" -- --cuda
EMBER_OS_RELEASE="$tmp/ubuntu" expect 1 "for Debian 12" "ID=ubuntu VERSION_ID=24.04" \
  "developer.nvidia.com/cuda-downloads" -- --dry-run
EMBER_OS_RELEASE="$tmp/debian13" expect 1 "ID=debian VERSION_ID=13" -- --dry-run
EMBER_OS_RELEASE="$tmp/missing" expect 1 "$tmp/missing says ID=? VERSION_ID=?" -- --dry-run

if command -v shellcheck >/dev/null; then
  shellcheck "$script" || fail "shellcheck $script"
else
  echo "shellcheck is not installed: skipping the lint"
fi
[ "$failures" -eq 0 ] && echo "install_cuda_test: all passed"
exit $((failures > 0))
