#!/usr/bin/env bash
# gpu_bundle.sh [OUT] — packs what scripts/gpu_check.sh runs (each test binary with a case that
# gpu_check's filter selects, the benchmarks, the examples and emberrun from build/, with the
# libraries they need) into OUT
# (default .gpu/bundle.txz; list .gpu/ in .git/info/exclude and name it in the device call's
# carry). Stripped and xz-compressed: about 34 MB, where the plain bundle.sh tarball of all of
# build/ is over 45 MB. Open MPI's plugins are left out (no MPI runs there). Also writes
# .gpu/kjv.txt, the KJV as plain text, which gpu_check's GPT steps and tests read there (the GPU
# machine has no bible-kjv to decode /usr/lib/bible.data): examples/gpt's token cache of it is
# that text, so one tiny step writes it.
# It packs build/ as it is: build it first (or set GPU_BUNDLE_BUILD=1 to run `cmake --build build`
# here). It refuses a build that is not what the GPU machine needs: CMAKE_BUILD_TYPE Release,
# EMBER_WITH_CUDA ON, CMAKE_CUDA_ARCHITECTURES with sm_90 code (H100/H200), NCCL found and cuDNN's
# frontend headers found (else attention runs without cuDNN's kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_TEST_FILTER='*Cuda*:*CUDA*:*Nccl*:*_cuda*'  # the same as gpu_check.sh's
out=${1:-.gpu/bundle.txz}
cache=build/CMakeCache.txt
[ -f "$cache" ] || { echo "gpu_bundle.sh: no $cache: configure and build build/ first" >&2; exit 1; }
# cache_value NAME: NAME's value in the cache ("" when unset).
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$cache" | head -n 1; }
bad=()
[ "$(cache_value CMAKE_BUILD_TYPE)" = Release ] ||
  bad+=("CMAKE_BUILD_TYPE is '$(cache_value CMAKE_BUILD_TYPE)', expected Release")
[ "$(cache_value EMBER_WITH_CUDA)" = ON ] ||
  bad+=("EMBER_WITH_CUDA is '$(cache_value EMBER_WITH_CUDA)', expected ON")
archs=$(cache_value CMAKE_CUDA_ARCHITECTURES)
# sm_90 machine code: 90, 90-real, 90a or 90a-real ("all" and "all-major" hold it too).
tr ';' '\n' <<<"$archs" | grep -Eqx '90a?(-real)?|all|all-major' ||
  bad+=("CMAKE_CUDA_ARCHITECTURES is '$archs', expected one entry of 90 or 90-real (H100/H200)")
[ "$(cache_value EMBER_WITH_NCCL)" = ON ] ||
  bad+=("EMBER_WITH_NCCL is '$(cache_value EMBER_WITH_NCCL)', expected ON")
for v in NCCL_INCLUDE_DIR NCCL_LIBRARY CUDNN_FRONTEND_INCLUDE_DIR; do
  case $(cache_value $v) in
    '' | *-NOTFOUND) bad+=("$v is '$(cache_value $v)': not found at configure time") ;;
  esac
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'gpu_bundle.sh: build/ is not a build for the GPU machine:\n' >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
if [ "${GPU_BUNDLE_BUILD:-0}" = 1 ]; then
  cmake --build build
fi
mkdir -p "$(dirname "$out")" .gpu
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
# A test binary goes only if it lists a case that gpu_check.sh would run (listing needs no GPU);
# ref_libtorch (libtorch, OpenCV and what they pull in: over 500 MB) stays. The whole listing is
# read before it is searched: `lister | grep -q` under pipefail would drop a binary whenever grep
# quits first and the lister dies of SIGPIPE.
files=()
for exe in build/tests/*_test; do
  if ! list=$("$exe" --gtest_list_tests --gtest_filter="$GPU_TEST_FILTER" 2>/dev/null); then
    echo "gpu_bundle.sh: $exe --gtest_list_tests failed: left out" >&2
    continue
  fi
  [ "$(grep -c '^  ' <<<"$list")" -gt 0 ] && files+=("$exe")
done
while IFS= read -r f; do files+=("$f"); done < <(
  find build/benchmarks build/examples build/launcher -type f -perm -u+x ! -name ref_libtorch \
    ! -path '*/CMakeFiles/*')
bash ../shared/gpu/bundle.sh "$t/b.tgz" "${files[@]}" >/dev/null
mkdir "$t/x"
tar xzf "$t/b.tgz" -C "$t/x"
rm -rf "$t/x/openmpi"
strip --strip-unneeded "$t"/x/bin/build/*/* "$t"/x/lib/*.so* 2>/dev/null || true
tar cJf "$out" -C "$t/x" .
echo "$out: $(du -h "$out" | cut -f1)"
# Where gpu_check.sh reads it ($root/.gpu/kjv.txt), wherever OUT is.
kjv=.gpu/kjv.txt
if [ ! -s "$kjv" ]; then
  build/examples/gpt --cache-dir "$t/kjv" --layers 1 --dim 32 --heads 4 --context 32 --steps 1 \
    --eval-every 0 --eval-batches 1 >/dev/null
  cp "$t/kjv/bible.data.tokens" "$kjv"
fi
carry=.gpu
case $(cd "$(dirname "$out")" && pwd) in
  "$PWD/.gpu") ;;
  *) carry=".gpu and $(dirname "$out")" ;;
esac
echo "$kjv: $(du -h "$kjv" | cut -f1) (carry $carry in the device call)"
