"""Rank bodies for test_fsdp.py (module-level so that spawned processes can import them)."""

import os
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ciera
import ciera.torch as ct
from ciera import fsdp
from ciera import data, models
from conftest import error_of, later_set_up_stage_failing, policy_failing_on, set_up_stages_failing


def tiny_spec(family, **overrides):
    # Dimensions chosen so that some parameters do not split evenly over 3 or 4 ranks (vocab 257,
    # 4 experts over 3 ranks); row strides stay multiples of 16 bytes for grouped GEMMs.
    spec = dict(family=family, hidden=40, layers=2, experts=4, experts_per_token=2, expert_intermediate=48, heads=4,
                vocab=257)
    spec.update(overrides)
    return models.ModelSpec(**spec)


def build(spec, world, seed=0, dtype=torch.bfloat16, reduce_dtype=torch.float32):
    model = models.build(spec, seed)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    for layer in models.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train(model, rank, steps, corpus, lr=1e-3, before_step=None):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if before_step:
            before_step(step)
        tokens = data.batch(corpus, step, rank, 2, 24)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float().view(torch.int32).item())  # the loss's bits
    return losses


def local_bits(model):
    return [p.to_local().detach().clone().view(torch.uint8) for p in model.parameters()]


def same_bits(ours, theirs) -> bool:
    """Two lists of tensors equal bit for bit: as many of them, at least one, each equal."""
    return len(ours) == len(theirs) > 0 and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def exact_vs_plain(rank, world, family, transport="torch"):
    """Trains the same model with FSDP2's all-gather and with CIERA; returns the comparison."""
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec(family)
    plain = build(spec, world)
    plain_losses = train(plain, rank, 10, corpus)
    plain_params = local_bits(plain)

    model = build(spec, world)
    config = ciera.EngineConfig()
    config.warmup_steps = 4  # gathers per bucket: forward and backward of the first two steps
    handle = ct.enable(model, config, transport=transport, verify=True)
    losses = train(model, rank, 10, corpus)
    return compare(handle, model, losses, plain_losses, plain_params)


def compare(handle, model, losses, plain_losses, plain_params) -> dict:
    """Disables CIERA and reports the training against plain FSDP2's, bit for bit."""
    records = handle.take_records()
    params = local_bits(model)
    handle.disable()
    return {
        "losses_equal": losses == plain_losses,
        "params_equal": same_bits(params, plain_params),
        "wrong_bytes": handle.wrong_bytes,
        "verified_bytes": handle.verified_bytes,
        "compressed_gathers": sum(r.compressed for r in records),
        "gathers": len(records),
        "wire_bytes": sum(r.wire_bytes for r in records),
        "raw_bytes": sum(r.raw_bytes for r in records),
    }


def parameter_ranges(rank, world):
    """Every parameter's bytes sit where Bucket.param_range says, uneven shards included."""
    spec = tiny_spec("olmoe")
    model = build(spec, world, dtype=torch.float32)
    handle = ct.enable(model, ciera.EngineConfig(), overlap=False)  # output complete on return
    captured = {}
    original = ct.CieraAllGather.__call__

    def capture(self, output_tensor, input_tensor, group, async_op=False):
        result = original(self, output_tensor, input_tensor, group, async_op)
        captured.setdefault(self.bucket.index, output_tensor.clone())
        return result

    ct.CieraAllGather.__call__ = capture
    try:
        tokens = data.batch(data.load_corpus(1 << 16), 0, rank, 1, 8)
        model(input_ids=tokens, labels=tokens).loss.backward()
    finally:
        ct.CieraAllGather.__call__ = original
    names = dict(model.named_parameters())
    mismatches, checked, uneven = 0, 0, 0
    for bucket in handle.buckets:
        out = captured[bucket.index]
        for k, p in enumerate(bucket.params):
            full = names[p.name].full_tensor().detach().reshape(names[p.name].shape[0], -1)
            rows = -(-full.shape[0] // world)  # FSDP: ceil(dim0 / world) rows per rank, zero padded
            padded = torch.zeros(rows * world, full.shape[1])
            padded[: full.shape[0]] = full
            uneven += full.shape[0] % world != 0
            for r in range(world):
                start, end = bucket.param_range(r, k)
                expect = padded[r * rows : (r + 1) * rows].reshape(-1)
                mismatches += int((out[start:end] != expect).sum())
                checked += end - start
    handle.disable()
    return {"mismatches": mismatches, "checked": checked, "uneven": uneven}


def disable_restores_plain(rank, world):
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("mixtral")
    plain = build(spec, world)
    expected = train(plain, rank, 6, corpus)
    model = build(spec, world)
    handle = ct.enable(model, ciera.EngineConfig())
    first = train(model, rank, 3, corpus)
    open_before = len(ct.open_engines())
    handle.disable()
    comms = [type(fsdp.all_gather_comm(m)).__name__ for m in handle._runtime.modules]
    try:
        handle.cache_bytes
        closed_error = None
    except ValueError as e:
        closed_error = str(e)
    # Continue without CIERA: a fresh optimizer would differ, so compare only the CIERA part
    # with the plain run, and check that the plain path now runs.
    rest = train(model, rank, 1, corpus)
    # Enabling and disabling again keeps no engine open: the registry of open engines does not grow.
    for _ in range(2):
        ct.enable(model, ciera.EngineConfig()).disable()
    return {"first_equal": first == expected[:3], "comms": comms, "ran_after_disable": len(rest) == 1,
            "closed_error": closed_error, "open_before": open_before, "open_after": len(ct.open_engines())}


def gradient_average(rank, world):
    """FSDP2 on gloo averages gradients correctly: compare with one process on the whole batch."""
    corpus = data.load_corpus(1 << 18)
    spec = tiny_spec("olmoe")
    model = build(spec, world, dtype=torch.float32)
    handle = ct.enable(model, ciera.EngineConfig())
    tokens = torch.cat([data.batch(corpus, 0, r, 2, 16) for r in range(world)])
    mine = tokens[rank * 2 : (rank + 1) * 2]
    model(input_ids=mine, labels=mine).loss.backward()
    reference = models.build(spec, 0)
    reference(input_ids=tokens, labels=tokens).loss.backward()
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        g = p.grad.full_tensor()
        worst = max(worst, float((g - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)))
    handle.disable()
    return worst


def integer_parameters(rank, world):
    """A model with an int8 parameter inside an FSDP group (as a quantised weight would be)."""
    model = models.build(tiny_spec("olmoe"), 0)
    models.decoder_layers(model)[0].register_parameter(
        "scale_q", torch.nn.Parameter(torch.zeros(8, dtype=torch.int8), requires_grad=False))
    mesh = init_device_mesh("cpu", (world,))
    for layer in models.decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        ct.enable(model, ciera.EngineConfig())
    except TypeError as e:
        return str(e)
    return "no error"


def mismatched_config(rank, world):
    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    if rank == world - 1:
        config.codec.block_values = 1024
    try:
        ct.enable(model, config)
    except ciera.ConfigError as e:
        return str(e)
    return "no error"


def policy_fails_on_one_rank(rank, world):
    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    config.timeout_s = 20   # the others' wait, had they waited for that rank in the engine's agreement
    return error_of(lambda: ct.enable(model, config, policy=policy_failing_on(world - 1, rank)))


def one_rank_differs(rank, world):
    """On the last rank only: enable(verify=True), which would make gathers of its own that the
    others never make; an enable() argument out of range; enable_reduce_scatter() with a coding
    it refuses, and with another transport. What each raised on this rank, in that order."""
    last = rank == world - 1
    model = build(tiny_spec("olmoe"), world)
    return [
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), verify=last)),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), reselect_every=-1 if last else 0)),
        # timeout_s: the others' wait, had they waited for the last rank in the transport's set-up
        error_of(lambda: ct.enable_reduce_scatter(model, "bogus" if last else "exponent", timeout_s=20)),
        error_of(lambda: ct.enable_reduce_scatter(model, transport="mpi" if last else "torch", timeout_s=20)),
        # A cost model for another group size: found by the selector's set-up, on that rank alone.
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), cache_budget_bytes=1 << 20,
                                   cost_model=slow_link_model(world + 1 if last else world))),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), overlap="no")),
        error_of(lambda: ct.enable_reduce_scatter(model, transport="gloo", timeout_s=20)),
        # Each coding alone is exact; differing ones break the promise of one coding per call.
        error_of(lambda: ct.enable_reduce_scatter(model, "raw" if last else "exponent", timeout_s=20)),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), forward_prefetch=last)),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), overlap=False, forward_prefetch=True)),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), forward_prefetch="yes")),
        # A policy may return a ShardPolicy's name; anything else is refused naming the parameter
        # (pybind11's text showed only the list it could not convert).
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), policy=lambda b, p: "raw").disable()),
        error_of(lambda: ct.enable(model, ciera.EngineConfig(), policy=lambda b, p: 3 if last else "ciera")),
    ]


def models_or_cost_models_that_differ(rank, world):
    """On the last rank only: a model whose one weight is transposed (as many values, so each
    rank's shard sizes agree), one whose parameter is named otherwise, and a cost model of the
    right size with other numbers; and the transposed weight for enable_reduce_scatter(). What each
    raised on this rank, in that order."""
    from torch.distributed.fsdp import fully_shard

    last = rank == world - 1

    def linear(shape, name="0"):
        model = torch.nn.Sequential()
        model.add_module(name, torch.nn.Linear(*shape, bias=False, dtype=torch.bfloat16))
        fully_shard(model)
        return model

    other = slow_link_model(world)
    if last:
        other.allgather = ciera._ext.CommCurve.fit([(0.0, 1e-6), (1e7, 0.5)])
    return [
        error_of(lambda: ct.enable(linear((8, 4) if last else (4, 8)), ciera.EngineConfig())),
        error_of(lambda: ct.enable(linear((4, 8), "b" if last else "a"), ciera.EngineConfig())),
        error_of(lambda: ct.enable(linear((4, 8)), ciera.EngineConfig(), cache_budget_bytes=1 << 20,
                                   cost_model=other)),
        error_of(lambda: ct.enable_reduce_scatter(linear((8, 4) if last else (4, 8)), timeout_s=20)),
    ]


def enable_on_a_group_of_rank_0(rank, world):
    """enable() with a process group of rank 0 alone, called on every rank: what each raised."""
    import torch.distributed as dist

    model = build(tiny_spec("olmoe"), world)
    group = dist.new_group([0])
    return error_of(lambda: ct.enable(model, ciera.EngineConfig(), process_group=group))


def one_rank_refuses_a_call(rank, world):
    """CIERA's FSDP2 hooks called with tensors the last rank alone cannot pass (integer gradients
    to the reduce-scatter, an input of the wrong size to the all-gather): what each rank raised,
    and the seconds the two calls took (the others would have waited the 20 s timeout)."""
    import torch.distributed as dist

    from ciera.fsdp.layout import all_gather_comm, describe_buckets, reduce_scatter_comm
    last = rank == world - 1
    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    config.timeout_s = 20
    ct.enable_reduce_scatter(model, "exponent", timeout_s=20)
    ct.enable(model, config)
    module = describe_buckets(model)[0][0]
    start = time.time()
    dtype = torch.int32 if last else torch.float32
    reduce_scatter = reduce_scatter_comm(module)
    errors = [error_of(lambda: reduce_scatter(torch.empty(8, dtype=dtype), torch.ones(8 * world, dtype=dtype),
                                              dist.group.WORLD, dist.ReduceOp.SUM))]
    gather = all_gather_comm(module)
    engine = gather.runtime.group_of(dist.group.WORLD).engine
    values = gather.bucket.numel + (1 if last else 0)
    output = torch.empty(engine.bucket(gather.bucket.index).total_bytes() // 2, dtype=gather.bucket.dtype)

    def gather_and_wait():
        work = gather(output, torch.zeros(values, dtype=gather.bucket.dtype), dist.group.WORLD)
        if work is not None:   # in flight (enable()'s overlap): its error comes at the wait
            work.wait()

    errors.append(error_of(gather_and_wait))
    return errors, time.time() - start


def set_up_fails_on_one_rank(rank, world):
    """enable() whose transport, then whose engine, fails on the last rank alone, each just after
    its collective part: what each rank raised and the seconds it took, per stage. The others
    would have waited for the last rank in the engine's agreement until the 20 s timeout, or gone
    on with an engine it does not have."""
    from ciera.fsdp import api

    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    config.timeout_s = 20
    return set_up_stages_failing(rank == world - 1, lambda: ct.enable(model, config), api)


def later_set_up_stage_fails(rank, world, stage):
    """enable() with the selector, whose cost model measurement or engine (`stage`) fails on the
    last rank alone after the transport was made: what each rank raised and held before and after
    it, then a verified training step under a second enable()."""
    corpus = data.load_corpus(1 << 18)
    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    config.timeout_s = 20
    def enable():
        return ct.enable(model, config, verify=True, cache_budget_bytes=1 << 20)

    out = later_set_up_stage_failing(rank == world - 1, enable, stage)
    handle = enable()
    train(model, rank, 1, corpus)
    out.update(wrong_bytes=handle.wrong_bytes, verified_bytes=handle.verified_bytes)
    handle.disable()
    return out


def dead_rank(rank, world):
    corpus = data.load_corpus(1 << 18)
    model = build(tiny_spec("olmoe"), world)
    config = ciera.EngineConfig()
    config.timeout_s = 5
    handle = ct.enable(model, config)
    start = time.time()
    try:
        train(model, rank, 6, corpus, before_step=lambda s: os._exit(0) if rank == world - 1 and s == 2 else None)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.time() - start}
    return {"error": None, "seconds": time.time() - start}


def slow_link_model(world):
    """A cost model of a 10 MB/s link and a fast codec, so that compression clearly pays."""
    model = ciera._ext.CostModel()
    model.world_size = world
    model.allgather = ciera._ext.CommCurve.fit([(0.0, 1e-4), (1e7, 1.0001)])
    fast = ciera._ext.CodecThroughput()
    fast.detect_bytes_per_s = fast.encode_bytes_per_s = fast.decode_bytes_per_s = 1e10
    for dtype in (ciera._ext.DType.bf16, ciera._ext.DType.fp16, ciera._ext.DType.fp32):
        model.set_throughput(dtype, fast)
        model.set_delta_throughput(dtype, fast)
    return model


def selection_vs_plain(rank, world, budget_bytes, reselect_every=0, overlap=True, measured=False,
                       allow_delta=False):
    """Trains with the benefit-driven selector under a budget; compares with plain FSDP2."""
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")
    plain = build(spec, world)
    plain_losses = train(plain, rank, 10, corpus)
    plain_params = local_bits(plain)

    model = build(spec, world)
    config = ciera.EngineConfig()
    config.warmup_steps = 0
    handle = ct.enable(model, config, verify=True, overlap=overlap, cache_budget_bytes=budget_bytes,
                       select_after_steps=3, reselect_every=reselect_every,
                       cost_model=None if measured else slow_link_model(world), allow_delta=allow_delta)
    peak = []
    losses = train(model, rank, 10, corpus, before_step=lambda step: peak.append(handle.cache_bytes))
    peak.append(handle.cache_bytes)
    selector = handle.selector
    selection = selector.selection
    shards = selection.shards
    return compare(handle, model, losses, plain_losses, plain_params) | {
        "peak_cache_bytes": max(peak),
        "selected_cache_bytes": selection.cache_bytes,
        "chosen": sorted(s.name for s in shards if s.chosen),
        "delta": sorted(s.name for s in shards if s.policy == ciera.ShardPolicy.delta),
        "chosen_memory_bytes": sum(s.chosen_memory_bytes for s in shards),
        "types": sorted({s.type for s in shards if s.chosen}),
        "selections": selector.history,
        "monitor_bytes": selector.monitor_bytes,   # after the last step
        "gain_s": selection.gain_s,
        # What the selector saw and decided, per shard, to check it against the cost model.
        "shards": [{k: getattr(s, k) for k in ("name", "bucket", "regathers", "chosen", "raw_bytes",
                                               "expected_wire_bytes", "comm_saved_s", "encode_s", "decode_s",
                                               "gain_s", "memory_bytes")}
                   for s in shards],
        "round_overhead_s": ciera._ext.compressed_round_overhead_s(selector.cost_model),
    }


def selector_resume(rank, world):
    """A selector's state taken after 6 steps (through JSON, as a checkpoint keeps it) and loaded
    into a fresh engine: the same step count, selection and schedule as the selector it came from."""
    import json

    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")

    def enable(model):
        config = ciera.EngineConfig()
        config.warmup_steps = 0
        return ct.enable(model, config, verify=True, overlap=False, cache_budget_bytes=20_000, select_after_steps=3,
                         reselect_every=4, cost_model=slow_link_model(world))

    def chosen(selector):
        return sorted(s.name for s in selector.selection.shards if s.chosen)

    first, saved = build(spec, world), {}
    handle = enable(first)

    def take(step):
        if step == 6:
            s = handle.selector
            saved.update(state=json.loads(json.dumps(s.state_dict())), chosen=chosen(s),
                         policies={k: str(v) for k, v in s.policies.items()})
    train(first, rank, 10, corpus, before_step=take)
    history = [h["step"] for h in handle.selector.history]
    handle.disable()

    second = build(spec, world)
    resumed = enable(second)
    s = resumed.selector
    s.load_state_dict(saved["state"])
    out = {"step": s.step, "chosen": chosen(s), "chosen_before": saved["chosen"],
           "policies_equal": {k: str(v) for k, v in s.policies.items()} == saved["policies"],
           "selection_step": s.selection_step, "carried": s.carried is not None}
    train(second, rank, 4, corpus)   # its steps 7..10: a re-selection at step 7, as the first had
    records = resumed.take_records()
    out |= {"history": history, "resumed_history": [h["step"] for h in s.history],
            "compressed_gathers": sum(r.compressed for r in records), "wrong_bytes": resumed.wrong_bytes,
            "verified_bytes": resumed.verified_bytes}
    resumed.disable()
    return out


class _SkippingLM(torch.nn.Module):
    """Embedding, three FSDP blocks and a head; `skip_last` leaves the last block out (an early
    exit in an evaluation pass)."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                                              torch.nn.Linear(2 * width, width)) for _ in range(3))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.skip_last = False

    def forward(self, x):
        h = self.emb(x)
        for i, layer in enumerate(self.layers):
            if not (self.skip_last and i == len(self.layers) - 1):
                h = h + layer(h)
        return self.head(h)


def _sharded_skipping_lm(world):
    """A _SkippingLM from seed 0, each block and the root under fully_shard."""
    torch.manual_seed(0)
    model = _SkippingLM()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def skipped_module_after_a_change(rank, world, with_ciera):
    """Trains 6 steps; after each, a no-grad evaluation pass that skips the last block; after step
    3 every parameter is halved in place. Returns the loss bits and each rank's parameter bits,
    and what the modules prefetch before enable(), after it and after disable(). enable()'s
    default overlap once turned on forward prefetch: the skipped block kept the values it had
    gathered, and the next step used them after the halving (plain FSDP2 diverged from CIERA at
    step 5)."""
    model = _sharded_skipping_lm(world)

    def prefetching():
        return [len(m._get_fsdp_state()._states_to_forward_prefetch) for m in [*model.layers, model]]

    before = prefetching()
    handle = None
    if with_ciera:
        config = ciera.EngineConfig()
        config.warmup_steps = 1
        handle = ct.enable(model, config)   # the defaults: overlap on
    during = prefetching()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        x = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 64, (4, 16), generator=x)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(int(loss.detach().view(torch.int32)))
        model.skip_last = True
        with torch.no_grad():
            model(tokens)
        model.skip_last = False
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    # The root stays unsharded after the no-grad pass (its parameters are plain tensors then).
    params = [(p.to_local() if hasattr(p, "to_local") else p).detach().contiguous().view(torch.uint8).numpy().tobytes()
              for p in model.parameters()]
    wrong = handle.wrong_bytes if handle is not None else 0
    if handle is not None:
        handle.disable()
    return {"losses": losses, "params": params, "before": before, "during": during, "after": prefetching(),
            "wrong_bytes": wrong}


def forward_prefetch_is_put_back(rank, world):
    """enable(forward_prefetch=True) sets each module to prefetch the next; disable() puts back
    what the user had set."""
    model = _sharded_skipping_lm(world)
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])

    def prefetching():
        return [[id(s) for s in m._get_fsdp_state()._states_to_forward_prefetch] for m in [*model.layers, model]]

    before = prefetching()
    handle = ct.enable(model, ciera.EngineConfig(), forward_prefetch=True)
    during = prefetching()
    handle.disable()
    return {"changed": during != before, "restored": prefetching() == before}


def selector_counts_with_evaluation_passes(rank, world, evaluating):
    """Three training steps under a budget (the selection comes later), with `evaluating` a
    no-grad pass between each forward and its backward and an eval-mode pass after each step.
    Returns the selector's step count and gathers per bucket: evaluation passes add neither
    (a no-grad pass once counted as a step, its gathers as re-gathers, and dropped the backward
    re-gathers of the step it sat in)."""
    model = _sharded_skipping_lm(world)
    handle = ct.enable(model, ciera.EngineConfig(), cache_budget_bytes=10**9, select_after_steps=10,
                       cost_model=slow_link_model(world))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        if evaluating:
            with torch.no_grad():
                model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if evaluating:
            model.eval()
            model(tokens)
            model.train()
    selector = handle.selector
    # The blocks' buckets: FSDP2 keeps the root gathered after a forward, so after an evaluation
    # pass the next training step does not gather it at all (fewer gathers there, rightly counted).
    out = {"step": selector.step, "gathers": sorted((k, n) for k, n in selector.gathers.items() if k[1] != 0)}
    handle.disable()
    return out


def verify_on_a_wrong_gather(rank, world):
    """verify=True's check on an exact output, then on one wrong on rank 1 alone: the error on
    every rank, and each rank's own count of wrong bytes."""
    from ciera.fsdp.gather import Runtime

    runtime = Runtime(None, [], [], True)
    mine = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
    right = torch.cat([torch.full((4,), float(r + 1), dtype=torch.bfloat16) for r in range(world)])
    runtime.verified(mine, right.clone(), None)   # exact: nothing raised
    wrong = right.clone()
    if rank == 1:
        wrong[0] = 7.0   # 0x40e0 for 1.0's 0x3f80: both bytes differ
    return error_of(lambda: runtime.verified(mine, wrong, None)), runtime.wrong_bytes, runtime.verified_bytes


def _small_sharded(world, reduce_dtype, param_dtype=None):
    """Three Linear layers of uneven sizes (7, 3, 11 rows: padded shards on 2 ranks), each its own
    FSDP2 unit, and the root."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Linear(3, 11))
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _sharded_gradients(rank, world, reduce_dtype, param_dtype, set_up, through_ciera, micro_batches):
    """This rank's sharded gradients after `micro_batches` backward passes (gradient sync on the
    last only), with FSDP2's own reduce-scatter or CIERA's; and CIERA's call count."""
    from torch.distributed.fsdp import FSDPModule

    model = _small_sharded(world, reduce_dtype, param_dtype)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            set_up(module)
    handle = ct.enable_reduce_scatter(model, "exponent", timeout_s=20) if through_ciera else None
    generator = torch.Generator().manual_seed(100 + rank)
    try:
        for i in range(micro_batches):
            if micro_batches > 1:
                model.set_requires_gradient_sync(i == micro_batches - 1)
            model(torch.randn(4, 5, generator=generator) * 3).pow(2).sum().backward()
        grads = torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()])
        return grads, len(handle.records) if handle else 0
    finally:
        if handle:
            handle.disable()


def reduce_scatter_under_fsdp2_settings(rank, world):
    """For each FSDP2 setting that changes what its reduce-scatter asks for (the reduce dtype, and
    so AVG or a SUM between FSDP2's own divisions; a forced sum; a divide factor; gradient
    accumulation): whether CIERA's sharded gradients equal FSDP2's own bit for bit (2 ranks: one
    addition, in either order the same), and its calls. Then the divide factor FSDP2 asks
    PREMUL_SUM for: what each rank raised."""
    settings = {
        "fp32": (torch.float32, None, lambda m: None, 1),
        "bf16 reduce, fp32 parameters": (torch.bfloat16, None, lambda m: None, 1),
        "fp16 reduce (sum between FSDP2's divisions)": (torch.float16, None, lambda m: None, 1),
        "forced sum": (torch.float32, None, lambda m: m.set_force_sum_reduction_for_comms(True), 1),
        "forced sum, divide factor 3": (torch.float32, None, lambda m: (m.set_force_sum_reduction_for_comms(True),
                                                                        m.set_gradient_divide_factor(3.0)), 1),
        "divide factor = world": (torch.float32, None, lambda m: m.set_gradient_divide_factor(float(world)), 1),
        "3 micro-batches, fp32": (torch.float32, None, lambda m: None, 3),
        "2 micro-batches, bf16": (torch.bfloat16, torch.bfloat16, lambda m: None, 2),
    }
    results = {}
    for name, (reduce_dtype, param_dtype, set_up, micro_batches) in settings.items():
        own, _ = _sharded_gradients(rank, world, reduce_dtype, param_dtype, set_up, False, micro_batches)
        ours, calls = _sharded_gradients(rank, world, reduce_dtype, param_dtype, set_up, True, micro_batches)
        results[name] = (torch.equal(own.view(torch.int32), ours.view(torch.int32)), calls)
    refused = error_of(lambda: _sharded_gradients(rank, world, torch.float32, None,
                                                  lambda m: m.set_gradient_divide_factor(3.0), True, 1))
    return results, refused
