#!/usr/bin/env bash
# Every test: installs what it needs, then
#   1. release build: all GoogleTest suites through ctest; with nvcc on the machine the CUDA
#      codec is compiled too (for sm_80/sm_90), and its GPU tests report "Skipped" without a GPU;
#   2. AddressSanitizer + UBSan build: the unit and MPI tests again;
#   3. ThreadSanitizer build: the engine and lossless-collectives tests;
#   4. the Python package, installed with pip into .venv, and its pytest suite;
#   5. libFuzzer targets (clang): each fuzzer for CIERA_FUZZ_SECONDS (default 30) from its
#      committed seed corpus, one per core at a time (scripts/fuzz.sh --parallel).
# Tests assert correctness only; no test asserts a timing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
"$root/scripts/install-deps.sh"

echo "== release build + tests (unit, MPI under mpirun -np 2/3/4, link lab)"
dir=$("$root/scripts/build.sh" release)
ctest --test-dir "$dir" --output-on-failure -j "$jobs"
if command -v nvcc >/dev/null; then
  echo "== CUDA compile check: ciera::cuda and its tests were built by nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  test -f "$dir/src/cuda/libciera_cuda.a" && test -x "$dir/tests/ciera_cuda_tests"
  "$dir/tests/ciera_cuda_tests" --gtest_brief=1 | tail -n 3
fi

echo "== AddressSanitizer + UBSan"
dir=$("$root/scripts/build.sh" asan)
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"

echo "== ThreadSanitizer: the engine's threads (worker pool, communication thread, callers) and the collectives' rounds"
dir=$("$root/scripts/build.sh" tsan ciera_unit_tests)
TSAN_OPTIONS=halt_on_error=1 "$dir/tests/ciera_unit_tests" --gtest_brief=1 --gtest_filter='*Engine*:*Adaptive*:*ReduceScatter*:*Alltoallv*:*Collective*'

echo "== Python package (pip install .) and its tests: FSDP2 on 2-4 ranks, ciera train"
python=$("$root/scripts/python-env.sh")
(cd "$root" && "$python" -m pytest -q --durations=15 tests/python)

echo "== fuzzers, each from a copy of its committed corpus (fuzz/corpus/)"
"$root/scripts/fuzz.sh" --check-corpus --parallel --seconds "${CIERA_FUZZ_SECONDS:-30}"
echo "== all tests passed"
