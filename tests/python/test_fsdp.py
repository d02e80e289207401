"""ciera.torch with FSDP2 on 2 and 4 CPU ranks: training through CIERA is bitwise identical to
FSDP2's own all-gather, for every supported model family."""

import pytest
from conftest import all_ok, grown, needs_torch, spawn

needs_torch()
import fsdp_workers as w  # noqa: E402


@pytest.mark.parametrize("family", ["olmoe", "mixtral", "qwen2_moe", "deepseek"])
def test_losses_and_parameters_are_bitwise_identical_on_two_ranks(family):
    for r in all_ok(spawn(w.exact_vs_plain, 2, family)):
        assert r["losses_equal"] and r["params_equal"], r
        assert r["wrong_bytes"] == 0 and r["verified_bytes"] > 0, r
        assert r["compressed_gathers"] > 0, r
        assert r["wire_bytes"] < r["raw_bytes"], r


@pytest.mark.parametrize("family", ["olmoe", "deepseek"])
def test_four_ranks_with_uneven_shards(family):
    for r in all_ok(spawn(w.exact_vs_plain, 4, family)):
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, r


@pytest.mark.parametrize("world", [3, 4])
def test_parameter_byte_ranges_with_uneven_shards(world):
    results = all_ok(spawn(w.parameter_ranges, world))
    for r in results:
        assert r["checked"] > 0 and r["uneven"] > 0, r
        assert r["mismatches"] == 0, r


def test_disable_restores_the_plain_path():
    for r in all_ok(spawn(w.disable_restores_plain, 2)):
        assert r["first_equal"], r
        assert set(r["comms"]) == {"DefaultAllGather"}, r
        assert r["ran_after_disable"], r
        assert "engine is closed" in (r["closed_error"] or ""), r   # Handle.cache_bytes after disable()
        assert r["open_before"] == 1 and r["open_after"] == 0, r     # closed engines are forgotten


def test_gradients_are_averaged_like_a_single_process():
    for worst in all_ok(spawn(w.gradient_average, 2)):
        assert worst < 1e-4


def test_integer_parameters_are_refused_clearly():
    for message in all_ok(spawn(w.integer_parameters, 2)):
        assert "bf16, fp16 and fp32" in message and "int8" in message, message


def test_mismatched_configuration_fails_on_every_rank():
    messages = all_ok(spawn(w.mismatched_config, 2))
    for m in messages:
        assert m.startswith("enable(): configuration mismatch across ranks: block_values is '"), m
    assert len(set(messages)) == 1


def test_a_policy_failing_on_one_rank_fails_every_rank_at_once():
    # Before the transport is made: with the policy run after it, rank 0 waited for rank 1 in
    # the engine's agreement and failed with a CommError.
    errors = set(all_ok(spawn(w.policy_fails_on_one_rank, 2)))
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith("ConfigError: enable(): on rank 1: RuntimeError: no policy file on this node"), error


def test_options_that_differ_between_ranks_fail_every_rank_alike():
    expected = [
        "ConfigError: enable(): the ranks differ in verify: False on ranks 0, 1; True on rank 2",
        "ValueError: enable(): on rank 2: reselect_every must be >= 0, got -1",
        "ConfigError: enable_reduce_scatter(): on rank 2: reduce-scatter coding must be one of exponent, raw, auto, "
        "got 'bogus'",
        "ConfigError: enable_reduce_scatter(): the ranks differ in transport: 'torch' on ranks 0, 1; 'mpi' on rank 2",
        "ConfigError: enable(): on rank 2: no cost model for the 3-rank group (0, 1, 2) (cost_model is for 4 ranks)",
        "TypeError: enable(): on rank 0: overlap must be True or False, got str 'no'",
        "ValueError: enable_reduce_scatter(): on rank 0: transport must be 'torch', 'mpi' or 'nccl', got 'gloo'",
        "ConfigError: enable_reduce_scatter(): the ranks differ in coding: 'exponent' on ranks 0, 1; 'raw' on rank 2",
        "ConfigError: enable(): the ranks differ in forward_prefetch: False on ranks 0, 1; True on rank 2",
        "ValueError: enable(): on rank 0: forward_prefetch=True prefetches gathers that overlap compute: it needs "
        "overlap=True",
        "TypeError: enable(): on rank 0: forward_prefetch must be True or False, got str 'yes'",
        None,
        "TypeError: enable(): on rank 2: policy(bucket, param) must return a ciera.ShardPolicy or one of its names "
        "('raw', 'ciera', 'delta', 'zeropp_int8', 'sdp4bit', 'stateless'); for 'model.embed_tokens.weight' it "
        "returned int 3",
    ]
    for rank, errors in enumerate(all_ok(spawn(w.one_rank_differs, 3))):
        assert errors == expected, (rank, errors)


def test_models_or_cost_models_that_differ_between_ranks_fail_every_rank_alike():
    """A transposed weight has the same shard sizes, so the engine's agreement cannot see it; each
    rank would gather its peers' values into its own shape."""
    for rank, errors in enumerate(all_ok(spawn(w.models_or_cost_models_that_differ, 3))):
        assert errors[:2] == [
            "ConfigError: enable(): the ranks' models differ: parameter '0.weight' is [8, 4] bfloat16 on rank 0, "
            "[4, 8] bfloat16 on rank 2",
            "ConfigError: enable(): the ranks' models differ: parameter 0 is 'a.weight' on rank 0, 'b.weight' on "
            "rank 2"], (rank, errors)
        assert errors[2].startswith("ConfigError: enable(): the ranks differ in cost_model: "), (rank, errors)
        assert "on ranks 0, 1;" in errors[2] and errors[2].endswith("on rank 2"), (rank, errors)
        assert errors[3] == ("ConfigError: enable_reduce_scatter(): the ranks' models differ: parameter '0.weight' is "
                             "[8, 4] bfloat16 on rank 0, [4, 8] bfloat16 on rank 2"), (rank, errors)


def test_enable_on_a_group_a_rank_is_not_in_says_so_on_that_rank():
    errors = all_ok(spawn(w.enable_on_a_group_of_rank_0, 2))
    assert errors[0] == "ConfigError: enable(): on rank 0: process_group has 1 ranks, the model is sharded over 2"
    assert errors[1] == ("ConfigError: enable(): rank 1 is not in process_group; only its ranks may call it with "
                         "that group"), errors


def test_a_call_one_rank_refuses_fails_every_rank_at_once():
    results = all_ok(spawn(w.one_rank_refuses_a_call, 2))
    (rs_0, ag_0), _ = results[0]
    (rs_1, ag_1), _ = results[1]
    assert rs_1 == "ConfigError: CIERA's reduce-scatter takes BF16, FP16 or FP32 gradients, got torch.int32 -> torch.int32"
    assert rs_0.startswith("ConfigError: lossless collectives: rank 1 refused its arguments to its reduce_scatter call 0")
    assert ag_1.startswith("ConfigError: FSDP all-gather input for ") and "but CIERA registered" in ag_1, ag_1
    # The peer's text is the refusal's first 76 bytes, marked where it was cut (its record's field).
    assert ag_0.startswith("ConfigError: rank 1 rejected its gather of bucket ") and \
        ": FSDP all-gather input for " in ag_0 and (ag_0.endswith("...") or "but CIERA registered" in ag_0), ag_0
    assert all(seconds < 15 for _, seconds in results), results   # not the 20 s timeout


def test_verify_makes_a_gather_that_is_not_exact_an_error_on_every_rank():
    """verify counted the bytes that differed from torch's gather and let training go on with
    them: not exact is now an error on every rank, though only one rank's output was wrong."""
    results = all_ok(spawn(w.verify_on_a_wrong_gather, 2))
    for rank, (error, wrong, verified) in enumerate(results):
        assert error == ("Error: verify: CIERA's gather differs from torch.distributed's in 2 bytes over the "
                         f"group's ranks ({wrong} on rank {rank})"), (rank, error)
        assert (wrong, verified) == (2 * rank, 32), (rank, wrong, verified)


def test_a_set_up_stage_failing_on_one_rank_fails_every_rank_at_once():
    """One FSDP2 group: a transport, or an engine, that the last rank alone could not make was
    raised on that rank only; the others waited for it in the engine's agreement until the
    timeout (the transport), or went on with an engine whose peer had none (the engine)."""
    results = all_ok(spawn(w.set_up_fails_on_one_rank, 2))
    expected = ["ConfigError: enable(): rank 1 could not set up CIERA on its 2-rank gather group (kind 0): "
                "RuntimeError: no route to the peers on this node",
                "ConfigError: enable(): rank 1 could not set up CIERA on its 2-rank gather group (kind 0): "
                "MemoryError: no room for the codec state"]
    for rank, stages in enumerate(results):
        assert [error for error, _ in stages] == expected, (rank, stages)
        assert all(seconds < 15 for _, seconds in stages), (rank, stages)   # not the 20 s timeout


@pytest.mark.parametrize("stage", ["measured_cost_model", "make_engine"])
def test_a_later_set_up_stage_failing_on_one_rank_leaves_nothing_behind(stage):
    """The transport made, then the cost model's measurement or the engine failing on the last
    rank: every rank's error ends what the set-up made there. Until stop 72 each rank kept the
    transport's gloo group (3 threads, 5 file descriptors) to exit, and the failing rank its
    transport to the next garbage collection. enable() then works again in the same processes."""
    results = all_ok(spawn(w.later_set_up_stage_fails, 2, stage))
    for rank, r in enumerate(results):
        assert r["error"] == ("ConfigError: enable(): rank 1 could not set up CIERA on its 2-rank gather group "
                              "(kind 0): MemoryError: no room for the codec state"), (rank, r)
        assert not grown(r["before"], r["after"]), (rank, r)
        assert r["verified_bytes"] > 0 and r["wrong_bytes"] == 0, (rank, r)


def test_a_dead_rank_makes_the_others_fail_within_the_timeout():
    results = spawn(w.dead_rank, 3, timeout=120)
    survivors = [results[r] for r in (0, 1)]
    for status, value in survivors:
        assert status == "ok", value
        assert value["error"] is not None and value["error"].startswith("CommError: "), value
        assert value["seconds"] < 60, value


# ---- Benefit-driven selection (paper §3.2) -------------------------------------------------------

@pytest.mark.parametrize("budget", [20_000, 10**12])
def test_selection_respects_the_budget_and_stays_exact(budget):
    results = all_ok(spawn(w.selection_vs_plain, 2, budget))
    for r in results:
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, r
        assert r["chosen"], r                                  # a slow link: compression pays
        assert r["peak_cache_bytes"] <= r["selected_cache_bytes"] <= budget, r
        assert r["compressed_gathers"] > 0 and r["wire_bytes"] < r["raw_bytes"], r
    assert len({tuple(r["chosen"]) for r in results}) == 1     # every rank chose the same


@pytest.mark.parametrize("budget", [20_000, 10**12])
def test_selection_with_delta_chooses_three_ways_within_the_budget_and_stays_exact(budget):
    results = all_ok(spawn(w.selection_vs_plain, 2, budget, 0, True, False, True))
    for r in results:
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, r
        assert r["peak_cache_bytes"] <= r["selected_cache_bytes"] <= budget, r
        assert r["selected_cache_bytes"] == r["chosen_memory_bytes"], r
        assert r["compressed_gathers"] > 0 and r["wire_bytes"] < r["raw_bytes"], r
        # No selection follows: the monitors (the previous values too, with delta) are gone.
        assert r["monitor_bytes"] == 0, r
    if budget == 10**12:
        # Unlimited cache on a slow link: value-delta frames are the smallest for training weights.
        assert results[0]["delta"], results[0]
    assert len({(tuple(r["chosen"]), tuple(r["delta"])) for r in results}) == 1


def test_a_smaller_budget_selects_a_subset():
    small = all_ok(spawn(w.selection_vs_plain, 2, 20_000))[0]["chosen"]
    large = all_ok(spawn(w.selection_vs_plain, 2, 10**12))[0]["chosen"]
    assert set(small) < set(large)


def test_zero_budget_selects_nothing_and_gathers_raw():
    for r in all_ok(spawn(w.selection_vs_plain, 2, 0)):
        assert r["chosen"] == [] and r["peak_cache_bytes"] == 0, r
        assert r["compressed_gathers"] == 0 and r["wire_bytes"] == r["raw_bytes"], r
        assert r["losses_equal"] and r["params_equal"], r


def test_reselection_every_few_steps_stays_exact_without_overlap():
    for r in all_ok(spawn(w.selection_vs_plain, 2, 10**12, 2, False)):
        assert len(r["selections"]) >= 3, r                    # steps 3, 5, 7, 9
        assert r["monitor_bytes"] > 0, r                        # they count for the next one
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, r


def test_measured_cost_model_selects_by_its_own_numbers_and_stays_exact():
    """Here the cost model is measured on loopback TCP between two processes sharing this machine's
    few cores. What it selects depends on what it measured (usually little: the link is faster
    than decoding; but a loaded machine measures a slower link), so only that the selection follows
    from the model's own numbers is asserted, never how much it takes (that would be a timing)."""
    results = all_ok(spawn(w.selection_vs_plain, 2, 10**12, 0, True, True))
    for r in results:
        assert r["losses_equal"] and r["params_equal"] and r["wrong_bytes"] == 0, r
        assert r["peak_cache_bytes"] <= r["selected_cache_bytes"], r
        shards, chosen = r["shards"], [s for s in r["shards"] if s["chosen"]]
        # The selection follows from the cost model: g_i = dComm_i - T_decode (overlapped, so
        # encoding is off the critical path), only gains above zero are taken, a chosen shard is
        # expected to send fewer bytes in a step than it would raw, the cache is what the chosen shards
        # hold, and the chosen gains pay for their buckets' extra round. Bytes and times are per step
        # (the forward's gather and the backward's re-gathers) but raw_bytes is one gather's.
        for s in shards:
            assert abs(s["gain_s"] - (s["comm_saved_s"] - s["decode_s"])) <= 1e-12 + 1e-9 * abs(s["comm_saved_s"]), s
            assert not s["chosen"] or s["gain_s"] > 0, s
            assert not s["chosen"] or s["expected_wire_bytes"] < s["raw_bytes"] * (1 + s["regathers"]), s
        assert r["selected_cache_bytes"] == sum(s["memory_bytes"] for s in chosen), r
        for bucket in {s["bucket"] for s in chosen}:
            # The extra round is paid at every gather of the bucket in the step.
            gathers = 1 + max(s["regathers"] for s in shards if s["bucket"] == bucket)
            assert sum(s["gain_s"] for s in chosen if s["bucket"] == bucket) > r["round_overhead_s"] * gathers, bucket
        assert r["gain_s"] >= 0, r
    assert len({tuple(r["chosen"]) for r in results}) == 1     # every rank chose the same


def test_a_failed_gather_fails_again_at_every_later_wait():
    """FSDP2 may wait on a gather's work twice: after a failed step, its next unshard finds the
    result still pending and waits on it. A second wait used to return True, and FSDP copied out
    a buffer the gather never filled; it now raises the gather's error again."""
    from types import SimpleNamespace

    import torch

    import ciera
    from ciera.fsdp.gather import _GatherWork

    class FailingEngine:
        def wait(self, ticket):
            raise ciera.ConfigError("rank 1 rejected its gather of bucket 'b0': refused")

    gather = SimpleNamespace(runtime=SimpleNamespace(overlap=True), bucket=SimpleNamespace(index=0))
    work = _GatherWork(gather, SimpleNamespace(engine=FailingEngine()), 7, 0.0, torch.empty(4), torch.empty(2),
                       None, caller_s=0.0)
    for _ in range(3):
        with pytest.raises(ciera.ConfigError, match="rank 1 rejected"):
            work.wait()
    assert work.output_tensor is None and work.input_tensor is None  # nothing kept alive for it


def test_records_keep_the_latest_calls_and_count_those_let_go(monkeypatch):
    """A handle's records are one per call: a training that never takes them held them all, for
    ever. They keep the latest RecordLog.LIMIT (at most twice that between trims)."""
    from ciera.fsdp.gather import RecordLog, Runtime

    monkeypatch.setattr(RecordLog, "LIMIT", 4)
    log = RecordLog()
    for i in range(21):
        log.append(i)
        assert len(log) < 2 * RecordLog.LIMIT and log.dropped + len(log) == i + 1
    assert list(log) == list(range(log.dropped, 21)) and log.dropped > 0
    runtime = Runtime(None, [], [], False)
    assert isinstance(runtime.records, RecordLog) and isinstance(runtime.take_records(), RecordLog)
    assert isinstance(runtime.records, RecordLog)


def test_enable_leaves_forward_prefetch_alone_and_a_skipped_module_sees_changed_parameters():
    """A no-grad pass that skips a module, then an in-place change of every parameter: CIERA's
    training stays bitwise FSDP2's (enable()'s default overlap once turned on forward prefetch,
    which left the skipped module's stale gather for the next step)."""
    plain = all_ok(spawn(w.skipped_module_after_a_change, 2, False))
    ciera_runs = all_ok(spawn(w.skipped_module_after_a_change, 2, True))
    for p, c in zip(plain, ciera_runs):
        assert c["losses"] == p["losses"], (p["losses"], c["losses"])
        assert c["params"] == p["params"]
        assert c["wrong_bytes"] == 0
        assert c["before"] == c["during"] == c["after"], c   # the modules' prefetch untouched


def test_forward_prefetch_is_opt_in_and_put_back_by_disable():
    for r in all_ok(spawn(w.forward_prefetch_is_put_back, 2)):
        assert r["changed"] and r["restored"], r


def test_evaluation_passes_are_not_counted_by_the_selector():
    plain = all_ok(spawn(w.selector_counts_with_evaluation_passes, 2, False))
    evaluating = all_ok(spawn(w.selector_counts_with_evaluation_passes, 2, True))
    assert plain == evaluating, (plain, evaluating)
    assert plain[0]["step"] == 3 and plain[0]["gathers"], plain


def test_a_reselection_applies_the_changes_that_free_cache_first(monkeypatch):
    """A selection that drops one shard and picks another of the same size fits the budget only if
    the dropped shard's cache goes first: the engine must see the changes in that order, whatever
    order the selector listed them in, and never a call for a shard whose policy stays."""
    from types import SimpleNamespace

    import ciera.fsdp.selection as selection
    from ciera import _ext

    calls = []
    engine = SimpleNamespace(set_policy=lambda bucket, param, policy: calls.append((param, policy)))
    ciera, raw = _ext.ShardPolicy.ciera, _ext.ShardPolicy.raw
    shard = lambda param, policy, memory: SimpleNamespace(group=0, bucket=0, param=param, policy=policy,
                                                          chosen_memory_bytes=memory)
    # Listed taking first: param 2 becomes coded (takes 100), param 0 goes raw (frees 100),
    # param 1 stays coded, param 3 grows from 40 to 60.
    chosen = SimpleNamespace(shards=[shard(2, ciera, 100), shard(3, _ext.ShardPolicy.delta, 60),
                                     shard(1, ciera, 100), shard(0, raw, 0)])
    monkeypatch.setattr(selection, "_ext", SimpleNamespace(
        SelectorOptions=SimpleNamespace, ShardPolicy=_ext.ShardPolicy,
        select_shards=lambda candidates, models, options: chosen))
    s = object.__new__(selection.Selector)
    s.kinds = [([], engine, set())]
    s.models, s.trackers = [], []
    s.budget_bytes, s.overlap, s.codec, s.allow_delta, s.reselect_every = 260, True, None, True, 2
    s.policies = {(0, 0, 0): ciera, (0, 0, 1): ciera, (0, 0, 2): raw, (0, 0, 3): ciera}
    s.memory = {(0, 0, 0): 100, (0, 0, 1): 100, (0, 0, 3): 40}
    monkeypatch.setattr(s, "candidates", lambda merged, regathers: [], raising=False)
    assert s.choose([], regathers={}) is chosen
    assert calls == [(0, raw), (3, _ext.ShardPolicy.delta), (2, ciera)], calls
    assert s.memory == {(0, 0, 0): 0, (0, 0, 1): 100, (0, 0, 2): 100, (0, 0, 3): 60}
    assert sum(s.memory.values()) <= s.budget_bytes


def test_reduce_scatter_is_fsdp2s_own_under_each_of_its_settings():
    """Bit for bit FSDP2's gradients on 2 ranks, whatever FSDP2 asks of the reduce-scatter (AVG,
    SUM between its own divisions, a forced sum) and with gradient accumulation; a divide factor
    it asks PREMUL_SUM for is refused on both ranks alike, naming the setting that works."""
    ranks = all_ok(spawn(w.reduce_scatter_under_fsdp2_settings, 2))
    for results, refused in ranks:
        for name, (identical, calls) in results.items():
            assert identical and calls > 0, (name, results)
        assert refused.startswith("ConfigError: "), refused
        assert "FSDP2 asked for PREMUL_SUM" in refused and "set_force_sum_reduction_for_comms(True)" in refused, refused
    assert len({refused for _, refused in ranks}) == 1, ranks
