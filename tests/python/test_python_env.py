"""scripts/python-env.sh (what main.sh and test.sh install with) reinstalls only when the sources
changed, and runs started together take turns. Run on a small git checkout holding the script,
with a stand-in venv whose pip records its calls: no real install, so this is quick."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "python-env.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("git") and shutil.which("flock")), reason="needs git and flock")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout with the script, a few sources, and a venv whose pip only logs."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "python-env.sh")
    (repo / "src").mkdir()
    (repo / "src" / "a.cpp").write_text("int a;\n")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / ".gitignore").write_text("/.venv/\n/build*/\n")
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.0.0"\nexit 0\n')
    (bin_dir / "pip").write_text('#!/bin/sh\necho install >> "$(dirname "$0")/../pip.log"\nsleep "${FAKE_PIP_SECONDS:-0}"\n')
    for tool in ("python", "pip"):
        (bin_dir / tool).chmod(0o755)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "sources")
    return repo


def _run(repo: Path, **env):
    import os

    done = subprocess.run([str(repo / "scripts" / "python-env.sh")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(repo / ".venv" / "bin" / "python")
    return done


def _installs(repo: Path) -> int:
    log = repo / ".venv" / "pip.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_second_run_does_not_reinstall_until_a_source_changes(checkout):
    _run(checkout)
    assert _installs(checkout) == 1
    second = _run(checkout)
    assert _installs(checkout) == 1 and "up to date" in second.stderr, second.stderr
    (checkout / "src" / "a.cpp").write_text("int a = 1;\n")  # edited, not staged
    _run(checkout)
    assert _installs(checkout) == 2
    (checkout / "src" / "b.cpp").write_text("int b;\n")  # a new file, not yet tracked
    _run(checkout)
    assert _installs(checkout) == 3
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-q", "-m", "more")  # a new commit: `ciera --version` names it
    _run(checkout)
    assert _installs(checkout) == 4
    assert "up to date" in _run(checkout).stderr and _installs(checkout) == 4


def test_runs_started_together_install_once(checkout):
    import os

    script = str(checkout / "scripts" / "python-env.sh")
    env = dict(os.environ, FAKE_PIP_SECONDS="1")
    runs = [subprocess.Popen([script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    outputs = [p.communicate(timeout=60) for p in runs]
    assert all(p.returncode == 0 for p in runs), outputs
    assert _installs(checkout) == 1
    assert sum("up to date" in err for _, err in outputs) == 1, outputs


def test_outside_a_git_checkout_it_always_installs(checkout):
    shutil.rmtree(checkout / ".git")
    _run(checkout)
    _run(checkout)
    assert _installs(checkout) == 2
