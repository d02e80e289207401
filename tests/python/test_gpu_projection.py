"""scripts/gpu-cluster-config.py: a GPU device check's measured codec throughputs become a
`ciera simulate` preset (links kept from the base preset), which the simulator accepts and uses;
a failed or foreign benchmark file is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ciera import cli

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-cluster-config.py"


def _tool() -> str:
    try:
        return cli.native_tool()
    except SystemExit as e:
        pytest.skip(f"no native ciera tool: {e}")


def _bench(tmp_path, failure="") -> Path:
    # The shape scripts/device-check.sh codec writes (bench/cuda/bench_cuda_codec.cpp).
    report = {"gpu": "TEST GPU", "sizes": [
        {"values": 1000, "codec": {"failure": "", "coders": [
            {"name": "ciera-auto", "encode_gb_per_s": 1.0, "decode_gb_per_s": 1.0}]}, "kernels": []},
        {"values": 4000, "codec": {"failure": failure, "coders": [
            {"name": "ciera-auto", "encode_gb_per_s": 123.5, "decode_gb_per_s": 456.25},
            {"name": "nvCOMP ANS on the raw shard", "encode_gb_per_s": 9.0, "decode_gb_per_s": 9.0}]},
         "kernels": [{"op": "changed_blocks (B=512)", "gb_per_s": 789.0}]}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    return path


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_measured_throughputs_become_a_preset_the_simulator_uses(tmp_path):
    tool = _tool()
    made = _run(_bench(tmp_path), "--tool", tool)
    assert made.returncode == 0, made.stderr
    config = json.loads(made.stdout)
    kernels = config["clusters"]["h200-measured"]["kernels"]
    assert (kernels["encode_GBps"], kernels["decode_GBps"], kernels["detect_GBps"]) == (123.5, 456.25, 789.0)
    assert "TEST GPU" in kernels["source"]
    assert config["clusters"]["h200-measured"]["inter"] == config["clusters"]["h200-ndr"]["inter"]
    preset = tmp_path / "measured.json"
    preset.write_text(made.stdout)
    sim = subprocess.run([tool, "simulate", "--cluster-config", preset, "--cluster", "h200-measured",
                          "--model", "olmoe-1b-7b", "--gpus", "16", "--json"], capture_output=True, text=True)
    assert sim.returncode == 0, sim.stderr
    assert "encode 123.5, decode 456.2" in subprocess.run(
        [tool, "simulate", "--cluster-config", preset, "--cluster", "h200-measured", "--model", "olmoe-1b-7b",
         "--gpus", "16"], capture_output=True, text=True).stdout


def test_a_failed_benchmark_is_refused_in_one_line(tmp_path):
    made = _run(_bench(tmp_path, failure="no usable CUDA device"), "--tool", _tool())
    assert made.returncode == 1
    assert made.stderr.strip() == "gpu-cluster-config: the benchmark's codec run failed: no usable CUDA device"


def test_a_file_that_is_not_a_benchmark_is_refused(tmp_path):
    other = tmp_path / "other.json"
    other.write_text("{}")
    made = _run(other, "--tool", _tool())
    assert made.returncode == 1
    assert "no 'sizes'" in made.stderr
