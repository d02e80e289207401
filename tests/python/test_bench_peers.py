"""`ciera bench codec` through the Python entry point: beside CIERA's rows, the peer schemes measured
in the same run on the same shards (issue 18): zeropp-int8 and sdp4bit (lossy: their error, and
every receiver's reconstruction equal to the sender's) from the native tool, and zipnn (lossless,
every shard checked) from the Python side, in the JSON report and in the table."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ciera

needs_zipnn = pytest.mark.skipif(importlib.util.find_spec("zipnn") is None,
                                 reason="zipnn is not installed: pip install 'ciera[peers]'")

SMALL = ["--steps", "6", "--warmup", "2", "--values", "65536", "--sample-every", "1", "--quiet"]
LOSSLESS = ("ciera-auto", "ciera-block", "stateless", "zstd-1", "zstd-3")


def _ciera(args, extra_path=None):
    """`ciera ARGS` through the Python entry point, importing ciera from where the tests do."""
    from ciera import cli

    try:
        cli.native_tool()
    except SystemExit:
        pytest.skip("the native ciera tool is not built")
    path = [str(Path(ciera.__file__).resolve().parents[1])]
    if extra_path:
        path.insert(0, str(extra_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-m", "ciera.cli", "bench", "codec", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def _rows(done) -> tuple[dict, dict]:
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    report = json.loads(done.stdout)
    return report, {row["name"]: row for row in report["comparisons"]}


def _check_native_rows(report, rows, value_bits):
    assert report["verified"] is True, report
    for name in LOSSLESS:
        row = rows[name]
        assert row["lossy"] is False and row["verified"] is True, row
        assert "max_abs_error" not in row and "max_rel_error" not in row, row
    steady = report["config"]["steps"] - report["config"]["warmup"]
    # ZeRO++: 8 bits per value and an FP32 scale per 8000 values; SDP4Bit: 4 bits and an FP32
    # scale per 2048 values. Both lossy, both reconstructed identically on both sides.
    for name, low, high, samples in (("zeropp-int8", 8.0, 8.2, rows["stateless"]["samples"]),
                                     ("sdp4bit", 4.0, 4.2, steady)):
        row = rows[name]
        assert row["lossy"] is True and row["verified"] is True, row
        assert low < row["bits_per_value"] < high, row
        assert row["samples"] == samples, row
        # Weights ~ N(0, 0.02): an error of a quantisation step, far below 0.01. The relative
        # error of the smallest weights is large (int8 rounds them to 0), but finite.
        assert 0 < row["max_abs_error"] < 0.01 and 0 < row["max_rel_error"] < float("inf"), row
        assert row["ratio_vs_raw"] == pytest.approx(value_bits / row["bits_per_value"]), row
        assert row["encode_GBps"] > 0 and row["decode_GBps"] > 0, row


@needs_zipnn
@pytest.mark.parametrize("dtype,value_bits", [("bf16", 16), ("fp16", 16), ("fp32", 32)])
def test_json_report_has_the_peer_rows_measured_on_the_same_shards(dtype, value_bits):
    report, rows = _rows(_ciera([*SMALL, "--dtype", dtype, "--json"]))
    _check_native_rows(report, rows, value_bits)
    zipnn = rows["zipnn"]
    assert zipnn["lossy"] is False and zipnn["verified"] is True, zipnn
    assert zipnn["samples"] == rows["stateless"]["samples"] == 4, zipnn   # the same sampled shards
    assert 0 < zipnn["bits_per_value"] < value_bits, zipnn
    assert zipnn["encode_GBps"] > 0 and zipnn["decode_GBps"] > 0 and "ZipNN 0.5.4" in zipnn["note"], zipnn
    assert list(rows)[-1] == "zipnn"


@needs_zipnn
def test_table_has_the_peer_rows_and_a_max_error_column():
    done = _ciera(SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("codec"))
    assert "max abs error" in header and "max rel error" in header and "verified" in header, done.stdout
    cells = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
             (*LOSSLESS, "zeropp-int8", "sdp4bit", "zipnn")}
    assert set(cells) == {*LOSSLESS, "zeropp-int8", "sdp4bit", "zipnn"}, done.stdout
    for name, row in cells.items():
        assert row[-1] == "yes", done.stdout
        if name in ("zeropp-int8", "sdp4bit"):
            assert float(row[-3]) > 0 and float(row[-2]) > 0, done.stdout
        else:
            assert row[-3] == row[-2] == "-", done.stdout
    assert "verified bit-exact every step: yes" in done.stdout, done.stdout


def test_without_zipnn_the_native_report_is_unchanged_and_one_line_says_how(tmp_path):
    (tmp_path / "zipnn.py").write_text("raise ImportError('hidden for this test')\n")
    done = _ciera([*SMALL, "--json"], extra_path=tmp_path)
    report, rows = _rows(done)
    _check_native_rows(report, rows, 16)
    assert "zipnn" not in rows
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "zipnn row" in lines[0] and "pip install 'ciera[peers]'" in lines[0], done.stderr


@needs_zipnn
def test_flags_written_with_a_value_mean_what_the_native_tool_reads():
    """From a user audit: `--json=true` printed a table, `--no-compare=true` failed on an option
    the user never gave (the entry point matched the bare flags only)."""
    report, rows = _rows(_ciera([*SMALL, "--json=true"]))
    assert "zipnn" in rows and report["verified"] is True
    done = _ciera([*SMALL, "--no-compare=true"])
    assert done.returncode == 0 and "zipnn" not in done.stdout, (done.returncode, done.stderr[-3000:])


def test_a_bad_option_is_still_one_line_and_no_report():
    done = _ciera(["--values", "0", "--json"])
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--values must be at least 1" in lines[0], done.stderr
