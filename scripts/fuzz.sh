#!/usr/bin/env bash
# Runs every libFuzzer target (fuzz/) from a scratch copy of its committed seed corpus
# (fuzz/corpus/<target>/; a run never changes it) and prints, per target, the executions, the
# executions per second and the result. Exits non-zero if any target failed; its log and the
# reproducer (crash-*, timeout-*, oom-*) are kept in build/fuzz/fuzz-runs/.
#
#   fuzz.sh (--seconds S | --runs N) [--parallel] [--check-corpus] [target...]
#
# --seconds: each target for S seconds (scripts/test.sh); --runs: each for N executions
# (scripts/fuzz-long.sh). --parallel runs the targets side by side, one core each, as many at
# a time as there are cores.
# --check-corpus first fails if fuzz/corpus/ is not what make_corpus writes from the library as
# it now is (a format change without scripts/fuzz-corpus.sh would leave seeds that the decoders
# reject at the first check).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
all_targets=(fuzz_payload fuzz_device_decode fuzz_envelope fuzz_control fuzz_decode fuzz_roundtrip
             fuzz_delta fuzz_peers fuzz_collectives)
limit=() parallel=0 check_corpus=0 targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) limit=(-max_total_time="$2"); shift 2 ;;
    --runs) limit=(-runs="$2"); shift 2 ;;
    --parallel) parallel=1; shift ;;
    --check-corpus) check_corpus=1; shift ;;
    -*) echo "usage: fuzz.sh (--seconds S | --runs N) [--parallel] [--check-corpus] [target...]" >&2
        exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [[ ${#limit[@]} -eq 0 ]]; then
  echo "fuzz.sh: give --seconds S or --runs N" >&2
  exit 2
fi
[[ ${#targets[@]} -gt 0 ]] || targets=("${all_targets[@]}")

dir=$("$root/scripts/build.sh" fuzz)
runs="$dir/fuzz-runs"
rm -rf "$runs"
mkdir -p "$runs"
if [[ $check_corpus -eq 1 ]]; then
  "$dir/fuzz/make_corpus" "$runs/expected-corpus" >/dev/null
  if ! diff -rq "$runs/expected-corpus" "$root/fuzz/corpus" >&2; then
    echo "fuzz.sh: fuzz/corpus/ is stale: run scripts/fuzz-corpus.sh and commit what it writes" >&2
    exit 1
  fi
fi

# A unit slower than 10 s is a hang (reliability test 2).
# fuzz_device_decode reads fuzz_payload's inputs (the same payload streams).
corpus_of() { if [[ $1 == fuzz_device_decode ]]; then echo fuzz_payload; else echo "$1"; fi; }
# fuzz_roundtrip's inputs may be as long as its largest seed and more (three rANS segments of BF16
# exponents; 20000 FP32 values cross one); the others keep libFuzzer's default (4096, or their
# largest seed).
max_len_of() { if [[ $1 == fuzz_roundtrip ]]; then echo -max_len=80000; fi; }
run_one() {
  local target=$1
  cp -r "$root/fuzz/corpus/$(corpus_of "$target")" "$runs/$target-corpus"
  # shellcheck disable=SC2046  # max_len_of prints one word or none
  "$dir/fuzz/$target" "${limit[@]}" $(max_len_of "$target") -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$runs/$target-" "$runs/$target-corpus" >"$runs/$target.log" 2>&1
}

declare -A status
if [[ $parallel -eq 1 ]]; then
  # At most one target per core at a time: each still gets a core for its whole time or run count.
  slots=$(nproc)
  for target in "${targets[@]}"; do
    while [[ $(jobs -rp | wc -l) -ge $slots ]]; do wait -n || true; done
    (if run_one "$target"; then echo 0; else echo $?; fi >"$runs/$target.status") &
  done
  wait
  for target in "${targets[@]}"; do status[$target]=$(cat "$runs/$target.status"); done
else
  for target in "${targets[@]}"; do
    if run_one "$target"; then status[$target]=0; else status[$target]=$?; fi
  done
fi

final_stat() { sed -n "s/^stat::$2: *//p" "$runs/$1.log" | tail -n 1; }
failed=0
printf '%-16s %14s %10s  %s\n' target executions exec/s result
for target in "${targets[@]}"; do
  result=ok
  if [[ ${status[$target]} -ne 0 ]]; then
    result="FAILED (exit ${status[$target]}; $runs/$target.log)"
    failed=1
  fi
  printf '%-16s %14s %10s  %s\n' "$target" "$(final_stat "$target" number_of_executed_units)" \
    "$(final_stat "$target" average_exec_per_sec)" "$result"
done
if [[ $failed -ne 0 ]]; then
  for target in "${targets[@]}"; do
    if [[ ${status[$target]} -ne 0 ]]; then
      echo "== $target: end of its log"
      tail -n 40 "$runs/$target.log"
    fi
  done
  exit 1
fi
