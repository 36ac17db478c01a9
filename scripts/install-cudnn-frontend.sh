#!/usr/bin/env bash
# Installs cuDNN's frontend (NVIDIA's header-only C++ library over cuDNN's graph API, which Ember's
# CUDA attention builds its SDPA graphs with) under /opt/cudnn-frontend/VERSION/include. Debian has
# no package for it; NVIDIA publishes the headers inside a PyPI wheel (nvidia-cudnn-frontend), so
# this downloads that wheel (pinned, hash-checked) and keeps only its include/ folder.
# Idempotent: prints nothing and touches nothing when that version is there. Needs root or sudo,
# and pip for Debian's python3 (python3-pip, which install-deps.sh installs first).
#   scripts/install-cudnn-frontend.sh [PREFIX]   (default /opt/cudnn-frontend)
set -euo pipefail
version=1.32.0
wheel=nvidia_cudnn_frontend-$version-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
sha256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
prefix=${1:-/opt/cudnn-frontend}
dest=$prefix/$version
[ -f "$dest/include/cudnn_frontend.h" ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
echo "install-cudnn-frontend: fetching nvidia-cudnn-frontend $version from PyPI"
/usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: --python-version 311 \
  --platform manylinux_2_28_x86_64 --dest "$t" "nvidia-cudnn-frontend==$version"
echo "$sha256  $t/$wheel" | sha256sum -c --quiet -
/usr/bin/python3 - "$t/$wheel" "$t/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
$sudo mkdir -p "$prefix"
$sudo rm -rf "$dest.partial"
$sudo cp -r "$t/x" "$dest.partial"
$sudo mv "$dest.partial" "$dest"
echo "install-cudnn-frontend: $dest/include"
