"""Checkpoint and resume (reliability item 7): `ciera train --checkpoint-every K` then `--resume`
gives the steps after the checkpoint, and the final parameters, bitwise as the uninterrupted run
had them; a checkpoint that does not fit the run is refused in one line before any rank starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import all_ok, needs_torch, spawn

torch = needs_torch()

import fsdp_workers as w

# The tests share one uninterrupted run (a module fixture): under pytest-xdist (test.sh runs
# `-n 2 --dist loadgroup`) they stay on one worker, which trains it once.
pytestmark = pytest.mark.xdist_group("resume")

# Small enough for 2 shared cores: 2 ranks, 12 steps of a one-layer OLMoE, a checkpoint at step 6.
TINY = ["--ranks", "2", "--warmup", "3", "--layers", "1", "--hidden", "32", "--experts", "4",
        "--expert-intermediate", "32", "--seq-len", "16", "--batch", "2", "--rss-every", "5"]


def _train(*args, timeout=600):
    import ciera

    # Wherever the tests import ciera from (installed, or this checkout), the job does too.
    env = dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "ciera.train", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _summary(done) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    summary = _summary(_train(*TINY, "--steps", 12, "--checkpoint-every", 6, "--json", "--out", out))
    return summary, next(out.iterdir())


def test_a_resumed_run_is_bitwise_identical_to_the_uninterrupted_one(uninterrupted, tmp_path):
    whole, run_dir = uninterrupted
    assert [Path(c).name for c in whole["checkpoints"]] == ["step-000006", "step-000012"]
    resumed = _summary(_train(*TINY, "--steps", 12, "--resume", run_dir / "checkpoints" / "step-000006",
                              "--json", "--out", tmp_path))
    assert resumed["steps_before"] == 6 and resumed["resumed_from"].endswith("step-000006")
    for name in ("fsdp2", "ciera"):
        assert len(resumed["losses"][name]) == 6
        assert resumed["losses"][name] == whole["losses"][name][6:], name   # steps 7..12, bit for bit
        assert resumed["param_sha256"][name] == whole["param_sha256"][name], name
    # Both runs compared with FSDP2 every step, and compressed: the resumed one from key frames.
    assert whole["steps_identical"] == whole["steps_compared"] == 12
    assert resumed["steps_identical"] == resumed["steps_compared"] == 6
    assert resumed["losses_identical"] and resumed["params_identical"]
    assert 0 < resumed["bits_per_value"] < 16
    assert [m["step"] for m in resumed["memory"]] == [7, 10, 12]
    assert all(len(m["rss_bytes"]) == 2 and min(m["rss_bytes"]) > 0 for m in resumed["memory"])
    records = [json.loads(line) for line in open(next(tmp_path.iterdir()) / "metrics.jsonl")]
    assert sorted({r["step"] for r in records}) == list(range(6, 12))


def test_a_checkpoint_that_does_not_fit_the_run_is_refused_in_one_line(uninterrupted, tmp_path):
    _, run_dir = uninterrupted
    step6 = run_dir / "checkpoints" / "step-000006"
    cases = [
        ([*TINY, "--steps", 12, "--resume", tmp_path / "none"], "no such folder"),
        ([*TINY, "--steps", 12, "--resume", run_dir], "not a checkpoint folder"),
        ([*TINY[2:], "--ranks", 3, "--steps", 12, "--resume", step6], "written by 2 ranks, this run has --ranks 3"),
        ([*TINY, "--hidden", 64, "--steps", 12, "--resume", step6],
         "written with --hidden 32, this run has --hidden 64"),
        ([*TINY, "--steps", 6, "--resume", step6], "--steps 6 must exceed the 6 steps"),
        ([*TINY, "--steps", 12, "--ablation", "--resume", step6], "not er, bsc"),
        ([*TINY, "--steps", 12, "--codec", "zeropp-int8", "--resume", step6],
         "written with --codec ciera, this run has --codec zeropp-int8"),
        ([*TINY, "--steps", 12, "--reshard-after-forward", 1, "--resume", step6],
         "written with --reshard-after-forward None, this run has --reshard-after-forward 1"),
        ([*TINY, "--steps", 12, "--resume", ""], "--resume needs a checkpoint folder"),
        ([*TINY, "--steps", 12, "--checkpoint-every", 13], "--checkpoint-every 13 would write no checkpoint"),
        ([*TINY, "--steps", 12, "--checkpoint-every", 0], "--checkpoint-every must be >= 1"),
        ([*TINY, "--steps", 12, "--rss-every", 0], "--rss-every must be >= 1"),
        ([*TINY, "--steps", 12, "--checkpoint-every", 6, "--checkpoint-timeout", 0],
         "--checkpoint-timeout must be"),
    ]
    for args, reason in cases:
        done = _train(*args, "--out", tmp_path / "runs", timeout=120)
        assert done.returncode != 0 and reason in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr   # one line, no traceback
    assert not (tmp_path / "runs").exists()   # refused before a run folder was made
    # The hint names the whole checkpoints only: one cut short (no metadata yet) is refused too.
    cut_short = tmp_path / "cut"
    (cut_short / "checkpoints" / "step-000003").mkdir(parents=True)
    (cut_short / "checkpoints" / "step-000006").mkdir()
    (cut_short / "checkpoints" / "step-000006" / "ciera-checkpoint.json").write_text("{}")
    done = _train(*TINY, "--steps", 12, "--resume", cut_short, "--out", tmp_path / "runs", timeout=120)
    assert done.returncode == 2 and "(its checkpoints/ holds step-000006)" in done.stderr, done.stderr


def _damaged(step: Path, tmp_path: Path, damage) -> Path:
    """A copy of the checkpoint folder `step`, with `damage(copy)` done to it."""
    import shutil

    copy = tmp_path / "damaged" / step.name
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(step, copy)
    damage(copy)
    return copy


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _edit(meta: Path, **fields) -> None:
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **fields}))


def test_a_damaged_or_unfit_checkpoint_is_refused_before_any_rank_starts(uninterrupted, tmp_path):
    """Files the load would read, missing or cut short, were found only inside the ranks (one
    line naming no file: "CheckpointException ranks:dict_keys([0, 1])"); a run with --budget-mb
    from a checkpoint written without it trained, reported every shard selected, compressed
    none, and ended in a traceback."""
    _, run_dir = uninterrupted
    step6 = run_dir / "checkpoints" / "step-000006"
    cases = [
        (lambda d: (d / "rng-rank1.pt").unlink(), "rng-rank1.pt is missing (rank 1's RNG state)"),
        (lambda d: _truncate(d / "rng-rank0.pt", 100), "rng-rank0.pt is damaged"),
        (lambda d: torch.save({"x": 1}, d / "rng-rank1.pt"), "rng-rank1.pt is damaged (it holds a dict, not a CPU RNG"),
        (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing (.metadata names it)"),
        (lambda d: _truncate(d / "__0_0.distcp", 1000), "__0_0.distcp is 1000 bytes, but .metadata reads it"),
        (lambda d: _truncate(d / ".metadata", 1000), ".metadata is damaged"),
        (lambda d: _edit(d / "ciera-checkpoint.json", steps_done=-3), "says -3 steps were done"),
    ]
    for damage, reason in cases:
        done = _train(*TINY, "--steps", 12, "--resume", _damaged(step6, tmp_path, damage), "--out",
                      tmp_path / "runs", timeout=120)
        assert done.returncode == 2 and reason in done.stderr, (reason, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = _train(*TINY, "--steps", 12, "--budget-mb", 1, "--resume", step6, "--out", tmp_path / "runs", timeout=120)
    assert done.returncode == 2 and "written without the selector of ciera" in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_selector_state_continues_in_a_fresh_engine():
    for r in all_ok(spawn(w.selector_resume, 2)):
        assert r["step"] == 6 and r["selection_step"] == 3 and r["carried"], r
        assert r["chosen"] == r["chosen_before"] and r["chosen"] and r["policies_equal"], r
        assert r["history"] == r["resumed_history"] == [3, 7], r
        assert r["compressed_gathers"] > 0 and r["wrong_bytes"] == 0 and r["verified_bytes"] > 0, r


def _refusal(*args) -> str | None:
    """What options.check says of a command line, in this process (no launch: a few ms each)."""
    from ciera.train import options

    parsed = options.parser().parse_args([*map(str, args)])
    try:
        options.check(parsed)
    except SystemExit as refused:
        return str(refused.code)
    return None


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_changed_or_mixed_file_is_refused_by_its_sha256(uninterrupted, tmp_path):
    """torch keeps no checksum: one flipped byte in a .distcp trained other numbers (reported as
    CIERA inexact, or with --no-baseline not at all), and step 12's files copied into step 6's
    folder resumed as "bitwise identical" with other losses."""
    from ciera.train import checkpoint

    _, run_dir = uninterrupted
    step6, step12 = (run_dir / "checkpoints" / name for name in ("step-000006", "step-000012"))
    meta = json.loads((step6 / checkpoint.METADATA).read_text())
    # Every file the folder holds has its sha256 recorded, the CPU run's no CUDA RNG state.
    assert meta["version"] == 2 and meta["config"]["device"] == "cpu"
    assert sorted(meta["sha256"]) == sorted(p.name for p in step6.iterdir() if p.name != checkpoint.METADATA)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank0.pt", "rng-rank1.pt"} <= set(meta["sha256"])
    assert all(checkpoint.sha256_of(step6 / name) == digest for name, digest in meta["sha256"].items())
    resume = [*TINY, "--steps", 12, "--resume"]
    assert _refusal(*resume, step6) is None
    copy = _damaged(step6, tmp_path, lambda d: _flip_byte(d / "__0_0.distcp", 2000))
    assert f"checkpoint damaged or mixed: __0_0.distcp's sha256 is {checkpoint.sha256_of(copy / '__0_0.distcp')}, " \
           f"the checkpoint recorded {meta['sha256']['__0_0.distcp']}" in _refusal(*resume, copy)
    assert "__0_0.distcp's sha256 is" in _refusal(*resume, copy, "--no-baseline")
    import shutil

    step12_data = ("__0_0.distcp", "__1_0.distcp")
    mixed = _damaged(step6, tmp_path, lambda d: [shutil.copy(step12 / n, d / n) for n in step12_data])
    assert "checkpoint damaged or mixed: __0_0.distcp's sha256 is" in _refusal(*resume, mixed)
    # The whole path once: one line, status 2, before any rank starts.
    done = _train(*resume, _damaged(step6, tmp_path, lambda d: _flip_byte(d / "__1_0.distcp", 100)), "--out",
                  tmp_path / "runs", timeout=120)
    assert done.returncode == 2 and "__1_0.distcp's sha256 is" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists(), done.stderr


def test_ciera_checkpoint_json_is_read_strictly(uninterrupted, tmp_path):
    """"steps_done": 3.7 was read as 3 and "selectors": [1] accepted; --device was not recorded
    (a CUDA checkpoint resumed on the CPU goes on with other numbers)."""
    _, run_dir = uninterrupted
    step6 = run_dir / "checkpoints" / "step-000006"
    meta = json.loads((step6 / "ciera-checkpoint.json").read_text())

    def config(**fields):
        return {"config": {**meta["config"], **fields}}

    cases = [({"steps_done": 6.0}, '"steps_done" must be an integer, got 6.0'),
             ({"steps_done": True}, '"steps_done" must be an integer, got true'),
             ({"ranks": "2"}, '"ranks" must be an integer, got "2"'),
             ({"selectors": [1]}, '"selectors" must be an object of selector states by training, got [1]'),
             ({"selectors": {"ciera": 1}}, '"selectors" must be an object'),
             ({"trainings": ["fsdp2", 1]}, '"trainings" must be a list of names'),
             ({"sha256": {".metadata": "00"}}, '"sha256" must be an object of sha256 digests'),
             ({"version": 1}, "before checkpoints recorded their files' sha256"),
             ({"version": "2"}, 'checkpoint version "2", this ciera reads 2'),
             (config(device="cuda"), "written with --device cuda, this run has --device cpu"),
             (config(hidden=32.0), "written with --hidden 32.0, this run has --hidden 32"),
             (config(hsdp=0), "written with --hsdp 0, this run has --hsdp False")]
    for fields, reason in cases:
        copy = _damaged(step6, tmp_path, lambda d: _edit(d / "ciera-checkpoint.json", **fields))
        assert reason in (_refusal(*TINY, "--steps", 12, "--resume", copy) or ""), (fields, reason)
    no_sha = {k: v for k, v in meta.items() if k != "sha256"}
    copy = _damaged(step6, tmp_path, lambda d: (d / "ciera-checkpoint.json").write_text(json.dumps(no_sha)))
    assert 'ciera-checkpoint.json has no "sha256"' in _refusal(*TINY, "--steps", 12, "--resume", copy)


def test_a_checkpoint_of_another_shape_is_named_by_its_parameter(uninterrupted):
    """A model/checkpoint shape mismatch failed on every rank inside dcp.load, reported as
    "CheckpointException ranks:dict_keys([0, 1])" with the cause only in log.txt."""
    from ciera.train import checkpoint

    _, run_dir = uninterrupted
    step6 = run_dir / "checkpoints" / "step-000006"
    fits = {"ciera": {"model": {"model.embed_tokens.weight": torch.empty(256, 32)}}}
    checkpoint.check_shapes(fits, step6)
    with pytest.raises(ValueError, match=r"ciera's model.embed_tokens.weight has shape \[256, 32\] in the "
                                         r"checkpoint, \[256, 64\] here"):
        checkpoint.check_shapes({"ciera": {"model": {"model.embed_tokens.weight": torch.empty(256, 64)}}}, step6)
    with pytest.raises(ValueError, match=r"holds no model.extra.weight of fsdp2 \(shape \[3\] here\)"):
        checkpoint.check_shapes({"fsdp2": {"model": {"model.extra.weight": torch.empty(3)}}}, step6)


def test_a_resumed_delta_run_says_which_step_carries_the_key_frames(uninterrupted):
    """The steps row named the key frames' step for ciera/auto, and for delta only with warmup 1,
    never after a resume (whose fresh engine sends key frames at its first step)."""
    from ciera.train.launcher import render_summary

    whole, run_dir = uninterrupted
    delta = {**whole, "main_scheme": "delta", "codec": "delta", "budget_bytes": None}
    steps = [line for line in render_summary({**delta, "warmup": 1}, run_dir).splitlines() if line.startswith("steps")]
    assert "from step 1;" in steps[0] and "(step 1 carries the key frames)" in steps[0], steps
    resumed = {**delta, "steps_before": 6, "resumed_from": str(run_dir / "checkpoints" / "step-000006")}
    for warmup in (1, 3, 9):
        steps = [line for line in render_summary({**resumed, "warmup": warmup}, run_dir).splitlines()
                 if line.startswith("steps")]
        assert "value-delta frames on every shard from step 7;" in steps[0], steps
        assert "(step 7 carries the key frames)" in steps[0], steps
