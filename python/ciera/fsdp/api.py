"""The public entry point: enable() routes every FSDP2 parameter group's all-gather through CIERA,
and the Handle it returns gives statistics and disable()."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import checked_on_every_rank, parameter_shapes, set_up_on_every_rank
from ciera.fsdp import lifecycle
from ciera.fsdp.gather import CieraAllGather, GatherRecord, Runtime
from ciera.fsdp.layout import (DTYPES, Bucket, DefaultAllGather, all_gather_comm, describe_buckets, describe_groups,
                               element_bytes, lone_shard_group, prefetch_forward, restore_forward_prefetch)
from ciera.fsdp.selection import Selector
from ciera.fsdp.transport import check_engine_config, check_transport, make_subgroup_transport, make_transport


class Handle:
    """What enable() returns: the engine, per-parameter layout, statistics, and disable()."""

    def __init__(self, runtime: Runtime, hook=None):
        self._runtime = runtime
        self._hook = hook
        self._prefetched: list = []   # enable(forward_prefetch=True): each module's prefetch before it

    @property
    def engine(self):
        """The engine of the shard group (every forward gather)."""
        return self._runtime.engine

    def _engines(self) -> list:
        """Every engine of this enable(): one per group (DeepSpeed's runtime has one, no groups)."""
        return [g.engine for g in self._runtime.groups] or [self._runtime.engine]

    @property
    def groups(self) -> list:
        """One GatherGroup per kind of process group FSDP2 gathers on (the shard group; with
        reshard_after_forward=N also the post-forward group), each with its engine."""
        return self._runtime.groups

    def set_policy(self, bucket: int, param: int, policy) -> None:
        """Sets how parameter `param` of `bucket` travels, in every group's engine. Collective."""
        for engine in self._engines():
            engine.set_policy(bucket, param, policy)

    @property
    def buckets(self) -> list[Bucket]:
        return self._runtime.buckets

    @property
    def overlap(self) -> bool:
        """Whether gathers are handed back to FSDP in flight (CCP)."""
        return self._runtime.overlap

    @property
    def wrong_bytes(self) -> int:
        return self._runtime.wrong_bytes

    @property
    def verified_bytes(self) -> int:
        return self._runtime.verified_bytes

    def take_records(self) -> list[GatherRecord]:
        return self._runtime.take_records()

    def set_gather_observer(self, callback) -> None:
        """callback(bucket index, this rank's input: Tensor) after each gather, once every rank
        has its output (and, with verify, once the outputs are verified). An exception it raises
        is raised by that gather on this rank alone: the peers, which know nothing of it, fail
        in their next gather when this process ends, or at the engine's timeout."""
        self._runtime.on_gather = callback

    def set_output_observer(self, callback) -> None:
        """callback(bucket: Bucket, output: Tensor) after each gather, with every rank's shards; an
        exception it raises is handled as set_gather_observer's."""
        self._runtime.on_output = callback

    @property
    def cache_bytes(self) -> int:
        """Codec state this rank holds now (encoder copies and peers' exponent caches); a
        ValueError after disable()."""
        return sum(engine.cache_bytes for engine in self._engines())

    @property
    def selector(self) -> Selector | None:
        """The benefit-driven selector, when enable() was given a cache budget."""
        return self._runtime.selector

    def disable(self) -> None:
        """Restores FSDP2's default all-gather on every module (and the forward prefetch it had
        before enable(forward_prefetch=True)) and closes the engine; collective. The process
        group enable() made for transport "torch" stays until the process exits (released here,
        torch's teardown raced with it at exit: ciera.fsdp.lifecycle): each enable()/disable()
        cycle keeps one gloo group, about 5 file descriptors and 3 threads, so enable once per
        training rather than around every evaluation."""
        for module in self._runtime.modules:
            module.set_custom_all_gather(DefaultAllGather())
        restore_forward_prefetch(self._prefetched)
        self._prefetched = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for engine in self._engines():
            lifecycle.close_engine(engine)


def _layouts(buckets: list, world: int, selecting: bool, policy) -> list:
    layouts = []
    for bucket in buckets:
        layout = _ext.BucketLayout()
        layout.name = bucket.module_name or "<root>"
        layout.dtype = DTYPES[bucket.dtype]
        layout.shard_values = [[p.numel for p in bucket.params] for _ in range(world)]
        if selecting:
            layout.policy = [_ext.ShardPolicy.raw for _ in bucket.params]
        else:
            layout.policy = [_chosen_policy(policy, bucket, p) if policy else _ext.ShardPolicy.ciera
                             for p in bucket.params]
        layouts.append(layout)
    return layouts


def _chosen_policy(policy, bucket, param):
    """What policy(bucket, param) returned, as a ShardPolicy: a member, or a member's name
    ("raw", "ciera", ...); anything else is a TypeError naming the parameter (pybind11's own text
    showed only the whole list it could not convert)."""
    chosen = policy(bucket, param)
    if isinstance(chosen, _ext.ShardPolicy):
        return chosen
    member = getattr(_ext.ShardPolicy, chosen, None) if isinstance(chosen, str) else None
    if isinstance(member, _ext.ShardPolicy):
        return member
    names = ", ".join(repr(n) for n in _ext.ShardPolicy.__members__)
    raise TypeError(f"enable(): policy(bucket, param) must return a ciera.ShardPolicy or one of its names "
                    f"({names}); for {param.name!r} it returned {type(chosen).__name__} {chosen!r}")


def shared_options(transport, verify, cache_budget_bytes, select_after_steps, reselect_every, overlap, cost_model,
                   allow_delta) -> dict:
    """enable()'s options every rank must share, beyond the engine configuration its engine agrees:
    ranks that differ in one would make different calls (another transport, verify's extra
    gathers, the selector's collectives at other steps, a cost model measured on some ranks)."""
    # Before the agreed step, on one rank alone if it raised: nothing here may (keys of mixed
    # types do not sort; a value that is no CostModel is named by its type, and refused there).
    given = (None if cost_model is None else
             {repr(size): plain_cost_model(m) for size, m in sorted(cost_model.items(), key=lambda kv: repr(kv[0]))}
             if isinstance(cost_model, dict) else plain_cost_model(cost_model))
    return {"transport": transport, "verify": bool(verify), "cache_budget_bytes": cache_budget_bytes,
            "select_after_steps": select_after_steps, "reselect_every": reselect_every, "overlap": bool(overlap),
            "cost_model": given, "allow_delta": bool(allow_delta)}


def plain_cost_model(model) -> tuple | str:
    """A CostModel as plain data, to compare and send between ranks: (world size, the allgather
    curve's (bytes, seconds) samples, per dtype the (detect, encode, decode) bytes per second of
    exponent reuse and of value-delta frames); for anything else its type (the argument checks
    name it)."""
    if not isinstance(model, _ext.CostModel):
        return type(model).__name__
    speeds = [[(t.detect_bytes_per_s, t.encode_bytes_per_s, t.decode_bytes_per_s)
               for t in (model.throughput(d), model.delta_throughput(d))] for d in DTYPES.values()]
    return model.world_size, model.allgather.samples, speeds


def _set_up_on_every_rank(process_group, group, stage):
    """set_up_on_every_rank() over `process_group` for one stage of setting up `group`'s kind."""
    return set_up_on_every_rank(
        stage, process_group,
        lambda rank: f"enable(): rank {rank} could not set up CIERA on its {group.size}-rank gather group "
                     f"(kind {group.kind})")


def _close_engines(groups) -> None:
    for group in groups:
        if group.engine is not None:
            lifecycle.close_engine(group.engine)
            group.engine = None


def given_cost_model(given, size: int, ranks: tuple, what: str = "enable()"):
    """`given`'s cost model for the gather group of `size` ranks `ranks` (given: a CostModel, or a
    dict from group size to CostModel when the model gathers on groups of several sizes);
    ConfigError if it has none of that size. Checked before any set-up, on every rank at once: a
    rank that found out inside its set-up alone would leave its peers waiting for it until the
    timeout."""
    model = given.get(size) if isinstance(given, dict) else given
    if not isinstance(model, _ext.CostModel) or model.world_size != size:
        held = (f"has group sizes {sorted(given)}" if isinstance(given, dict)
                else f"is for {given.world_size} ranks")
        raise _ext.ConfigError(f"{what}: no cost model for the {size}-rank group {ranks} (cost_model {held})")
    return model


def measured_cost_model(native, buckets: list, world: int, config):
    """The selector's cost model measured on `native` (a transport of `world` ranks) before an
    engine takes it over: Comm() up to the largest of `buckets` gathered, each of their dtypes
    coded. Collective over the transport's ranks."""
    largest = max(b.numel * world * element_bytes(b.dtype) for b in buckets)
    dtypes = sorted({DTYPES[b.dtype] for b in buckets}, key=int)
    return _ext.measure_cost_model(native, largest, dtypes, config.codec)


def _cost_model(given, native, group, config):
    """The selector's cost model for `group`'s shards: the one `given` has for it, or measured on
    the group's transport."""
    if given is None:
        return measured_cost_model(native, group.buckets, group.size, config)
    return given_cost_model(given, group.size, group.ranks)


def make_engine(native, config, layouts: list, device: torch.device):
    """The engine of `layouts` on `native`, coding on `device` (the CPU or one CUDA device), closed
    by ciera.fsdp.lifecycle at exit if its owner does not. Collective: it agrees its configuration
    with its peers."""
    try:
        engine = _ext.Engine(native, config, layouts, device=device.index if device.type == "cuda" else -1)
    except _ext.ConfigError as e:   # the engine's agreement (the same on every rank): named as enable()'s others
        raise _ext.ConfigError(f"enable(): {e}") from e
    lifecycle.register_engine(engine)
    return engine


def install_selector(runtime: Runtime, models, config, module, group, cache_budget_bytes: int,
                     select_after_steps: int | None, reselect_every: int, overlap: bool, allow_delta: bool):
    """The benefit-driven selector of `runtime`'s engines (enable()'s cache_budget_bytes and what
    goes with it; `models` its cost models, `group` the group it agrees its choices over), counting
    training steps by a forward pre-hook on `module`. Returns that hook."""
    after = config.warmup_steps if select_after_steps is None else select_after_steps
    runtime.selector = Selector(runtime, models, int(cache_budget_bytes), after, reselect_every, overlap,
                                config.codec, group, allow_delta=bool(allow_delta))
    return runtime.selector.install(module)


def _agree_cost_models(models: list, groups, process_group) -> list:
    """The measured cost models, one per kind of group, made the same on every rank of the world.
    measure_cost_model() agrees its numbers inside one group, so the groups of one kind (a node
    each, say) can measure differently; but the selection is one, under one budget, and it sets
    the policies of every kind's engine, the world group's too: ranks that priced with other
    numbers would choose unlike and fail that engine's next gather. Each kind is priced as its
    slowest group, the rule measure_cost_model() applies to ranks: the most seconds at every probed
    size (refitted) and the fewest bytes per second of each codec. Collective over
    `process_group`."""
    if all(len(g.partition) == 1 for g in groups):
        return models   # one group per kind: agreed already
    everyone = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, [plain_cost_model(m)[1:] for m in models], group=process_group)
    agreed = []
    for kind, model in enumerate(models):
        curves = [_ext.CommCurve.fit(samples) for samples, _ in (rank[kind] for rank in everyone)]
        sizes = sorted({size for samples, _ in (rank[kind] for rank in everyone) for size, _ in samples})
        merged = _ext.CostModel()
        merged.world_size = model.world_size
        merged.allgather = _ext.CommCurve.fit([(size, max(c.seconds(size) for c in curves)) for size in sizes])
        for i, dtype in enumerate(DTYPES.values()):
            for j, setter in enumerate((merged.set_throughput, merged.set_delta_throughput)):
                slowest = _ext.CodecThroughput()
                slowest.detect_bytes_per_s, slowest.encode_bytes_per_s, slowest.decode_bytes_per_s = (
                    min(column) for column in zip(*(rank[kind][1][i][j] for rank in everyone)))
                setter(dtype, slowest)
        agreed.append(merged)
    return agreed


def _model_device(model: torch.nn.Module) -> torch.device:
    """The one device the model's parameters are on: CPU, or one CUDA device (whose index the
    engine codes on). ConfigError for anything else."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise _ext.ConfigError(f"enable(): the model's parameters are on {len(devices)} devices "
                               f"({', '.join(sorted(map(str, devices)))}); CIERA needs them on one")
    device = devices.pop()
    if device.type == "cuda":
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        raise _ext.ConfigError(f"enable(): parameters on {device}; CIERA gathers CPU or CUDA tensors")
    return device


def _check_arguments(model, config, transport, policy, cache_budget_bytes, select_after_steps,
                     reselect_every, cost_model, allow_delta=False, verify=False, overlap=True,
                     forward_prefetch=False) -> None:
    """enable()'s arguments, each on its own and together: TypeError or ValueError naming the
    argument and its value, before anything is set up."""
    def count(name, value, allow_none=False):
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"enable(): {name} must be an int, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"enable(): {name} must be >= 0, got {value}")

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable(): model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("verify", verify), ("overlap", overlap), ("allow_delta", allow_delta),
                        ("forward_prefetch", forward_prefetch)):
        if isinstance(value, str) or value not in (True, False):   # a NumPy bool, 0 or 1 pass
            raise TypeError(f"enable(): {name} must be True or False, got {type(value).__name__} {value!r}")
    if forward_prefetch and not overlap:
        raise ValueError("enable(): forward_prefetch=True prefetches gathers that overlap compute: it needs "
                         "overlap=True")
    if cost_model is not None and not (isinstance(cost_model, _ext.CostModel) or (
            isinstance(cost_model, dict) and all(isinstance(m, _ext.CostModel) for m in cost_model.values()))):
        raise TypeError(f"enable(): cost_model must be a ciera CostModel, or a dict from group size to CostModel, "
                        f"got {type(cost_model).__name__}")
    check_engine_config("enable()", "config", config)
    check_transport("enable()", transport)
    if policy is not None and not callable(policy):
        raise TypeError(f"enable(): policy must be callable(bucket, param) -> ShardPolicy, got {policy!r}")
    count("cache_budget_bytes", cache_budget_bytes, allow_none=True)
    count("select_after_steps", select_after_steps, allow_none=True)
    count("reselect_every", reselect_every)
    if cache_budget_bytes is None:
        for name, value in (("select_after_steps", select_after_steps), ("cost_model", cost_model),
                            ("reselect_every", reselect_every or None), ("allow_delta", allow_delta or None)):
            if value is not None:
                raise ValueError(f"enable(): {name}={value!r} is for the selector; it needs cache_budget_bytes")
    elif policy is not None:
        raise ValueError("enable(): give either policy= or cache_budget_bytes=, not both")
    else:
        after = select_after_steps if select_after_steps is not None else (config or _ext.EngineConfig()).warmup_steps
        if after < 2:
            raise ValueError(f"enable(): the selector chooses after {after} steps, but it measures exponent changes "
                             "between consecutive steps: select_after_steps (or config.warmup_steps) must be >= 2")


def _described(model, process_group, selecting: bool, cost_model):
    """The model's FSDP2 buckets, its gather groups and its device, or the error enable() raises
    for them (ConfigError, or ValueError for a model already enabled)."""
    described = describe_buckets(model)
    if not described:
        raise _ext.ConfigError("enable(): the model has no FSDP2 (fully_shard) parameter groups")
    # Any of ciera's gathers (CieraAllGather, or ciera.fsdp.zipnn's, which imports this module).
    if any(type(all_gather_comm(module)).__module__.startswith("ciera.fsdp.") for module, _ in described):
        raise ValueError("enable(): the model's all-gathers already go through CIERA or ZipNN; call disable() "
                         "on the Handle of that enable() first")
    device = _model_device(model)
    if device.type == "cuda" and selecting and cost_model is None:
        raise ValueError("enable(): on CUDA the selector needs cost_model= (the start-up measurement "
                         "times host coders and host-memory transfers, not the GPU's)")
    groups = describe_groups(described)
    if groups[0].partition == (tuple(range(dist.get_world_size())),):
        if dist.get_world_size(process_group) != groups[0].size:
            raise _ext.ConfigError(f"enable(): process_group has {dist.get_world_size(process_group)} ranks, the "
                                   f"model is sharded over {groups[0].size}")
    members = set(dist.get_process_group_ranks(process_group) if process_group is not None
                  else range(dist.get_world_size()))
    if any(len(g.partition) > 1 for g in groups) and len(members) != dist.get_world_size():
        # Groups of one kind on every node (HSDP, reshard_after_forward=N): enable() agrees their
        # set-up, cost models and selection over process_group, and a node that failed alone
        # would leave the others in FSDP2's own collectives across nodes.
        raise _ext.ConfigError(f"enable(): FSDP2 gathers this model on groups of several nodes (HSDP or "
                               f"reshard_after_forward=N), whose set-up enable() agrees over the world; "
                               f"process_group holds ranks {sorted(members)}: pass the world (the default)")
    for group in groups:
        outside = sorted(set(group.ranks) - members)
        if outside:
            # The set-up agrees this rank's engines over process_group, and the selector merges its
            # statistics there: an engine's peers outside it would set up and select on their own.
            raise _ext.ConfigError(f"enable(): FSDP2 gathers this rank's parameters on ranks {list(group.ranks)}, "
                                   f"but {outside} {'is' if len(outside) == 1 else 'are'} not in process_group "
                                   f"(ranks {sorted(members)})")
    return described, groups, device


def enable(model: torch.nn.Module, config: _ext.EngineConfig | None = None, *, process_group=None,
           transport: str = "torch", verify: bool = False, policy=None,
           cache_budget_bytes: int | None = None, select_after_steps: int | None = None,
           reselect_every: int = 0, overlap: bool = True, cost_model=None, allow_delta: bool = False,
           forward_prefetch: bool = False) -> Handle:
    """Routes every FSDP2 parameter group's all-gather of `model` through CIERA.

    Collective: every rank calls it with the same model structure (parameter names, shapes and
    dtypes) and configuration (checked; a difference raises ConfigError on every rank), on a
    `process_group` that holds every rank its gathers reach (the world under HSDP or
    reshard_after_forward=N, whose groups of every node enable() sets up together). By default it
    is the world, or, for a model FSDP2 shards on a mesh of some of the world's ranks only (a
    mesh made on a subgroup), that mesh's group: its ranks call enable(), the others need not. The
    model's parameters are on the CPU or on
    one CUDA device: then payloads live and are coded in that device's memory (CIERA built with
    CUDA). `transport` is "torch" (a dedicated group beside `process_group`:
    gloo for CPU models, NCCL for CUDA ones), "mpi" (CIERA's Open MPI transport, CPU only; the
    job must run under mpirun) or "nccl" (CIERA's own NCCL communicator, CUDA only). With `verify`, every gather is also done by torch.distributed
    and compared byte for byte: a difference on any rank raises ciera.Error on every rank before
    the output is used (Handle.wrong_bytes counts the bytes that differed). `policy(bucket, param) -> ShardPolicy`
    chooses per parameter; the default compresses everything.

    With `cache_budget_bytes`, the benefit-driven selector decides instead (paper §3.2): every
    parameter goes raw for `select_after_steps` training steps (default: config.warmup_steps)
    while its exponent changes are counted; then the parameters whose compression saves more
    time than it costs, ranked by gain per byte of cache, go through CIERA until the budget (per
    rank, bytes of codec state) is used. `reselect_every` > 0 re-runs the selection every that
    many steps on fresh statistics (results stay exact: a switched shard restarts with a key
    frame). With `allow_delta`, a parameter may also go in value-delta frames (ShardPolicy.delta:
    its receivers keep its previous values, two bytes per BF16 value, and take the exact
    step-to-step differences; the backward re-gather of an unchanged layer is then nearly free):
    the selector ranks raw, exponent reuse and delta by gain per byte of cache (per step: it counts
    how often FSDP2 gathers each layer in a step, and a re-gather of unchanged values costs delta
    a header, exponent reuse the mantissas again), and the warmup also keeps each shard's previous
    values to measure what delta frames would cost.

    With `overlap` (CCP, paper §3.3), a gather is handed back to FSDP in flight: encoding,
    exchange and decoding run on the engine's threads while the previous module computes
    (FSDP's backward prefetch; forward prefetch, `forward_prefetch=True`, makes each FSDP module
    start the next one's gather in model.modules() order, put back by disable(): every forward
    must then run the modules in that order, since a module prefetched and skipped keeps what it
    gathered and misses a change to its parameters before it next runs, as with FSDP2's own
    set_modules_to_forward_prefetch; off by default, so that enable() changes nothing FSDP2
    does but the gathers themselves). `overlap=False`
    finishes each gather before returning, and makes the selector charge detection and encoding
    to the critical path. `cost_model` (an _ext.CostModel, the same on every rank) replaces the
    start-up measurement, for tests and for reusing one measured earlier.

    A bad argument raises TypeError or ValueError before anything is set up, and so does a model
    whose all-gathers already go through CIERA (enabled and not disabled): on every rank, naming
    the rank where it arose, whether one rank or all of them got it wrong."""
    selecting = cache_budget_bytes is not None
    if process_group is None:
        # A model sharded on one group of some ranks (its mesh made on a subgroup): the set-up
        # agrees over that group, not the world, whose other ranks may never call enable() (they
        # waited here until torch's timeout) or shard apart.
        process_group = lone_shard_group(model)
    # Every local step first, on every rank, before any collective: the arguments, the model's
    # state and `policy` (the user's callable) can fail on one rank alone, and the others must
    # hear of it here, not wait for that rank in a set-up until its timeout; so must ranks that
    # chose other options (the engine agrees only its own configuration).
    def prepare():
        _check_arguments(model, config, transport, policy, cache_budget_bytes, select_after_steps,
                         reselect_every, cost_model, allow_delta, verify, overlap, forward_prefetch)
        described, groups, device = _described(model, process_group, selecting, cost_model)
        if selecting and cost_model is not None:
            for group in groups:
                given_cost_model(cost_model, group.size, group.ranks)
        return described, groups, device, [_layouts(g.buckets, g.size, selecting, policy) for g in groups]

    described, groups, device, layouts = checked_on_every_rank(
        "enable()", prepare, process_group,
        same=shared_options(transport, verify, cache_budget_bytes, select_after_steps, reselect_every, overlap,
                            cost_model, allow_delta) | {"forward_prefetch": bool(forward_prefetch)},
        parameters=lambda: parameter_shapes(model))
    config = config or _ext.EngineConfig()
    models = []
    with contextlib.ExitStack() as undo:
        # What the set-up made, ended on every rank if a stage fails on any (every rank leaves
        # here by the agreed error): every kind's engines, then the process groups made for the
        # transports (a gloo group keeps 3 threads and 5 descriptors to exit otherwise). A
        # native transport goes with its last reference, the error's traceback.
        made_groups = []
        undo.callback(lifecycle.release_groups, made_groups)
        undo.callback(_close_engines, groups)
        for group, group_layouts in zip(groups, layouts):
            # One engine per kind of group, on this rank's group of that kind (created by every
            # rank at once, kind after kind, so groups of one kind form together). Every stage is
            # agreed over process_group, with a single group too (_set_up_on_every_rank): a stage
            # that failed on one rank, or in one node's group, is an error on every rank, not a
            # wait until the timeout in the next stage's collectives or in the next kind's.
            def transport_stage():
                if len(group.partition) == 1:
                    return make_transport(transport, process_group, config.timeout_s, device, made=made_groups)
                return make_subgroup_transport(transport, group.partition, group.ranks, config.timeout_s, device,
                                               made=made_groups)

            def engine_stage():
                group.engine = make_engine(native, config, group_layouts, device)

            native = _set_up_on_every_rank(process_group, group, transport_stage)
            if selecting:
                models.append(_set_up_on_every_rank(process_group, group,
                                                    lambda: _cost_model(cost_model, native, group, config)))
            _set_up_on_every_rank(process_group, group, engine_stage)
        if selecting and cost_model is None:
            models = _agree_cost_models(models, groups, process_group)
        undo.pop_all()   # set up on every rank: the handle's disable() closes the engines, the groups stay to exit
    runtime = Runtime(groups[0].engine, [b for _, b in described], [m for m, _ in described], verify,
                      overlap=overlap, groups=groups)
    for module, bucket in described:
        module.set_custom_all_gather(CieraAllGather(runtime, bucket))
    hook = (install_selector(runtime, models, config, model, process_group, cache_budget_bytes, select_after_steps,
                             reselect_every, overlap, allow_delta) if selecting else None)
    handle = Handle(runtime, hook)
    # Last, when nothing can fail any more: no handle would be there to put it back.
    handle._prefetched = prefetch_forward(model) if forward_prefetch else []
    return handle
