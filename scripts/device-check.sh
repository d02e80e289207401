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
# writing to the output folder (its second argument, else $OUT, else build/device-check-out) at
# most 8 files, as many as the device tool brings back: summary.txt (a line per step, written as
# each step ends, so a call cut short still says how far it got), the benchmark's JSON (a file
# per size, so a size cut short keeps the other), and logs.tgz with every log. Each step gets
# what is left of one overall deadline (CIERA_DEVICE_CHECK_SECONDS, default 540: inside the
# tool's 600 s per call, build included); a step the deadline leaves no time is "not run".
#
#   scripts/device-check.sh codec [OUT_DIR]
#
# The collective check (issue 16), a run of its own:
#   scripts/device-check.sh collective [OUT_DIR]
# prints the versions (the image's NCCL first: several ranks on one GPU need 2.30 or later),
# builds the engine's GPU tests, the NCCL transport's tests and benchmark and the Python
# extension (with CUDA and NCCL, against the image's pybind11 and NCCL header), then
#   1. the engine on device memory, ranks as threads on the one GPU over the loopback
#      transport (CudaEngine*, tests/cuda/test_cuda_engine.cpp);
#   2. the NCCL transport and the engine over it, 2-4 ranks on the one GPU
#      (NCCL_MULTI_RANK_GPU_ENABLE=1; skipped, saying so, with an older NCCL);
#   3. `ciera_nccl_bench --ranks 4`: ncclAllGather against the compressed allgather on the same
#      bytes, with wrong-element counts (bench-allgather.json);
#   4. a short `ciera train --device cuda --ranks 2 --verify --launcher torchrun`: FSDP2 against
#      CIERA on CUDA, both with deterministic algorithms, and a plain-vs-plain control (train/).
#
# Both in one call, one build and one machine start (a session has 15 minutes of device time in
# all, starts included: two calls of 540 s do not fit), under the same deadline:
#   scripts/device-check.sh all [OUT_DIR]
#
# On a machine without a GPU it still builds everything (a dry run): the tests then report
# "Skipped" and the benchmark says why it cannot run. On a machine with one, a step that skips
# or does not run (a test skipped, a benchmark refused, no NCCL library, no Python extension)
# fails the check, but for the documented one: several NCCL ranks on one GPU need NCCL 2.30.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-}
if [[ $what != codec && $what != collective && $what != all ]]; then
  echo "usage: device-check.sh codec|collective|all [OUT_DIR]" >&2
  exit 2
fi
out=${2:-${OUT:-$root/build/device-check-out}}
mkdir -p "$out"
deps="$root/.device-deps"
if [[ ! -f $deps/xxhash/include/xxhash.h ]]; then
  echo "device-check: $deps is missing; run scripts/device-deps.sh first and carry .device-deps" >&2
  exit 2
fi
build="$root/build/device-check-$what"
logs="$build/logs"        # every log, packed into $out/logs.tgz at exit
rm -rf "$logs"
mkdir -p "$logs"
start=$SECONDS
budget=${CIERA_DEVICE_CHECK_SECONDS:-540}
status=0
: > "$out/summary.txt"
# step NAME RESULT: one line of the summary, written at once.
step() { printf '%-34s %s\n' "$1" "$2" | tee -a "$out/summary.txt"; }
# left CAP: seconds a step may take: CAP, or what is left of the deadline if less (0: none left,
# and the step must not run: `timeout 0` would mean no limit at all).
left() {
  local rest=$((budget - (SECONDS - start)))
  ((rest < 0)) && rest=0
  echo $((rest < $1 ? rest : $1))
}
# capped SECONDS COMMAND...: COMMAND under a time limit, killed 10 s after its TERM if it ignores it.
capped() { timeout -k 10 "$@"; }
# gpu_failure NAME RESULT: a step that skipped or did not run. With a GPU here that is a failure
# of the check (the GPU was never exercised); in a dry run it is what is expected.
gpu_failure() {
  if [[ ${#arch_args[@]} -gt 0 ]]; then
    step "$1" "FAILED on a GPU machine: $2"
    status=1
  else
    step "$1" "$2"
  fi
}
pack_logs() {
  tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
  echo "device-check: $((SECONDS - start)) s, output in $out (logs in logs.tgz)"
}
trap pack_logs EXIT

# The local GPU's architecture only, when there is one (a third of the compile time of
# sm_80 + sm_90 + PTX); the dry run compiles the default set.
arch_args=()
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi > "$logs/nvidia-smi.txt" 2>&1
  arch_args=(-DCMAKE_CUDA_ARCHITECTURES=native)
fi
{ nvcc --version; cmake --version | head -1; } > "$logs/toolchain.txt" 2>&1

# gtest_step NAME CAP BINARY LOG FILTER: one GPU test binary: passed / skipped / failed.
gtest_step() {
  local name=$1 cap=$2 binary=$3 log=$4 filter=$5 limit
  limit=$(left "$cap")
  if ((limit == 0)); then
    step "$name" "not run: the deadline has passed"
    status=1
    return
  fi
  capped "$limit" "$binary" --gtest_filter="$filter" --gtest_output="json:$logs/$log.json" \
    > "$logs/$log.log" 2>&1
  local rc=$?
  local ran
  ran=$(grep -o '[0-9]* tests* from [0-9]* test suites* ran' "$logs/$log.log")
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    step "$name" "TIMED OUT after $limit s ($log.log: $(grep -c '^\[       OK \]' "$logs/$log.log") passed before)"
    status=1
  elif [[ $rc -ne 0 ]]; then
    step "$name" "FAILED (status $rc, $log.log: $(grep -m1 '^\[  FAILED  \]' "$logs/$log.log" | head -c 90))"
    status=1
  elif grep -q '^\[  SKIPPED \] [0-9]* test' "$logs/$log.log"; then
    local why
    why=$(grep -m1 -A1 ': Skipped' "$logs/$log.log" | tail -n 1 | head -c 90)
    # NCCL before 2.30 cannot put several ranks on one GPU: documented, not a failure.
    if grep -A1 ': Skipped' "$logs/$log.log" | grep -v ': Skipped\|^--$' | grep -qv '2\.30'; then
      gpu_failure "$name" "$ran, some skipped: $why"
    else
      step "$name" "$ran, some skipped: $why"
    fi
  else
    step "$name" "passed ($ran)"
  fi
}

# configure_and_build LOG_NAME CMAKE_ARGS... -- TARGETS...
configure_and_build() {
  local args=() targets=()
  while [[ $1 != -- ]]; do args+=("$1"); shift; done
  shift
  targets=("$@")
  if (($(left 420) == 0)); then
    step build "not run: the deadline has passed"
    exit 1
  fi
  if cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCIERA_CUDA=ON \
       -DCIERA_CUDA_ONLY=ON -DCIERA_WITH_MPI=OFF -DCIERA_BUILD_TESTS=ON \
       -DCIERA_XXHASH_HEADER_DIR="$deps/xxhash/include" -DCIERA_GTEST_SOURCE_DIR="$deps/googletest" \
       "${arch_args[@]}" "${args[@]}" > "$logs/configure.log" 2>&1 &&
     capped "$(left 420)" cmake --build "$build" --target "${targets[@]}" > "$logs/build.log" 2>&1; then
    step build "ok ($((SECONDS - start)) s)"
  else
    step build "FAILED (logs.tgz: configure.log, build.log)"
    tail -n 30 "$logs/build.log" "$logs/configure.log" 2>/dev/null
    exit 1
  fi
}

# What the codec check builds (codec_build), and its steps: the tests, memcheck and the 16M
# benchmark (codec_steps FILTER), then the 256M benchmark (codec_bench 268435456). With `all`
# the engine's tests (*CudaEngine*) are the collective check's, and the 256M size comes last.
codec_build=(-DCIERA_NVCOMP_DIR="$deps/nvcomp" -- ciera_cuda_tests ciera_cuda_bench)
codec_steps() {
  export LD_LIBRARY_PATH="$deps/nvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  # 1. GPU tests.
  gtest_step "GPU tests" 240 "$build/tests/ciera_cuda_tests" tests "$1"

  # 2. compute-sanitizer on a short decode test.
  local sanitizer rc
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -z $sanitizer ]]; then
    step compute-sanitizer "not installed here"
  elif [[ ${#arch_args[@]} -eq 0 ]]; then
    step compute-sanitizer "no GPU here"
  elif (($(left 150) == 0)); then
    step compute-sanitizer "not run: the deadline has passed"
    status=1
  else
    local limit
    limit=$(left 150)
    capped "$limit" "$sanitizer" --tool memcheck --error-exitcode 9 "$build/tests/ciera_cuda_tests" \
      --gtest_filter='*Rans*:*Checksum*' > "$logs/sanitizer.log" 2>&1
    rc=$?
    if grep -qi 'not supported\|unable to\|error 999' "$logs/sanitizer.log" && [[ $rc -ne 0 && $rc -ne 9 ]]; then
      step compute-sanitizer "refused the device here: $(grep -m1 -i 'not supported\|unable to' "$logs/sanitizer.log" | head -c 100)"
    elif [[ $rc -eq 0 ]]; then
      step compute-sanitizer "memcheck clean (sanitizer.log)"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
      step compute-sanitizer "TIMED OUT after $limit s, no error reported before (sanitizer.log)"
      status=1
    else
      step compute-sanitizer "FOUND ERRORS or timed out, status $rc (sanitizer.log)"
      status=1
    fi
  fi

  # 3. The benchmark at 16M values (256M: codec_bench, last).
  codec_bench 16777216
}

# codec_bench VALUES: the benchmark at one size, a run of its own (its own JSON and cap: a size
# cut short keeps the other's figures); then every size's figures so far, as a table.
codec_bench() {
  local values=$1 name limit rc
  name="bench-$((values >> 20))M"
  limit=$(left $((values > 16777216 ? 200 : 90)))
  if ((limit == 0)); then
    step "benchmark $((values >> 20))M" "not run: the deadline has passed"
    status=1
    return
  fi
  capped "$limit" "$build/bench/cuda/ciera_cuda_bench" --values "$values" --reps 10 \
    --json "$out/$name.json" > "$logs/$name.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    step "benchmark $((values >> 20))M" "$name.json"
  elif [[ $rc -eq 3 ]]; then
    gpu_failure "benchmark $((values >> 20))M" "not run: $(tail -n 1 "$logs/$name.log")"
  else
    step "benchmark $((values >> 20))M" "FAILED or timed out ($limit s), status $rc ($name.log)"
    status=1
  fi

  local reports=("$out"/bench-*M.json)
  if [[ -f ${reports[0]} ]]; then
    python3 - "${reports[@]}" <<'PY' || true
import json, sys
reports = [json.load(open(path)) for path in sys.argv[1:]]
print(f"{reports[0]['gpu']}: GB/s of shard bytes (x cudaMemcpy D2D of the same bytes)")
for size in [s for report in reports for s in report["sizes"]]:
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
}

# The Python that holds torch there (KINDS.md: /opt/torch/.venv/bin/python3), else python3.
python=${CIERA_PYTHON:-$(command -v python3)}

# The collective check (issue 16): what it finds out and builds (collective_build, after
# collective_versions), and its steps (collective_steps).
collective_build=()
collective_versions() {
  # The image's NCCL (torch's nvidia-nccl package): its version decides whether several ranks
  # may share the one GPU (2.30+), its header builds the transport, its library is the one the
  # transport loads (as in a torch process). Python.h decides whether the extension can build.
  "$python" - > "$logs/versions.txt" 2>&1 <<'PY'
import os, sys, sysconfig
print("python", sys.version.split()[0], "Python.h", os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
import torch
import torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "reduce_scatter_single", hasattr(dist, "reduce_scatter_single"))
v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print("torch nccl", ".".join(map(str, v)) if isinstance(v, tuple) else v)
try:
    import nvidia.nccl
    base = os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0]
    print("nccl dir", base)
except Exception as e:
    print("nccl dir", "none", e)
PY
  cat "$logs/versions.txt"
  local nccl_dir nccl_include nccl_lib nccl_version pybind python_args=() targets
  nccl_dir=$(sed -n 's/^nccl dir \([^ ]*\)$/\1/p' "$logs/versions.txt")
  nccl_include="$root/.deps/nccl/include"
  [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]] && nccl_include="$nccl_dir/include"
  [[ -f $deps/nccl/include/nccl.h && ! -f $nccl_include/nccl.h ]] && nccl_include="$deps/nccl/include"
  nccl_lib=""
  [[ -n $nccl_dir && -f $nccl_dir/lib/libnccl.so.2 ]] && nccl_lib="$nccl_dir/lib/libnccl.so.2"
  [[ -n $nccl_lib ]] && export CIERA_NCCL_LIBRARY="$nccl_lib"
  nccl_version=$(sed -n 's/^torch nccl \(.*\)$/\1/p' "$logs/versions.txt")
  if [[ -n $nccl_lib ]]; then
    step "NCCL (the image's)" "${nccl_version:-unknown} $nccl_lib"
  else
    gpu_failure "NCCL (the image's)" "${nccl_version:-unknown} (no library found)"
  fi
  targets=(ciera_cuda_tests ciera_nccl_tests ciera_nccl_bench)
  pybind=$("$python" -m pybind11 --cmakedir 2>/dev/null || true)
  if grep -q "Python.h True" "$logs/versions.txt" && [[ -n $pybind ]]; then
    python_args=(-DCIERA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" -Dpybind11_DIR="$pybind"
                 -DCIERA_PYTHON_EXT_DIR="$build/pkg/ciera")
    targets+=(_ext)
  else
    gpu_failure "Python extension" "not built: no Python.h or pybind11 for $python (train step skipped)"
  fi
  collective_build=(-DCIERA_NCCL_INCLUDE_DIR="$nccl_include" "${python_args[@]}" -- "${targets[@]}")
}

collective_steps() {
  # 1. The engine on device memory, ranks as threads over the loopback transport.
  gtest_step "engine on the GPU (loopback)" 120 "$build/tests/ciera_cuda_tests" engine '*CudaEngine*'

  # 2. The NCCL transport and the engine over it, ranks sharing the one GPU.
  NCCL_MULTI_RANK_GPU_ENABLE=1 gtest_step "NCCL transport + engine" 150 "$build/tests/ciera_nccl_tests" nccl '*'

  # 3. The allgather benchmark against ncclAllGather.
  local rc limit
  limit=$(left 90)
  if ((limit == 0)); then
    rc=-1
  else
    NCCL_MULTI_RANK_GPU_ENABLE=1 capped "$limit" "$build/ciera_nccl_bench" --ranks 4 \
      --json "$out/bench-allgather.json" > "$logs/bench-allgather.log" 2>&1
    rc=$?
  fi
  if [[ $rc -eq -1 ]]; then
    step "bench allgather --ranks 4" "not run: the deadline has passed"
    status=1
  elif [[ $rc -eq 0 ]]; then
    step "bench allgather --ranks 4" "bench-allgather.json: $(grep -m1 -i 'wrong elements' "$logs/bench-allgather.log" | head -c 80)"
  elif [[ $rc -eq 2 ]]; then   # refused before any work: this machine cannot run it (exit_status.hpp)
    local why
    why=$(tail -n 1 "$logs/bench-allgather.log" | head -c 100)
    if [[ $why == *2.30* ]]; then
      step "bench allgather --ranks 4" "not run: $why"
    else
      gpu_failure "bench allgather --ranks 4" "not run: $why"
    fi
  else
    step "bench allgather --ranks 4" "FAILED or timed out ($limit s), status $rc (bench-allgather.log)"
    status=1
  fi

  # 4. FSDP2 on CUDA against CIERA, launched as PyTorch users do: the package's sources beside
  # the extension just built, in a copy of their own ($build/pkg).
  limit=$(left 180)
  if [[ ${#arch_args[@]} -eq 0 ]]; then
    step "train --device cuda" "no GPU here"
  elif [[ ! -d $build/pkg/ciera ]]; then
    gpu_failure "train --device cuda" "not run: no Python extension"
  elif ((limit < 60)); then
    step "train --device cuda" "not run: the deadline has passed"
    status=1
  else
    (cd "$root/python" && find ciera -name '*.py' -exec cp --parents {} "$build/pkg/" \;)
    ( cd "$root" && PYTHONPATH="$build/pkg" PYTHONUNBUFFERED=1 NCCL_MULTI_RANK_GPU_ENABLE=1 \
        capped "$limit" "$python" -m ciera.train --device cuda --launcher torchrun --ranks 2 --steps 24 \
        --warmup 8 --layers 2 --verify --out "$logs/train" --json ) > "$logs/train.log" 2>&1
    rc=$?
    cp "$(ls -d "$logs"/train/*/ 2>/dev/null | head -n 1)summary.json" "$out/train-summary.json" 2>/dev/null
    if [[ $rc -eq 0 ]]; then
      step "train --device cuda" "bitwise identical to FSDP2, control identical (train-summary.json)"
    else
      step "train --device cuda" "FAILED or timed out ($limit s), status $rc (train.log: $(tail -n 1 "$logs/train.log" | head -c 90))"
      status=1
    fi
  fi
}

# One build for what was asked (both target sets for `all`), then the steps.
args=() targets=()
add_build() {  # add_build CMAKE_ARGS... -- TARGETS...
  while [[ $1 != -- ]]; do args+=("$1"); shift; done
  shift
  targets+=("$@")
}
[[ $what != collective ]] && add_build "${codec_build[@]}"
if [[ $what != codec ]]; then
  collective_versions
  add_build "${collective_build[@]}"
fi
configure_and_build "${args[@]}" -- "${targets[@]}"
case $what in
  codec) codec_steps '*'; codec_bench 268435456 ;;
  collective) collective_steps ;;
  all) codec_steps '-*CudaEngine*'; collective_steps; codec_bench 268435456 ;;
esac
exit $status
