"""`ciera train --schemes` / `--baselines`: every gather scheme trains the same model from the same
seed on the same batches beside plain FSDP2. The lossless ones (ciera, delta, stateless, zipnn)
are bitwise identical to FSDP2 in the training harness; the lossy ones (zeropp-int8, sdp4bit)
drift, are measured, and are never reported as exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_torch  # noqa: F401  (makes ciera importable)

needs_torch()  # every test here trains: torch and transformers (pip install '.[train]')

SMALL = ["--ranks", "2", "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32"]


def _env():
    import ciera

    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


def _train(tmp_path, *args, timeout=900):
    cmd = [sys.executable, "-m", "ciera.train", *SMALL, *args, "--json", "--out", str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def test_every_baseline_side_by_side(tmp_path):
    from ciera.train import schemes

    done = _train(tmp_path, "--baselines", "--steps", "6", "--warmup", "2", "--verify")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {x["name"]: x for x in summary["schemes"]}
    assert list(rows) == schemes.available_baselines()
    for name in ("ciera", "delta", "stateless", "zeropp-int8", "sdp4bit"):
        assert name in rows, name
    for name, x in rows.items():
        for key in ("exact", "bits_per_value", "allgather_ms", "iteration_ms", "max_loss_diff", "max_param_diff",
                    "final_loss"):
            assert key in x, (name, key)
        if x["lossy"]:
            assert x["exact"] is False, name   # never exact, whatever its numbers
            assert x["max_param_diff"] > 0, name
            assert x["bits_per_value"] < 9, name
        else:
            assert x["exact"] is True, name
            assert x["max_loss_diff"] == 0 and x["max_param_diff"] == 0, name
            assert 0 < x["bits_per_value"] < 16, name
    assert rows["sdp4bit"]["bits_per_value"] < rows["zeropp-int8"]["bits_per_value"]
    # The lossless trainings were also checked gather by gather against torch's all-gather.
    assert summary["wrong_bytes"] == 0 and summary["verified_bytes"] > 0
    assert summary["losses_identical"] and summary["params_identical"]
    run_dir = next(tmp_path.iterdir())
    for name in ("schemes_loss.png", "schemes_loss_diff.png", "loss.png"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"fsdp2", *rows}
    table = done.stdout
    assert "gather schemes side by side" in table and "LOSSY" in table


@pytest.mark.parametrize("codec", ["zeropp-int8", "stateless"])
def test_one_alternative_against_fsdp2(tmp_path, codec):
    done = _train(tmp_path, "--codec", codec, "--steps", "4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    [row] = summary["schemes"]
    assert row["name"] == codec and summary["main_scheme"] == codec
    assert summary["warmup"] == 1   # nothing waits for warmup
    if codec == "stateless":
        assert row["exact"] and summary["losses_identical"] and summary["params_identical"]
    else:
        assert not row["exact"] and not summary["losses_identical"] and row["max_param_diff"] > 0
        assert "LOSSY" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--schemes", "ciera,ciera"], "--schemes lists ciera twice"),
    (["--schemes", "zstd"], "unknown scheme 'zstd'"),
    (["--schemes", "ciera", "--codec", "delta"], "give one of them"),
    (["--baselines", "--ablation"], "--ablation cannot run with --schemes/--baselines"),
    (["--codec", "sdp4bit", "--budget-mb", "4"], "it cannot run with --budget-mb"),
    (["--codec", "zeropp-int8", "--device", "cuda"], "host codec backend only"),
])
def test_bad_scheme_options_are_refused_before_anything_starts(tmp_path, args, message):
    done = _train(tmp_path, *args, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())
