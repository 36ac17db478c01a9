#!/usr/bin/env bash
# Installs every Debian package Ember's build, tests, benchmarks and API reference need.
# Idempotent: when nothing is missing it prints nothing and touches nothing. Needs root (or sudo)
# to install.
set -euo pipefail
pkgs=(
  cmake ninja-build ccache g++ make pkg-config file
  libopenblas-dev libopenblas-openmp-dev libdnnl-dev ocl-icd-opencl-dev
  libgloo-dev libopenmpi-dev openmpi-bin slurm-wlm munge
  libboost-dev libboost-system-dev libcli11-dev libspdlog-dev nlohmann-json3-dev zlib1g-dev libxxhash-dev
  libssl-dev
  libgtest-dev libgmock-dev
  libcairo2-dev fonts-dejavu-core
  dataset-fashion-mnist
  bible-kjv-text bible-kjv
  python3-torch libtorch-dev
  protobuf-compiler python3-protobuf python3-crc32c
  iproute2 etcd-server openssl curl doxygen
  clang libclang-rt-dev libomp-dev
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
