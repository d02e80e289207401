#!/usr/bin/env bash
# Configures and builds one flavour of CIERA: build.sh release|asan|tsan|fuzz [target...] (all
# targets unless named). Prints the build dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
flavour=${1:-release}
shift || true
dir="$root/build/$flavour"
# The sanitizer flavours keep line tables only (-g1): what a sanitizer's report needs (file and
# line of every frame); full debug info made their builds about a third slower.
sanitized=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
case "$flavour" in
  # The release flavour builds the CUDA codec whenever nvcc is there (CIERA_CUDA=AUTO); the
  # sanitizer flavours are host-only (the CUDA code is checked by compute-sanitizer on a device).
  release) args=(-DCMAKE_BUILD_TYPE=Release -DCIERA_BUILD_BENCHMARKS=ON -DCIERA_CUDA=AUTO) ;;
  asan)    args=("${sanitized[@]}" -DCIERA_SANITIZE=address,undefined -DCIERA_BUILD_TOOLS=OFF -DCIERA_CUDA=OFF) ;;
  tsan)    args=("${sanitized[@]}" -DCIERA_SANITIZE=thread -DCIERA_BUILD_TOOLS=OFF -DCIERA_WITH_MPI=OFF -DCIERA_CUDA=OFF) ;;
  fuzz)    args=("${sanitized[@]}" -DCIERA_SANITIZE=address,undefined -DCIERA_BUILD_FUZZERS=ON -DCIERA_CUDA=OFF
                 -DCIERA_BUILD_TESTS=OFF -DCIERA_BUILD_TOOLS=OFF -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link
                 -DCMAKE_CXX_COMPILER=clang++-14) ;;
  *) echo "usage: build.sh release|asan|tsan|fuzz [target...]" >&2; exit 2 ;;
esac
# CIERA_CUDA_ARCHITECTURES (e.g. 90-real) replaces CMake's default GPU architectures (test.sh: one,
# where there is no GPU to run the kernels on and the build is only a compile check).
if [[ -n "${CIERA_CUDA_ARCHITECTURES:-}" && $flavour == release ]]; then   # the others build no CUDA
  args+=("-DCMAKE_CUDA_ARCHITECTURES=$CIERA_CUDA_ARCHITECTURES")
fi
cmake -S "$root" -B "$dir" -G Ninja "${args[@]}" >/dev/null
if [[ $# -gt 0 ]]; then cmake --build "$dir" --target "$@" >&2; else cmake --build "$dir" >&2; fi
echo "$dir"
