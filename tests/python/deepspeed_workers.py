"""Rank bodies for test_deepspeed.py (module-level so that spawned processes can import them).

Each rank runs with torch.distributed already initialised (conftest.spawn, gloo); DeepSpeed
wraps that group. Its CPU accelerator would JIT-build a shared-memory all-reduce it uses only for
inference: switched off."""

import os

import torch
import torch.distributed as dist

import ciera
import ciera.deepspeed
from conftest import error_of, later_set_up_stage_failing, policy_failing_on, set_up_stages_failing


def _deepspeed(rank: int, world: int):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_SIZE=str(world))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, **zero}, "steps_per_print": 10**9}


def engine(deepspeed, seed: int, cfg: dict):
    from ciera import models

    spec = models.ModelSpec(family="olmoe", hidden=64, layers=2, experts=4, expert_intermediate=96, vocab=256)
    module = models.build(spec, seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ds_engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
    return ds_engine


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (2, 16), generator=g)


def train_step(ds_engine, tokens) -> int:
    loss = ds_engine(input_ids=tokens, labels=tokens).loss
    ds_engine.backward(loss)
    ds_engine.step()
    return int(loss.detach().float().view(torch.int32).item())


def full_params(deepspeed, ds_engine) -> list[bytes]:
    """Every parameter as ZeRO-3 holds it (gathered by DeepSpeed, bit patterns)."""
    out = []
    for p in ds_engine.module.parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out.append(p.detach().clone().view(torch.int16).numpy().tobytes())
    return out


def exact_vs_plain(rank: int, world: int, zero: dict, steps: int, overlap: bool, options: dict | None = None) -> dict:
    """A plain ZeRO-3 engine and one with CIERA, same seed and batches, interleaved: losses and
    final parameters, and what CIERA's gathers did."""
    deepspeed = _deepspeed(rank, world)
    cfg = config(**zero)
    plain = engine(deepspeed, 0, cfg)
    ours = engine(deepspeed, 0, cfg)
    engine_config = ciera.EngineConfig()
    engine_config.warmup_steps = 1
    options = dict(options or {})
    if options.get("policy") == "delta":   # by name: a spawned rank's arguments are pickled
        engine_config.warmup_steps = 0
        options["policy"] = lambda bucket, param: ciera.ShardPolicy.delta
    if options.get("cost_model") == "slow link":
        from fsdp_workers import slow_link_model

        options["cost_model"] = slow_link_model(world)
    handle = ciera.deepspeed.enable(ours, engine_config, verify=True, overlap=overlap, **options)
    losses = {"plain": [], "ciera": []}
    per_step = []
    for step in range(steps):
        tokens = batch(rank, step)
        losses["plain"].append(train_step(plain, tokens))
        losses["ciera"].append(train_step(ours, tokens))
        records = handle.take_records()
        per_step.append({"gathers": len(records), "raw": sum(r.raw_bytes for r in records),
                         "wire": sum(r.wire_bytes for r in records),
                         "compressed": sum(1 for r in records if r.compressed)})
    result = {
        "losses_equal": losses["plain"] == losses["ciera"],
        "params_equal": full_params(deepspeed, plain) == full_params(deepspeed, ours),
        "wrong_bytes": handle.wrong_bytes, "verified_bytes": handle.verified_bytes,
        "passed_through": handle.passed_through, "per_step": per_step, "buckets": len(handle.buckets),
        "cache_bytes": handle.cache_bytes,
        "selections": handle.selector.history if handle.selector is not None else None,
        "delta_shards": (sum(1 for x in handle.selector.selection.shards if x.policy == ciera.ShardPolicy.delta)
                         if handle.selector is not None else None),
    }
    handle.disable()
    from deepspeed.runtime.zero import partition_parameters as pp

    result["restored"] = pp._dist_allgather_fn.__module__ == pp.__name__
    return result


def refused(rank: int, world: int, cases: list) -> list[str]:
    """What enable() raises for an engine configured with each case's `zero` (or given its
    `kwargs`): one DeepSpeed start-up for all cases."""
    deepspeed = _deepspeed(rank, world)
    out = []
    for zero, kwargs in cases:
        ds_engine = engine(deepspeed, 0, config(**zero))
        try:
            ciera.deepspeed.enable(ds_engine, **kwargs).disable()
            out.append("accepted")
        except (ciera.ConfigError, ValueError, TypeError) as error:
            out.append(f"{type(error).__name__}: {error}")
    # Parameters partitioned over a group smaller than the world (what DeepSpeed's mpu makes
    # under tensor or pipeline parallelism), or over two groups (expert parallelism): an engine
    # made as usual, its parameters' ds_process_group then pointed at such groups, for enable()
    # and enable_reduce_scatter() alike.
    own = [dist.new_group([r]) for r in range(world)][rank]   # every rank makes every group
    ds_engine = engine(deepspeed, 0, config())
    params = list(ds_engine.module.parameters())
    original = [p.ds_process_group for p in params]
    for groups in ([own] * len(params), [own if i % 2 else g for i, g in enumerate(original)]):
        for p, g in zip(params, groups, strict=True):
            p.ds_process_group = g
        for call in (ciera.deepspeed.enable, ciera.deepspeed.enable_reduce_scatter):
            try:
                call(ds_engine).disable()
                out.append("accepted")
            except ciera.ConfigError as error:
                out.append(f"{type(error).__name__}: {error}")
    for p, g in zip(params, original, strict=True):
        p.ds_process_group = g
    return out


def mismatched(rank: int, world: int) -> list[str]:
    """Ranks that disagree on the engine configuration, then on DeepSpeed's persistence
    threshold (rank 1 keeps the default): ConfigError on every rank, each time."""
    deepspeed = _deepspeed(rank, world)
    out = []
    for engine_config, zero in ((ciera.EngineConfig(), {"stage3_param_persistence_threshold": 0}),
                                (None, {"stage3_param_persistence_threshold": 0} if rank == 0 else {})):
        if engine_config is not None:
            engine_config.codec.block_values = 512 if rank == 0 else 256
        ds_engine = engine(deepspeed, 0, config(**zero))
        try:
            ciera.deepspeed.enable(ds_engine, engine_config).disable()
            out.append("accepted")
        except ciera.ConfigError as error:
            out.append(str(error))
    return out


def one_rank_fails(rank: int, world: int) -> list:
    """On the last rank only: enable()'s policy fails, enable_reduce_scatter() is given a coding it
    refuses, another transport, another coding, and a timeout that is not a number of seconds
    (until stop 68 it failed in that rank's group set-up alone, the others waiting there). What
    each raised on this rank, in that order."""
    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config(stage3_param_persistence_threshold=0))
    engine_config = ciera.EngineConfig()
    engine_config.timeout_s = 20   # the others' wait, had they waited for that rank in the engine's agreement
    last = rank == world - 1
    return [
        error_of(lambda: ciera.deepspeed.enable(ds_engine, engine_config, policy=policy_failing_on(world - 1, rank))),
        error_of(lambda: ciera.deepspeed.enable_reduce_scatter(ds_engine, "bogus" if last else "exponent",
                                                               timeout_s=20)),
        error_of(lambda: ciera.deepspeed.enable_reduce_scatter(ds_engine, transport="mpi" if last else "torch",
                                                               timeout_s=20)),
        error_of(lambda: ciera.deepspeed.enable_reduce_scatter(ds_engine, "raw" if last else "exponent",
                                                               timeout_s=20)),
        error_of(lambda: ciera.deepspeed.enable_reduce_scatter(ds_engine, timeout_s=float("nan") if last else 20)),
    ]


def set_up_fails_on_one_rank(rank: int, world: int) -> list:
    """ciera.deepspeed.enable() whose transport, then whose engine, fails on the last rank alone,
    each just after its collective part: what each rank raised and the seconds it took, per stage.
    Until stop 71 the others waited for the last rank in the engine's agreement until the 20 s
    timeout (the transport), or went on with an engine the last rank does not have (the engine)."""
    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config(stage3_param_persistence_threshold=0))
    engine_config = ciera.EngineConfig()
    engine_config.timeout_s = 20
    return set_up_stages_failing(rank == world - 1, lambda: ciera.deepspeed.enable(ds_engine, engine_config),
                                 ciera.deepspeed)


def later_set_up_stage_fails(rank: int, world: int, stage: str) -> dict:
    """ciera.deepspeed.enable() with the selector, whose cost model measurement or engine (`stage`)
    fails on the last rank alone after the transport was made: what each rank raised and held
    before and after it, then a verified training step under a second enable()."""
    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config(stage3_param_persistence_threshold=0))
    engine_config = ciera.EngineConfig()
    engine_config.timeout_s = 20
    def enable():
        return ciera.deepspeed.enable(ds_engine, engine_config, verify=True, cache_budget_bytes=1 << 20)

    out = later_set_up_stage_failing(rank == world - 1, enable, stage)
    handle = enable()
    train_step(ds_engine, batch(rank, 0))
    out.update(wrong_bytes=handle.wrong_bytes, verified_bytes=handle.verified_bytes)
    handle.disable()
    return out


class _ObserverFailingOnce:
    """A selector whose observation of the first gather raises (on the rank that has it)."""

    def observe(self, *_):
        raise RuntimeError("the observer failed")


def a_gather_one_rank_cannot_start(rank: int, world: int) -> dict:
    """CIERA's ZeRO-3 gathers, where the last rank fails to start the first fetch (its selector's
    observation raises): what each rank's training step raised, and how long it took."""
    import time

    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config(stage3_param_persistence_threshold=0))
    engine_config = ciera.EngineConfig()
    engine_config.timeout_s = 20   # the others' wait, had they waited for that rank in the gather
    handle = ciera.deepspeed.enable(ds_engine, engine_config, overlap=False)
    if rank == world - 1:
        handle._runtime.selector = _ObserverFailingOnce()
    start = time.perf_counter()
    error = error_of(lambda: train_step(ds_engine, batch(rank, 0)))
    return {"error": error, "seconds": time.perf_counter() - start}


def an_observer_fails_on_one_rank(rank: int, world: int) -> dict:
    """CIERA's ZeRO-3 gathers with verify, where the last rank's output observer raises at its
    first call (a fetch of several parameters): what each rank's training step raised, and how
    long it took. The others must not be left in the verification of that fetch's next
    parameter, an all-gather of the world group that waits out its 60 s timeout."""
    import time

    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config(stage3_param_persistence_threshold=0))
    engine_config = ciera.EngineConfig()
    engine_config.timeout_s = 20
    handle = ciera.deepspeed.enable(ds_engine, engine_config, overlap=False, verify=True)

    def observer(bucket, output):
        # The experts' fused gate_up_proj comes first of the two parameters of its module's fetch.
        if rank == world - 1 and bucket.module_name.endswith("mlp.experts.gate_up_proj"):
            raise RuntimeError("the observer failed")

    handle.set_output_observer(observer)
    start = time.perf_counter()
    error = error_of(lambda: train_step(ds_engine, batch(rank, 0)))
    seconds = time.perf_counter() - start
    if rank == world - 1:
        time.sleep(5)   # alive: a peer left in a verification waits until this process ends
    return {"error": error, "seconds": seconds, "verified": handle.verified_bytes}


def reduce_scatter_vs_twin(rank: int, world: int, steps: int) -> dict:
    """The same ZeRO-3 training three times, same seed and batches: DeepSpeed's own gradient
    reduce-scatter, CIERA's uncompressed twin ("raw") and CIERA's coded one, with CIERA's
    parameter gathers in the last (both enables on one engine). Then refusals on this rank."""
    deepspeed = _deepspeed(rank, world)
    runs = {}
    for name in ("plain", "raw", "exponent"):
        ds_engine = engine(deepspeed, 0, config())
        handle = None if name == "plain" else ciera.deepspeed.enable_reduce_scatter(ds_engine, name)
        gathers = ciera.deepspeed.enable(ds_engine) if name == "exponent" else None
        # Beside the coded engine, in the same process and steps, an engine CIERA was not enabled
        # on: it must keep DeepSpeed's own reduce-scatter (bitwise the plain run's).
        beside = engine(deepspeed, 0, config()) if name == "exponent" else None
        losses = []
        for step in range(steps):
            losses.append(train_step(ds_engine, batch(rank, step)))
            if beside is not None:
                runs.setdefault("beside", []).append(train_step(beside, batch(rank, step)))
        if beside is not None:
            runs["beside_params"] = full_params(deepspeed, beside)
        records = handle.records if handle else []
        runs[name] = {"losses": losses, "params": full_params(deepspeed, ds_engine), "calls": len(records),
                      "raw": sum(r.raw_bytes for r in records), "wire": sum(r.wire_bytes for r in records),
                      "passed_through": handle.passed_through if handle else 0}
        if name == "exponent":
            try:
                ciera.deepspeed.enable_reduce_scatter(ds_engine, "raw")
                runs["twice"] = "accepted"
            except ValueError as error:
                runs["twice"] = str(error)
            gathers.disable()
        if handle:
            handle.disable()
            handle.disable()   # a second call does nothing
            runs[name]["enabled_after_disable"] = handle.enabled
    from deepspeed.runtime.comm import coalesced_collectives as cc

    ours, twin, plain = runs["exponent"], runs["raw"], runs["plain"]
    refusals = []
    for zero in ({"stage": 2}, {"reduce_scatter": False}):
        cfg = config()
        cfg["zero_optimization"].update(zero)
        try:
            ciera.deepspeed.enable_reduce_scatter(engine(deepspeed, 0, cfg)).disable()
            refusals.append("accepted")
        except ciera.ConfigError as error:
            refusals.append(str(error))
    return {
        "losses_equal": ours["losses"] == twin["losses"], "params_equal": ours["params"] == twin["params"],
        "loss_diff_vs_plain": max(abs(torch.tensor([a], dtype=torch.int32).view(torch.float32).item()
                                      - torch.tensor([b], dtype=torch.int32).view(torch.float32).item())
                                  for a, b in zip(ours["losses"], plain["losses"])),
        "calls": ours["calls"], "raw": ours["raw"], "wire": ours["wire"], "twin_raw": twin["raw"],
        "twin_wire": twin["wire"], "passed_through": ours["passed_through"] + twin["passed_through"],
        "twice": runs["twice"], "enabled_after_disable": ours["enabled_after_disable"],
        "restored": cc._torch_reduce_scatter_fn.__module__ == cc.__name__, "refusals": refusals,
        "beside_is_plain": runs["beside"] == plain["losses"] and runs["beside_params"] == plain["params"],
    }


def reduce_scatter_passed_through_by_some_ranks(rank: int, world: int) -> dict:
    """ZeRO-3 steps whose gradient reduce-scatters CIERA serves on every rank but where serves()
    says no: on every rank (step 0: every call left to DeepSpeed, agreed), on none (step 1), and
    on the last rank alone (step 2), as a tensor only that rank laid out otherwise would. What
    each step raised and took on this rank; the last rank would have sat in DeepSpeed's gloo
    reduce-scatter while the others waited in CIERA's until its 20 s timeout."""
    import time

    deepspeed = _deepspeed(rank, world)
    ds_engine = engine(deepspeed, 0, config())
    handle = ciera.deepspeed.enable_reduce_scatter(ds_engine, timeout_s=20)
    steps = []
    for step, declines in enumerate((True, False, rank == world - 1)):
        if declines:
            handle.serves = lambda *args: False
        elif "serves" in vars(handle):
            del handle.serves
        start = time.perf_counter()
        error = error_of(lambda: train_step(ds_engine, batch(rank, step)))
        steps.append({"error": error, "seconds": time.perf_counter() - start, "calls": handle.calls,
                      "passed_through": handle.passed_through})
    return {"steps": steps}
