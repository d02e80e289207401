"""Rank bodies for test_topology.py: FSDP2 gathering on more than one process group (partial
resharding, HSDP), with and without CIERA (module-level so spawned processes can import them)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ciera
import ciera.torch as ct
from ciera import data
from fsdp_workers import compare, local_bits, slow_link_model, tiny_spec, train


def build(spec, world, layout, seed=0):
    """The tiny model under FSDP2 as `layout` says: "flat" (one shard group), "partial" (flat,
    every layer resharded to 2 ranks after forward: its backward gather runs on a node of 2) or
    "hsdp" (2-D mesh: replicated over nodes of 2, sharded inside each)."""
    from ciera import models

    model = models.build(spec, seed)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = 2 if layout == "partial" else True
    for layer in models.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def hierarchical_vs_plain(rank, world, layout, budget=None, allow_delta=False, measured_unlike=False):
    """Trains the same model plainly and through CIERA on `layout`; compares them bit for bit and
    says which groups CIERA gathered on, how often, and what they sent. With `measured_unlike` the
    selector's cost models are measured at enable(), and the second node's 2-rank group comes out
    a thousand times faster than the first's (as two nodes' links may measure)."""
    if measured_unlike:
        measure = ciera._ext.measure_cost_model

        def unlike(native, *args, **kwargs):
            measure(native, *args, **kwargs)   # the real measurement, a collective, then a stand-in
            model = slow_link_model(native.size)
            if native.size == 2 and rank >= 2:
                model.allgather = ciera._ext.CommCurve.fit([(0.0, 1e-7), (1e10, 1.0000001)])
            return model
        ciera._ext.measure_cost_model = unlike
    corpus = data.load_corpus(1 << 20)
    spec = tiny_spec("olmoe")
    plain = build(spec, world, layout)
    plain_losses = train(plain, rank, 8, corpus)
    plain_params = local_bits(plain)

    model = build(spec, world, layout)
    config = ciera.EngineConfig()
    config.warmup_steps = 0 if budget is not None else 2
    options = {}
    if budget is not None:
        models = None if measured_unlike else {world: slow_link_model(world), 2: slow_link_model(2)}
        options = dict(cache_budget_bytes=budget, select_after_steps=3, cost_model=models, allow_delta=allow_delta)
    handle = ct.enable(model, config, verify=True, **options)
    groups = [{"kind": g.kind, "ranks": list(g.ranks), "partition": [list(p) for p in g.partition],
               "factor": g.factor, "gathered": sorted(g.gathered)} for g in handle.groups]
    peak = []
    losses = train(model, rank, 8, corpus, before_step=lambda step: peak.append(handle.cache_bytes))
    peak.append(handle.cache_bytes)
    records = handle.take_records()
    per_kind = {}
    for r in records:
        kind = per_kind.setdefault(r.group, {"gathers": 0, "compressed": 0, "ranks": list(r.ranks)})
        kind["gathers"] += 1
        kind["compressed"] += int(r.compressed)
    selection = handle.selector.selection if handle.selector else None
    out = compare(handle, model, losses, plain_losses, plain_params)
    out.update(groups=groups, per_kind=per_kind, peak_cache_bytes=max(peak))
    if selection is not None:
        out.update(selected_cache_bytes=selection.cache_bytes,
                   chosen_by_group=[sum(1 for s in selection.shards if s.chosen and s.group == k)
                                    for k in range(len(groups))])
    return out


def engine_failure_in_one_group(rank, world):
    """One rank of the second node asks for another block size: its node's engine refuses, and
    every rank of the world must hear of it (HSDP: the other node's engine was fine)."""
    spec = tiny_spec("olmoe")
    model = build(spec, world, "hsdp")
    config = ciera.EngineConfig()
    if rank == 3:
        config.codec.block_values = 256
    try:
        ct.enable(model, config)
    except ciera.ConfigError as e:
        return str(e)
    return "no error"


def replicate_group_is_refused(rank, world):
    """enable() and enable_reduce_scatter() with process_group=<the HSDP mesh's replicate group>:
    the engines' peers (the shard group) are outside it. What each raised on this rank."""
    model = build(tiny_spec("olmoe"), world, "hsdp")
    replicate, _ = dist.new_subgroups_by_enumeration([[r for r in range(world) if r % 2 == k] for k in range(2)])
    errors = []
    for enable in (lambda: ct.enable(model, ciera.EngineConfig(), process_group=replicate),
                   lambda: ct.enable_reduce_scatter(model, process_group=replicate, timeout_s=20)):
        try:
            enable()
            errors.append("no error")
        except ciera.ConfigError as e:
            errors.append(str(e))
    return errors


def unknown_group_is_refused(rank, world):
    """A gather on a group the model's meshes do not have is a ConfigError, not a wrong result."""
    spec = tiny_spec("olmoe")
    model = build(spec, world, "flat")
    handle = ct.enable(model, ciera.EngineConfig(), overlap=False)
    gather = ct.CieraAllGather(handle._runtime, handle.buckets[0])
    stray, _ = dist.new_subgroups(2)
    # new_subgroups can return on one rank while its peer in a subgroup is still connecting; a rank
    # that then refused alone and destroyed its groups failed that peer's connect ("Connection
    # closed by peer", seen once in a fresh-clone run of stop 60). Every rank is done here first.
    dist.barrier()
    bucket = handle.buckets[0]
    try:
        gather(torch.empty(bucket.numel * 2, dtype=bucket.dtype), torch.zeros(bucket.numel, dtype=bucket.dtype), stray)
    except ciera.ConfigError as e:
        return str(e)
    finally:
        handle.disable()
    return "no error"


def zipnn_on_sub_groups(rank, world, layout):
    """enable_zipnn() on a model FSDP2 gathers on smaller groups than ZipNN's one group (HSDP, or
    partial resharding): a ConfigError on every rank naming the groups, before any gather (it
    was a FormatError at the first gather, or a size error in the first backward pass)."""
    from ciera.fsdp.zipnn import enable_zipnn

    model = build(tiny_spec("olmoe"), world, layout)
    try:
        enable_zipnn(model).disable()
    except ciera.ConfigError as e:
        return str(e)
    return "no error"


def one_replica_enables_on_its_own_mesh(rank, world, rows, scheme="ciera"):
    """A 2 x 2 mesh whose rows train apart, FSDP2 on each row's 1-D mesh: the first row (rows
    "first") or both ("both") call enable(), with the default process_group, which is then each
    row's group. Before stop 67 the first row alone waited for the second in the world's set-up,
    and both rows were refused ("bucket describes 2 ranks but the transport has 4"). Returns
    whether the losses equal plain FSDP2's on the same mesh, and the gathers' verified bytes.
    `scheme` "zipnn": enable_zipnn() in place of enable(), which defaults alike."""
    from ciera import models

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replica", "shard"))["shard"]

    def build_on_row():
        model = models.build(tiny_spec("olmoe"), 0)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in models.decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    corpus = data.load_corpus(1 << 16)
    plain_losses = train(build_on_row(), rank % 2, 3, corpus)
    model = build_on_row()
    handle = None
    if (rank < 2 or rows == "both") and scheme == "zipnn":
        from ciera.fsdp.zipnn import enable_zipnn

        handle = enable_zipnn(model, verify=True)
    elif rank < 2 or rows == "both":
        config = ciera.EngineConfig()
        config.warmup_steps = 1
        config.timeout_s = 20
        handle = ct.enable(model, config, verify=True)
    losses = train(model, rank % 2, 3, corpus)
    verified = handle.verified_bytes if handle else None
    if handle:
        handle.disable()
    return losses == plain_losses, verified
