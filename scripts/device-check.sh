#!/usr/bin/env bash
# The one prepared GPU check (issue 15): on a bare GPU machine (nvcc, CMake, ninja; no MPI, no
# package manager, no internet) it builds the CUDA codec, its tests and its benchmark from this
# checkout and .device-deps/ (scripts/device-deps.sh, carried with the call), then
#   1. runs the GPU tests (every kernel against the CPU codec's bytes);
#   2. runs compute-sanitizer (memcheck) on the rANS-decode and checksum tests, where the machine
#      lets it (on gVisor it refuses the device: the output then says so);
#   3. runs the benchmark: the device codec on the benchmark trajectory at 16M and 256M BF16 values,
#      every payload checked equal to the CPU encoder's, beside cudaMemcpy D2D and nvCOMP ANS, and
#      each kernel on its own,
# writing logs and JSON to the output folder: its second argument, else $OUT, else
# build/device-check-out. Prints a short summary last. Meant to finish in under 8 minutes.
#
#   scripts/device-check.sh codec [OUT_DIR]
#
# On a machine without a GPU it still builds everything (a dry run): the tests then report
# "Skipped" and the benchmark says why it cannot run.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-}
if [[ $what != codec ]]; then
  echo "usage: device-check.sh codec [OUT_DIR]" >&2
  exit 2
fi
out=${2:-${OUT:-$root/build/device-check-out}}
mkdir -p "$out"
deps="$root/.device-deps"
if [[ ! -f $deps/xxhash/include/xxhash.h ]]; then
  echo "device-check: $deps is missing; run scripts/device-deps.sh first and carry .device-deps" >&2
  exit 2
fi
build="$root/build/device-check"
start=$SECONDS
status=0
summary=()
step() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }

# The local GPU's architecture only, when there is one (a third of the compile time of
# sm_80 + sm_90 + PTX); the dry run compiles the default set.
arch_args=()
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  arch_args=(-DCMAKE_CUDA_ARCHITECTURES=native)
fi
{ nvcc --version; cmake --version | head -1; } > "$out/toolchain.txt" 2>&1

if cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCIERA_CUDA=ON \
     -DCIERA_CUDA_ONLY=ON -DCIERA_WITH_MPI=OFF -DCIERA_BUILD_TESTS=ON \
     -DCIERA_XXHASH_HEADER_DIR="$deps/xxhash/include" -DCIERA_GTEST_SOURCE_DIR="$deps/googletest" \
     -DCIERA_NVCOMP_DIR="$deps/nvcomp" "${arch_args[@]}" > "$out/configure.log" 2>&1 &&
   cmake --build "$build" --target ciera_cuda_tests ciera_cuda_bench > "$out/build.log" 2>&1; then
  step build "ok ($((SECONDS - start)) s)"
else
  step build "FAILED (configure.log, build.log)"
  tail -n 30 "$out/build.log" "$out/configure.log" 2>/dev/null
  printf '%s\n' "${summary[@]}"
  exit 1
fi
export LD_LIBRARY_PATH="$deps/nvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 1. GPU tests.
"$build/tests/ciera_cuda_tests" --gtest_output="json:$out/tests.json" > "$out/tests.log" 2>&1
rc=$?
skipped=$(grep -c '^\[  SKIPPED \]' "$out/tests.log" || true)
if [[ $rc -ne 0 ]]; then
  step "GPU tests" "FAILED (tests.log)"
  status=1
elif grep -q '^\[  SKIPPED \] [0-9]* test' "$out/tests.log"; then
  step "GPU tests" "skipped: $(grep -m1 -A1 ': Skipped' "$out/tests.log" | tail -n 1 | head -c 100)"
else
  step "GPU tests" "passed ($(grep -o '[0-9]* tests* from [0-9]* test suites* ran' "$out/tests.log"))"
fi

# 2. compute-sanitizer on a short decode test.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [[ -z $sanitizer ]]; then
  step compute-sanitizer "not installed here"
elif [[ ${#arch_args[@]} -eq 0 ]]; then
  step compute-sanitizer "no GPU here"
else
  timeout 300 "$sanitizer" --tool memcheck --error-exitcode 9 "$build/tests/ciera_cuda_tests" \
    --gtest_filter='*Rans*:*Checksum*:CudaDecoder.DecodesCpu*' > "$out/sanitizer.log" 2>&1
  rc=$?
  if grep -qi 'not supported\|unable to\|error 999' "$out/sanitizer.log" && [[ $rc -ne 0 && $rc -ne 9 ]]; then
    step compute-sanitizer "refused the device here: $(grep -m1 -i 'not supported\|unable to' "$out/sanitizer.log" | head -c 100)"
  elif [[ $rc -eq 0 ]]; then
    step compute-sanitizer "memcheck clean (sanitizer.log)"
  else
    step compute-sanitizer "FOUND ERRORS (sanitizer.log)"
    status=1
  fi
fi

# 3. The benchmark.
"$build/bench/cuda/ciera_cuda_bench" --reps 10 --json "$out/bench.json" > "$out/bench.log" 2>&1
rc=$?
if [[ $rc -eq 0 ]]; then
  step benchmark "bench.json"
elif [[ $rc -eq 3 ]]; then
  step benchmark "not run: $(tail -n 1 "$out/bench.log")"
else
  step benchmark "FAILED (bench.log)"
  status=1
fi

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
if [[ -f $out/bench.json ]]; then
  python3 - "$out/bench.json" <<'PY' || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"{report['gpu']}: GB/s of shard bytes (x cudaMemcpy D2D of the same bytes)")
for size in report["sizes"]:
    codec = size["codec"]
    print(f"  {size['values']} values: memcpy D2D {codec['memcpy_d2d_gb_per_s']:.0f} GB/s, "
          f"key frames {codec['key_frame_bits_per_value']:.3f} bits/value, verified {codec['verified']}")
    for c in codec["coders"]:
        print(f"    {c['name']:<42} {c['bits_per_value']:7.3f} b/v  encode {c['encode_gb_per_s']:8.1f}"
              f" (x{c['encode_vs_memcpy_d2d']:.2f})  decode {c['decode_gb_per_s']:8.1f} (x{c['decode_vs_memcpy_d2d']:.2f})")
    for k in size["kernels"]:
        print(f"    kernel {k['op']:<35} {k['gb_per_s']:9.1f}  x{k['vs_memcpy_d2d']:.2f}")
PY
fi
echo "device-check: $((SECONDS - start)) s, output in $out"
exit $status
