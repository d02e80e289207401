#!/usr/bin/env bash
# The main job with its embedded defaults: installs what it needs, builds, and runs the codec
# benchmark on its default training trajectory (16M BF16 values, 100 Adam steps, every step
# verified bit for bit), printing a readable summary. Extra arguments go to `ciera bench codec`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
dir=$("$root/scripts/build.sh" release)
exec "$dir/tools/ciera" bench codec "$@"
