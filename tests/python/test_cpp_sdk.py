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
        if top == "ciera" or top.endswith(".dist-info") or top == "..":  # ..: the console script
            continue
        outside.append(str(path))
    assert not outside, f"installed at the root of site-packages: {outside[:10]}"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_find_package_at_cmake_prefix_path_builds_and_runs_the_codec_example(tmp_path):
    prefix = ciera.cmake_prefix_path
    assert prefix is not None and (Path(prefix) / "include" / "ciera" / "codec.hpp").is_file()
    build = tmp_path / "build"
    _run("cmake", "-S", str(ROOT / "examples"), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF")
    _run("cmake", "--build", str(build), "--target", "codec_roundtrip")
    assert "every one bitwise exact" in _run(str(build / "codec_roundtrip"))


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout
