"""The main job end to end: `ciera train` on 2 ranks (mpirun, MPI transport), verified."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_torch  # noqa: F401  (makes ciera importable)

needs_torch()  # every test here trains: torch and transformers (pip install '.[train]')


def _env():
    import ciera

    # Wherever the tests import ciera from (installed, or this checkout), the job does too.
    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


@pytest.mark.parametrize("family,transport", [("olmoe", "mpi"), ("qwen2_moe", "torch")])
def test_ciera_train_is_bitwise_identical_to_fsdp2(tmp_path, family, transport):
    cmd = [sys.executable, "-m", "ciera.train", "--ranks", "2", "--model", family, "--steps", "8", "--warmup", "3",
           "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32", "--transport", transport,
           "--verify", "--json", "--out", str(tmp_path)]
    env = _env()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("steps", "bits_per_value", "allgather_speedup", "iteration_speedup", "wrong_bytes", "losses_identical"):
        assert key in summary, key
    assert summary["steps"] == 8
    assert summary["losses_identical"] and summary["params_identical"]
    assert summary["wrong_bytes"] == 0 and summary["verified_bytes"] > 0
    assert 0 < summary["bits_per_value"] < 16
    # Bytes per step and the ratio come from the same steady steps (medians of the bytes beside a
    # ratio of sums once disagreed): the printed raw / wire is the printed ratio.
    assert summary["allgather_raw_bytes"] / summary["allgather_wire_bytes"] == pytest.approx(summary["ratio"], rel=1e-5)
    run_dir = next(tmp_path.iterdir())
    for name in ("metrics.jsonl", "summary.json", "loss.png", "bits_per_value.png", "exponent_change_rate.png"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"fsdp2", "ciera"} and len(records) == 16


def test_ciera_train_writes_a_trace(tmp_path):
    """--trace: the plain run's compute times, the Comm() points measured in the training and a
    probe of torch.distributed's all-gather and reduce-scatter, in the simulator's format. (This
    tiny unshaped run's times are noise, so whether `ciera simulate` can fit them is not asked
    here; the simulator's tests replay traces.)"""
    trace = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "ciera.train", "--ranks", "2", "--steps", "4", "--warmup", "1", "--layers", "1",
           "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32", "--trace", str(trace),
           "--out", str(tmp_path / "runs")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (next((tmp_path / "runs").iterdir()) / "log.txt").read_text()   # the ranks' output
    assert "deprecated" not in log, log[-3000:]   # torch 2.13's names for the collectives
    written = json.loads(trace.read_text())
    assert written["format"] == "ciera-trace" and written["world_size"] == 2
    # Noise may make a curve of this tiny run fall with bytes, which `ciera simulate` refuses: then,
    # and only then, the job says so.
    warned = "ciera simulate will refuse" in done.stderr
    simulated = subprocess.run([sys.executable, "-m", "ciera.cli", "simulate", "--trace", str(trace), "--json"],
                               capture_output=True, text=True, env=_env(), timeout=120)
    assert warned == (simulated.returncode != 0), (written["comm"], simulated.stderr[-2000:], done.stderr[-2000:])
    if simulated.returncode != 0:   # for that reason alone: a trace it cannot read fails here
        assert "measured time does not increase with bytes" in simulated.stderr, simulated.stderr[-2000:]
    else:
        assert json.loads(simulated.stdout), simulated.stdout[-2000:]
    assert written["buckets"] and all(p["seconds"] > 0 for kind in written["comm"].values() for p in kind)
    for kind in ("allgather", "reduce_scatter"):
        points = written["comm_probe"][kind]
        sizes = [p["bytes"] for p in points]
        assert len(points) >= 2 and sizes == sorted(set(sizes)) and all(p["seconds"] > 0 for p in points), points


def _trace_with(reduce_scatter: list) -> dict:
    """A minimal trace in the simulator's format (as tests/test_sim.cpp's) with these Comm() points
    for the reduce-scatter."""
    return {"format": "ciera-trace", "version": 1, "model": {"family": "olmoe", "params": 1000000},
            "world_size": 4, "dtype": "bf16", "link": {"kind": "linklab", "gbit": 1.0, "latency_ms": 0.0},
            "codec": {"encode_GBps": 1000, "decode_GBps": 1000, "detect_GBps": 0},
            "comm": {"allgather": [{"bytes": 1000000, "seconds": 0.5}, {"bytes": 2000000, "seconds": 1.0}],
                     "reduce_scatter": [{"bytes": b, "seconds": s} for b, s in reduce_scatter]},
            "optimizer_s": 0.1,
            "buckets": [{"name": "layers.0", "forward_s": 1.0, "backward_s": 2.0, "raw_bytes": 1000000,
                         "wire_bytes": 500000, "grad_bytes": 1000000,
                         "shards": [{"name": "experts", "type": "expert_ffn", "values": 400000,
                                     "change_rate": 0.01, "block_change_rate": 0.3}]}]}


@pytest.mark.parametrize("points,flat", [
    ([(1000000, 0.5), (2000000, 1.0)], False),
    ([(1000000, 0.5), (2000000, 0.4)], True),                     # falls with bytes
    ([(1000000, 0.5)], False),                                    # one size: fitted through 0
    ([(1000000, 0.2), (1000000, 0.8), (2000000, 0.5)], True),     # same size averaged: level
    ([(1000000, 0.5), (2000000, 0.9), (3000000, 0.1), (4000000, 0.51)], True),  # least squares, not the ends
    ([(10000000, 0.5), (10000128, 0.4)], False),  # sizes barely apart: fitted through 0
])
def test_the_trace_warning_comes_exactly_when_ciera_simulate_refuses(tmp_path, points, flat):
    """`ciera train --trace` says at once when its trace's measured times do not rise with bytes:
    it asks the simulator (ciera.trace.simulate_refusal), whose answer agrees with a user's own
    `ciera simulate` on the same file."""
    from ciera import cli, trace

    try:
        cli.native_tool()
    except SystemExit:
        pytest.skip("the native ciera tool is not built: there is no simulator to ask")
    path = tmp_path / "t.json"
    trace.write(str(path), _trace_with(points))
    refusal = trace.simulate_refusal(str(path))
    assert (refusal is not None) == flat, refusal
    assert flat == (refusal is not None and "comm.reduce_scatter: measured time does not increase" in refusal)
    done = subprocess.run([sys.executable, "-m", "ciera.cli", "simulate", "--trace", str(path), "--json"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    refused = done.returncode != 0 and "comm.reduce_scatter: measured time does not increase" in done.stderr
    assert refused == flat and (flat or done.returncode == 0), done.stderr[-2000:]


def test_ciera_train_rejects_bad_options(tmp_path):
    env = _env()
    done = subprocess.run([sys.executable, "-m", "ciera.train", "--steps", "5", "--warmup", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "--steps 5 must exceed --warmup 5" in done.stderr
    done = subprocess.run([sys.executable, "-m", "ciera.train", "--budget-mb", "-1", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "--budget-mb must be >= 0" in done.stderr


def test_in_training_statistics_agree_with_ciera_analyze_on_checkpoints(tmp_path):
    """The same exponent changes counted two ways: on the gathered parameters during training
    (--stats) and by `ciera analyze` on the checkpoints the run wrote (--save-checkpoints)."""
    ckpts = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "ciera.train", "--ranks", "2", "--steps", "5", "--warmup", "0", "--hidden", "64",
           "--expert-intermediate", "64", "--seq-len", "32", "--no-baseline", "--stats",
           "--save-checkpoints", str(ckpts), "--json", "--out", str(tmp_path / "runs")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    training = json.loads((run_dir / "characterisation.json").read_text())["total"]
    assert len(list(ckpts.glob("*.safetensors"))) == 5
    from ciera.cli import native_tool

    analyzed = subprocess.run([str(native_tool()), "analyze", str(ckpts), "--json", "--quiet"],
                              capture_output=True, text=True, timeout=300)
    assert analyzed.returncode == 0, analyzed.stderr
    offline = json.loads(analyzed.stdout.strip().splitlines()[-1])["total"]
    assert training["transitions"] == 4  # step transitions (analyze counts them per tensor)
    assert training["changed_values"] > 0
    for key in ("values", "changed_values", "blocks", "changed_blocks", "shards", "changed_shards"):
        assert training[key] == offline[key], key
