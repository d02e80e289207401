#!/usr/bin/env bash
# Creates .venv (once) and installs CIERA into it from this checkout (`pip install .`), with the
# training, test and peers extras: torch 2.13.0's CPU build (from local disk), transformers,
# pytest, zipnn (the ZipNN gather scheme and `ciera bench codec`'s zipnn row; an sdist whose C
# extension pip compiles) and DeepSpeed (ciera.deepspeed, ZeRO-3 on its CPU accelerator).
# Prints the venv's python.
#
# The install is skipped when nothing it is built from changed since the last one: a stamp in
# .venv holds a hash of the commit and of every file the package is built from (tracked or new,
# as they are in the working tree, not as staged). Outside a git checkout there is nothing to
# hash, and it always installs. Runs that start together take turns (flock): the second finds
# the first's install done.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd -P)  # physical, as git rev-parse --show-toplevel
venv="$root/.venv"
stamp="$venv/.ciera-install-stamp"
extras="train,test,peers,deepspeed"

mkdir -p "$root/build"
exec 9>"$root/build/.python-env.lock"
if command -v flock >/dev/null; then
  flock 9
fi

# What the wheel is built from (pyproject.toml's scikit-build configuration and the package).
sources_hash() {
  # A checkout of its own: not a copy of the sources inside some other repository.
  [[ "$(git -C "$root" rev-parse --show-toplevel 2>/dev/null)" == "$root" ]] || return 1
  local files
  files=$(cd "$root" && git ls-files -z --cached --others --exclude-standard -- \
            pyproject.toml CMakeLists.txt README.md cmake include src python tools \
            scripts/linklab.sh scripts/linklab-agent.sh |
          while IFS= read -r -d '' file; do
            if [[ -f "$file" ]]; then printf '%s\n' "$file"; fi
          done | LC_ALL=C sort -u)
  {
    echo "extras $extras"
    "$venv/bin/python" -V 2>&1
    git -C "$root" rev-parse HEAD  # `ciera --version` names the commit the build was made from
    printf '%s\n' "$files"
    printf '%s\n' "$files" | (cd "$root" && git hash-object --stdin-paths)
  } | sha256sum | cut -d' ' -f1
}

if [[ ! -x "$venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$venv" >&2
fi
wanted=$(sources_hash || true)
if [[ -n "$wanted" && -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]]; then
  echo "python-env.sh: .venv is up to date with the sources; not reinstalling" >&2
  echo "$venv/bin/python"
  exit 0
fi
rm -f "$stamp"
# pip's own status is what counts (grep exits 1 when it has filtered everything).
set +e
"$venv/bin/pip" install --quiet --disable-pip-version-check "$root[$extras]" 2>&1 |
  { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
  echo "python-env.sh: pip install failed (exit $status)" >&2
  exit "$status"
fi
"$venv/bin/python" -c "import ciera, torch" >&2
if [[ -n "$wanted" ]]; then
  echo "$wanted" >"$stamp"
fi
echo "$venv/bin/python"
