#!/usr/bin/env bash
# gpu_bundle.sh [OUT] — packs what scripts/gpu_check.sh runs (the CUDA-relevant test binaries,
# the benchmarks, the examples and emberrun from build/, with the libraries they need) into OUT
# (default .gpu/bundle.txz; list .gpu/ in .git/info/exclude and name it in the device call's
# carry). Stripped and xz-compressed: about 22 MB, where the plain bundle.sh tarball of all of
# build/ is over 45 MB. Open MPI's plugins are left out (no MPI runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu/bundle.txz}
mkdir -p "$(dirname "$out")"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
bash ../shared/gpu/bundle.sh "$t/b.tgz" build/tests build/benchmarks build/examples build/launcher >/dev/null
mkdir "$t/x"
tar xzf "$t/b.tgz" -C "$t/x"
rm -rf "$t/x/openmpi"
find "$t/x/bin/build/tests" -maxdepth 1 -type f | grep -v -E \
  '/(tensor_|autograd_(elementwise|indexing|linalg|reduce|views)|nn_(optim|serialize)|distributed_(gloo|nccl|ddp)_test)' |
  xargs -r rm -f
strip --strip-unneeded "$t"/x/bin/build/*/* "$t"/x/lib/*.so* 2>/dev/null || true
tar cJf "$out" -C "$t/x" .
echo "$out: $(du -h "$out" | cut -f1)"
