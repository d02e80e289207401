#!/usr/bin/env bash
# Creates .venv (once) and installs CIERA into it from this checkout (`pip install .`), with the
# training and test extras: torch 2.13.0's CPU build (from local disk), transformers, pytest.
# Prints the venv's python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [[ ! -x "$root/.venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$root/.venv" >&2
fi
# pip's own status is what counts (grep exits 1 when it has filtered everything).
set +e
"$root/.venv/bin/pip" install --quiet --disable-pip-version-check "$root[train,test]" 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
  echo "python-env.sh: pip install failed (exit $status)" >&2
  exit "$status"
fi
"$root/.venv/bin/python" -c "import ciera, torch" >&2
echo "$root/.venv/bin/python"
