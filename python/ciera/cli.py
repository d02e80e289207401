"""The ``ciera`` command. ``ciera train`` is the Python training job; every other subcommand
(``bench codec``, ``bench allgather``, ...) is the native tool shipped inside this package."""

import os
import sys
from pathlib import Path


def native_tool() -> Path:
    """The C++ ``ciera`` tool: inside the installed package, or in a source build tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "bin" / "ciera", here.parents[1] / "build" / "release" / "tools" / "ciera"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("ciera: the native tool is missing; reinstall with `pip install .`")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from ciera import train

        return train.main(argv[1:])
    tool = native_tool()
    share = Path(__file__).resolve().parent / "share" / "linklab.sh"
    env = dict(os.environ)
    if share.is_file():
        env.setdefault("CIERA_LINKLAB", str(share))
    os.execve(str(tool), [str(tool), *argv], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
