#!/usr/bin/env bash
# The main job with its embedded defaults: installs what it needs, builds and installs CIERA
# (skipped when the sources have not changed; runs started together take turns), and runs
# `ciera train`: 4 CPU ranks train a small OLMoE with FSDP2 twice from the same seed, once with
# FSDP2's own all-gather and once through CIERA, and show they are bitwise identical while CIERA
# sends about half the bytes; each run gets a run folder of its own. Extra arguments go to
# `ciera train` (see `ciera train --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/python-env.sh" >/dev/null
cd "$root"
exec "$root/.venv/bin/ciera" train "$@"
