#!/usr/bin/env bash
# setup_torch.sh [BUILD_DIR]: a virtual environment with a pinned current PyTorch, for the
# speed comparisons of benchmarks/ (never for the tests: they use Debian's python3-torch, and
# make test downloads nothing). Made once under BUILD_DIR (default build/) and reused; prints the
# interpreter's path. PyPI's torch for Linux x86-64 is the CUDA build (with NVIDIA's runtime
# libraries as dependencies, some GB): it runs on the CPU as well, and is what a user installing
# from PyPI gets; the CPU-only wheels live on download.pytorch.org, which these machines cannot
# reach.
set -euo pipefail
build=${1:-build}
version=2.15.0
venv=$build/torch-venv
py=$venv/bin/python
if [ -x "$py" ] && "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "$py"
  exit 0
fi
mkdir -p "$build"
/usr/bin/python3 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$version" numpy >&2
"$py" -c "import torch; print('setup_torch: torch', torch.__version__, file=__import__('sys').stderr)"
echo "$py"
