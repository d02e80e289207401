"""The ``ciera`` command. ``ciera train`` is the Python training job; every other subcommand
(``bench codec``, ``bench allgather``, ``analyze``, ...) is the native tool shipped inside this
package, whose ``--help`` lists ``train`` too. ``ciera analyze ... --plot DIR`` runs the native
tool, then draws its report's figures (plotting is Python's job). ``ciera bench codec`` runs the
native bench and adds a ``zipnn`` row measured on the same shards (ciera.bench_peers; ZipNN is a
Python package). ``ciera --version`` is answered here, from the extension this package imports."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn


def native_tool() -> Path:
    """The C++ ``ciera`` tool: inside the installed package, or in a source build tree."""
    here = Path(__file__).resolve().parent
    override = os.environ.get("CIERA_NATIVE_TOOL")  # e.g. a development build directory's tool
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise SystemExit(f"ciera: error: CIERA_NATIVE_TOOL={override} is not an executable file")
        return Path(override)
    for candidate in (here / "bin" / "ciera", here.parents[1] / "build" / "release" / "tools" / "ciera"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("ciera: error: the native tool is missing; reinstall with `pip install .`")


def run_native(tool: Path, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """The native tool on `args`, named `ciera` in its argv: its usage lines and the command its
    reports record then read as the user typed them, not as the file inside the package."""
    return subprocess.run(["ciera", *args], executable=str(tool), **kwargs)


def _fail(message: str) -> NoReturn:
    """A bad `ciera analyze` command line, as the native tool reports one: a line, status 2."""
    print(f"ciera analyze: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def version_text() -> str:
    """What ``ciera --version`` prints, as the native tool does: the library version, the git
    commit it was built from and the wire-format version it writes and reads."""
    from ciera import _ext

    commit = getattr(_ext, "git_commit", "unknown")  # an extension built before it had one
    return f"ciera {_ext.__version__} (commit {commit}), wire format {_ext.format_version}"


def _option_value(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value of ``name VALUE`` or ``name=VALUE`` in args, or None; the other arguments).
    Given twice, or without a value, is one line on stderr and status 2."""
    value, rest, i = None, [], 0
    while i < len(args):
        if args[i] == name or args[i].startswith(name + "="):
            if value is not None:
                _fail(f"{name} given twice")
            if args[i] == name:
                if i + 1 >= len(args):
                    _fail(f"{name} needs a value")
                value, i = args[i + 1], i + 2
            else:
                value, i = args[i].split("=", 1)[1], i + 1
            if not value:
                _fail(f"{name} needs a value")
        else:
            rest.append(args[i])
            i += 1
    return value, rest


def _check_plot_dir(plot_dir: str) -> None:
    """Before the analysis runs: the figures can be written to plot_dir, and drawn (a folder no
    installation could write to is refused for that first)."""
    import importlib.util

    from ciera.paths import folder_problem

    problem = folder_problem(plot_dir)
    if problem:
        _fail(f"--plot {plot_dir}: {problem}")
    if importlib.util.find_spec("matplotlib") is None:
        _fail("--plot needs matplotlib (pip install 'ciera[train]')")


def analyze_with_plots(tool: Path, args: list[str], plot_dir: str) -> int:
    """The native ``ciera analyze`` with its output unchanged, its JSON report also written (to
    the user's --json-file, else a temporary file), and the figures of that report written to
    ``plot_dir``."""
    _check_plot_dir(plot_dir)
    json_file, rest = _option_value(args, "--json-file")
    with tempfile.TemporaryDirectory(prefix="ciera-analyze-") as tmp:
        report_path = Path(json_file) if json_file else Path(tmp) / "report.json"
        status = run_native(tool, ["analyze", *rest, "--json-file", str(report_path)]).returncode
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
    if argv[:1] == ["--version"]:
        print(version_text())
        return 0
    tool = native_tool()
    if argv[:1] == ["analyze"]:
        plot_dir, rest = _option_value(argv[1:], "--plot")
        if plot_dir is not None and {"-h", "--help"} & set(rest):
            argv = ["analyze", *rest]   # the native help alone: it writes no report to plot
        elif plot_dir is not None:
            return analyze_with_plots(tool, rest, plot_dir)
    if argv[:2] == ["bench", "codec"]:
        from ciera import bench_peers

        status = bench_peers.bench_codec(tool, argv[2:])
        if status is not None:
            return status
    share = Path(__file__).resolve().parent / "share" / "linklab.sh"
    env = dict(os.environ)
    if share.is_file():
        env.setdefault("CIERA_LINKLAB", str(share))
    os.execve(str(tool), ["ciera", *argv], env)   # argv[0] as run_native gives it
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
