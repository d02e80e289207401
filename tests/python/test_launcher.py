"""`ciera train --launcher torchrun|mpirun|auto`, `--device`, `--control`: the ranks started by
torchrun train exactly as under mpirun, a rank that dies or stalls ends the job with the same one
line, and option pairs no run can use are refused before anything starts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, needs_torch  # noqa: F401  (makes ciera importable)

needs_torch()  # every test here trains: torch and transformers (pip install '.[train]')

SMALL = ["--ranks", "2", "--layers", "1", "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32"]


def _env():
    import ciera

    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ciera.train", *args], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


def test_torchrun_ranks_train_bitwise_identically_with_a_deterministic_control(tmp_path):
    done = _train(*SMALL, "--launcher", "torchrun", "--steps", "4", "--warmup", "1", "--control", "--verify",
                  "--pin-cores", "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["launcher"] == "torchrun" and summary["transport"] == "torch" and summary["device"] == "cpu"
    assert summary["links"] == "unshaped (torchrun on one host)"
    assert summary["losses_identical"] and summary["params_identical"] and summary["steps_identical"] == 4
    assert summary["wrong_bytes"] == 0 and summary["verified_bytes"] > 0
    assert summary["control_identical"] is True
    assert summary["losses"]["fsdp2-control"] == summary["losses"]["fsdp2"]
    assert summary["param_sha256"]["fsdp2-control"] == summary["param_sha256"]["fsdp2"]
    assert "the harness itself is deterministic" in done.stdout
    # --pin-cores: each rank on its own share of the cores torchrun gave it.
    from ciera.train.rank import core_share
    cores = sorted(os.sched_getaffinity(0))
    assert summary["pin_cores"] is True
    assert summary["rank_cores"] == [core_share(cores, 0, 2), core_share(cores, 1, 2)] != [cores, cores]
    assert "pinned (--pin-cores): rank 0 on core" in done.stdout
    run_dir = next(tmp_path.iterdir())
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"fsdp2", "fsdp2-control", "ciera"} and len(records) == 12
    assert sorted(p.name for p in (run_dir / "ranks").glob("*.json")) == ["0.json", "1.json"]


def test_core_share_gives_each_rank_its_own_cores():
    from ciera.train.rank import core_share

    assert [core_share([0, 1], r, 4) for r in range(4)] == [[0], [1], [0], [1]]
    assert [core_share([0, 1, 2, 3], r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [core_share(list(range(8)), r, 3) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [core_share([4, 6, 9], r, 3) for r in range(3)] == [[4], [6], [9]]
    assert core_share([3], 0, 1) == [3]


def test_a_rank_that_cannot_pin_itself_says_why(monkeypatch):
    from ciera.train import rank

    def refuse(tid, cores):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(rank.os, "sched_setaffinity", refuse)
    with pytest.raises(RuntimeError, match=r"^--pin-cores: could not confine this rank to cores \[[0-9, ]+\]: "
                                           r".*Invalid argument \(--no-pin-cores leaves the ranks where"):
        rank.pin_to_cores(0, 1)


def test_pin_cores_defaults_to_the_link_lab(tmp_path):
    from ciera.train import options

    def pinned(*argv):
        args = options.parser().parse_args([*argv, "--out", str(tmp_path)])
        options.check(args)
        return args.pin_cores

    assert pinned() is False and pinned("--link-gbit", "1") is True
    assert pinned("--pin-cores") is True and pinned("--link-gbit", "1", "--no-pin-cores") is False


def test_unpinned_mpirun_ranks_keep_every_core(tmp_path):
    """Outside the link lab the ranks stay where mpirun put them: on every core, as this process is."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed")
    done = _train(*SMALL, "--launcher", "mpirun", "--steps", "2", "--warmup", "1", "--no-baseline",
                  "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    cores = sorted(os.sched_getaffinity(0))
    assert summary["pin_cores"] is False and summary["rank_cores"] == [cores, cores]
    assert "not pinned: rank 0 on " in done.stdout


def test_auto_launcher_and_transport(monkeypatch, tmp_path):
    """auto: mpirun (and the MPI transport) where mpirun is on PATH, torchrun (torch) where not;
    the control defaults to on for cuda only."""

    from ciera import _ext
    from ciera.train import options

    def resolved(*argv):
        args = options.parser().parse_args([*argv, "--out", str(tmp_path)])
        options.check(args)
        return args.launcher, args.transport, args.control

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed")
    assert resolved() == ("mpirun", "mpi" if _ext.with_mpi else "torch", False)
    assert resolved("--launcher", "torchrun") == ("torchrun", "torch", False)
    assert resolved("--transport", "torch") == ("mpirun", "torch", False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun here
    assert resolved() == ("torchrun", "torch", False)
    with pytest.raises(SystemExit, match="mpirun not found .* --transport mpi needs it"):
        resolved("--transport", "mpi")


@pytest.mark.parametrize("argv,message", [
    (["--launcher", "torchrun", "--transport", "mpi"], "--transport mpi needs the ranks under mpirun"),
    (["--launcher", "torchrun", "--link-gbit", "1"], "--link-gbit: the link lab starts its ranks under mpirun"),
    (["--transport", "nccl"], "--transport nccl is CIERA's NCCL communicator, for GPU memory: it needs --device cuda"),
    (["--device", "cuda", "--transport", "mpi"], "--transport mpi carries host memory"),
    (["--device", "cuda", "--trace", "t.json"], "--trace times collectives of CPU tensors"),
    (["--device", "cuda", "--budget-mb", "1"], "--budget-mb: the selector's cost model is measured"),
    (["--control", "--no-baseline"], "--control trains plain FSDP2 twice"),
    (["--device", "cuda"], "--device cuda: no CUDA device is available here"),
])
def test_impossible_pairs_are_refused_in_one_line(tmp_path, argv, message):
    import torch

    from ciera.train import options

    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as refused:
        options.check(options.parser().parse_args([*argv, "--out", str(tmp_path)]))
    text = str(refused.value.code)
    assert text.startswith("ciera train: ") and "\n" not in text and message in text, text


def test_a_refused_pair_starts_nothing(tmp_path):
    done = _train("--launcher", "torchrun", "--transport", "mpi", "--out", str(tmp_path / "runs"), timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr == ("ciera train: --transport mpi needs the ranks under mpirun; with --launcher torchrun "
                           "use --transport torch\n")
    assert not (tmp_path / "runs").exists()


def test_a_killed_rank_is_named_from_torchruns_report(tmp_path):
    """torchrun lists the rank that was killed and those it ended itself afterwards (SIGTERM, or
    SIGKILL for a stopped rank); only the first is the cause."""
    from ciera.train.watch import RankStatus, Watch

    for rank in range(3):
        RankStatus(tmp_path, rank).update("training", "ciera", 4, "backward pass")
    log = """W1130 20:51:36.1 api.py:1028] Sending process 102 closing signal SIGTERM
W1130 20:52:06.1 api.py:1047] Unable to shutdown process 102 via 15, forcefully exiting via 9
ciera.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_20:51:36
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 102)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 102
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_20:51:36
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 101)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 101
"""
    watch = Watch(tmp_path, 3)
    watch.read_statuses()
    assert watch.failure_line(1, log) == ("ciera train: rank 1 was killed by signal 9 (Killed) in the backward pass "
                                          "of step 5 of the ciera run")


def test_exit_status_counts_the_control_and_the_parameters():
    from ciera.train.launcher import exit_status

    good = {"losses_identical": True, "params_identical": True, "iteration_ms_fsdp2": 1.0, "wrong_bytes": 0}
    assert exit_status(good) == 0
    # Losses can agree while the final parameters do not: that is not an exact run.
    assert exit_status(dict(good, params_identical=False)) == 3
    # Without a baseline nothing was compared (None); a baseline whose times are absent (no step
    # timed) still compared every step.
    assert exit_status(dict(good, losses_identical=None, params_identical=None, iteration_ms_fsdp2=None)) == 0
    assert exit_status(dict(good, params_identical=False, iteration_ms_fsdp2=None)) == 3
    assert exit_status(dict(good, control_identical=None)) == 0
    assert exit_status(dict(good, control_identical=True)) == 0
    assert exit_status(dict(good, control_identical=False)) == 3
    assert exit_status(dict(good, losses_identical=False)) == 3
    # A --reduce-scatter run whose CIERA training passed every call through to the framework's
    # own reduction: two runs of that reduction agree, and say nothing of CIERA's.
    scatter = dict(good, mode="reduce_scatter", reduce_scatter_ciera_calls=12)
    assert exit_status(scatter) == 0
    assert exit_status(dict(scatter, reduce_scatter_ciera_calls=0)) == 3
    from ciera.train.reduce_scatter import identical_text

    assert identical_text(dict(scatter, reduce_scatter_ciera_calls=0), True, "ZeRO-3").startswith(
        "NOT TESTED: every reduce-scatter of the CIERA training went to ZeRO-3's own")
    assert identical_text(scatter, True, "ZeRO-3").startswith("yes: ")


def test_layout_and_inter_node_lines_only_for_nodes_of_several_ranks():
    """A flat run's summary counts each rank as a node of its own; its table names no nodes, and
    a layout line only where the layout is not plain FSDP2."""
    from ciera.train.launcher import layout_row, two_level
    from ciera.train.options import parser, topology

    def summary(*argv):
        return {"topology": topology(parser().parse_args(list(argv)))}

    flat = summary("--ranks", "2")
    assert not two_level(flat) and layout_row(flat) == []
    nodes = summary("--nodes", "2", "--ranks-per-node", "2")
    assert two_level(nodes) and layout_row(nodes) == [("layout", "2 nodes of 2 ranks; FSDP2, one shard group")]
    resharded = summary("--ranks", "4", "--reshard-after-forward", "2")
    assert not two_level(resharded)
    assert layout_row(resharded) == [("layout", "FSDP2 reshard_after_forward=2 (backward gathers on that many ranks)")]
    both = summary("--nodes", "2", "--ranks-per-node", "4", "--hsdp", "--reshard-after-forward", "2")
    assert layout_row(both) == [("layout", "2 nodes of 4 ranks; HSDP (replicated across nodes, sharded inside each), "
                                           "reshard_after_forward=2 (backward gathers on that many ranks)")]
    kept = summary("--ranks", "4", "--reshard-after-forward", "1")
    assert layout_row(kept) == [("layout", "FSDP2 reshard_after_forward=1 (parameters stay gathered for backward: "
                                           "no re-gather)")]
    assert layout_row({}) == []
