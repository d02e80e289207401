"""The C++ library inside the pip-installed package: every file the wheel installed lies in the
package (nothing at the root of site-packages), and find_package(ciera) at
ciera.cmake_prefix_path builds and runs examples/codec_roundtrip.cpp. Skipped where ciera is
this checkout's sources rather than an installed package, or without cmake."""

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

import ciera

ROOT = Path(__file__).resolve().parents[2]

try:
    INSTALLED = importlib.metadata.files("ciera")
except importlib.metadata.PackageNotFoundError:
    INSTALLED = None

pytestmark = pytest.mark.skipif(INSTALLED is None, reason="ciera is not a pip-installed package here")


def test_every_file_of_the_wheel_lies_in_the_package():
    outside = []
    for path in INSTALLED:
        top = path.parts[0]
        if top == "ciera" or top.endswith(".dist-info"):
            continue
        if top == ".." and path.parts[-2:] == ("bin", "ciera"):  # the console script, in the venv's bin
            continue
        outside.append(str(path))
    assert not outside, f"installed outside the package: {outside[:10]}"


def _cmake_problem() -> str | None:
    """Why examples/ cannot be configured and built here, or None."""
    if shutil.which("cmake") is None:
        return "needs cmake"
    version = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.split()[2]
    if tuple(int(x) for x in version.split(".")[:2]) < (3, 22):
        return f"needs cmake 3.22, this is {version}"
    if shutil.which("ninja") is None and shutil.which("make") is None:
        return "needs ninja or make"
    return None


@pytest.mark.skipif(_cmake_problem() is not None, reason=str(_cmake_problem()))
def test_find_package_at_cmake_prefix_path_builds_and_runs_the_codec_example(tmp_path):
    prefix = ciera.cmake_prefix_path
    assert prefix is not None and (Path(prefix) / "include" / "ciera" / "codec.hpp").is_file()
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run("cmake", "-S", str(ROOT / "examples"), "-B", str(build), *generator, f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF")
    _run("cmake", "--build", str(build), "--target", "codec_roundtrip")
    assert "every one bitwise exact" in _run(str(build / "codec_roundtrip"))


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout
