#!/usr/bin/env bash
# Prepares .device-deps/ (git-ignored): what the bare GPU machine lacks for
# `scripts/device-check.sh codec`, taken from the package registries on this machine and
# unpacked, so the device tool can carry it (64 MiB limit; this is about 29 MiB):
#   xxhash/include/   xxhash.h from Debian's libxxhash-dev (compiled there from the header)
#   googletest/       GoogleTest's sources from Debian's googletest (built there)
#   nvcomp/           include/ and lib64/libnvcomp.so.6 from PyPI's nvidia-libnvcomp-cu13 (pinned:
#                     the x86-64 manylinux_2_28 wheel, whatever this machine is)
#   nccl/include/     nccl.h (scripts/nccl-header.sh), in case the image's NCCL package has none
# (pybind11, torch, transformers and NCCL's library are in the GPU machine's image already.)
# Run it once before a device run; it does nothing when the folder is complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.device-deps"
if [[ -f "$deps/xxhash/include/xxhash.h" && -f "$deps/googletest/CMakeLists.txt" &&
      -f "$deps/nvcomp/lib64/libnvcomp.so.6" && -f "$deps/nccl/include/nccl.h" ]]; then
  echo "$deps"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download libxxhash-dev googletest >&2)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
rm -rf "$deps"
mkdir -p "$deps/xxhash/include" "$deps/nvcomp"
cp "$work/root/usr/include/xxhash.h" "$deps/xxhash/include/"
cp -r "$work/root/usr/src/googletest" "$deps/googletest"
nvcomp_version=6.0.0.12   # the version the device check was written against (libnvcomp.so.6)
python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
  --dest "$work" "nvidia-libnvcomp-cu13==$nvcomp_version" >&2
python3 - "$work" "$deps/nvcomp" <<'PY'
import glob, os, sys, zipfile
work, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "nvidia_libnvcomp_cu13-*.whl"))[0])
prefix = "nvidia/libnvcomp/"
for name in wheel.namelist():
    rel = name[len(prefix):] if name.startswith(prefix) else None
    if rel and not rel.endswith("/") and (rel.startswith("include/") or rel == "lib64/libnvcomp.so.6"):
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(wheel.read(name))
PY
if [[ ! -f $deps/nvcomp/lib64/libnvcomp.so.6 || ! -f $deps/nvcomp/include/nvcomp.h ]]; then
  echo "device-deps: nvidia-libnvcomp-cu13 $nvcomp_version held no nvidia/libnvcomp/lib64/libnvcomp.so.6" \
       "and include/nvcomp.h; the benchmark's nvCOMP peer needs them (scripts/device-deps.sh)" >&2
  exit 1
fi
mkdir -p "$deps/nccl/include"
cp "$("$root/scripts/nccl-header.sh")/nccl.h" "$deps/nccl/include/"
du -sh "$deps" >&2
echo "$deps"
