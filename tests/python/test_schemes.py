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
    # The counts beside the verdicts are over the same trainings, each one's in its row.
    assert summary["loss_mismatches"] == 0 and summary["param_bytes_mismatched"] == 0
    assert summary["steps_identical"] == summary["steps_compared"] == 6
    assert all(x["steps_identical"] == 6 and x["loss_mismatches"] == 0 for x in rows.values() if not x["lossy"])
    run_dir = next(tmp_path.iterdir())
    for name in ("schemes_loss.png", "schemes_loss_diff.png", "loss.png"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"fsdp2", *rows}
    table = done.stdout
    assert "gather schemes side by side" in table and "LOSSY" in table


def _described(differs: list[int], param_bytes: int = 0) -> dict:
    """describe_run()'s exactness fields of a training whose loss differed (1) at these steps on
    one rank of two, and `param_bytes` final parameter bytes."""
    return {"losses_identical": not any(differs), "params_identical": param_bytes == 0,
            "loss_mismatches": sum(differs), "param_bytes_mismatched": param_bytes,
            "steps_compared": len(differs), "steps_identical": differs.count(0)}


def test_the_top_level_counts_are_over_the_trainings_the_verdicts_judge():
    """The top-level losses_identical and params_identical judge every lossless training, and the
    counts beside them count the same ones: a delta training diverging beside a matching ciera (the
    main training) read losses_identical false beside ciera's 0 mismatches and every step
    identical. A lossy training is no part of them (its drift is its result), unless every one is."""
    from ciera.train.summary import exactness_fields

    differing = {"ciera": [0, 0, 0, 0], "delta": [0, 0, 1, 1], "stateless": [0, 1, 0, 0],
                 "sdp4bit": [1, 1, 1, 1]}
    described = {"ciera": _described(differing["ciera"]), "delta": _described(differing["delta"], param_bytes=10),
                 "stateless": _described(differing["stateless"]), "sdp4bit": _described(differing["sdp4bit"], 99)}
    assert exactness_fields(described, differing, ["ciera", "delta", "stateless"], compared=True) == {
        "losses_identical": False, "params_identical": False, "loss_mismatches": 3, "param_bytes_mismatched": 10,
        "steps_compared": 4, "steps_identical": 1}   # step 1: every lossless training matched
    assert exactness_fields(described, differing, ["ciera"], compared=True) == {
        "losses_identical": True, "params_identical": True, "loss_mismatches": 0, "param_bytes_mismatched": 0,
        "steps_compared": 4, "steps_identical": 4}
    # Every training lossy: nothing is exact, and the counts are theirs.
    lossy = {"sdp4bit": described["sdp4bit"]}
    assert exactness_fields(lossy, differing, [], compared=True) == {
        "losses_identical": False, "params_identical": False, "loss_mismatches": 4, "param_bytes_mismatched": 99,
        "steps_compared": 4, "steps_identical": 0}
    # Without a baseline nothing was compared (check_runs flags every step, describe_run counts none).
    unseen = {"ciera": {**_described([1, 1]), "loss_mismatches": 0, "steps_compared": 0}}
    assert exactness_fields(unseen, {"ciera": [1, 1]}, ["ciera"], compared=False) == {
        "losses_identical": None, "params_identical": None, "loss_mismatches": 0, "param_bytes_mismatched": 0,
        "steps_compared": 0, "steps_identical": 0}


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
