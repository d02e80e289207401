#!/usr/bin/env bash
# The long fuzzing run behind docs/benchmarks.md's figure: every fuzz target for N executions
# (default 10^7) from its committed corpus; prints executions, executions per second and the
# result per target (scripts/fuzz.sh, which also sets their -max_len). --parallel runs the targets
# side by side, one core each.
#
#   fuzz-long.sh [N] [--parallel] [target...]
set -euo pipefail
runs=10000000
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  runs=$1
  shift
fi
exec "$(dirname "$0")/fuzz.sh" --runs "$runs" "$@"
