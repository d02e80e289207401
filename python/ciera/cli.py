"""The ``ciera`` command. ``ciera train`` is the Python training job; every other subcommand
(``bench codec``, ``bench allgather``, ``analyze``, ...) is the native tool shipped inside this
package. ``ciera analyze ... --plot DIR`` runs the native tool, then draws its report's figures
(plotting is Python's job)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def native_tool() -> Path:
    """The C++ ``ciera`` tool: inside the installed package, or in a source build tree."""
    here = Path(__file__).resolve().parent
    override = os.environ.get("CIERA_NATIVE_TOOL")  # e.g. a development build directory's tool
    if override:
        return Path(override)
    for candidate in (here / "bin" / "ciera", here.parents[1] / "build" / "release" / "tools" / "ciera"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("ciera: the native tool is missing; reinstall with `pip install .`")


def _split_plot_option(args: list[str]) -> tuple[str | None, list[str]]:
    """(DIR of ``--plot DIR`` or ``--plot=DIR``, the other arguments)."""
    plot_dir, rest, i = None, [], 0
    while i < len(args):
        if args[i] == "--plot":
            if i + 1 >= len(args):
                raise SystemExit("ciera analyze: --plot needs a directory")
            plot_dir, i = args[i + 1], i + 2
        elif args[i].startswith("--plot="):
            plot_dir, i = args[i].split("=", 1)[1], i + 1
        else:
            rest.append(args[i])
            i += 1
    return plot_dir, rest


def analyze_with_plots(tool: Path, args: list[str], plot_dir: str) -> int:
    """The native ``ciera analyze`` with its output unchanged, its JSON report also written to a
    temporary file, and the figures of that report written to ``plot_dir``."""
    with tempfile.TemporaryDirectory(prefix="ciera-analyze-") as tmp:
        report_path = Path(tmp) / "report.json"
        status = subprocess.call([str(tool), "analyze", *args, "--json-file", str(report_path)])
        if status != 0:
            return status
        report = json.loads(report_path.read_text())
    from ciera import analysis_plots

    written = analysis_plots.write_figures(report, plot_dir)
    print(f"ciera analyze: {len(written)} figures in {plot_dir}: "
          + ", ".join(Path(p).name for p in written), file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from ciera import train

        return train.main(argv[1:])
    tool = native_tool()
    if argv[:1] == ["analyze"]:
        plot_dir, rest = _split_plot_option(argv[1:])
        if plot_dir is not None:
            return analyze_with_plots(tool, rest, plot_dir)
    share = Path(__file__).resolve().parent / "share" / "linklab.sh"
    env = dict(os.environ)
    if share.is_file():
        env.setdefault("CIERA_LINKLAB", str(share))
    os.execve(str(tool), [str(tool), *argv], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
