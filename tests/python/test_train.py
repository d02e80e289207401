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
    # The wire counts the engine's control records and verdicts too (a user audit found them in
    # no figure): a part of it, and named.
    assert 0 < summary["allgather_control_bytes"] < summary["allgather_wire_bytes"]
    assert f"(control records {summary['allgather_control_bytes']:,})" in done.stdout
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
           "--out", str(tmp_path / "runs"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (next((tmp_path / "runs").iterdir()) / "log.txt").read_text()   # the ranks' output
    assert "deprecated" not in log, log[-3000:]   # torch 2.13's names for the collectives
    written = json.loads(trace.read_text())
    assert written["format"] == "ciera-trace" and written["world_size"] == 2
    # A step's gathers in the trace send what the training reports, control records included (the
    # trace held the payloads alone, so `ciera simulate` read a higher ratio than train printed).
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    per_step = {key: sum(b[key] * b["gathers_per_step"] for b in written["buckets"])
                for key in ("raw_bytes", "wire_bytes")}
    assert per_step["raw_bytes"] == pytest.approx(summary["allgather_raw_bytes"], abs=1), (per_step, summary)
    assert summary["allgather_control_bytes"] > 0
    assert per_step["wire_bytes"] == pytest.approx(summary["allgather_wire_bytes"], abs=1), (per_step, summary)
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
                         "shards": [{"name": "experts", "type": "expert_ffn", "values": 500000,
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
    assert training["changed_values"] > 0
    for key in ("transitions", "values", "changed_values", "blocks", "changed_blocks", "shards", "changed_shards"):
        assert training[key] == offline[key], key


TINY = ["--ranks", "2", "--layers", "1", "--hidden", "64", "--experts", "4", "--expert-intermediate", "64",
        "--seq-len", "32", "--batch", "2"]


def _run_train(tmp_path, *args):
    done = subprocess.run([sys.executable, "-m", "ciera.train", *TINY, *args, "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    summary = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode in (0, 3) else None
    return done, summary


@pytest.fixture(scope="module")
def control_run(tmp_path_factory):
    """Three steps, no warmup, with --control: (the job, its summary, its metrics.jsonl records)."""
    out = tmp_path_factory.mktemp("control")
    done, s = _run_train(out, "--steps", "3", "--warmup", "0", "--control")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, s, [json.loads(line) for line in open(next(out.iterdir()) / "metrics.jsonl")]


def _timed_median(records, run, key):
    """The median of a training's per-step times (each the slowest rank's) over steps 2 and 3."""
    import statistics

    return statistics.median(r[key] for r in records if r["run"] == run and r["step"] >= 1)


def test_time_figures_leave_out_each_process_first_step(control_run):
    """A process's first training step is about twice as slow, and plain FSDP2 always takes it
    (the order rotates from step 0): the time medians are over the later steps only."""
    done, s, records = control_run
    for run in ("fsdp2", "ciera"):
        assert s[f"allgather_ms_{run}"] == pytest.approx(_timed_median(records, run, "allgather_ms")), run
        assert s[f"iteration_ms_{run}"] == pytest.approx(_timed_median(records, run, "iteration_ms")), run
    assert s["timed_steps"] == 2 and "times over 2 steps" in done.stdout
    assert 0 <= s["allgather_hidden_fraction_ciera"] <= 1


def test_the_control_is_timed_beside_the_speedups(control_run):
    """--control's training (plain FSDP2 again) is timed as the others and reported: the
    baseline's speedup over it is the noise floor of the run's speedups."""
    done, s, records = control_run
    assert s["allgather_ms_control"] == pytest.approx(_timed_median(records, "fsdp2-control", "allgather_ms"))
    assert s["iteration_ms_control"] == pytest.approx(_timed_median(records, "fsdp2-control", "iteration_ms"))
    assert s["allgather_speedup_control"] == pytest.approx(s["allgather_ms_fsdp2"] / s["allgather_ms_control"])
    assert s["iteration_speedup_control"] == pytest.approx(s["iteration_ms_fsdp2"] / s["iteration_ms_control"])
    assert s["allgather_share_control"] is not None and s["reduce_scatter_ms_control"] is not None
    assert "noise floor: FSDP2 against its control" in done.stdout


@pytest.fixture(scope="module")
def one_step_schemes_run(tmp_path_factory):
    """One step, no warmup, two lossless schemes, --verify: (the job, its summary)."""
    done, s = _run_train(tmp_path_factory.mktemp("one-step"), "--steps", "1", "--warmup", "0", "--verify",
                         "--schemes", "ciera,stateless")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, s


def test_no_timed_step_reports_no_times(one_step_schemes_run):
    """--steps 1 leaves no step after each process's first: every time figure is absent (a cold
    first step once read as a 3.84x speedup), while the bytes and the exactness stand."""
    done, s = one_step_schemes_run
    for key in ("allgather_ms_fsdp2", "iteration_ms_fsdp2", "allgather_ms_ciera", "iteration_ms_ciera",
                "allgather_speedup", "iteration_speedup", "detect_encode_ms_ciera", "allgather_hidden_fraction_ciera"):
        assert s[key] is None, key
    assert all(x["allgather_speedup"] is None and x["iteration_speedup"] is None for x in s["schemes"])
    assert s["timed_steps"] == 0 and "allgather time/step   not measured" in done.stdout
    assert s["losses_identical"] and s["params_identical"] and s["ratio"] > 1


def test_verify_counts_the_bytes_of_every_training(one_step_schemes_run):
    """--verify with several schemes: verified_bytes counts what every training compared, as
    wrong_bytes counts their wrong ones. Each compares every byte its gathers put out: the raw
    bytes of a step, on each of the 2 ranks, for its 1 step."""
    done, s = one_step_schemes_run
    per_training = s["allgather_raw_bytes"] * 2
    assert s["verified_bytes"] == 2 * per_training and s["wrong_bytes"] == 0
    assert [x["verified_bytes"] for x in s["schemes"]] == [per_training] * 2
    assert f"0 wrong bytes of {2 * per_training:,}" in done.stdout


def test_without_a_baseline_nothing_is_called_identical_or_not(tmp_path):
    done, s = _run_train(tmp_path, "--steps", "2", "--warmup", "1", "--no-baseline")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert s["losses_identical"] is None and s["params_identical"] is None
    assert [x["exact"] for x in s["schemes"]] == [None]
    assert s["schemes"][0]["losses_identical"] is None and s["schemes"][0]["params_identical"] is None
    assert "not compared (--no-baseline)" in done.stdout


def test_a_reduce_scatter_run_waits_for_no_warmup_and_names_no_codec(tmp_path):
    """--reduce-scatter ciera: every training gathers with FSDP2's own all-gather and the
    reduce-scatter keeps no codec state between calls, so no warmup applies: a run shorter than the
    allgather's default warmup (30) runs, every step steady (it was refused: "--steps 3 must exceed
    --warmup 30 (the default here)"), and the summary names no codec (it said "ciera"). A --warmup
    given is still one the steps must exceed: it bounds the steady state the summary reports."""
    done, s = _run_train(tmp_path / "runs", "--reduce-scatter", "ciera", "--steps", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert s["mode"] == "reduce_scatter" and s["codec"] is None and s["warmup"] == 0, s
    assert s["losses_identical"] and s["params_identical"] and s["steps_identical"] == 3, s
    assert "steady state = steps 1..3" in done.stdout
    done, _ = _run_train(tmp_path / "refused", "--reduce-scatter", "ciera", "--steps", "3", "--warmup", "3")
    assert done.returncode == 2 and "--steps 3 must exceed --warmup 3 to measure" in done.stderr, done.stderr
    assert not (tmp_path / "refused").exists()
    # "auto" probes each call shape 4 calls coded, then 4 raw: those 8 steps are its warmup.
    done, _ = _run_train(tmp_path / "auto", "--reduce-scatter", "auto", "--steps", "8")
    assert done.returncode == 2 and "--warmup 8 (the default here)" in done.stderr, done.stderr


def _step_metrics(raw, wire, exposed, duration):
    from ciera.train.metrics import StepMetrics

    return StepMetrics(loss=1.0, iteration_s=1.0, allgather_s=exposed, reduce_scatter_s=0.0, raw_bytes=raw,
                       wire_bytes=wire, changed_values=0, compared_values=0, encode_s=0.0, gather_duration_s=duration)


def _record(summed_steps, world=2):
    """A Run whose steps were recorded with these sums over ranks, rank 0's own the same each step."""
    from ciera.train.metrics import Run

    run = Run("ciera", model=None, lr=1e-4, take_records=None, optimizer=object())
    mine = _step_metrics(100, 40, 0.3, 1.0)
    for summed in summed_steps:
        run.record(0, summed, mine, mine, world=world)
    return run


def test_byte_figures_are_the_mean_over_ranks():
    """Run.record keeps each step's bytes as the mean over ranks (every rank's summed, over the
    world), not the calling rank's alone: --reduce-scatter's ranks send unequal coded bytes."""
    run = _record([_step_metrics(200, 100, 0.5, 2.0), _step_metrics(300, 90, 0.5, 2.0)])
    assert run.results["raw"] == [100, 150] and run.results["wire"] == [50, 45]


def test_the_hidden_share_of_the_gathers_is_a_fraction():
    """Per step, over every rank's gathers together, the share of their duration the training did
    not wait for: within [0, 1] (a wait timed from before the gather's start can exceed its
    duration), None for a step without gathers; the summary's figure is the median of these."""
    run = _record([_step_metrics(200, 100, 0.5, 2.0), _step_metrics(200, 100, 2.5, 2.0),
                   _step_metrics(0, 0, 0.0, 0.0)])
    assert run.results["hidden_fraction"] == [pytest.approx(0.75), 0.0, None]


def test_rank_order_losses_compare_every_ranks(tmp_path):
    """pair.losses_identical (--reduce-scatter's losses_identical_to_fsdp2) says False on every rank
    when any rank's losses differ, though rank 0's agree."""
    script = (
        "import sys, torch, torch.distributed as dist\n"
        "from ciera.train import pair\n"
        "rank = int(sys.argv[1])\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, 2)\n"
        "dist.init_process_group('gloo', store=store, rank=rank, world_size=2)\n"
        "class R: pass\n"
        "a, b = R(), R()\n"
        "a.results = {'loss_bits': [1, 2, 3]}\n"
        "b.results = {'loss_bits': [1, 2, 3] if rank == 0 else [1, 2, 4]}\n"
        "print(pair.losses_identical(a, b), pair.losses_identical(a, a))\n"
        "dist.destroy_process_group()\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env()) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert [o[0].split() for o in outs] == [["False", "True"]] * 2
