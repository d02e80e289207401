"""CIERA's lossless collectives from Python: the binding on loopback threads, the torch transport
(gloo) against torch's own collectives, FSDP2's gradient reduce-scatter through them (bitwise
the uncompressed twin's), and ciera train --reduce-scatter."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import all_ok, needs_torch, spawn

torch = needs_torch()

import ciera
from ciera import _ext

import collectives_workers as w


def _loopback(world, body):
    shared = _ext.loopback_world(world)
    results, errors = [None] * world, [None] * world

    def run(rank):
        try:
            config = ciera.CollectivesConfig()
            config.slice_values = 1000   # several rounds per call
            results[rank] = body(rank, ciera.LosslessCollectives(_ext.loopback_transport(shared, rank), config))
        except Exception as e:   # noqa: BLE001 - reported below, per rank
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_scatter_is_the_rank_order_sum_on_loopback(dtype):
    world, n = 3, 5000
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(world * n, generator=g) * 1e-3).to(dtype) for _ in range(world)]
    code = {torch.bfloat16: _ext.DType.bf16, torch.float32: _ext.DType.fp32}[dtype]

    def body(rank, collectives):
        out = torch.empty(n, dtype=dtype)
        stats = collectives.reduce_scatter(code, _ext.ReduceOp.avg, inputs[rank], out)
        return out, stats

    results, errors = _loopback(world, body)
    assert errors == [None] * world, errors
    for rank, (out, stats) in enumerate(results):
        total = inputs[0][rank * n:(rank + 1) * n].float()
        for p in range(1, world):
            total = total + inputs[p][rank * n:(rank + 1) * n].float()
        expected = (total / world).to(dtype)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), rank
        # Seven rounds: an edge of 250 values, five slices of 900, an edge of 250 (docs/format.md, "Rounds").
        assert stats.coded_slices == (world - 1) * 7 and stats.wire_bytes < stats.raw_bytes, rank
        # Beside the parts, this rank's call record of each round and its verdict (docs/format.md).
        assert stats.control_bytes == 7 * (48 + 24 * world) + 256, rank


def test_a_refused_call_names_the_rank_on_every_rank():
    def body(rank, collectives):
        out = torch.empty(8, dtype=torch.bfloat16)
        collectives.reduce_scatter(_ext.DType.bf16, _ext.ReduceOp.sum, torch.zeros(16 + rank, dtype=torch.bfloat16), out)

    _, errors = _loopback(2, body)
    assert all(isinstance(e, ciera.ConfigError) for e in errors), errors
    assert "rank 1 refused its arguments" in str(errors[0]) and "input must be 2 parts" in str(errors[1])


def test_torch_transport_alltoallv_and_reduce_scatter_match_torch():
    for rank, r in enumerate(all_ok(spawn(w.torch_alltoallv, 3))):
        assert r["alltoallv_equal"] and r["gapped_equal"] and r["reduce_scatter_equal"], (rank, r)
        assert r["coded"] > 0 and r["wire"] < r["raw"], (rank, r)


@pytest.mark.parametrize("coding,reduce_dtype", [("exponent", "fp32"), ("exponent", "bf16"), ("auto", "fp32")])
def test_fsdp2_reduce_scatter_is_bitwise_its_uncompressed_twin(coding, reduce_dtype):
    for rank, r in enumerate(all_ok(spawn(w.fsdp_reduce_scatter, 2, coding, reduce_dtype))):
        assert r["losses_equal"] and r["params_equal"], (rank, r)
        assert r["calls"] > 0 and r["twin_wire"] == r["twin_raw"] > 0, (rank, r)
        if coding == "exponent":
            # Gradient exponents take a few bits, not 8 (BF16: 16 -> ~11 bits; FP32: 32 -> ~27).
            assert r["wire"] < (0.8 if reduce_dtype == "bf16" else 0.95) * r["raw"], (rank, r)
        # Another summation order than gloo's: close to FSDP2's own, not equal in every bit.
        assert r["max_loss_diff_vs_fsdp2"] < 1e-2, (rank, r)


def test_fsdp2_reduce_scatter_on_an_hsdp_mesh_runs_in_each_shard_group():
    # 2 x 2 mesh: FSDP2 reduce-scatters inside each node of 2 ranks (CIERA's collectives there),
    # then all-reduces across the nodes with its own collective.
    for rank, r in enumerate(all_ok(spawn(w.fsdp_reduce_scatter, 4, "exponent", "bf16", "hsdp"))):
        assert r["group"] == ([0, 1] if rank < 2 else [2, 3]), (rank, r)
        assert r["losses_equal"] and r["params_equal"], (rank, r)
        assert r["calls"] > 0 and 0 < r["wire"] < 0.8 * r["raw"], (rank, r)
        # Two ranks a group add in one order (a + b is b + a): FSDP2's own losses, bit for bit.
        assert r["max_loss_diff_vs_fsdp2"] == 0, (rank, r)


def test_fsdp2_reduce_scatter_disable_restores_fsdp2s_own():
    for rank, r in enumerate(all_ok(spawn(w.disable_reduce_scatter, 2))):
        assert r["restored_equal"], (rank, r)
        assert r["calls"] > 0 and r["calls_after_disable"] == r["calls"] and not r["enabled"], (rank, r)
        assert r["comms"] == [r["default"]], (rank, r)
        assert r["refused"] and "already go through CIERA" in r["refused"], (rank, r)
        assert r["calls_again"] > 0, (rank, r)
        # Every rank is refused, and every rank hears the first rank's refusal.
        refused = r["sliced_refused"]
        assert refused and "on rank 0: the model is sharded over ranks (0,)" in refused, (rank, r)


def test_enable_reduce_scatter_refuses_one_ranks_arguments_on_every_rank_at_once():
    expected = {"niceness": ("ConfigError", "on rank 1", "worker_niceness must be 0..19"),
                "timeout": ("ValueError", "on rank 1", "timeout_s must be a finite number of seconds > 0, got -1"),
                "niceness_type": ("TypeError", "on rank 1", "worker_niceness must be an int (0..19), got str 'x'"),
                "model": ("TypeError", "on rank 0", "model must be a torch.nn.Module, got NoneType"),
                "group": ("TypeError", "on rank 0", "process_group must be a torch.distributed process group")}
    for rank, r in enumerate(all_ok(spawn(w.enable_reduce_scatter_refusals, 2))):
        for case, words in expected.items():
            error, seconds = r[case]
            assert error and all(word in error for word in words), (rank, case, error)
            assert seconds < 10, (rank, case, seconds)   # at once, not after a peer's timeout


def test_cieras_own_group_is_freed_before_the_interpreter_finalizes():
    """A gloo group freed only by the interpreter's finalization can abort the process at exit
    (pytorch/pytorch#190489: 4 of 10 two-rank runs of enable_reduce_scatter without disable())."""
    for rank, r in enumerate(all_ok(spawn(w.groups_released_at_exit, 2))):
        assert r["calls"] > 0 and r["freed"], (rank, r)
        assert r["after"] and "CommError" in r["after"] and "process group was released" in r["after"], (rank, r)


def _env():
    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


TINY = ["--ranks", "2", "--steps", "4", "--warmup", "1", "--layers", "1", "--hidden", "64", "--experts", "4",
        "--expert-intermediate", "64", "--seq-len", "32", "--batch", "2", "--launcher", "torchrun", "--json"]


def test_ciera_train_reduce_scatter_is_bitwise_its_twin(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ciera.train", "--reduce-scatter", "ciera", "--reduce-dtype", "bf16",
                           *TINY, "--out", str(tmp_path)], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = json.loads(done.stdout.strip().splitlines()[-1])
    assert s["mode"] == "reduce_scatter" and s["baseline_run"] == "plain-deterministic"
    assert s["losses_identical"] and s["params_identical"], s
    assert s["reduce_scatter_ratio"] > 1.2 and s["reduce_scatter_speedup"] > 0, s
    # Less the waits for the last rank to enter: shorter, never longer, for both arms.
    for arm in ("plain_deterministic", "ciera"):
        assert 0 < s[f"reduce_scatter_after_arrival_ms_{arm}"] <= s[f"reduce_scatter_ms_{arm}"], s
    assert s["reduce_scatter_after_arrival_speedup"] > 0, s
    # The wire bytes hold the call records and verdicts (until stop 70 no figure did): a part of
    # them, named in the table, and in the ratio.
    wire, control = s["reduce_scatter_wire_bytes"], s["reduce_scatter_control_bytes"]
    assert 0 < control < wire, s
    assert f"(control records {control:,})" in done.stdout
    assert s["reduce_scatter_raw_bytes"] / wire == pytest.approx(s["reduce_scatter_ratio"], rel=1e-4), s
    # The busiest link (its parts alone) carries at least the mean link's coded parts and, raw, the
    # same as every link (the byte figures are rounded means).
    parts_ratio = s["reduce_scatter_raw_bytes"] / (wire - control)
    assert 1 <= s["reduce_scatter_busiest_link_ratio"] <= parts_ratio * (1 + 1e-4), s
    assert "busiest link" in done.stdout
    assert s["max_loss_diff_vs_fsdp2"] < 1e-2 and s["max_param_diff_vs_fsdp2"] is not None
    assert "bitwise identical to the same reduction uncompressed" in done.stdout
    assert s["topology"] == {"nodes": 2, "ranks_per_node": 1, "reshard_after_forward": 0, "hsdp": False}, s
    # A flat run of plain FSDP2 on one host: no layout line, no nodes (launcher.layout_row).
    assert "nodes of" not in done.stdout and "one shard group" not in done.stdout
    records = [json.loads(line) for line in open(next(tmp_path.iterdir()) / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"fsdp2", "plain-deterministic", "ciera"} and len(records) == 12
    assert all(r["reduce_scatters"] > 0 for r in records)
    # Both runs through CIERA's collectives send records; the framework's own reduction none.
    assert all((r["control_bytes"] > 0) == (r["run"] != "fsdp2") for r in records), records


@pytest.mark.parametrize("args,message", [
    (["--reduce-scatter", "ciera", "--codec", "delta"], "--codec delta: --reduce-scatter compares reduce-scatters"),
    (["--reduce-scatter", "ciera", "--zero"], "--zero cannot run with --reduce-scatter ciera"),
    (["--reduce-dtype", "bf16"], "--reduce-dtype is for --reduce-scatter ciera/auto"),
    (["--worker-niceness", "5"], "--worker-niceness is for --reduce-scatter ciera/auto"),
    (["--reduce-scatter", "ciera", "--worker-niceness", "20"], "--worker-niceness must be 0..19, got 20"),
])
def test_ciera_train_reduce_scatter_refuses(tmp_path, capsys, args, message):
    from ciera.train import options

    with pytest.raises(SystemExit) as refused:
        options.check(options.parser().parse_args([*args, "--out", str(tmp_path)]))
    assert message in f"{refused.value.code} {capsys.readouterr().err}"


def test_ciera_train_captures_the_moe_inputs(tmp_path):
    """--capture-activations: rank 0's inputs of every MoE block over the plain training's last
    steps, BF16 [tokens, hidden], as ciera bench alltoall --input reads them."""
    from safetensors.torch import load_file

    target = tmp_path / "moe-inputs.safetensors"
    args = [a for a in TINY if a != "--json"]
    done = subprocess.run([sys.executable, "-m", "ciera.train", *args, "--capture-activations", str(target),
                           "--out", str(tmp_path)], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tensors = load_file(str(target))
    # One layer; 4 steps of 2 sequences of 32 tokens; hidden 64.
    assert list(tensors) == ["layer0"] and tensors["layer0"].shape == (4 * 2 * 32, 64)
    assert tensors["layer0"].dtype == torch.bfloat16 and tensors["layer0"].abs().sum() > 0
