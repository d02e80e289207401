"""ciera.deepspeed: DeepSpeed ZeRO-3's parameter all-gathers through CIERA, bitwise identical to
plain ZeRO-3 (two ranks, DeepSpeed's CPU accelerator on gloo); bad configurations refused on
every rank with the setting named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import all_ok, grown, spawn

pytest.importorskip("deepspeed")

import deepspeed_workers as w  # noqa: E402


@pytest.mark.parametrize("zero,overlap", [
    # Every parameter fetched by the coordinator in forward and backward (coalesced and single).
    ({"stage3_param_persistence_threshold": 0}, True),
    # DeepSpeed's defaults: this small model's parameters are persistent, re-gathered after each
    # optimizer step by param.all_gather() (the other path); gathers finished before returning.
    ({}, False),
])
def test_gathers_are_bitwise_plain_zero3s(zero, overlap):
    steps = 4
    results = all_ok(spawn(w.exact_vs_plain, 2, zero, steps, overlap))
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_equal"], (rank, r)
        assert r["wrong_bytes"] == 0 and r["verified_bytes"] > 0, (rank, r)
        assert r["passed_through"] == 0, (rank, r)
        assert r["restored"], "disable() must put DeepSpeed's own gather back"
        # Every parameter is gathered every step; after its first gather (warmup_steps counts a
        # bucket's gathers, two a step for most), every gather is coded and moves fewer bytes
        # than raw.
        assert all(s["gathers"] >= r["buckets"] for s in r["per_step"]), r["per_step"]
        for s in r["per_step"][1:]:
            assert s["compressed"] == s["gathers"] and s["wire"] < 0.75 * s["raw"], (rank, r["per_step"])
        assert r["cache_bytes"] > 0
    # Both ranks made the same gathers (the engine pairs them in order).
    assert [s["gathers"] for s in results[0]["per_step"]] == [s["gathers"] for s in results[1]["per_step"]]


REFUSED = [
    ({"stage": 2}, {}, "the engine runs ZeRO stage 2; CIERA compresses ZeRO-3's parameter all-gathers"),
    ({"stage3_use_all_reduce_for_fetch_params": True}, {},
     "stage3_use_all_reduce_for_fetch_params is set; parameters are then fetched by all-reduce"),
    ({"zero_hpz_partition_size": 2}, {}, "zero_hpz_partition_size is set"),
    # Served by DeepSpeed's own gather, one parameter at a time: uncompressed, and unsaid.
    ({"stage3_allgather_sequential": True}, {}, "stage3_allgather_sequential is set; parameters are then gathered "
                                                "one at a time"),
    ({}, {"transport": "udp"}, "transport must be 'torch', 'mpi' or 'nccl', got 'udp'"),
    ({}, {"reselect_every": 3}, "reselect_every=3 is for the selector; it needs cache_budget_bytes"),
]


# After REFUSED, the worker points the parameters at other groups: a group smaller than the
# world, then two groups; enable() and enable_reduce_scatter() each refuse both.
GROUPS_REFUSED = [
    f"ciera.deepspeed.{call}(): on rank 0: {problem}"
    for problem in ("the data-parallel group holds 1 of the 2 ranks (tensor or pipeline parallelism)",
                    "the parameters are partitioned over 2 process groups (expert parallelism?)")
    for call in ("enable", "enable_reduce_scatter")
]


def test_bad_configuration_is_refused_on_every_rank():
    results = all_ok(spawn(w.refused, 2, [(zero, kwargs) for zero, kwargs, _ in REFUSED]))
    messages = [message for _, _, message in REFUSED] + GROUPS_REFUSED
    for rank, texts in enumerate(results):
        for message, text in zip(messages, texts, strict=True):
            assert message in text, (rank, text)


def test_selection_under_a_budget_stays_bitwise_plain_zero3s():
    """The benefit-driven selector on ZeRO-3's parameters (one candidate each): warmup statistics
    from CIERA's gathers, a selection at the same step on every rank, results still exact."""
    options = {"cache_budget_bytes": 1 << 30, "select_after_steps": 2}
    results = all_ok(spawn(w.exact_vs_plain, 2, {"stage3_param_persistence_threshold": 0}, 4, True, options))
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, (rank, r)
        assert [s["step"] for s in r["selections"]] == [2], r["selections"]
        assert all(s["compressed"] == 0 for s in r["per_step"][:2]), r["per_step"]   # raw while counting
    assert results[0]["selections"] == results[1]["selections"]


def test_value_delta_frames_are_bitwise_plain_zero3s():
    """Every parameter in value-delta frames from the first step (each rank keeps its peers'
    previous values): forward and backward gathers of every step exact."""
    results = all_ok(spawn(w.exact_vs_plain, 2, {"stage3_param_persistence_threshold": 0}, 4, True,
                           {"policy": "delta"}))
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, (rank, r)
        assert r["verified_bytes"] > 0 and r["passed_through"] == 0, (rank, r)
        # After the first frame (the values themselves), only the step's differences travel.
        for s in r["per_step"][1:]:
            assert s["compressed"] == s["gathers"] and s["wire"] < 0.75 * s["raw"], (rank, r["per_step"])
        # The previous values of the peer's half of every parameter, two bytes each.
        assert r["cache_bytes"] >= r["per_step"][0]["raw"] // 2 // max(1, r["per_step"][0]["gathers"]), r


def test_selection_with_delta_under_a_budget_stays_bitwise_plain_zero3s():
    """The selector offered value-delta frames on a slow link with room for every cache: it picks
    delta for parameters, at the same step on every rank, and the training stays exact."""
    options = {"cache_budget_bytes": 1 << 40, "select_after_steps": 2, "allow_delta": True, "cost_model": "slow link"}
    results = all_ok(spawn(w.exact_vs_plain, 2, {"stage3_param_persistence_threshold": 0}, 4, True, options))
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, (rank, r)
        assert r["delta_shards"] > 0, r
        assert all(s["compressed"] == 0 for s in r["per_step"][:2]), r["per_step"]   # raw while counting
        # From the selection on, the chosen parameters (not the tiny norms) travel coded.
        assert all(0 < s["compressed"] and s["wire"] < s["raw"] for s in r["per_step"][2:]), r["per_step"]
    assert results[0]["selections"] == results[1]["selections"]
    assert results[0]["delta_shards"] == results[1]["delta_shards"]


def test_ranks_with_different_options_fail_together():
    """CIERA's options, and the ZeRO-3 settings that decide which parameters are gathered when
    (a persistence threshold on one rank alone: its peers' gathers were paired with others and
    one rank failed at the timeout, the other went on)."""
    results = all_ok(spawn(w.mismatched, 2))
    for rank, (options, schedule) in enumerate(results):
        assert "block_values" in options, (rank, options)
        assert schedule == ("ciera.deepspeed.enable(): the ranks differ in "
                            "zero_optimization.stage3_param_persistence_threshold: 0 on rank 0; 100000 on rank 1"), \
            (rank, schedule)


def test_gather_hooks_leave_a_later_wrapper_in_place_and_keep_the_originals():
    # A wrapper of DeepSpeed's gather installed after CIERA's stays when CIERA's hooks go, a call
    # already past CIERA's dispatch still finds DeepSpeed's original to call, and a later enable()
    # does not take the wrapper (which calls CIERA's hook) as the original: no endless recursion.
    code = ("import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
            "from deepspeed.runtime.zero import partition_parameters as pp\n"
            "from deepspeed import comm as ds_comm\n"
            "import ciera.deepspeed as cd\n"
            "fetch, gather = pp._dist_allgather_fn, ds_comm.all_gather_into_tensor\n"
            "cd._hooks.install()\n"
            "assert pp._dist_allgather_fn is cd._fetch and ds_comm.all_gather_into_tensor is cd._gather\n"
            "def wrapper(*a, **k): pass\n"
            "pp._dist_allgather_fn = wrapper\n"
            "cd._hooks.uninstall()\n"
            "assert pp._dist_allgather_fn is wrapper, 'the later wrapper was clobbered'\n"
            "assert ds_comm.all_gather_into_tensor is gather\n"
            "assert cd._hooks.original_fetch is fetch and cd._hooks.original_gather is gather\n"
            "cd._hooks.install()   # ours are still under the wrapper: not taken again as the original\n"
            "assert cd._hooks.original_fetch is fetch and pp._dist_allgather_fn is wrapper\n"
            "from deepspeed.runtime.comm import coalesced_collectives as cc\n"
            "scatter = cc._torch_reduce_scatter_fn\n"
            "cd._rs_hooks.install()\n"
            "cc._torch_reduce_scatter_fn = wrapper\n"
            "cd._rs_hooks.uninstall()\n"
            "cd._rs_hooks.install()\n"
            "assert cd._rs_hooks.original is scatter and cc._torch_reduce_scatter_fn is wrapper\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_refusal_or_option_on_one_rank_fails_every_rank_alike():
    expected = [
        "ConfigError: ciera.deepspeed.enable(): on rank 1: RuntimeError: no policy file on this node",
        "ConfigError: ciera.deepspeed.enable_reduce_scatter(): on rank 1: reduce-scatter coding must be one of "
        "exponent, raw, auto, got 'bogus'",
        "ConfigError: ciera.deepspeed.enable_reduce_scatter(): the ranks differ in transport: 'torch' on rank 0; "
        "'mpi' on rank 1",
        "ConfigError: ciera.deepspeed.enable_reduce_scatter(): the ranks differ in coding: 'exponent' on rank 0; "
        "'raw' on rank 1",
        "ValueError: ciera.deepspeed.enable_reduce_scatter(): on rank 1: timeout_s must be a finite number of "
        "seconds > 0, got nan",
    ]
    for rank, errors in enumerate(all_ok(spawn(w.one_rank_fails, 2))):
        assert errors == expected, (rank, errors)


def test_a_set_up_stage_failing_on_one_rank_fails_every_rank_at_once():
    """A transport, or an engine, that the last rank alone could not make is named on every rank
    within seconds, not after the others' 20 s timeout in the next stage."""
    results = all_ok(spawn(w.set_up_fails_on_one_rank, 2))
    expected = ["ConfigError: ciera.deepspeed.enable(): rank 1 could not set up CIERA: "
                "RuntimeError: no route to the peers on this node",
                "ConfigError: ciera.deepspeed.enable(): rank 1 could not set up CIERA: "
                "MemoryError: no room for the codec state"]
    for rank, stages in enumerate(results):
        assert [error for error, _ in stages] == expected, (rank, stages)
        assert all(seconds < 15 for _, seconds in stages), (rank, stages)


@pytest.mark.parametrize("stage", ["measured_cost_model", "make_engine"])
def test_a_later_set_up_stage_failing_on_one_rank_leaves_nothing_behind(stage):
    """The transport made, then the cost model's measurement or the engine failing on the last
    rank: every rank's error ends what the set-up made there (until stop 72 each rank kept the
    transport's gloo group, 3 threads and 5 file descriptors, to exit), and enable() then works."""
    results = all_ok(spawn(w.later_set_up_stage_fails, 2, stage))
    for rank, r in enumerate(results):
        assert r["error"] == ("ConfigError: ciera.deepspeed.enable(): rank 1 could not set up CIERA: "
                              "MemoryError: no room for the codec state"), (rank, r)
        assert not grown(r["before"], r["after"]), (rank, r)
        assert r["verified_bytes"] > 0 and r["wrong_bytes"] == 0, (rank, r)


def test_a_gather_one_rank_cannot_start_fails_every_rank_at_once():
    results = all_ok(spawn(w.a_gather_one_rank_cannot_start, 2))
    assert results[1]["error"] == "RuntimeError: the observer failed", results
    assert results[0]["error"].startswith("ConfigError: rank 1 rejected its gather of bucket "), results
    assert results[0]["error"].endswith(": the observer failed"), results
    assert all(r["seconds"] < 15 for r in results), results   # not the 20 s timeout


def test_an_observer_that_raises_on_one_rank_leaves_no_peer_in_a_verification():
    results = all_ok(spawn(w.an_observer_fails_on_one_rank, 2))
    assert results[1]["error"] == "RuntimeError: the observer failed", results
    # Rank 0 finished the fetch rank 1's observer failed in (every parameter verified on both),
    # and then failed in its next gather once rank 1 had gone: the engine's CommError, not the
    # world group's 60 s timeout in a verification.
    assert results[0]["error"].startswith("CommError: "), results
    assert all(r["seconds"] < 40 and r["verified"] > 0 for r in results), results


def test_gradient_reduce_scatter_is_bitwise_its_uncompressed_twin():
    for rank, r in enumerate(all_ok(spawn(w.reduce_scatter_vs_twin, 2, 3))):
        assert r["losses_equal"] and r["params_equal"], (rank, r)
        assert r["calls"] > 0 and r["passed_through"] == 0, (rank, r)
        assert r["twin_wire"] == r["twin_raw"] == r["raw"] > 0 and r["wire"] < r["raw"], (rank, r)
        # Another summation order than gloo's: close to DeepSpeed's own, not equal in every bit.
        assert r["loss_diff_vs_plain"] < 1e-2, (rank, r)
        assert "already go through CIERA" in r["twice"], (rank, r)
        assert not r["enabled_after_disable"] and r["restored"], (rank, r)
        assert r["beside_is_plain"], (rank, r)
        assert "runs ZeRO stage 2" in r["refusals"][0], (rank, r)
        assert "reduce_scatter is off" in r["refusals"][1], (rank, r)


def test_a_reduce_scatter_passed_through_by_some_ranks_fails_every_rank_at_once():
    """serves() decides per rank; a call one rank left to DeepSpeed's gloo reduce-scatter and the
    other served left each in its own collective, waiting for the other until its timeout (20 s
    for CIERA's, 60 s for the world group's). Now the choice is agreed on every call."""
    results = all_ok(spawn(w.reduce_scatter_passed_through_by_some_ranks, 2))
    for rank, r in enumerate(results):
        everyone, no_one, one = r["steps"]
        # Every rank passed every call through: DeepSpeed's reduce-scatter ran, nothing served.
        assert everyone["error"] is None and everyone["calls"] == 0 and everyone["passed_through"] > 0, (rank, r)
        # Then all served (the agreed pass-throughs kept the ranks' call counts in step).
        assert no_one["error"] is None and no_one["calls"] > 0, (rank, r)
        assert no_one["passed_through"] == everyone["passed_through"], (rank, r)
        error = one["error"]
        assert error.startswith("ConfigError: lossless collectives: reduce_scatter call "), (rank, error)
        assert error.endswith(" runs on rank 0, but rank 1 passes it through to the caller's own (every rank must "
                              "make the same choice); rank 1: serves() declined it (left to DeepSpeed's "
                              "reduce-scatter)"), (rank, error)
        assert one["seconds"] < 15, (rank, r)   # at once, not at the 20 s timeout
    assert results[0]["steps"][2]["error"] == results[1]["steps"][2]["error"], results


def test_not_a_deepspeed_engine():
    import torch

    import ciera.deepspeed

    with pytest.raises(TypeError, match="engine must be a DeepSpeedEngine"):
        ciera.deepspeed.enable(torch.nn.Linear(2, 2))


def _env():
    import ciera

    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


TINY = ["--ranks", "2", "--steps", "4", "--warmup", "1", "--layers", "1", "--hidden", "64", "--experts", "4",
        "--expert-intermediate", "64", "--seq-len", "32", "--batch", "2", "--launcher", "torchrun", "--json"]


def test_ciera_train_framework_deepspeed_is_bitwise_identical_to_zero3(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ciera.train", "--framework", "deepspeed", "--verify", *TINY,
                           "--out", str(tmp_path)], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "deepspeed" and summary["baseline_run"] == "zero3"
    assert summary["losses_identical"] and summary["params_identical"], summary
    assert summary["wrong_bytes"] == 0 and summary["verified_bytes"] > 0 and summary["passed_through"] == 0
    # Exponent reuse after warmup: 8-12 bits per value of payload. Each tiny parameter is a bucket
    # of its own here, whose rounds' control records weigh on the wire (counted in it, and named).
    payload_bits = 16 * (summary["allgather_wire_bytes"] - summary["allgather_control_bytes"]) / summary["allgather_raw_bytes"]
    assert 8 < payload_bits < 12 and summary["ratio"] > 1.1, summary
    assert 0 < summary["allgather_control_bytes"] < summary["allgather_wire_bytes"]
    assert f"(control records {summary['allgather_control_bytes']:,})" in done.stdout
    assert summary["allgather_speedup"] > 0 and summary["iteration_speedup"] > 0
    assert "bitwise identical to plain ZeRO-3's" in done.stdout
    run_dir = next(tmp_path.iterdir())
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"zero3", "ciera"} and len(records) == 8
    assert all(r["gathers"] > 0 and r["allgather_ms"] > 0 for r in records)
    # --warmup counts steps (the engine's warmup counts a bucket's gathers, two a step): raw
    # before step --warmup, exponent reuse from it on.
    ciera_steps = sorted((r for r in records if r["run"] == "ciera"), key=lambda r: r["step"])
    warmup = int(TINY[TINY.index("--warmup") + 1])
    assert 0 < warmup < len(ciera_steps), TINY
    # Raw payloads in the warmup (the wire beyond them: the engine's control records), then fewer.
    assert all(r["wire_bytes"] - r["control_bytes"] == r["raw_bytes"] for r in ciera_steps[:warmup]), ciera_steps
    assert all(r["wire_bytes"] - r["control_bytes"] < 0.8 * r["raw_bytes"] for r in ciera_steps[warmup:]), ciera_steps
    assert (run_dir / "loss.png").is_file()


# DeepSpeed's default bucket holds the tiny model whole: one reduce-scatter a step. A bucket of
# 20,000 values splits its ~100,000 gradient values into several calls, each bitwise its twin's.
@pytest.mark.parametrize("bucket", [None, 20000])
def test_ciera_train_framework_deepspeed_reduce_scatter_is_bitwise_its_twin(tmp_path, bucket):
    sized = [] if bucket is None else ["--reduce-bucket-size", str(bucket)]
    done = subprocess.run([sys.executable, "-m", "ciera.train", "--framework", "deepspeed", "--reduce-scatter", "ciera",
                           "--reduce-dtype", "bf16", *sized, *TINY, "--out", str(tmp_path)], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = json.loads(done.stdout.strip().splitlines()[-1])
    assert s["mode"] == "reduce_scatter" and s["framework"] == "deepspeed" and s["own_run"] == "zero3", s
    assert s["losses_identical"] and s["params_identical"] and s["reduce_scatter_passed_through"] == 0, s
    assert s["reduce_scatter_ratio"] > 1.2 and s["reduce_scatter_ms_zero3"] > 0, s
    assert s["max_loss_diff_vs_zero3"] < 1e-2 and s["max_param_diff_vs_zero3"] is not None, s
    assert "ZeRO-3 with its own all-gather" in done.stdout and "vs ZeRO-3's reduction" in done.stdout
    run_dir = next(tmp_path.iterdir())
    assert run_dir.name.endswith("-deepspeed-rs-w2"), run_dir
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert {r["run"] for r in records} == {"zero3", "plain-deterministic", "ciera"} and len(records) == 12
    calls = {r["reduce_scatters"] for r in records}
    assert calls == {1} if bucket is None else min(calls) >= 3, records
    assert s["ds_config"]["zero_optimization"].get("reduce_bucket_size") == bucket, s["ds_config"]


@pytest.mark.parametrize("args,message", [
    (["--zero"], "--zero is its own comparison (ZeRO-1/2 against PyTorch's); it cannot run with --framework deepspeed"),
    (["--baselines"], "--baselines is for the FSDP2 comparison; it cannot run with --framework deepspeed"),
    (["--codec", "stateless"], "--codec stateless: --framework deepspeed compares CIERA's own codecs"),
    (["--device", "cuda"], "--framework deepspeed trains on DeepSpeed's CPU accelerator; not yet with --device cuda"),
    (["--reduce-bucket-size", "0"], "--reduce-bucket-size must be at least 1 value, got 0"),
])
def test_ciera_train_framework_deepspeed_refuses(tmp_path, capsys, args, message):
    from ciera.train import options

    with pytest.raises(SystemExit) as refused:
        options.check(options.parser().parse_args(["--framework", "deepspeed", *args, "--out", str(tmp_path)]))
    assert message in f"{refused.value.code} {capsys.readouterr().err}"


def test_ciera_train_framework_deepspeed_options_reach_enable():
    """--codec delta and --budget-mb as ciera.deepspeed.enable() gets them, and the table's line."""
    import ciera
    from ciera.train import deepspeed as job
    from ciera.train import options

    def parsed(*args):
        a = options.parser().parse_args(["--framework", "deepspeed", *args])
        options.check(a)
        return a

    delta = job.gather_options(parsed("--codec", "delta"))
    assert delta["policy"](None, None) == ciera.ShardPolicy.delta and job.engine_config(parsed("--codec", "delta")).warmup_steps == 0
    budget = job.gather_options(parsed("--codec", "delta", "--budget-mb", "40", "--warmup", "5"))
    assert budget == {"cache_budget_bytes": 40 << 20, "select_after_steps": 5, "reselect_every": 0, "allow_delta": True}
    # --warmup counts steps, the engine's warmup a bucket's gathers: raw by policy until step --warmup.
    plain = job.gather_options(parsed())
    assert list(plain) == ["policy"] and plain["policy"](None, None) == ciera.ShardPolicy.raw
    assert job.engine_config(parsed("--warmup", "7")).warmup_steps == 0
    assert job.ds_config(parsed())["zero_optimization"] == {"stage": 3}
    assert job.ds_config(parsed("--reduce-bucket-size", "5000000"))["zero_optimization"] == {
        "stage": 3, "reduce_bucket_size": 5000000}
    line = job._codec_line({"budget_bytes": 1, "codec": "delta", "selected_shards": 4, "candidate_shards": 25})
    assert line == "the selector, after warmup, among raw, exponent reuse and value-delta frames: 4 of 25 parameters coded"


def test_a_fetch_that_failed_fails_again_at_every_later_wait():
    """A fetch marked itself done before its gathers were waited for: when one failed, a second
    wait() (DeepSpeed's, or a caller's retry) returned True over outputs never filled."""
    from types import SimpleNamespace

    import torch

    import ciera
    from ciera.deepspeed import _Gather

    class FailingEngine:
        def start(self, *args, **kwargs):
            return 1

        def wait(self, ticket):
            raise ciera.CommError("a peer is dead or stalled")

    runtime = SimpleNamespace(engine=FailingEngine(), buckets=[SimpleNamespace(numel=4, index=0)], selector=None,
                              overlap=True, verify=False, on_gather=None, on_output=None, records=[])
    gather = _Gather(SimpleNamespace(runtime=runtime, world=2), [(0, 0)], torch.zeros(4, dtype=torch.bfloat16),
                     torch.zeros(8, dtype=torch.bfloat16), None)
    for _ in range(2):
        with pytest.raises(ciera.CommError, match="dead or stalled"):
            gather.wait()
