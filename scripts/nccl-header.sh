#!/usr/bin/env bash
# Puts NCCL's header in .deps/nccl/include/nccl.h (git-ignored), so that the NCCL transport
# (ciera::nccl, src/comm/nccl) compiles on a machine without NCCL. The transport loads
# libnccl.so.2 at run time (dlopen), so the header is all the build needs: the 340 MB library
# stays out of the build. The header comes from PyPI's nvidia-nccl-cu13 wheel (about 300 MB,
# downloaded to a temporary folder and deleted); only nccl.h is kept. Quick and silent when the
# header is already there. Prints the include folder.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
include="$root/.deps/nccl/include"
wheel_version=2.32.3
if [[ -f $include/nccl.h ]]; then
  echo "$include"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "nccl-header: fetching nccl.h from nvidia-nccl-cu13 $wheel_version (the wheel is deleted after)" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work" \
  "nvidia-nccl-cu13==$wheel_version" >&2
mkdir -p "$include"
python3 - "$work" "$include" <<'PY'
import glob, os, sys, zipfile
work, include = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "nvidia_nccl_cu13-*.whl"))[0])
data = wheel.read("nvidia/nccl/include/nccl.h")
# Written under a temporary name and renamed, so an interrupted run leaves no half header.
with open(os.path.join(include, "nccl.h.partial"), "wb") as out:
    out.write(data)
os.replace(os.path.join(include, "nccl.h.partial"), os.path.join(include, "nccl.h"))
PY
echo "$include"
