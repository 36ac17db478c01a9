#!/usr/bin/env bash
# Installs what Ember's GPU path needs on Debian 12, from NVIDIA's network repository for it: the
# CUDA toolkit (nvcc, the runtime, cuBLAS), cuDNN (convolutions) and NCCL (the nccl backend).
# Idempotent: the repository's key is added once and only missing packages are installed.
# Needs root or sudo. docs/install.md ("GPUs") and docs/choosing_a_backend.md say what comes next.
#
#   scripts/install-cuda.sh [--dry-run] [--cuda MAJOR.MINOR]
#
# --dry-run prints what it would do and changes nothing (no root needed).
# EMBER_OS_RELEASE names another os-release file (tests use it).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/install-cuda.sh [--dry-run] [--cuda MAJOR.MINOR]
Installs the CUDA toolkit, cuDNN and NCCL from NVIDIA's Debian 12 repository.
  --dry-run        print what would be done, change nothing
  --cuda X.Y       the toolkit version (default 13.0; cuDNN and NCCL follow its major version)
EOF
}

dry_run=0
cuda_version=13.0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --cuda)
      [ $# -ge 2 ] || { echo "install-cuda: --cuda needs a version such as 13.0" >&2; exit 2; }
      cuda_version=$2
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install-cuda: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if ! [[ $cuda_version =~ ^[0-9]+\.[0-9]+$ ]]; then
  echo "install-cuda: --cuda expects MAJOR.MINOR such as 13.0, got '$cuda_version'" >&2
  exit 2
fi
cuda_major=${cuda_version%%.*}

# NVIDIA publishes this repository for Debian 12 only; another system needs its own
# (https://developer.nvidia.com/cuda-downloads), so refuse rather than mix them.
os_release=${EMBER_OS_RELEASE:-/etc/os-release}
os_field() { { sed -n "s/^$1=//p" "$os_release" 2>/dev/null || true; } | tr -d '"' | head -n 1; }
os_id=$(os_field ID)
os_version=$(os_field VERSION_ID)
if [ "$os_id" != debian ] || [ "$os_version" != 12 ]; then
  echo "install-cuda: NVIDIA's repository this script uses is for Debian 12, but $os_release says" \
    "ID=${os_id:-?} VERSION_ID=${os_version:-?}; install CUDA, cuDNN and NCCL for your system" \
    "from https://developer.nvidia.com/cuda-downloads instead" >&2
  exit 1
fi
case "$(dpkg --print-architecture)" in
  amd64) repo_arch=x86_64 ;;
  arm64) repo_arch=sbsa ;;
  *)
    echo "install-cuda: NVIDIA's Debian 12 repository has amd64 and arm64 packages only, not" \
      "$(dpkg --print-architecture)" >&2
    exit 1
    ;;
esac
repo=https://developer.download.nvidia.com/compute/cuda/repos/debian12/$repo_arch
keyring=cuda-keyring_1.1-1_all.deb

# cuda-toolkit-X-Y: nvcc, the runtime, cuBLAS (no driver); libcudnn9-dev-cuda-X: cuDNN's headers
# and libraries; libnccl-dev: NCCL's (the repository's NCCL is built for its newest CUDA).
pkgs=("cuda-toolkit-${cuda_version/./-}" "libcudnn9-dev-cuda-$cuda_major" libnccl2 libnccl-dev)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
missing=()
for p in "${pkgs[@]}"; do
  if installed "$p"; then
    echo "install-cuda: $p is installed"
  else
    missing+=("$p")
  fi
done
need_key=1
installed cuda-keyring && need_key=0

if [ $dry_run -eq 1 ]; then
  if [ $need_key -eq 1 ]; then
    echo "install-cuda: would download $repo/$keyring and install it (NVIDIA's repository key)"
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "install-cuda: would run apt-get update and install ${missing[*]}"
  else
    echo "install-cuda: nothing to install"
  fi
else
  if [ $need_key -eq 1 ] || [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo >/dev/null || {
        echo "install-cuda: installing packages needs root; run it as root or install sudo" >&2
        exit 1
      }
      sudo="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    if [ $need_key -eq 1 ]; then
      echo "install-cuda: adding NVIDIA's repository ($repo)"
      tmp=$(mktemp -d)
      trap 'rm -rf "$tmp"' EXIT
      if command -v curl >/dev/null; then
        curl -fsSL -o "$tmp/$keyring" "$repo/$keyring"
      else
        wget -q -O "$tmp/$keyring" "$repo/$keyring"
      fi
      $sudo dpkg -i "$tmp/$keyring" >/dev/null
    fi
    echo "install-cuda: installing ${missing[*]}"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    echo "install-cuda: done"
  else
    echo "install-cuda: nothing to install"
  fi
fi

# The toolkit builds GPU code without a driver; running it needs one.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "install-cuda: note: no working NVIDIA driver here (nvidia-smi): Ember builds its CUDA" \
    "code without one, but to run it install the driver (from this repository: nvidia-open" \
    "for Turing and newer GPUs) and reboot"
fi
echo "install-cuda: next: cmake -S . -B build -G Ninja && cmake --build build (nvcc is found in" \
  "/usr/local/cuda); then docs/choosing_a_backend.md"
