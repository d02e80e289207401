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
# most 8 files, as many as the device tool brings back: summary.txt (a line per step) and
# summary.json (an array of {step, result, failed, seconds, rc}), both rewritten as each step
# ends, so a call cut short still says how far it got; the benchmark's JSON (a file per size,
# each rewritten as its sizes end, so a size cut short keeps the other); and logs.tgz with every
# log, also repacked after each step (the build folder does not come back). Each step gets what
# is left of one overall deadline (CIERA_DEVICE_CHECK_SECONDS, default 420: call the device tool
# with timeout_s 480, so the check ends on its own with time to bring its files back); a step the
# deadline leaves no time is "not run".
#
# A failure stops nothing but itself: the codec's targets are built first, the collective's
# (NCCL, Python extension) as a build of their own, each with `-k 0` (a target that fails to
# compile leaves the others built), and then every step whose binary exists runs. NCCL's header
# and the Python extension's options are passed only when their files are there.
#
# CUDA architectures: CIERA_CUDA_ARCHITECTURES, default 90-real (sm_90: the H100 and the H200
# alike, and what scripts/test.sh compiles for without a GPU); `native` would ask the driver at
# configure time, which a failed probe would turn into no build at all.
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
# Both in one call, one configure and one machine start (a session has 15 minutes of device
# time in all, starts included: two calls do not fit), under the same deadline:
#   CIERA_DEVICE_CHECK_SECONDS=420 scripts/device-check.sh all "$OUT"     (device tool: timeout_s 480)
#
# On a machine without a GPU it still builds everything (a dry run, for sm_90 alone): the tests
# then report "Skipped" and the benchmarks say why they cannot run. On a machine with one, a
# step that skips or does not run (a test skipped, a benchmark refused, no Python extension)
# fails the check, but for the documented one: several NCCL ranks on one GPU need NCCL 2.30.
# Exit status: 0 when every step passed, else 1 (summary.txt and summary.json say which).
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
logs="$build/logs"        # every log, packed into $out/logs.tgz after each step
rm -rf "$logs"
mkdir -p "$logs"
start=$SECONDS
budget=${CIERA_DEVICE_CHECK_SECONDS:-420}
status=0
failed_steps=()
summary=()                # summary.json's entries, one JSON object a step
last_end=$SECONDS         # when the last step ended: a step's seconds are counted from there
: > "$out/summary.txt"
echo "[]" > "$out/summary.json"
rm -f "$out"/bench-*.json "$out/train-summary.json" "$out"/*.part   # an earlier run's, if any

# pack_logs: every log so far into $out/logs.tgz (replaced whole, so a kill mid-way keeps the last).
pack_logs() {
  tar -czf "$out/logs.tgz.part" -C "$logs" . 2>/dev/null && mv -f "$out/logs.tgz.part" "$out/logs.tgz"
}
# json_text TEXT: TEXT as a JSON string (printable ASCII; anything else becomes '?').
json_text() {
  printf '"%s"' "$(printf '%s' "$1" | tr '\t\n\r' '   ' | tr -c ' -~' '?' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')"
}
# record FAILED NAME RESULT [RC]: one step's line in summary.txt and entry in summary.json, both
# written at once, then the logs packed: whatever ends the call, $out holds the latest.
record() {
  local failed=$1 name=$2 result=$3 rc=${4:-null} now=$SECONDS entry body=""
  printf '%-34s %s\n' "$name" "$result" | tee -a "$out/summary.txt"
  summary+=("{\"step\": $(json_text "$name"), \"result\": $(json_text "$result"), \"failed\": $failed, \"seconds\": $((now - last_end)), \"rc\": $rc}")
  last_end=$now
  for entry in "${summary[@]}"; do body+="${body:+,$'\n'}  $entry"; done
  printf '[\n%s\n]\n' "$body" > "$out/summary.json.part" && mv -f "$out/summary.json.part" "$out/summary.json"
  pack_logs
}
# step NAME RESULT [RC]: a step that passed (or a note); fail NAME RESULT [RC]: one that failed.
step() { record false "$@"; }
fail() {
  status=1
  failed_steps+=("$1")
  record true "$@"
}
# how RC LIMIT: a failed command's status in words.
how() {
  if [[ $1 -eq 124 || $1 -eq 137 ]]; then echo "timed out after $2 s"; else echo "FAILED, status $1"; fi
}
# left CAP: seconds a step may take: CAP, or what is left of the deadline if less (0: none left,
# and the step must not run: `timeout 0` would mean no limit at all).
left() {
  local rest=$((budget - (SECONDS - start)))
  ((rest < 0)) && rest=0
  echo $((rest < $1 ? rest : $1))
}
# capped SECONDS COMMAND...: COMMAND under a time limit, killed 10 s after its TERM if it ignores it.
capped() { timeout -k 10 "$@"; }
# gpu_failure NAME RESULT [RC]: a step that skipped or did not run. With a GPU here that is a
# failure of the check (the GPU was never exercised); in a dry run it is what is expected.
gpu_failure() {
  if $have_gpu; then
    fail "$1" "FAILED on a GPU machine: $2" "${3:-null}"
  else
    step "$@"
  fi
}
finish() {
  rm -f "$out"/*.part
  pack_logs
  echo "device-check: $((SECONDS - start)) s, output in $out (summary.json, logs in logs.tgz)"
}
trap finish EXIT

# sm_90 only by default (the H100 and the H200 are both sm_90; a third of the compile time of
# sm_80 + sm_90 + PTX), with a GPU or without; CIERA_CUDA_ARCHITECTURES overrides it (`native`,
# say, for another card).
have_gpu=false
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  have_gpu=true
  nvidia-smi > "$logs/nvidia-smi.txt" 2>&1
fi
arch=${CIERA_CUDA_ARCHITECTURES:-90-real}
{ nvcc --version; cmake --version | head -1; ninja --version; } > "$logs/toolchain.txt" 2>&1

# gtest_step NAME CAP BINARY LOG FILTER: one GPU test binary: passed / skipped / failed.
gtest_step() {
  local name=$1 cap=$2 binary=$3 log=$4 filter=$5 limit
  if [[ ! -x $binary ]]; then
    fail "$name" "not run: $(basename "$binary") was not built (build logs)"
    return
  fi
  limit=$(left "$cap")
  if ((limit == 0)); then
    fail "$name" "not run: the deadline has passed"
    return
  fi
  capped "$limit" "$binary" --gtest_filter="$filter" --gtest_output="json:$logs/$log.json" \
    > "$logs/$log.log" 2>&1
  local rc=$?
  local ran
  ran=$(grep -o '[0-9]* tests* from [0-9]* test suites* ran' "$logs/$log.log")
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    fail "$name" "timed out after $limit s ($log.log: $(grep -c '^\[       OK \]' "$logs/$log.log") passed before; last started: $(grep '^\[ RUN      \]' "$logs/$log.log" | tail -n 1 | cut -c 14- | head -c 70))" "$rc"
  elif [[ $rc -ne 0 ]]; then
    fail "$name" "FAILED, status $rc ($log.log: $(grep -m1 '^\[  FAILED  \]' "$logs/$log.log" | head -c 90))" "$rc"
  elif grep -q '^\[  SKIPPED \] [0-9]* test' "$logs/$log.log"; then
    local why
    why=$(grep -m1 -A1 ': Skipped' "$logs/$log.log" | tail -n 1 | head -c 90)
    # NCCL before 2.30 cannot put several ranks on one GPU: documented, not a failure.
    if grep -A1 ': Skipped' "$logs/$log.log" | grep -v ': Skipped\|^--$' | grep -qv '2\.30'; then
      gpu_failure "$name" "$ran, some skipped: $why" "$rc"
    else
      step "$name" "$ran, some skipped: $why" "$rc"
    fi
  else
    step "$name" "passed ($ran)" "$rc"
  fi
}

# configure OPTIONAL_ARGS...: one configure, with the optional (NCCL, Python) options; if it fails
# with them, again without them, so the codec still builds.
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCIERA_CUDA=ON -DCIERA_CUDA_ONLY=ON
            -DCIERA_WITH_MPI=OFF -DCIERA_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES="$arch"
            -DCIERA_XXHASH_HEADER_DIR="$deps/xxhash/include" -DCIERA_GTEST_SOURCE_DIR="$deps/googletest")
if [[ -f $deps/nvcomp/lib64/libnvcomp.so.6 ]]; then
  cmake_args+=(-DCIERA_NVCOMP_DIR="$deps/nvcomp")
  export LD_LIBRARY_PATH="$deps/nvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
configure() {
  local limit rc
  limit=$(left 120)
  if ((limit == 0)); then
    fail configure "not run: the deadline has passed"
    return
  fi
  # No binary of an earlier run may stand in for one this build fails to make.
  rm -rf "$build/tests/ciera_cuda_tests" "$build/tests/ciera_nccl_tests" \
    "$build/bench/cuda/ciera_cuda_bench" "$build/ciera_nccl_bench" "$build/pkg"
  capped "$limit" cmake -S "$root" -B "$build" "${cmake_args[@]}" "$@" > "$logs/configure.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    step configure "ok, CUDA architectures $arch" 0
    return
  fi
  if [[ $# -gt 0 ]] && (($(left 120) > 0)); then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
    capped "$(left 120)" cmake -S "$root" -B "$build" "${cmake_args[@]}" > "$logs/configure-codec.log" 2>&1
    local again=$?
    if [[ $again -eq 0 ]]; then
      fail configure "$(how $rc "$limit") with the NCCL/Python options (configure.log); without them: ok" "$rc"
      return
    fi
  fi
  fail configure "$(how $rc "$limit") (configure.log: $(grep -m1 'CMake Error' "$logs/configure.log" | head -c 80))" "$rc"
}

# build_step NAME LOG CAP TARGETS...: builds those of TARGETS the configure made, with `-k 0` (a
# target that fails leaves the others built); a target it did not make is a GPU failure.
build_step() {
  local name=$1 log=$2 cap=$3 t limit rc targets=() missing=()
  shift 3
  for t in "$@"; do
    if [[ -f $build/build.ninja ]] && ninja -C "$build" -t query "$t" >/dev/null 2>&1; then
      targets+=("$t")
    else
      missing+=("$t")
    fi
  done
  limit=$(left "$cap")
  if ((${#targets[@]} == 0)); then
    fail "$name" "not run: no target configured (${missing[*]}; configure.log)"
    return
  elif ((limit == 0)); then
    fail "$name" "not run: the deadline has passed"
    return
  fi
  local began=$SECONDS
  capped "$limit" cmake --build "$build" --target "${targets[@]}" -- -k 0 > "$logs/$log.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    local first
    first=$(grep -m1 -E 'error|FAILED:' "$logs/$log.log" | head -c 90)
    fail "$name" "$(how $rc "$limit") ($log.log${first:+: $first})" "$rc"
    tail -n 20 "$logs/$log.log"
  elif ((${#missing[@]} > 0)); then
    gpu_failure "$name" "built ${targets[*]} in $((SECONDS - began)) s; not configured: ${missing[*]} (configure.log)" "$rc"
  else
    step "$name" "ok: ${targets[*]} in $((SECONDS - began)) s" "$rc"
  fi
}

# The codec check's steps: the tests, memcheck and the 16M benchmark (codec_steps FILTER), then
# the 256M benchmark (codec_bench 268435456). With `all` the engine's tests (*CudaEngine*) are
# the collective check's, and the 256M size comes last.
codec_steps() {
  # 1. GPU tests.
  gtest_step "GPU tests" 120 "$build/tests/ciera_cuda_tests" tests "$1"

  # 2. compute-sanitizer on a short decode test.
  local sanitizer rc
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ -z $sanitizer ]]; then
    step compute-sanitizer "not installed here"
  elif ! $have_gpu; then
    step compute-sanitizer "no GPU here"
  elif [[ ! -x $build/tests/ciera_cuda_tests ]]; then
    fail compute-sanitizer "not run: ciera_cuda_tests was not built"
  elif (($(left 60) == 0)); then
    fail compute-sanitizer "not run: the deadline has passed"
  else
    local limit
    limit=$(left 60)
    capped "$limit" "$sanitizer" --tool memcheck --error-exitcode 9 "$build/tests/ciera_cuda_tests" \
      --gtest_filter='*Rans*:*Checksum*' > "$logs/sanitizer.log" 2>&1
    rc=$?
    if grep -qi 'not supported\|unable to\|error 999' "$logs/sanitizer.log" && [[ $rc -ne 0 && $rc -ne 9 && $rc -ne 124 && $rc -ne 137 ]]; then
      step compute-sanitizer "refused the device here: $(grep -m1 -i 'not supported\|unable to' "$logs/sanitizer.log" | head -c 100)" "$rc"
    elif [[ $rc -eq 0 ]]; then
      step compute-sanitizer "memcheck clean (sanitizer.log)" "$rc"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
      fail compute-sanitizer "timed out after $limit s, no error reported before (sanitizer.log)" "$rc"
    elif [[ $rc -eq 9 ]]; then
      fail compute-sanitizer "FOUND ERRORS (sanitizer.log: $(grep -m1 '^========= [A-Z]' "$logs/sanitizer.log" | head -c 80))" "$rc"
    else
      fail compute-sanitizer "FAILED, status $rc (sanitizer.log)" "$rc"
    fi
  fi

  # 3. The benchmark at 16M values (256M: codec_bench, last).
  codec_bench 16777216
}

# codec_bench VALUES: the benchmark at one size, a run of its own (its own JSON and cap: a size
# cut short keeps the other's figures); then every size's figures so far, as a table.
codec_bench() {
  local values=$1 name label limit rc binary="$build/bench/cuda/ciera_cuda_bench"
  name="bench-$((values >> 20))M"
  label="benchmark $((values >> 20))M"
  limit=$(left $((values > 16777216 ? 200 : 90)))
  if [[ ! -x $binary ]]; then
    fail "$label" "not run: ciera_cuda_bench was not built"
    return
  elif ((limit == 0)); then
    fail "$label" "not run: the deadline has passed"
    return
  fi
  capped "$limit" "$binary" --values "$values" --reps 10 --json "$out/$name.json" > "$logs/$name.log" 2>&1
  rc=$?
  # Exit statuses as tools/exit_status.hpp: 2 this machine cannot run it, 3 not exact.
  if [[ $rc -eq 0 ]]; then
    step "$label" "$name.json" "$rc"
  elif [[ $rc -eq 2 ]]; then
    gpu_failure "$label" "not run: $(tail -n 1 "$logs/$name.log" | head -c 100)" "$rc"
  elif [[ $rc -eq 3 ]]; then
    fail "$label" "NOT EXACT, timings kept in $name.json: $(grep -m1 'NOT EXACT' "$logs/$name.log" | cut -d: -f4- | head -c 90)" "$rc"
  else
    fail "$label" "$(how $rc "$limit") ($name.log$([[ -f $out/$name.json ]] && echo ", $name.json"))" "$rc"
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
          f"key frames {codec['key_frame_bits_per_value']:.3f} bits/value, verified {size.get('verified', codec['verified'])}")
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

# The collective check (issue 16): what it finds out (collective_versions: the options and
# targets of its build) and its steps (collective_steps).
collective_args=() collective_targets=()
collective_versions() {
  # The image's NCCL (torch's nvidia-nccl package): its version decides whether several ranks
  # may share the one GPU (2.30+), its header builds the transport, its library is the one the
  # transport loads (as in a torch process). Python.h decides whether the extension can build.
  capped 60 "$python" - > "$logs/versions.txt" 2>&1 <<'PY'
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
  local nccl_dir nccl_include="" nccl_lib="" nccl_version pybind
  nccl_dir=$(sed -n 's/^nccl dir \([^ ]*\)$/\1/p' "$logs/versions.txt")
  # nccl.h: the image's, else the carried one; with neither, no option (CMake's own search then
  # decides, and without a header the NCCL targets are not configured: the build says so).
  if [[ -n $nccl_dir && -f $nccl_dir/include/nccl.h ]]; then
    nccl_include="$nccl_dir/include"
  elif [[ -f $deps/nccl/include/nccl.h ]]; then
    nccl_include="$deps/nccl/include"
  fi
  [[ -n $nccl_include ]] && collective_args+=(-DCIERA_NCCL_INCLUDE_DIR="$nccl_include")
  [[ -n $nccl_dir && -f $nccl_dir/lib/libnccl.so.2 ]] && nccl_lib="$nccl_dir/lib/libnccl.so.2"
  [[ -n $nccl_lib ]] && export CIERA_NCCL_LIBRARY="$nccl_lib"
  nccl_version=$(sed -n 's/^torch nccl \(.*\)$/\1/p' "$logs/versions.txt")
  # Not finding it through Python is no failure: the transport then loads libnccl.so.2 by the
  # loader's search, and the NCCL tests say whether that found one.
  local found=${nccl_lib:-"not found through Python; the loader's search is used"}
  step "NCCL (the image's)" "${nccl_version:-unknown}, $found, header ${nccl_include:-none}"
  collective_targets=(ciera_nccl_tests ciera_nccl_bench)
  pybind=$("$python" -m pybind11 --cmakedir 2>/dev/null || true)
  if grep -q "Python.h True" "$logs/versions.txt" && [[ -n $pybind && -d $pybind ]]; then
    collective_args+=(-DCIERA_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" -Dpybind11_DIR="$pybind"
                      -DCIERA_PYTHON_EXT_DIR="$build/pkg/ciera")
    collective_targets+=(_ext)
  else
    gpu_failure "Python extension" "not built: no Python.h or pybind11 for $python (train step skipped)"
  fi
}

collective_steps() {
  # 1. The engine on device memory, ranks as threads over the loopback transport.
  gtest_step "engine on the GPU (loopback)" 120 "$build/tests/ciera_cuda_tests" engine '*CudaEngine*'

  # 2. The NCCL transport and the engine over it, ranks sharing the one GPU.
  NCCL_MULTI_RANK_GPU_ENABLE=1 gtest_step "NCCL transport + engine" 120 "$build/tests/ciera_nccl_tests" nccl '*'

  # 3. The allgather benchmark against ncclAllGather: two sizes, short, each collective given up
  # after 20 s (its JSON is rewritten after each size, so a size cut short keeps the other).
  local rc limit label="bench allgather --ranks 4"
  limit=$(left 90)
  if [[ ! -x $build/ciera_nccl_bench ]]; then
    fail "$label" "not run: ciera_nccl_bench was not built"
  elif ((limit == 0)); then
    fail "$label" "not run: the deadline has passed"
  else
    NCCL_MULTI_RANK_GPU_ENABLE=1 capped "$limit" "$build/ciera_nccl_bench" --ranks 4 --sizes 4M,64M \
      --steps 10 --warmup 5 --timeout 20 --json "$out/bench-allgather.json" > "$logs/bench-allgather.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then
      step "$label" "bench-allgather.json: $(grep -m1 -i 'wrong elements' "$logs/bench-allgather.log" | head -c 80)" "$rc"
    elif [[ $rc -eq 2 ]]; then   # refused before any work: this machine cannot run it (exit_status.hpp)
      local why
      why=$(tail -n 1 "$logs/bench-allgather.log" | head -c 100)
      if [[ $why == *2.30* ]]; then
        step "$label" "not run: $why" "$rc"
      else
        gpu_failure "$label" "not run: $why" "$rc"
      fi
    elif [[ $rc -eq 3 ]]; then
      fail "$label" "NOT EXACT: wrong elements (bench-allgather.json, bench-allgather.log)" "$rc"
    else
      fail "$label" "$(how $rc "$limit") (bench-allgather.log$([[ -f $out/bench-allgather.json ]] && echo "; bench-allgather.json has the sizes done"))" "$rc"
    fi
  fi

  # 4. FSDP2 on CUDA against CIERA, launched as PyTorch users do: the package's sources beside
  # the extension just built, in a copy of their own ($build/pkg).
  limit=$(left 180)
  if ! $have_gpu; then
    step "train --device cuda" "no GPU here"
  elif ! compgen -G "$build/pkg/ciera/_ext*" >/dev/null; then
    gpu_failure "train --device cuda" "not run: no Python extension"
  elif ((limit < 60)); then
    fail "train --device cuda" "not run: the deadline has passed"
  else
    (cd "$root/python" && find ciera -name '*.py' -exec cp --parents {} "$build/pkg/" \;)
    ( cd "$root" && PYTHONPATH="$build/pkg" PYTHONUNBUFFERED=1 NCCL_MULTI_RANK_GPU_ENABLE=1 \
        capped "$limit" "$python" -m ciera.train --device cuda --launcher torchrun --ranks 2 --steps 24 \
        --warmup 8 --layers 2 --verify --out "$logs/train" --json ) > "$logs/train.log" 2>&1
    rc=$?
    cp "$(ls -d "$logs"/train/*/ 2>/dev/null | head -n 1)summary.json" "$out/train-summary.json" 2>/dev/null
    if [[ $rc -eq 0 ]]; then
      step "train --device cuda" "bitwise identical to FSDP2, control identical (train-summary.json)" "$rc"
    else
      fail "train --device cuda" "$(how $rc "$limit") (train.log: $(tail -n 1 "$logs/train.log" | head -c 90))" "$rc"
    fi
  fi
}

# Configure once (with the collective's options when asked, and only those whose files exist),
# build the codec's targets, then the collective's as a build of their own (in `all`, only with
# 150 s of the deadline kept for the steps), then run every step.
[[ $what != codec ]] && collective_versions
configure "${collective_args[@]}"
if [[ $what == collective ]]; then
  build_step "build (engine tests)" build-codec 300 ciera_cuda_tests
else
  build_step "build (codec)" build-codec 300 ciera_cuda_tests ciera_cuda_bench
fi
if [[ $what == all && -x $build/tests/ciera_cuda_tests ]] && (($(left 300) < 180)); then
  # The codec's steps would have no time left: they come first.
  fail "build (NCCL, Python extension)" "not run: $(left 300) s of the deadline left, kept for the codec's steps"
elif [[ $what != codec ]]; then
  cap=300
  # In `all`, 150 s are kept for the codec's steps when there are any to run.
  [[ $what == all && -x $build/tests/ciera_cuda_tests ]] && cap=$(($(left 300) - 150))
  build_step "build (NCCL, Python extension)" build-collective "$cap" "${collective_targets[@]}"
fi
case $what in
  codec) codec_steps '*'; codec_bench 268435456 ;;
  collective) collective_steps ;;
  all) codec_steps '-*CudaEngine*'; collective_steps; codec_bench 268435456 ;;
esac
if ((status == 0)); then
  record false "device check" "every step passed in $((SECONDS - start)) s$($have_gpu || echo " (no GPU here: a dry run, the GPU steps skipped)")" 0
else
  failed_list=$(printf '%s; ' "${failed_steps[@]}")
  record true "device check" "FAILED in $((SECONDS - start)) s: ${failed_list%; }" 1
fi
exit $status
