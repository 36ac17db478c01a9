#!/usr/bin/env bash
# The default CUDA architectures (Note [CUDA architectures] in CMakeLists.txt), by configuring the
# tree as a user would, with a stand-in nvidia-smi first on PATH: the GPUs it lists, deduplicated;
# the portable default when it fails (a machine without a driver); a user's choice kept. Exits 77
# (skipped) without nvcc. Usage: cuda_architectures_test.sh SOURCE_DIR
set -euo pipefail
src=$1
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "no nvcc: a build without CUDA has no architectures to choose"
  exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ember_cuda_arch_test_XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# configure NAME [CMAKE ARGS...]: configures the tree into $tmp/NAME with the stand-in on PATH;
# prints the architectures CMake cached, and leaves the log in $tmp/NAME.log.
configure() {
  local name=$1; shift
  PATH="$tmp/bin:$PATH" cmake -S "$src" -B "$tmp/$name" -G Ninja -DEMBER_BUILD_TESTS=OFF \
    -DEMBER_BUILD_BENCHMARKS=OFF -DEMBER_BUILD_EXAMPLES=OFF "$@" >"$tmp/$name.log" 2>&1 ||
    { fail "configure $name failed:"; cat "$tmp/$name.log" >&2; return 0; }
  sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$tmp/$name/CMakeCache.txt"
}
expect_log() {  # expect_log NAME TEXT
  grep -qF -- "$2" "$tmp/$1.log" || fail "$1: the configure output lacks '$2'"
}

# Three GPUs of two kinds: machine code for exactly those. ($1 is the stand-in's own argument.)
# shellcheck disable=SC2016
printf '#!/bin/sh\n[ "$1" = --query-gpu=compute_cap ] || exit 3\nprintf "9.0\\n8.9\\n9.0\\n"\n' \
  >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/nvidia-smi"
got=$(configure gpus)
[ "$got" = "90;89" ] || fail "with GPUs of compute capability 9.0 and 8.9: got '$got', expected '90;89'"
expect_log gpus "CUDA architectures 90;89 (the GPUs nvidia-smi lists"

# A user's choice wins, GPUs or not.
got=$(configure chosen -DCMAKE_CUDA_ARCHITECTURES=86)
[ "$got" = "86" ] || fail "with -DCMAKE_CUDA_ARCHITECTURES=86: got '$got'"

# nvidia-smi present but failing, as without a driver: the portable default.
printf '#!/bin/sh\necho "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"\nexit 9\n' \
  >"$tmp/bin/nvidia-smi"
got=$(configure nodriver)
[ "$got" = "80-virtual;90-real" ] || fail "without a working driver: got '$got', expected '80-virtual;90-real'"
expect_log nodriver "CUDA architectures 80-virtual;90-real (no GPU seen"

[ "$failures" -eq 0 ] && echo "cuda_architectures_test: all passed"
exit $((failures > 0))
