#!/usr/bin/env bash
# Installs what CIERA builds and tests with, from Debian packages. Idempotent: packages already
# present are not touched, so repeated runs cost nothing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  ccache                             # test.sh: the wheel's build reuses the release build's objects
  libxxhash-dev libzstd-dev          # hashing/checksums, zstd baseline
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev    # the ciera tool
  clang-14 libclang-rt-14-dev        # libFuzzer
  libopenmpi-dev openmpi-bin         # the MPI transport
  iproute2                           # the link lab (ip netns, tc)
  python3-venv python3-dev python3-doc  # the Python package; python3-doc is the training text
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  # Another run installing at the same time holds dpkg's lock: wait for it rather than fail.
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}" >/dev/null
fi

# With nvcc the build compiles the NCCL transport too (ciera::nccl), which needs only nccl.h:
# fetched once into .deps/nccl/include (scripts/nccl-header.sh; nothing to do once it is there).
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  "$(dirname "$0")/nccl-header.sh" >/dev/null
fi
