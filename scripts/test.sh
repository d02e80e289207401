#!/usr/bin/env bash
# Every test: installs what it needs, then
#   1. release build: every GoogleTest suite (each binary in one process per core, sharded),
#      then the rest through ctest (MPI under mpirun, link lab, CLI, and examples/ built against
#      a fresh install with find_package); with nvcc on the machine
#      the CUDA codec is compiled too (for sm_80/sm_90; without a GPU, where it is only a compile
#      check, for sm_90 alone: a third of nvcc's time, and the sources have no per-architecture
#      code), and its GPU tests report "Skipped" without a GPU;
#   2. AddressSanitizer + UBSan build: the same tests again, less those labelled release_only
#      (the forced MPI algorithms at 2 and 4 ranks, the include-root check, the install: the
#      same code);
#   3. ThreadSanitizer build: the engine and lossless-collectives tests (ciera_thread_tests);
#   4. the Python package, installed with pip into .venv, and its pytest suite (two tests at a
#      time, pytest-xdist);
#   5. libFuzzer targets (clang): each fuzzer for CIERA_FUZZ_SECONDS (default 20) from its
#      committed seed corpus, one per core at a time (scripts/fuzz.sh --parallel). 20 s, not
#      30, since a VM without AVX-512 (2026-12-04) came within a minute of CI's 45; depth is
#      scripts/fuzz-long.sh's job.
# Tests assert correctness only; no test asserts a timing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
# Each stage's heading says when it started (seconds since this script did): CI has 45 minutes.
stage() { echo "== $* [${SECONDS}s]"; }
"$root/scripts/install-deps.sh"
# Compiler cache: a machine that keeps its cache takes a run's objects from the last run of a
# checkout at the same place (paths made relative to it), and within one run the wheel's build
# (stage 4) takes the library objects of the release build, whose flags it shares. ccache hashes
# the compiler's name as well as its binary: CMake alone finds c++ and the wheel's build g++ (the
# same compiler), and with the names differing every object missed (stop 53: 8 hits, 383 misses
# from an empty cache). So both are told g++ and gcc here, unless the caller chose. A miss costs
# a hash; a stale entry is never used.
if command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$root"
  if command -v g++ >/dev/null && command -v gcc >/dev/null; then
    export CC=${CC:-gcc} CXX=${CXX:-g++}
  fi
  ccache --zero-stats >/dev/null
fi
if command -v nvcc >/dev/null && ! nvidia-smi -L >/dev/null 2>&1 && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  export CIERA_CUDA_ARCHITECTURES=${CIERA_CUDA_ARCHITECTURES:-90-real}
fi

# Runs a GoogleTest binary as $jobs shards side by side, one process each (environment as the
# caller's); prints each shard's result, and a failed shard's output.
gtest_shards() {
  local binary=$1 name shard log pids=() failed=0
  name=$(basename "$binary")
  for ((shard = 0; shard < jobs; shard++)); do
    # In the binary's folder, as ctest runs it.
    (cd "$(dirname "$binary")" && GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$shard \
      timeout 1800 "$binary" --gtest_brief=1) >"$binary.shard$shard.log" 2>&1 &
    pids+=($!)
  done
  for ((shard = 0; shard < jobs; shard++)); do
    log="$binary.shard$shard.log"
    if wait "${pids[shard]}"; then
      echo "$name, shard $((shard + 1))/$jobs: $(grep -E '^\[  PASSED  \]' "$log")"
    else
      failed=1
      echo "== $name, shard $((shard + 1))/$jobs FAILED; the end of its output:"
      tail -n 200 "$log"
    fi
  done
  return $failed
}

# Every GoogleTest suite of a build tree (ctest label gtest) through gtest_shards: one process
# per shard, not per test. Under the sanitizers each process costs about 0.1 s to start and
# leak-check, a third of that stage when ctest ran each of the 2,300 tests alone; in the release
# build it saves about 20 s. Fails if the tree has no such suite.
gtest_suites() {
  local binaries binary failed=0
  binaries=$(ctest --test-dir "$1" -L gtest --show-only=json-v1 |
    python3 -c 'import json, sys; print("\n".join(sorted({t["command"][0] for t in json.load(sys.stdin)["tests"]})))')
  if [[ -z "$binaries" ]]; then
    echo "== no GoogleTest suite found in $1" >&2
    return 1
  fi
  for binary in $binaries; do
    gtest_shards "$binary" || failed=1
  done
  return $failed
}

stage "release build + tests (unit, MPI under mpirun -np 2/3/4, link lab)"
dir=$("$root/scripts/build.sh" release)
gtest_suites "$dir"
ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE gtest
if command -v nvcc >/dev/null; then
  echo "== CUDA compile check: ciera::cuda and its tests were built by nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  test -f "$dir/src/cuda/libciera_cuda.a" && test -x "$dir/tests/ciera_cuda_tests"
  "$dir/tests/ciera_cuda_tests" --gtest_brief=1 | tail -n 3
fi

stage "AddressSanitizer + UBSan"
dir=$("$root/scripts/build.sh" asan)
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 gtest_suites "$dir"
# Not the tests labelled release_only: the same code as tests run here (tests/CMakeLists.txt).
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE 'gtest|release_only'

stage "ThreadSanitizer: the engine's threads (worker pool, communication thread, callers) and the collectives' rounds"
# ciera_thread_tests: those suites of ciera_unit_tests alone, with their filter built in
# (tests/CMakeLists.txt, CIERA_THREAD_TEST_FILTER).
dir=$("$root/scripts/build.sh" tsan ciera_thread_tests)
TSAN_OPTIONS=halt_on_error=1 "$dir/tests/ciera_thread_tests" --gtest_brief=1

stage "Python package (pip install .) and its tests: FSDP2 on 2-4 ranks, ciera train"
python=$("$root/scripts/python-env.sh")
# Two tests at a time (pytest-xdist): a test spends much of its time waiting on its ranks and
# their timeouts. --dist loadgroup keeps the tests sharing a module fixture on one worker.
(cd "$root" && "$python" -m pytest -q -n 2 --dist loadgroup --durations=15 tests/python)

if [[ -n "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]]; then
  echo "== ccache: $(ccache --print-stats | awk '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { h += $2 }
    $1 == "cache_miss" { m = $2 } END { printf "%d hits, %d misses in this run", h, m }')"
fi

stage "fuzzers, each from a copy of its committed corpus (fuzz/corpus/)"
"$root/scripts/fuzz.sh" --check-corpus --parallel --seconds "${CIERA_FUZZ_SECONDS:-20}"
stage "all tests passed"
