#!/usr/bin/env bash
# The Makefile's configure step (its decisions, not CMake's work): CMake runs on a new build
# folder, with tests and benchmarks off for `make train`'s profile; again when CMAKE_ARGS are
# given on an existing folder (they take effect); again with tests on when a folder `make train`
# set up is wanted for `make test`; and not otherwise. A stand-in `cmake` first on PATH records
# each call. Usage: make_configure_test.sh SOURCE_DIR
set -euo pipefail
src=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
cat > "$tmp/bin/cmake" <<'STUB'
#!/usr/bin/env bash
echo "$*" >> "$CMAKE_LOG"
for ((i = 1; i <= $#; i++)); do
  if [ "${!i}" = -B ]; then j=$((i + 1)); mkdir -p "${!j}"; touch "${!j}/build.ninja"; fi
done
STUB
chmod +x "$tmp/bin/cmake"
export CMAKE_LOG="$tmp/calls" PATH="$tmp/bin:$PATH"
build="$tmp/build"
fail() { echo "FAIL: $1"; echo "cmake calls:"; cat "$CMAKE_LOG" 2>/dev/null; exit 1; }
configure() { : > "$CMAKE_LOG"; make -s -C "$src" configure BUILD_DIR="$build" "$@" >/dev/null; }
calls() { [ -s "$CMAKE_LOG" ] && wc -l < "$CMAKE_LOG" || echo 0; }

configure PROFILE=train
[ "$(calls)" = 1 ] || fail "a new folder is configured once"
grep -q -- "-G Ninja .*-DEMBER_BUILD_TESTS=OFF -DEMBER_BUILD_BENCHMARKS=OFF" "$CMAKE_LOG" ||
  fail "make train's folder has no tests or benchmarks"
configure PROFILE=train
[ "$(calls)" = 0 ] || fail "an unchanged folder is not configured again"
configure
grep -q -- "-DEMBER_BUILD_TESTS=ON -DEMBER_BUILD_BENCHMARKS=ON" "$CMAKE_LOG" ||
  fail "make test on make train's folder turns tests and benchmarks on"
configure
[ "$(calls)" = 0 ] || fail "then it is left alone"
configure PROFILE=train
[ "$(calls)" = 0 ] || fail "make train on a full folder does not turn tests off"
configure CMAKE_ARGS="-DEMBER_WITH_CUDA=OFF"
grep -q -- "-S .* -B $build -DEMBER_WITH_CUDA=OFF" "$CMAKE_LOG" ||
  fail "CMAKE_ARGS on an existing folder take effect"
echo "make configure: every case as expected"
