"""ciera.torch with FSDP2 on 2 and 4 CPU ranks: training through CIERA is bitwise identical to
FSDP2's own all-gather, for every supported model family."""

import pytest
from conftest import all_ok, spawn

import fsdp_workers as w


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


def test_gradients_are_averaged_like_a_single_process():
    for worst in all_ok(spawn(w.gradient_average, 2)):
        assert worst < 1e-4


def test_integer_parameters_are_refused_clearly():
    for message in all_ok(spawn(w.integer_parameters, 2)):
        assert "bf16, fp16 and fp32" in message and "int8" in message, message


def test_mismatched_configuration_fails_on_every_rank():
    messages = all_ok(spawn(w.mismatched_config, 2))
    for m in messages:
        assert "block_values" in m, m
    assert len(set(messages)) == 1


def test_a_dead_rank_makes_the_others_fail_within_the_timeout():
    results = spawn(w.dead_rank, 3, timeout=120)
    survivors = [results[r] for r in (0, 1)]
    for status, value in survivors:
        assert status == "ok", value
        assert value["error"] is not None, value
        assert value["seconds"] < 60, value
