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
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_TEST_FILTER='*Cuda*:*CUDA*:*Nccl*:*_cuda*'  # the same as gpu_check.sh's
out=${1:-.gpu/bundle.txz}
mkdir -p "$(dirname "$out")"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
# A test binary goes only if it lists a case that gpu_check.sh would run (listing needs no GPU);
# ref_libtorch (libtorch, OpenCV and what they pull in: over 500 MB) stays.
files=()
for exe in build/tests/*_test; do
  "$exe" --gtest_list_tests --gtest_filter="$GPU_TEST_FILTER" 2>/dev/null | grep -q '^  ' &&
    files+=("$exe")
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
kjv=$(dirname "$out")/kjv.txt
if [ ! -s "$kjv" ]; then
  build/examples/gpt --cache-dir "$t/kjv" --layers 1 --dim 32 --heads 4 --context 32 --steps 1 \
    --eval-every 0 --eval-batches 1 >/dev/null
  cp "$t/kjv/bible.data.tokens" "$kjv"
fi
echo "$kjv: $(du -h "$kjv" | cut -f1) (carry $(dirname "$out") in the device call)"
