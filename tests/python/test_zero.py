"""ciera.zero: PyTorch's ZeroRedundancyOptimizer with its parameter sync through CIERA (bitwise
identical to PyTorch's broadcasts), the FP32-master wrapper, and `ciera train --zero`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import all_ok, grown, needs_torch, spawn

torch = needs_torch()

import ciera
import zero_workers as w
from ciera import zero


def test_parameters_are_bitwise_identical_to_torch_zero():
    results = all_ok(spawn(w.exact_vs_torch, 2))   # uneven partitions: 4608 and 2424 values
    for rank, r in enumerate(results):
        for case in ("bf16", "fp32", "empty", "zero_sized", "frozen", "ciera", "raw"):
            c = r[case]
            assert all(c["equal"]) and all(c["losses_equal"]), (rank, case, c)
            assert c["in_flat"] and c["changed"], (rank, case, c)
            raw = {s[0] for s in c["stats"]}
            assert len(raw) == (2 if case == "frozen" else 1) and min(raw) > 0, (rank, case, c["stats"])
        # After the first sync (a key frame) the differences travel, far below 16 bits a value.
        for raw, wire, _ in r["bf16"]["stats"][1:]:
            assert wire < raw / (4 if w.POLICY == "delta" else 1.2), (rank, r["bf16"]["stats"])
        for raw, wire, _ in r["fp32"]["stats"][1:] + r["ciera"]["stats"][1:]:
            assert wire < raw, (rank, r["fp32"]["stats"], r["ciera"]["stats"])
        assert all(wire >= raw for raw, wire, _ in r["raw"]["stats"]), r["raw"]["stats"]
        assert r["bf16"]["cache_bytes"] > 0
        # ZeRO's consolidated state_dict (FP32 masters included) resumes bitwise; close() holds.
        assert r["resume"]["identical"] and r["resume"]["lr_restored"], r["resume"]
        assert "closed" in (r["resume"]["closed_error"] or ""), r["resume"]
        assert r["resume"]["untouched_after_close"], r["resume"]
        # Arguments that only rank 1 passes: raised on both ranks, naming rank 1, not at a timeout.
        d = r["differing"]
        assert d["bad_policy"] == ("ValueError: ciera.zero.ZeroRedundancyOptimizer: on rank 1: policy must be one "
                                   "of 'delta', 'ciera', 'raw', got 'fast'"), d
        assert d["chunk_values"] == ("ConfigError: ciera.zero.ZeroRedundancyOptimizer: the ranks differ in "
                                     "chunk_values: 4194304 on rank 0; 512 on rank 1"), d
        assert d["fp64"] == ("TypeError: ciera.zero.ZeroRedundancyOptimizer: on rank 1: CIERA carries bf16, fp16 and "
                             "fp32 parameters; the parameters on cpu are torch.float64"), d
        # PyTorch's own local checks, run inside the agreement: raised by its constructor on rank
        # 1 alone, they left rank 0 waiting in the next collective until the group's timeout.
        assert d["empty"] == ("ValueError: ciera.zero.ZeroRedundancyOptimizer: on rank 1: ZeroRedundancyOptimizer got "
                              "an empty parameter list"), d
        assert d["mixed_dense"] == ("ValueError: ciera.zero.ZeroRedundancyOptimizer: on rank 1: ZeroRedundancyOptimizer "
                                    "only supports using the same dense type for all parameters but got both "
                                    "torch.BFloat16Tensor and torch.FloatTensor"), d
        # Other parameters on rank 1: named as such (an extra one was a shard-size mismatch of
        # bucket 'zero:cpu'; a transposed one, of the same size, went unnoticed).
        assert d["extra_layer"] == ("ConfigError: ciera.zero.ZeroRedundancyOptimizer: the ranks' models differ: rank 0 "
                                    "has 4 parameters, rank 1 has 5"), d
        assert d["transposed"].startswith("ConfigError: ciera.zero.ZeroRedundancyOptimizer: the ranks' models differ: "
                                          "parameter '0' is [96, 48] bfloat16 on rank 0, [48, 96] bfloat16 on rank 1"), d
        assert all(d[k + "_s"] < 30 for k in ("bad_policy", "chunk_values", "fp64", "empty", "mixed_dense",
                                              "extra_layer", "transposed")), d
    # Rank 1's optimizer step fails: rank 0, in the sync, is told at once, not at the timeout.
    failed = [r["step_fails"] for r in results]
    assert failed[1]["error"] == "RuntimeError: out of memory on rank 1", failed
    assert failed[0]["error"] == ("ConfigError: rank 1 rejected its gather of bucket 'zero:cpu': its optimizer step "
                                  "failed: RuntimeError: out of memory on rank 1"), failed
    assert all(f["seconds"] < 15 for f in failed), failed
    for f in failed:
        assert f["next"].startswith("RuntimeError: ciera.zero.ZeroRedundancyOptimizer: the parameter sync of step 2 "
                                    "failed (") and f["next"].endswith("it cannot step or sync any more (make a new "
                                                                       "optimizer)"), failed
    # One parameter: a rank that steps nothing still syncs.
    assert sorted(r["empty"]["mine"] for r in results) == [0, 128]


@pytest.mark.parametrize("kwargs,error,message", [
    ({"overlap_with_ddp": True}, ValueError, "overlap_with_ddp=True is not supported"),
    ({"parameters_as_bucket_view": False}, ValueError, "parameters_as_bucket_view=False is not supported"),
    ({"policy": "fast"}, ValueError, "policy must be one of 'delta', 'ciera', 'raw', got 'fast'"),
    ({"transport": "udp"}, ValueError, "transport must be 'torch', 'mpi' or 'nccl', got 'udp'"),
    ({"engine_config": 3}, TypeError, "engine_config must be a ciera.EngineConfig, got int"),
    ({"chunk_values": 0}, ValueError, "chunk_values must be an int >= 1, got 0"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, error, message):
    # No process group exists here: the arguments are checked first.
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        zero.ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(4))], torch.optim.SGD, lr=0.1, **kwargs)


def test_params_in_a_set_or_as_one_tensor_are_refused():
    """A set's order differs from rank to rank, and so would ZeRO's partition: refused, as
    PyTorch's optimizers refuse it, before anything starts (no process group exists here)."""
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    for given, what in ((set(params), "params"), ([{"params": set(params)}], "a group's params"),
                        (params[0], "params")):
        with pytest.raises(TypeError, match=f"{what} must be an ordered iterable \\(a list\\) of tensors"):
            zero.ZeroRedundancyOptimizer(given, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="params must be an iterable of tensors or param-group dicts, got NoneType"):
        zero.ZeroRedundancyOptimizer(None, torch.optim.SGD, lr=0.1)


def test_fp32_master_bad_inner_class():
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        zero.fp32_master(dict)
    with pytest.raises(TypeError, match="already keeps FP32 masters"):
        zero.fp32_master(zero.fp32_master(torch.optim.SGD))
    with pytest.raises(TypeError, match="needs inner_class"):
        zero.FP32MasterOptimizer([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert zero.fp32_master(torch.optim.AdamW) is zero.fp32_master(torch.optim.AdamW)


def _bf16_params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 5).to(torch.bfloat16)),
            torch.nn.Parameter(torch.randn(11).to(torch.bfloat16))]


def _grads(step, params):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]


def test_fp32_master_matches_a_hand_written_reference():
    """AdamW on FP32 copies of BF16 parameters, by hand: the wrapper's parameters, after every
    step, are exactly the hand-kept masters rounded to BF16; a learning rate set on the
    wrapper's param_groups reaches the inner optimizer."""
    params = _bf16_params()
    opt = zero.fp32_master(torch.optim.AdamW)(params, lr=1e-2, weight_decay=0.1)
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for step in range(6):
        if step == 3:
            opt.param_groups[0]["lr"] = 1e-3   # as a scheduler (or ZeRO's param_group sync) does
            reference.param_groups[0]["lr"] = 1e-3
        grads = _grads(step, params)
        for p, m, g in zip(params, masters, grads):
            p.grad = g
            m.grad = g.float()
        opt.step()
        reference.step()
        for p, m in zip(params, masters):
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))   # round to nearest even
            assert torch.equal(opt.state[p]["exp_avg"], reference.state[m]["exp_avg"])
        assert all(m.grad is None for m in opt._masters.values())
    assert opt.inner.param_groups[0]["lr"] == 1e-3
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)   # the inner optimizer's defaults show
    # A parameter without a gradient is left alone, its master too.
    before = params[1].detach().clone()
    params[0].grad, params[1].grad = _grads(9, params)[0], None
    opt.step()
    assert torch.equal(params[1].detach(), before)


def test_fp32_master_defaults_are_the_inner_optimizers():
    """Schedulers read `defaults`: OneCycleLR's cycle_momentum needs "betas" (or "momentum")
    there, which the wrapper's own defaults (the caller's lr alone) lacked."""
    params = _bf16_params()
    optimizer = zero.fp32_master(torch.optim.AdamW)(params, lr=1e-3)
    assert optimizer.defaults["lr"] == 1e-3
    assert optimizer.defaults["betas"] == torch.optim.AdamW(params, lr=1e-3).defaults["betas"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10, cycle_momentum=True)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler.step()   # sets the wrapper's betas; the inner optimizer takes them at the next step
    optimizer.step()
    assert optimizer.param_groups[0]["betas"] == optimizer.inner.param_groups[0]["betas"] != (0.9, 0.999)


def test_fp32_master_state_dict_round_trip_and_fp32_params():
    params = _bf16_params()
    opt = zero.fp32_master(torch.optim.Adam)(params, lr=1e-3)
    for step in range(3):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["master"].dtype == torch.float32 and saved["state"][0]["exp_avg"].dtype == torch.float32
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = zero.fp32_master(torch.optim.Adam)(copies, lr=5.0)
    restored.load_state_dict(saved)
    assert restored.param_groups[0]["lr"] == 1e-3 == restored.inner.param_groups[0]["lr"]
    for step in range(3, 6):
        for ps in (params, copies):
            for p, g in zip(ps, _grads(step, ps)):
                p.grad = g
        opt.step()
        restored.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies))
    # FP32 parameters are their own masters: the wrapper is the inner optimizer, exactly.
    torch.manual_seed(1)
    fp32 = [torch.nn.Parameter(torch.randn(9))]
    twin = [torch.nn.Parameter(fp32[0].detach().clone())]
    wrapped, plain = zero.fp32_master(torch.optim.Adam)(fp32, lr=0.1), torch.optim.Adam(twin, lr=0.1)
    for step in range(3):
        fp32[0].grad = twin[0].grad = torch.full((9,), float(step + 1))
        wrapped.step()
        plain.step()
    assert torch.equal(fp32[0], twin[0]) and "master" not in wrapped.state_dict()["state"][0]


def _env():
    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


TINY = ["--ranks", "2", "--steps", "4", "--layers", "1", "--hidden", "64", "--experts", "4",
        "--expert-intermediate", "64", "--seq-len", "32", "--batch", "2", "--launcher", "torchrun", "--json"]


def _train(tmp_path, *args):
    done = subprocess.run([sys.executable, "-m", "ciera.train", *TINY, *args, "--out", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_ciera_train_zero_is_bitwise_identical_to_torch_zero(tmp_path):
    summary, table = _train(tmp_path, "--zero")
    assert summary["mode"] == "zero" and summary["policy"] == w.POLICY
    assert summary["losses_identical"] and summary["params_identical"], summary
    assert 0 < summary["bits_per_value"] < 16 and summary["sync_speedup"] > 0 and summary["iteration_speedup"] > 0
    assert "bitwise identical" in table
    run_dir = next(tmp_path.iterdir())
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"zero", "ciera"} and len(records) == 8
    assert all(r["sync_ms"] > 0 for r in records)


def test_ciera_train_codec_delta_is_bitwise_identical_to_fsdp2(tmp_path):
    """--codec delta: every shard in value-delta frames from the first step; the codec state is
    exactly one copy of the BF16 parameters (every rank keeps every shard's previous values)."""
    summary, table = _train(tmp_path, "--codec", "delta")
    assert summary["codec"] == "delta" and summary["warmup"] == 1
    assert summary["losses_identical"] and summary["params_identical"], summary
    assert 0 < summary["bits_per_value"] < 8
    assert summary["cache_bytes"] == 2 * summary["params"]
    assert "value-delta frames on every shard from step 1" in table


@pytest.mark.parametrize("args,message", [
    (["--zero", "--ablation"], "--ablation is for the FSDP2 comparison; it cannot run with --zero"),
    (["--zero", "--checkpoint-every", "2"], "--checkpoint-every is for the FSDP2 comparison; it cannot run with --zero"),
    (["--zero", "--device", "cuda"], "--zero trains with DDP on gloo on the CPU; not yet with --device cuda"),
    (["--codec", "delta", "--ablation"], "--codec delta is not exponent reuse; --ablation measures exponent reuse's parts"),
    (["--codec", "lz4"], "argument --codec: invalid choice: 'lz4'"),
])
def test_ciera_train_refuses_zero_and_delta_misuse(tmp_path, capsys, args, message):
    """The checks `ciera train` runs before starting anything (in process: the command line's
    one-line form is test_cli_errors' concern)."""
    from ciera.train import options

    with pytest.raises(SystemExit) as refused:
        options.check(options.parser().parse_args([*args, "--out", str(tmp_path)]))
    assert message in f"{refused.value.code} {capsys.readouterr().err}"


def test_ciera_train_defaults_follow_zero_and_codec(tmp_path):
    from ciera.train import options

    def resolved(*args):
        parsed = options.parser().parse_args([*args, "--out", str(tmp_path), "--launcher", "torchrun"])
        options.check(parsed)
        return parsed.codec, parsed.warmup

    delta = "delta" if hasattr(ciera.ShardPolicy, "delta") else "ciera"
    assert resolved("--zero") == (delta, 1)
    assert resolved() == ("ciera", 30)
    assert resolved("--zero", "--codec", "ciera", "--warmup", "2") == ("ciera", 2)
    # Under a budget the warmup is the selector's statistics, delta or not.
    assert resolved("--codec", "delta", "--budget-mb", "1") == ("delta", 30)
    assert resolved("--codec", "delta") == ("delta", 1)


def test_rebuilds_and_their_failures():
    results = all_ok(spawn(w.rebuilds_and_their_failures, 2))
    name = "ciera.zero.ZeroRedundancyOptimizer"
    for rank, r in enumerate(results):
        # PyTorch builds the local optimizer before the engines' collective set-up: rank 0 waited
        # there for rank 1 until the timeout.
        error, seconds = r["bad_lr"]
        assert error == f"ValueError: {name}: on rank 1: Invalid learning rate: -1.0" and seconds < 15, \
            (rank, r["bad_lr"])
        # One process group for the transport, one for the trainability check and one for the
        # rebuilds' agreements, made once, not per rebuild (every rebuild made one, kept until
        # exit); released by close().
        before, built, rebuilt = r["groups"]
        assert built == before + 3 and rebuilt == built and r["groups_after_close"] == before, (rank, r["groups"])
        assert r["groups_of_dropped"] == 3 and r["groups_after_drop"] == before, (rank, r)   # collected unclosed
        assert r["add_group_after_close"] == f"ValueError: {name} is closed (close()); it takes no parameter group"
        error, seconds = r["fails_in_rebuild"]
        expected = ("RuntimeError: a closure that fails on rank 1" if rank == 1 else
                    "ConfigError: rank 1 rejected its gather of bucket 'zero:cpu': its optimizer step failed: "
                    "RuntimeError: a closure that fails on rank 1")
        assert error == expected and seconds < 15, (rank, r["fails_in_rebuild"])
        error, seconds = r["differing_trainability"]
        assert error == (f"ConfigError: {name}: the ranks differ in which parameters are trainable (requires_grad): "
                         "rank 1's differ from rank 0's; every rank must freeze and unfreeze the same parameters "
                         "before step()") and seconds < 15, (rank, r["differing_trainability"])
        assert r["bad_group"].startswith(f"TypeError: {name}: on rank 0: the trainable parameters on cpu must share "
                                         "one dtype"), (rank, r["bad_group"])
        assert r["step_after_bad_group"].startswith(f"RuntimeError: {name}: its buckets could not be rebuilt "
                                                    "(TypeError: "), (rank, r["step_after_bad_group"])


@pytest.mark.parametrize("stage,error", [("make_transport", "RuntimeError: no route to the peers on this node"),
                                         ("group_beside", "RuntimeError: no route to the peers on this node"),
                                         ("Engine", "MemoryError: no room for the codec state")])
def test_a_set_up_stage_failing_on_one_rank_fails_every_rank_at_once_leaving_nothing(stage, error):
    """Each stage of the constructor's set-up (the transport, the engine, the trainability check's
    group) is agreed on every rank. Until stop 72 a transport or engine failing on rank 1 left
    rank 0 waiting until its 20 s timeout (in the engine's configuration agreement, or in making
    the check's group), a check group failing there left rank 0 with an optimizer; and each rank
    kept what it had made (gloo groups: 3 threads, 5 descriptors each) as long as its error was held."""
    results = all_ok(spawn(w.a_set_up_stage_fails_on_one_rank, 2, stage))
    agreed = f"ConfigError: ciera.zero.ZeroRedundancyOptimizer: rank 1 could not set up CIERA: {error}"
    for rank, r in enumerate(results):
        assert r["error"] == agreed, (rank, r)
        assert r["seconds"] < 10, (rank, r)   # not the 20 s timeout
        assert not grown(r["before"], r["held"]), (rank, r)
        assert not grown(r["before"], r["after"]), (rank, r)
        assert r["step"] is None, (rank, r)   # a second optimizer works in the same processes


@pytest.mark.parametrize("rebuild", ["step", "add_param_group"])
def test_a_rebuild_failing_on_one_rank_fails_every_rank_at_once_and_breaks_the_optimizer(rebuild):
    """A rebuild's engine (a step after a layer was frozen, add_param_group) failing on rank 1:
    every rank fails at once with the same error, its engines closed, and no later step runs.
    Until stop 72 rank 0's rebuild succeeded and its next sync waited for rank 1 until the 20 s
    timeout, a CommError naming gloo, its engine open meanwhile."""
    results = all_ok(spawn(w.a_rebuild_fails_on_one_rank, 2, rebuild))
    name = "ciera.zero.ZeroRedundancyOptimizer"
    agreed = f"ConfigError: {name}: rank 1 could not set up CIERA: MemoryError: no room for the codec state"
    for rank, r in enumerate(results):
        assert r["error"] == agreed and r["seconds"] < 10, (rank, r)
        assert r["open_engines"] == 0 and r["engines"] == 0 and r["cache_bytes"] is None, (rank, r)
        assert r["next_step"] == (f"RuntimeError: {name}: its buckets could not be rebuilt ({agreed}); "
                                  "it cannot step or sync any more (make a new optimizer)"), (rank, r)
        assert not grown(r["before"], r["after"]), (rank, r)   # close() released the rest


@pytest.mark.parametrize("case", ["add_param_group", "unfreeze", "fill"])
def test_a_rebuilds_local_failure_on_one_rank_fails_every_rank_at_once_and_breaks_the_optimizer(case):
    """A rebuild's work before its set-up (the check of the buckets' dtype, making them) failing on
    rank 1 alone: a float64 parameter added there, or unfrozen there after its .data was replaced,
    or an out-of-memory as its flat bucket is made. Every rank raises rank 1's error at once, and
    no later step runs. Until stop 72 rank 1 alone raised, rank 0 went on into the engine's set-up
    and waited out the engine's 20 s timeout and then its group's 60 s, a gloo timeout in the end."""
    results = all_ok(spawn(w.a_rebuild_check_fails_on_one_rank, 2, case))
    name = "ciera.zero.ZeroRedundancyOptimizer"
    agreed = (f"ConfigError: {name}: on rank 1: MemoryError: no room for the flat bucket" if case == "fill" else
              f"TypeError: {name}: on rank 1: the trainable parameters on cpu must share one dtype (one flat bucket "
              "per device), found ['torch.bfloat16', 'torch.float64']")
    for rank, r in enumerate(results):
        assert r["error"] == agreed and r["seconds"] < 10, (rank, r)
        assert r["next_step"] == (f"RuntimeError: {name}: its buckets could not be rebuilt ({agreed}); "
                                  "it cannot step or sync any more (make a new optimizer)"), (rank, r)


def test_a_torch_without_the_members_it_overrides_is_refused_at_import():
    # Were torch to rename one, its own per-parameter broadcasts would run in place of CIERA's sync.
    code = ("from torch.distributed.optim import ZeroRedundancyOptimizer as Z\n"
            "del Z._sync_params\n"
            "import ciera.zero\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ImportError: ciera.zero: torch " in done.stderr, done.stderr
    assert "has no _sync_params, which ciera.zero overrides or uses" in done.stderr, done.stderr


def test_a_peer_that_leaves_is_a_comm_error_within_the_timeout():
    results = spawn(w.a_peer_that_leaves, 2)
    status, (error, seconds) = results[0]
    assert status == "ok" and error == "CommError" and seconds < 15, results[0]


def test_a_second_threads_step_is_refused_before_its_local_step():
    results = all_ok(spawn(w.overlapping_steps, 2))
    second, closing, closed = results[0][0]
    assert second == ("RuntimeError: ciera.zero.ZeroRedundancyOptimizer.step: another thread's step() is in "
                      "flight; steps must not overlap"), second
    assert closing == ("RuntimeError: ciera.zero.ZeroRedundancyOptimizer.close: a step() of this optimizer is in "
                       "flight; close it after") and not closed, closing
    assert results[1][0] is None
    assert results[0][1] == results[1][1]   # two steps on each rank, the ranks' parameters agree


def test_each_of_two_subgroups_syncs_and_broadcasts_on_groups_of_its_own():
    results = all_ok(spawn(w.in_two_subgroups, 4))
    for rank, (equal, received, groups_left, engine_closed_first) in enumerate(results):
        assert all(equal), (rank, equal)
        assert received == [[10.0 * (rank // 2) + k] for k in range(3)], (rank, received)
        assert groups_left == 0, (rank, groups_left)   # each Broadcaster's group released by close() or collection
        assert engine_closed_first == [True], (rank, engine_closed_first)   # as close() does


# --- a tiny FP32 model: never much more than raw -------------------------------------------------

class _Incompressible(torch.optim.Optimizer):
    """Moves every parameter by random steps of nearly 32 bits (random bit patterns every fifth
    step): differences no coder can shrink. Every third step instead moves one value by one unit
    in the last place, which must travel as a small value-delta frame again."""

    def __init__(self, params, **defaults):
        super().__init__(params, defaults)
        self.steps = 0
        self.rng = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                bits = p.data.view(torch.int32)
                if self.steps % 3 == 0:
                    bits[0] += 1
                    continue
                width = 32 - int(torch.randint(0, 7, (), generator=self.rng))
                step = torch.randint(0, 2 ** width, p.shape, generator=self.rng, dtype=torch.int64)
                if self.steps % 5 == 0:
                    step = torch.randint(0, 2 ** 32, p.shape, generator=self.rng, dtype=torch.int64)
                moved = torch.rand(p.shape, generator=self.rng) < float(torch.rand((), generator=self.rng)) + 0.3
                new = (bits.to(torch.int64) + step * moved) & 0xFFFFFFFF
                bits.copy_(torch.where(new >= 2 ** 31, new - 2 ** 32, new).to(torch.int32))


def _tiny_fp32_syncs(rank, world, sizes, steps):
    torch.manual_seed(0)
    net = w.model(torch.float32, sizes=sizes)
    optimizer = zero.ZeroRedundancyOptimizer(net.parameters(), _Incompressible)
    syncs = []
    for s in range(steps):
        w.step(net, optimizer, rank, world, s, torch.float32)
        stats = optimizer.last_sync
        syncs.append((s + 1, stats.raw_bytes, stats.wire_bytes))
    bits = b"".join(p.detach().view(torch.uint8).numpy().tobytes() for p in net.parameters())
    optimizer.close()
    return syncs, bits


# 256 values (204 + 52 a rank), and 23 (12 + 11), where value-delta frames were a byte above that.
@pytest.mark.parametrize("sizes", [(16, 12, 4), (4, 3, 2)])
def test_a_tiny_fp32_model_syncs_in_at_most_raw_plus_the_framing(sizes):
    # Incompressible steps cost at most the values raw plus, per rank, the envelope's header (24
    # bytes and 8 per shard: one here) and a key frame's framing (90 bytes; docs/zero.md, "Wire
    # bytes"); the one-ulp steps after them are value-delta frames again (the receivers' previous
    # values were moved on by the key frames), far below raw; every rank ends with the same bits.
    world = 2
    results = all_ok(spawn(_tiny_fp32_syncs, world, sizes, 60))
    syncs, bits = results[0]
    assert bits == results[1][1]
    framing = world * (24 + 8 + 90)
    for step, raw, wire in syncs:
        assert wire <= raw + framing, (step, raw, wire, syncs)
        if step % 3 == 0 and step > 1:
            assert wire < raw / 2 if raw > 200 else wire <= world * (24 + 8 + 80 + 40), (step, raw, wire, syncs)


def test_parameters_out_of_their_buckets_are_refused_on_every_rank():
    """The engine reads and writes each device's flat bucket through its pointer. A parameter
    whose .data was replaced on one rank stepped its new tensor while the sync sent (and took)
    the bucket's stale values, and the ranks' parameters drifted apart in silence; a bucket's
    storage shrunk by untyped_storage().resize_() took the peers' values past its end; a negated
    view of a parameter's memory sent its values negated. Each is now refused on every rank at once."""
    results = all_ok(spawn(w.parameters_out_of_their_buckets, 2))
    name = "ciera.zero.ZeroRedundancyOptimizer"
    replaced = [r["replaced"] for r in results]
    assert replaced[0][0] == (f"ConfigError: {name}: parameter 0 no longer lies in the optimizer's bucket: its .data "
                              "was replaced after the optimizer was made (`.data =`, `module.to()`); write new values "
                              "into it in place (`.copy_()`), or make the optimizer after"), replaced
    assert replaced[1][0] == ("ConfigError: rank 0 rejected its gather of bucket 'zero:cpu': parameter 0 no longer "
                              "lies in the optimizer's bucket: its .data was replaced..."), replaced
    shrunk = [r["shrunk"] for r in results]
    assert shrunk[0][0] == (f"ConfigError: {name}: parameter 2's storage holds 10000 of its 13824 bytes: freed or "
                            "shrunk"), shrunk
    assert shrunk[1][0] == ("ConfigError: rank 0 rejected its gather of bucket 'zero:cpu': parameter 2's storage "
                            "holds 10000 of its 13824 bytes: freed or shrunk"), shrunk
    negated, index = [r["negated"] for r in results], results[1]["negated_index"]
    assert negated[1][0] == (f"ConfigError: {name}: parameter {index} is a negated view (its values are its memory's "
                             "negated, e.g. .conj().imag); pass .resolve_neg()"), negated
    assert negated[0][0].startswith(f"ConfigError: rank 1 rejected its gather of bucket 'zero:cpu': parameter {index} "
                                    "is a negated view"), negated
    assert all(r[case][1] < 15 for r in results for case in ("replaced", "shrunk", "negated")), results


def test_a_sync_moves_every_synced_parameters_version_on_every_rank():
    """The sync writes the peers' partitions through the bucket's pointer, unseen by autograd:
    only the local step moved versions, so a backward that saved rank 0's parameter before step()
    raised PyTorch's in-place error on rank 0 and went on with the new values on rank 1 (as it
    does under PyTorch's own ZeroRedundancyOptimizer). Every synced parameter's version now
    moves on every rank."""
    results = all_ok(spawn(w.versions_after_a_sync, 2))
    for rank, (moved, error) in enumerate(results):
        assert all(moved), (rank, moved)
        assert (error or "").startswith("RuntimeError: one of the variables needed for gradient computation has been "
                                        "modified by an inplace operation"), (rank, error)


def test_a_rebuild_on_one_rank_alone_fails_within_the_engines_timeout():
    """add_param_group on rank 1 alone, rank 0 in step(), the engine's timeout 5 s: each fails
    within a bounded time. Its rebuild's agreements run on a group of the engine's timeout: on
    process_group (where they ran for a moment in stop 72) rank 1 waited for rank 0 until
    process_group's timeout, 30 minutes by default (60 s in these tests)."""
    results = all_ok(spawn(w.a_lone_rebuild, 2))
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["seconds"] < 20, (rank, r)


def test_parameters_added_later_are_synced_once_trainable_and_must_match_across_ranks():
    """A parameter added frozen (add_param_group), then unfrozen on every rank: PyTorch's mask of
    trainable parameters covers those given at construction only, so until stop 72 it never
    entered a bucket and only its owner's copy moved, in silence. And a group added with a
    parameter of another shape on one rank (the same number of values) synced as if alike: now
    refused on every rank, as the constructor refuses it."""
    results = all_ok(spawn(w.added_parameters, 2))
    for rank, r in enumerate(results):
        assert r["unfrozen_alike"] and r["unfrozen_moved"], (rank, r)
        assert r["shape_error"].startswith("ConfigError: ciera.zero.ZeroRedundancyOptimizer: the ranks' models "
                                           "differ: parameter '4' is [2, 3] bfloat16 "), (rank, r)
