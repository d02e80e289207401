"""CIERA inside FSDP2's hierarchical layouts: partial resharding (reshard_after_forward=N: the
backward re-gather of a layer runs on N ranks) and HSDP (a 2-D mesh, sharded inside nodes), one
engine per process group, bitwise identical to the same layout without CIERA."""

import importlib.util

import pytest
from conftest import all_ok, needs_torch, spawn

needs_torch()
import topology_workers as w  # noqa: E402


def check_exact(r):
    assert r["losses_equal"] and r["params_equal"]
    assert r["wrong_bytes"] == 0 and r["verified_bytes"] > 0


def test_partial_resharding_gathers_backward_on_the_node_group_and_stays_exact():
    results = all_ok(spawn(w.hierarchical_vs_plain, 4, "partial"))
    for rank, r in enumerate(results):
        check_exact(r)
        world_group, node_group = r["groups"]
        assert world_group["partition"] == [[0, 1, 2, 3]] and world_group["factor"] == 1
        assert node_group["partition"] == [[0, 1], [2, 3]] and node_group["factor"] == 2
        assert node_group["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        # Every layer is re-gathered in backward on the node; the root is not resharded.
        assert node_group["gathered"] == [1, 2] and world_group["gathered"] == [0, 1, 2]
        assert r["per_kind"][1]["ranks"] == node_group["ranks"]
        assert r["per_kind"][1]["gathers"] == 2 * 8          # two layers, eight steps
        assert r["per_kind"][0]["gathers"] == 3 * 8
        # Exponent reuse after warmup on both groups.
        assert r["per_kind"][0]["compressed"] > 0 and r["per_kind"][1]["compressed"] > 0


def test_hsdp_gathers_inside_each_node_and_stays_exact():
    results = all_ok(spawn(w.hierarchical_vs_plain, 4, "hsdp"))
    for rank, r in enumerate(results):
        check_exact(r)
        assert len(r["groups"]) == 1
        group = r["groups"][0]
        assert group["partition"] == [[0, 1], [2, 3]]
        assert group["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["per_kind"][0]["compressed"] > 0


@pytest.mark.parametrize("allow_delta", [False, True])
def test_one_budget_covers_every_groups_engine(allow_delta):
    budget = 60_000
    results = all_ok(spawn(w.hierarchical_vs_plain, 4, "partial", budget, allow_delta))
    for r in results:
        check_exact(r)
        assert r["peak_cache_bytes"] <= budget
        assert 0 < r["selected_cache_bytes"] <= budget
    # The selection is made from statistics merged over the world: every rank chose alike.
    assert len({tuple(r["chosen_by_group"]) for r in results}) == 1
    assert sum(results[0]["chosen_by_group"]) > 0


def test_groups_of_one_kind_that_measure_unlike_still_select_alike():
    """The selector's cost models measured at enable(): the two nodes' 2-rank groups measure links
    a thousand times apart, but one selection sets every kind's policies, the world group's too;
    every rank must price alike (each kind as its slowest group) or the world engine's next
    gather fails on policies that differ between the nodes."""
    budget = 60_000
    results = all_ok(spawn(w.hierarchical_vs_plain, 4, "partial", budget, False, True))
    for r in results:
        check_exact(r)
        assert r["peak_cache_bytes"] <= budget
    assert len({tuple(r["chosen_by_group"]) for r in results}) == 1
    assert sum(results[0]["chosen_by_group"]) > 0


def test_a_failure_in_one_nodes_group_is_an_error_on_every_rank():
    messages = all_ok(spawn(w.engine_failure_in_one_group, 4))
    for m in messages:
        assert "rank 2 could not set up CIERA" in m or "rank 3 could not set up CIERA" in m, m
        assert "block" in m
    assert len(set(messages)) == 1


def test_a_process_group_without_the_shard_group_is_refused_at_enable():
    """Under HSDP the replicate group was accepted; its ranks then merged selection statistics
    with ranks they share no engine with and chose unlike, failing after the warmup. (The shard
    group is refused too: enable() agrees the nodes' set-up over the world, or one node could
    fail alone and leave the other in FSDP2's all-reduce across nodes.)"""
    for rank, (gathers, reductions) in enumerate(all_ok(spawn(w.replicate_group_is_refused, 4))):
        # The lowest rank of this rank's replicate group ({0, 2} or {1, 3}) names its shard peer.
        first = rank % 2
        assert gathers == (f"enable(): on rank {first}: FSDP2 gathers this model on groups of several nodes (HSDP or "
                           f"reshard_after_forward=N), whose set-up enable() agrees over the world; process_group "
                           f"holds ranks [{first}, {first + 2}]: pass the world (the default)"), (rank, gathers)
        # The reduce-scatter's checks agree over the world: rank 0's refusal on every rank (the
        # collectives ran on the shard groups and process_group was ignored).
        assert reductions == ("enable_reduce_scatter(): on rank 0: FSDP2 reduce-scatters this rank's gradients on "
                              "ranks (0, 1), not all in process_group (ranks (0, 2)); under HSDP pass the world or "
                              "the shard group, not the replicate group"), (rank, reductions)


def test_a_gather_on_an_unknown_group_is_refused():
    for m in all_ok(spawn(w.unknown_group_is_refused, 4)):
        assert "a group enable() did not find" in m


@pytest.mark.skipif(importlib.util.find_spec("zipnn") is None, reason="needs zipnn (pip install '.[peers]')")
@pytest.mark.parametrize("layout,groups", [("hsdp", "[((0, 1), (2, 3))]"), ("partial", "[((0, 1, 2, 3),), ((0, 1), (2, 3))]")])
def test_zipnn_refuses_a_model_gathered_on_smaller_groups(layout, groups):
    for m in all_ok(spawn(w.zipnn_on_sub_groups, 4, layout)):
        assert m.startswith("enable_zipnn(): on rank "), m
        assert f"FSDP2 gathers this model on the groups {groups}, but ZipNN exchanges on one group of ranks (0, 1, 2, 3)" in m, m


def _train(tmp_path, *extra):
    import json
    import subprocess
    import sys

    from test_train import _env

    cmd = [sys.executable, "-m", "ciera.train", "--nodes", "2", "--ranks-per-node", "2", "--steps", "6",
           "--warmup", "2", "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32", "--verify", "--json",
           "--out", str(tmp_path), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", [["--reshard-after-forward", "2"], ["--hsdp"]])
def test_ciera_train_on_two_nodes_is_bitwise_identical_to_the_same_layout(tmp_path, layout):
    """Under mpirun (Open MPI sub-communicators per group), no link lab: --nodes only groups ranks."""
    s = _train(tmp_path, *layout)
    assert s["losses_identical"] and s["params_identical"]
    assert s["wrong_bytes"] == 0 and s["verified_bytes"] > 0
    assert s["topology"] == {"nodes": 2, "ranks_per_node": 2, "hsdp": layout == ["--hsdp"],
                             "reshard_after_forward": 2 if layout != ["--hsdp"] else 0}
    if layout == ["--hsdp"]:
        # Every gather stays inside a node.
        assert s["inter_node_allgather_bytes_fsdp2"] == 0 and s["inter_node_allgather_bytes"] == 0
    else:
        # Forward gathers cross nodes; CIERA's carry fewer bytes (exponent reuse after warmup).
        assert 0 < s["inter_node_allgather_bytes"] < s["inter_node_allgather_bytes_fsdp2"]


def test_ciera_train_in_the_two_level_link_lab_reports_the_uplinks(tmp_path):
    import os
    import subprocess

    # A name of this process's own: two test runs at once must not take each other's probe.
    name = f"ciera-test-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("network namespaces are not permitted here (the link lab needs root)")
    subprocess.run(["ip", "netns", "delete", name], check=True)
    # The flat layout: partial resharding's sub-communicators are tested under mpirun above (in the
    # lab, one run in about a dozen of that layout hung in its first backward gather and failed at
    # the timeout: not yet explained, docs/reliability.md row 21).
    s = _train(tmp_path, "--link-gbit", "10")
    assert s["losses_identical"] and s["params_identical"]
    assert "per node between nodes" in s["links"]
    # In the lab the ranks stand in for nodes: each pinned to its share of the cores.
    assert s["pin_cores"] is True and len(s["rank_cores"]) == 4 and all(len(c) >= 1 for c in s["rank_cores"])
    uplinks = s["uplinks"]
    assert uplinks["nodes"] == 2 and uplinks["ranks_per_node"] == 2 and len(uplinks["uplinks"]) == 2
    # Everything that crossed: both trainings' forward gathers (at least one copy of each payload
    # per remote node), gradients and the harness's own collectives.
    crossed = sum(u["tx_bytes"] for u in uplinks["uplinks"])
    assert crossed > 6 * (s["inter_node_allgather_bytes_fsdp2"] + s["inter_node_allgather_bytes"]) / 2


@pytest.mark.parametrize("rows,scheme", [("first", "ciera"), ("both", "ciera"), ("first", "zipnn")])
def test_enable_on_a_mesh_of_some_ranks_agrees_over_that_mesh(rows, scheme):
    if scheme == "zipnn" and importlib.util.find_spec("zipnn") is None:
        pytest.skip("zipnn is not installed: pip install 'ciera[peers]'")
    results = all_ok(spawn(w.one_replica_enables_on_its_own_mesh, 4, rows, scheme, timeout=180))
    for rank, (same, verified) in enumerate(results):
        assert same, rank
        enabled = rank < 2 or rows == "both"
        assert (verified is not None) == enabled and (verified is None or verified > 0), (rank, verified)
