#!/usr/bin/env bash
# Installs the Debian packages Ember needs. Idempotent: when nothing is missing it prints nothing
# and touches nothing. Needs root (or sudo) to install.
#   install-deps.sh train   what `make train` needs: the compiler and build tools, the libraries
#                           the library and examples link, and the Fashion-MNIST data
#   install-deps.sh         everything: also what the tests, benchmarks, fuzzers and API
#                           reference use (GoogleTest, PyTorch as the reference, Slurm, etcd,
#                           Clang, iproute2 for the network namespaces, Doxygen, ...)
set -euo pipefail
profile=${1:-all}
train=(
  cmake ninja-build ccache g++ make pkg-config
  libopenblas-dev libopenblas-openmp-dev libdnnl-dev ocl-icd-opencl-dev
  libgloo-dev libopenmpi-dev
  libboost-dev libboost-system-dev libcli11-dev libspdlog-dev nlohmann-json3-dev zlib1g-dev libxxhash-dev
  libssl-dev libprotobuf-dev protobuf-compiler libcairo2-dev
  dataset-fashion-mnist
)
rest=(
  file openmpi-bin slurm-wlm munge
  libgtest-dev libgmock-dev
  fonts-dejavu-core
  bible-kjv-text bible-kjv
  python3-torch libtorch-dev python3-pip
  python3-protobuf python3-crc32c
  iproute2 etcd-server openssl curl doxygen
  clang libclang-rt-dev libomp-dev
)
case "$profile" in
  train) pkgs=("${train[@]}") ;;
  all) pkgs=("${train[@]}" "${rest[@]}") ;;
  *) echo "install-deps: unknown profile '$profile' (expected train or all)" >&2; exit 2 ;;
esac
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# cuDNN's frontend headers (CUDA attention's SDPA graphs) come from PyPI, not Debian: only where
# a CUDA toolkit is there to use them, and not for `make train`.
cudnn_frontend() {
  if [ "$profile" = all ] && [ -e /usr/local/cuda/include/cudnn.h ]; then
    bash "$(dirname "$0")/install-cudnn-frontend.sh"
  fi
}
if [ ${#missing[@]} -eq 0 ]; then
  cudnn_frontend
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
cudnn_frontend
