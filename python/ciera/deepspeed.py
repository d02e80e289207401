"""CIERA for DeepSpeed ZeRO-3: enable(engine) routes the engine's parameter all-gathers through
CIERA's engine; every gathered parameter is bitwise what plain ZeRO-3 gathers.

Where it hooks (DeepSpeed 0.15-0.19; tested with 0.19.8, the version `pip install
'ciera[deepspeed]'` installs). ZeRO-3 gathers parameters on two paths, and each is intercepted
where DeepSpeed itself routes it, by module attribute (DeepSpeed looks both up at call time):

- ``deepspeed.runtime.zero.partition_parameters._dist_allgather_fn(input, output, group)``: the
  forward/backward fetches and prefetches of the PartitionedParameterCoordinator. Its input is
  either one parameter's partition (``ds_tensor``) or, when several parameters are fetched
  together, their partitions concatenated in ``ds_id`` order (a view of this rank's slot of the
  output). Which parameters a call carries comes from each parameter's ``all_gather_coalesced``,
  which enable() wraps to name them (a thread-local list; backward fetches may run on autograd's
  threads). The gather is returned in flight: DeepSpeed's prefetching then overlaps CIERA's
  encoding, exchange and decoding with compute as it does its own gathers (paper §3.3).
- ``deepspeed.comm.all_gather_into_tensor(output, ds_tensor)``: ``param.all_gather()``, with which
  ZeRO-3 re-gathers its persistent parameters after each optimizer step (and GatheredParameters).
  Finished before it returns, as DeepSpeed expects.

Each ZeRO-3 parameter is one engine bucket whose shard is the parameter's partition (ZeRO-3 pads
every partition to ceil(numel / world) values, so all ranks' shards are alike); a coalesced
fetch of k parameters is k engine gathers, started together, each written to its place in
DeepSpeed's flat output. Any other all-gather (other dtypes, other groups, parameters of an engine
CIERA is not enabled on) goes to DeepSpeed's own function untouched; ``Handle.passed_through``
counts those that carried a parameter of this engine, so a configuration CIERA cannot serve is
visible, not silent.

Refused, with ConfigError naming the setting: ZeRO stages other than 3, ZeRO++'s quantised
weights and hierarchical partitioning (zero_quantized_weights, zero_hpz_partition_size > 1),
MiCS, parameter fetches by all-reduce (stage3_use_all_reduce_for_fetch_params), parameter
offload, parameters in more than one data-parallel group or in one smaller than the world, and
DeepSpeed versions outside 0.15-0.19."""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import checked_on_every_rank, set_up_on_every_rank, start_each, wait_each
from ciera.fsdp import api, lifecycle
from ciera.fsdp.gather import GatherRecord, RecordLog, Runtime
from ciera.fsdp.layout import DTYPES, Bucket, ParamSlice
from ciera.fsdp.transport import check_transport, make_transport

SUPPORTED_VERSIONS = ((0, 15), (0, 19))   # first and last DeepSpeed minor release served

_INSTALL_HINT = "pip install 'ciera[deepspeed]'"


class _Hooks:
    """DeepSpeed's two gather functions, replaced once while any engine has CIERA enabled."""

    def __init__(self):
        self.lock = threading.Lock()
        self.local = threading.local()   # .calls: stack of the parameter lists being fetched
        self.states: dict[int, "_State"] = {}   # id(param) -> the enabled engine's state
        self.timed: dict[int, "_Timed"] = {}    # id(param) -> a plain engine whose gathers are timed
        self.original_fetch = None
        self.original_gather = None
        self.fetch_installed = self.gather_installed = False   # ours are in DeepSpeed's call chain

    def install(self) -> None:
        """Puts _fetch and _gather in place of DeepSpeed's functions, unless they are in its call
        chain already: directly, or under a wrapper someone installed after them (whose
        function, taken as the original, would call ours again: a recursion without end)."""
        from deepspeed import comm as ds_comm
        from deepspeed.runtime.zero import partition_parameters as pp

        if not self.fetch_installed:
            self.original_fetch, pp._dist_allgather_fn = pp._dist_allgather_fn, _fetch
            self.fetch_installed = True
        if not self.gather_installed:
            self.original_gather, ds_comm.all_gather_into_tensor = ds_comm.all_gather_into_tensor, _gather
            self.gather_installed = True

    def uninstall(self) -> None:
        """Puts DeepSpeed's functions back once no engine is left, unless someone wrapped ours
        since: then ours stay under the wrapper, passing every call through, and a later
        install() finds them there. The originals stay: a call already past the dispatch on
        another thread still uses them (until stop 68 it found None there)."""
        from deepspeed import comm as ds_comm
        from deepspeed.runtime.zero import partition_parameters as pp

        if self.states or self.timed:
            return
        if self.fetch_installed and pp._dist_allgather_fn is _fetch:
            pp._dist_allgather_fn = self.original_fetch
            self.fetch_installed = False
        if self.gather_installed and ds_comm.all_gather_into_tensor is _gather:
            ds_comm.all_gather_into_tensor = self.original_gather
            self.gather_installed = False

    def fetching(self) -> list:
        calls = getattr(self.local, "calls", None)
        return calls[-1] if calls else []


_hooks = _Hooks()


class _State:
    """One enabled DeepSpeed engine: its parameters' buckets and the shared runtime."""

    def __init__(self, runtime: Runtime, params: list, group, world: int):
        self.runtime = runtime
        self.params = params                                   # in ds_id order, bucket i = params[i]
        self.bucket_of = {id(p): i for i, p in enumerate(params)}
        self.group = group
        self.world = world
        self.passed_through = 0
        self.wrapped: dict[int, object] = {}                   # id(param) -> its own all_gather_coalesced

    def plan(self, params: list, input_tensor, output_tensor, group) -> list[tuple[int, int]] | None:
        """(bucket, offset in the input) of each parameter a gather of `params` carries, when the
        input is exactly their partitions in that order and the output every rank's of them;
        None for anything else."""
        if group is not None and group is not self.group:
            return None
        if not (input_tensor.is_contiguous() and output_tensor.is_contiguous()):
            return None
        pieces, offset = [], 0
        for p in params:
            b = self.bucket_of.get(id(p))
            if b is None or p.ds_tensor.dtype != input_tensor.dtype:
                return None
            pieces.append((b, offset))
            offset += self.runtime.buckets[b].numel
        if not pieces or offset != input_tensor.numel() or output_tensor.numel() != offset * self.world:
            return None
        return pieces

    def start(self, pieces: list[tuple[int, int]], input_tensor, output_tensor, group, in_flight: bool):
        """Starts one engine gather per parameter; returns the _Gather that finishes them."""
        gather = _Gather(self, pieces, input_tensor, output_tensor, group)
        if in_flight and self.runtime.overlap:
            return gather
        gather.wait()
        return gather


class _Gather:
    """A ZeRO-3 gather in flight: one engine gather per parameter, each straight into its place in
    DeepSpeed's flat output (every rank's slot holds its partitions of all the parameters, so a
    parameter's parts lie one slot apart: the engine's slot stride); wait() finishes them in
    order and records them."""

    def __init__(self, state: _State, pieces, input_tensor, output_tensor, group):
        runtime = state.runtime
        self.state, self.group = state, group
        self.input, self.output = input_tensor, output_tensor
        self.started = time.perf_counter()
        stream = torch.cuda.current_stream(input_tensor.device).cuda_stream if input_tensor.is_cuda else 0
        size = output_tensor.element_size()
        slot = input_tensor.numel() * size          # one rank's slot of the output, in bytes
        shards = [input_tensor.narrow(0, offset, runtime.buckets[b].numel) for b, offset in pieces]

        def start_one(k: int):
            (b, offset), shard = pieces[k], shards[k]
            if runtime.selector is not None:
                runtime.selector.observe(0, b, shard)
            numel = runtime.buckets[b].numel
            return runtime.engine.start(b, shard.data_ptr(), numel * size, output_tensor.data_ptr() + offset * size,
                                        (state.world - 1) * slot + numel * size, stream, slot,
                                        keep=(shard, output_tensor))

        # A gather this rank cannot start: the peers, who start them all, are told at once, and
        # those started are waited for (start_each).
        tickets = start_each([(runtime.engine, b) for b, _ in pieces], start_one)
        self.tickets = [(runtime.buckets[b], offset, shard, ticket)
                        for (b, offset), shard, ticket in zip(pieces, shards, tickets)]
        self.done = False
        self.failure: BaseException | None = None

    def _drain(self, tickets) -> None:
        """Waits for the gathers of `tickets` (this call's), however they end."""
        try:
            wait_each([(self.state.runtime.engine, ticket) for *_, ticket in tickets])
        except Exception:  # noqa: BLE001 - the caller raises the failure that matters
            pass

    def parts(self, offset: int, numel: int):
        """Every rank's part of one parameter in the output: a (ranks, numel) view."""
        return self.output.view(self.state.world, self.input.numel()).narrow(1, offset, numel)

    def wait(self, timeout=None) -> bool:
        """Finishes the fetch; a fetch that failed fails again at every later wait (a caller that
        waits twice must not read outputs that were never filled, or failed verification)."""
        if self.failure is not None:
            raise self.failure
        if self.done:
            return True
        self.done = True   # while _finish runs: a re-entrant wait returns at once, as before
        try:
            self._finish()
        except BaseException as failure:
            self.failure = failure
            self.input = self.output = None   # its traceback holds this fetch: not the buffers too
            raise
        return True

    def _finish(self) -> None:
        runtime = self.state.runtime
        # Each parameter's record holds its share of the call: together they add up to the
        # call's duration and, in flight, to the time DeepSpeed waited for it.
        before, waited = self.started, time.perf_counter()
        for k, (bucket, _, _, ticket) in enumerate(self.tickets):
            try:
                stats = runtime.engine.wait(ticket)
            except Exception:
                self._drain(self.tickets[k + 1:])   # the call's other gathers: none left in flight
                raise
            now = time.perf_counter()
            exposed = now - waited if runtime.overlap else -1.0
            runtime.records.append(GatherRecord(bucket.index, now - before, stats.raw_bytes, stats.wire_bytes,
                                                stats.compressed, stats.resynchronised, exposed, self.started,
                                                stats.encode_s, control_bytes=stats.control_bytes))
            before = waited = now
        if runtime.verify or runtime.on_gather is not None or runtime.on_output is not None:
            # verify and the observers take the gathered parameter contiguous, as torch's
            # all-gather gives it (a copy, made only for them). Every parameter is verified (a
            # collective) before any observer runs: one that raised on one rank would otherwise
            # leave the peers in the next parameter's verification until the group's timeout.
            gathered = [(bucket, shard, self.parts(offset, bucket.numel).reshape(-1))
                        for bucket, offset, shard, _ in self.tickets]
            for _, shard, output in gathered:
                runtime.verified(shard, output, self.group)
            for bucket, shard, output in gathered:
                runtime.observed(bucket, shard, output)
        self.tickets = []
        self.input = self.output = None

    def is_completed(self) -> bool:
        return self.done


def _fetch(input_tensor, output_tensor, group=None):
    """partition_parameters._dist_allgather_fn's replacement: the coordinator's fetches."""
    params = _hooks.fetching()
    timed = _hooks.timed.get(id(params[0])) if params else None
    if timed is not None:
        start = time.perf_counter()
        return _TimedWork(timed, _hooks.original_fetch(input_tensor, output_tensor, group), start, output_tensor)
    state = _hooks.states.get(id(params[0])) if params else None
    if state is not None:
        wanted = [p for p in params if p.ds_tensor.dtype == input_tensor.dtype]
        pieces = state.plan(wanted, input_tensor, output_tensor, group)
        if pieces is not None:
            return state.start(pieces, input_tensor, output_tensor, group, in_flight=True)
        state.passed_through += 1
    return _hooks.original_fetch(input_tensor, output_tensor, group)


def _gather(output_tensor, tensor, group=None, async_op=False, *args, **kwargs):
    """deepspeed.comm.all_gather_into_tensor's replacement: param.all_gather() of a parameter
    whose partition is `tensor` goes through CIERA (finished before it returns); anything else
    goes to DeepSpeed's own function."""
    for timed in set(_hooks.timed.values()):
        if any(p.ds_tensor.data_ptr() == tensor.data_ptr() and p.ds_tensor.numel() == tensor.numel()
               for p in timed.params):
            start = time.perf_counter()
            work = _hooks.original_gather(output_tensor, tensor, group, async_op, *args, **kwargs)
            timed = _TimedWork(timed, work, start, output_tensor)
            if async_op:
                return timed
            timed.wait()
            return None
    for state in set(_hooks.states.values()):
        for p in state.params:
            if p.ds_tensor.data_ptr() == tensor.data_ptr() and p.ds_tensor.numel() == tensor.numel():
                pieces = state.plan([p], tensor, output_tensor, group)
                if pieces is None:
                    state.passed_through += 1
                    break
                gather = state.start(pieces, tensor, output_tensor, group, in_flight=False)
                return gather if async_op else None
    return _hooks.original_gather(output_tensor, tensor, group, async_op, *args, **kwargs)


class _Timed:
    """A plain ZeRO-3 engine whose gathers (DeepSpeed's own) are timed as CIERA's are."""

    def __init__(self, params: list):
        self.params = params
        self.records: list[GatherRecord] = RecordLog()
        self.wrapped: dict[int, object] = {}


class _TimedWork:
    """DeepSpeed's own gather in flight, recorded when DeepSpeed waits for it."""

    def __init__(self, timed: _Timed, work, start: float, output_tensor):
        self.timed, self.work, self.start = timed, work, start
        self.nbytes = output_tensor.numel() * output_tensor.element_size()
        self.done = False

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.done = True
        waited = time.perf_counter()
        if self.work is not None:   # None: a blocking call, already finished
            self.work.wait()
        now = time.perf_counter()
        self.timed.records.append(GatherRecord(-1, now - self.start, self.nbytes, self.nbytes, False, False,
                                               now - waited, self.start))
        self.work = None
        return True

    def is_completed(self) -> bool:
        return self.done


class TimedHandle:
    """What time_gathers() returns: the plain engine's gather records, and disable()."""

    def __init__(self, timed: _Timed):
        self._timed = timed

    def take_records(self) -> list[GatherRecord]:
        records, self._timed.records = self._timed.records, RecordLog()
        return records

    def disable(self) -> None:
        with _hooks.lock:
            _unwrap(self._timed, _hooks.timed)
            _hooks.uninstall()


def time_gathers(engine) -> TimedHandle:
    """Times a plain ZeRO-3 engine's parameter all-gathers (DeepSpeed's own, unchanged) as CIERA's
    are timed, for the baseline of a comparison: each gather's duration, and the time DeepSpeed
    waited for it (GatherRecord.exposed_s)."""
    _version()
    _check_engine(engine)
    params = _zero3_params(engine)
    timed = _Timed(params)
    with _hooks.lock:
        _wrap(timed, params, _hooks.timed)
        _hooks.install()
    return TimedHandle(timed)


def _wrap(owner, params: list, registry: dict) -> None:
    for p in params:
        if id(p) in _hooks.states or id(p) in _hooks.timed:
            raise ValueError("ciera.deepspeed: the engine's gathers already go through CIERA or are timed; call "
                             "disable() on that Handle first")
    for p in params:
        registry[id(p)] = owner
        owner.wrapped[id(p)] = p.all_gather_coalesced
        p.all_gather_coalesced = _naming(p.all_gather_coalesced)


def _unwrap(owner, registry: dict) -> None:
    for p in owner.params:
        if registry.get(id(p)) is owner:
            del registry[id(p)]
        original = owner.wrapped.pop(id(p), None)
        if original is not None:
            p.all_gather_coalesced = original


def _naming(original):
    """param.all_gather_coalesced that names the parameters it fetches for _fetch."""
    def all_gather_coalesced(params, *args, **kwargs):
        params = sorted(params, key=lambda p: p.ds_id)   # the order DeepSpeed lays them out in
        calls = getattr(_hooks.local, "calls", None)
        if calls is None:
            calls = _hooks.local.calls = []
        calls.append(params)
        try:
            return original(params, *args, **kwargs)
        finally:
            calls.pop()

    return all_gather_coalesced


class Handle(api.Handle):
    """What enable() returns: the engine, one bucket per ZeRO-3 parameter, statistics, disable()."""

    def __init__(self, runtime: Runtime, state: _State, hook=None):
        super().__init__(runtime, hook)
        self._state = state

    @property
    def params(self) -> list:
        """The engine's ZeRO-3 parameters, bucket i = params[i]."""
        return self._state.params

    @property
    def passed_through(self) -> int:
        """Gathers of this engine's parameters (those enable() found: Handle.params) that went to
        DeepSpeed's own all-gather (a layout CIERA did not recognise): 0 when every gather of them
        was CIERA's. A parameter added to the model after enable() is DeepSpeed's, not counted."""
        return self._state.passed_through

    def disable(self) -> None:
        """Restores DeepSpeed's own gathers for this engine and closes CIERA's engine; collective."""
        with _hooks.lock:
            _unwrap(self._state, _hooks.states)
            _hooks.uninstall()
        super().disable()


def _version() -> tuple[int, int]:
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError(f"ciera.deepspeed needs DeepSpeed: {_INSTALL_HINT}") from error
    text = deepspeed.__version__
    try:
        major, minor = (int(x) for x in text.split(".")[:2])
    except ValueError:
        raise _ext.ConfigError(f"ciera.deepspeed: cannot read DeepSpeed's version {text!r}") from None
    first, last = SUPPORTED_VERSIONS
    if not first <= (major, minor) <= last:
        raise _ext.ConfigError(
            f"ciera.deepspeed: DeepSpeed {text} is not supported; CIERA hooks ZeRO-3's gathers of DeepSpeed "
            f"{first[0]}.{first[1]} to {last[0]}.{last[1]} (partition_parameters._dist_allgather_fn)")
    return major, minor


def _check_engine(engine) -> None:
    """ConfigError naming the first setting of `engine` CIERA does not serve."""
    if not hasattr(engine, "zero_optimization_stage") or not hasattr(engine, "module"):
        raise TypeError(f"ciera.deepspeed.enable(): engine must be a DeepSpeedEngine (deepspeed.initialize's "
                        f"first result), got {type(engine).__name__}")
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise _ext.ConfigError(f"ciera.deepspeed.enable(): the engine runs ZeRO stage {stage}; CIERA compresses "
                               "ZeRO-3's parameter all-gathers (zero_optimization.stage = 3)")
    zero = engine._config.zero_config
    refused = [
        ("zero_quantized_weights", bool(getattr(zero, "zero_quantized_weights", False)),
         "ZeRO++'s int8 weights replace the gather CIERA compresses (and are lossy)"),
        ("zero_quantized_nontrainable_weights", bool(getattr(zero, "zero_quantized_nontrainable_weights", False)),
         "ZeRO++'s int8 weights replace the gather CIERA compresses (and are lossy)"),
        ("zero_hpz_partition_size", (getattr(zero, "zero_hpz_partition_size", 1) or 1) > 1,
         "hierarchical partitions gather on a second group CIERA does not serve yet"),
        ("stage3_use_all_reduce_for_fetch_params", bool(getattr(zero, "use_all_reduce_for_fetch_params", False)),
         "parameters are then fetched by all-reduce, not all-gather"),
        ("mics_shard_size", (getattr(engine._config, "mics_shard_size", -1) or -1) > 0,
         "MiCS gathers through its own coalesced collectives"),
        ("stage3_allgather_sequential", bool(getattr(zero, "allgather_sequential", False)),
         "parameters are then gathered one at a time, outside the coalesced fetch CIERA serves"),
        ("offload_param", getattr(zero, "offload_param", None) is not None
         and str(getattr(zero.offload_param, "device", "none")).split(".")[-1].lower() != "none",
         "offloaded partitions are gathered from host or NVMe copies"),
    ]
    for name, given, why in refused:
        if given:
            raise _ext.ConfigError(f"ciera.deepspeed.enable(): {name} is set; {why}")


# The ZeRO-3 settings that decide which parameters are gathered, and when: ranks that differ in
# them (a persistence threshold, say) make different gathers for the same calls, which the
# engines would pair up until one waits out its timeout.
_SCHEDULE = ("param_persistence_threshold", "model_persistence_threshold", "prefetch_bucket_size",
             "max_live_parameters", "max_reuse_distance")


def _schedule_settings(engine) -> dict:
    """The engine's _SCHEDULE settings by their names in DeepSpeed's config (none for what is not
    a DeepSpeedEngine: _check_engine refuses it)."""
    zero = getattr(getattr(engine, "_config", None), "zero_config", None)
    return {f"zero_optimization.stage3_{name}": getattr(zero, name, None) for name in _SCHEDULE}


def _parameters(engine) -> list:
    """parameter_shapes() for a ZeRO-3 module: each parameter's name, full shape (ds_shape), dtype
    and whether it is persistent (never gathered), as every rank must have them alike."""
    return [(name, tuple(getattr(p, "ds_shape", p.shape)), str(p.dtype).removeprefix("torch."),
             "persistent" if getattr(p, "ds_persist", False) else "partitioned")
            for name, p in engine.module.named_parameters()]


def _zero3_params(engine) -> list:
    params = [p for p in engine.module.parameters() if hasattr(p, "ds_id") and hasattr(p, "ds_tensor")]
    if not params:
        raise _ext.ConfigError("ciera.deepspeed.enable(): the engine's module has no ZeRO-3 parameters")
    return sorted(params, key=lambda p: p.ds_id)


def _buckets(engine, params: list) -> list[Bucket]:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    buckets = []
    for i, p in enumerate(params):
        name = names.get(id(p), f"<ds_id {p.ds_id}>")
        dtype = p.ds_tensor.dtype
        if dtype not in DTYPES:
            raise TypeError(f"CIERA carries bf16, fp16 and fp32 parameters; {name} is {dtype}")
        n = int(p.ds_tensor.ds_numel)
        buckets.append(Bucket(i, name, dtype, [ParamSlice(name, n, 0, int(p.ds_numel))], n))
    return buckets


def _group(params: list, what: str = "enable"):
    """The one data-parallel group the parameters are partitioned over, which must be the world:
    make_transport forms CIERA's group from this rank's list of ranks, and ranks in different
    groups would form theirs from different lists."""
    groups = {id(p.ds_process_group): p.ds_process_group for p in params}
    if len(groups) != 1:
        raise _ext.ConfigError(f"ciera.deepspeed.{what}(): the parameters are partitioned over {len(groups)} "
                               "process groups (expert parallelism?); CIERA serves one data-parallel group")
    group = groups.popitem()[1]
    if dist.get_world_size(group) != dist.get_world_size():
        raise _ext.ConfigError(f"ciera.deepspeed.{what}(): the data-parallel group holds {dist.get_world_size(group)} "
                               f"of the {dist.get_world_size()} ranks (tensor or pipeline parallelism); CIERA serves "
                               "a data-parallel group that is the world")
    return group


def _described(engine, selecting: bool, cost_model):
    """The engine's ZeRO-3 parameters, their data-parallel group, the device of their partitions
    and a bucket for each, or the error enable() raises for them on this rank."""
    params = _zero3_params(engine)
    if any(id(p) in _hooks.states or id(p) in _hooks.timed for p in params):
        raise ValueError("ciera.deepspeed.enable(): the engine's gathers already go through CIERA or are timed; "
                         "call disable() on that Handle first")
    group = _group(params)
    device = params[0].ds_tensor.device
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if selecting and cost_model is None:
            raise ValueError("ciera.deepspeed.enable(): on CUDA the selector needs cost_model=")
    return params, group, device, _buckets(engine, params)


def enable(engine, config: _ext.EngineConfig | None = None, *, transport: str = "torch", verify: bool = False,
           policy=None, cache_budget_bytes: int | None = None, select_after_steps: int | None = None,
           reselect_every: int = 0, overlap: bool = True, cost_model=None, allow_delta: bool = False) -> Handle:
    """Routes every ZeRO-3 parameter all-gather of a DeepSpeed engine through CIERA.

    `engine` is what deepspeed.initialize returned, with ZeRO stage 3. Collective: every rank
    calls it with the same model and options (checked: a difference in an option or in the
    engine's configuration raises ConfigError on every rank). The options are enable()'s for
    FSDP2 (ciera.fsdp.enable): the engine configuration, transport ("torch": a dedicated group
    beside DeepSpeed's data-parallel group; "mpi"; "nccl"), `verify` (every gather also done by
    torch.distributed and compared byte for byte, a difference an error on every rank), a per-parameter
    `policy(bucket, param)` or a cache budget for the benefit-driven selector (training steps
    counted by a forward pre-hook on the engine's module: with gradient accumulation, each
    micro-batch's forward counts as a step), and `overlap` (gathers handed back to
    DeepSpeed in flight, so its prefetching overlaps them with compute). Each bucket is one ZeRO-3
    parameter (Handle.params).

    A setting CIERA does not serve raises ConfigError naming it, before anything is set up, on
    every rank (naming the rank where it arose)."""
    selecting = cache_budget_bytes is not None
    # Every local step first, on every rank, before any collective: a check or `policy` (the
    # user's callable) that fails on one rank, or options that differ, fail every rank.
    def prepare():
        _version()
        _check_engine(engine)
        api._check_arguments(engine.module, config, transport, policy, cache_budget_bytes, select_after_steps,
                             reselect_every, cost_model, allow_delta, verify, overlap)
        params, group, device, buckets = _described(engine, selecting, cost_model)
        world = dist.get_world_size(group)
        given = (api.given_cost_model(cost_model, world, tuple(dist.get_process_group_ranks(group)),
                                      "ciera.deepspeed.enable()")
                 if selecting and cost_model is not None else None)
        return params, group, device, buckets, api._layouts(buckets, world, selecting, policy), given

    params, group, device, buckets, layouts, cost_model = checked_on_every_rank(
        "ciera.deepspeed.enable()", prepare,
        same={**api.shared_options(transport, verify, cache_budget_bytes, select_after_steps, reselect_every, overlap,
                                   cost_model, allow_delta), **_schedule_settings(engine)},
        parameters=lambda: _parameters(engine))
    config = config or _ext.EngineConfig()
    world = dist.get_world_size(group)
    # Each set-up stage agreed on every rank (as ciera.fsdp.enable()'s): one that failed on one
    # rank alone is an error on every rank, not its peers' wait in the next stage until the timeout.
    def failed(rank: int) -> str:
        return f"ciera.deepspeed.enable(): rank {rank} could not set up CIERA"

    def close(made) -> None:   # this rank's engine, where it made one and another rank did not
        if made is not None:
            lifecycle.close_engine(made)

    with contextlib.ExitStack() as undo:
        # The process group made for transport "torch", released on every rank if a later stage
        # fails on any (3 threads and 5 descriptors, kept to exit otherwise).
        made_groups = []
        undo.callback(lifecycle.release_groups, made_groups)
        native = set_up_on_every_rank(
            lambda: make_transport(transport, group, config.timeout_s, device, made=made_groups), group, failed)
        if selecting and cost_model is None:
            cost_model = set_up_on_every_rank(lambda: api.measured_cost_model(native, buckets, world, config),
                                              group, failed)
        gathers = set_up_on_every_rank(lambda: api.make_engine(native, config, layouts, device), group, failed,
                                       close)
        undo.pop_all()   # set up on every rank: the handle's disable() closes the engine, the group stays to exit
    runtime = Runtime(gathers, buckets, [], verify, overlap=overlap)
    state = _State(runtime, params, group, world)
    hook = (api.install_selector(runtime, cost_model, config, engine.module, group, cache_budget_bytes,
                                 select_after_steps, reselect_every, overlap, allow_delta) if selecting else None)
    with _hooks.lock:
        _wrap(state, params, _hooks.states)
        _hooks.install()
    return Handle(runtime, state, hook)



# --- Gradient reduce-scatter (issue 20's lossless collectives under ZeRO-3) ------------------------
#
# ZeRO-3 reduces each bucket of gradients in DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads:
# reduce_scatter_coalesced (deepspeed.runtime.comm.coalesced_collectives) lays every rank's
# partition of every gradient out in one flat buffer, divides it by the world size, and calls
# that module's _torch_reduce_scatter_fn(input, output, group) with output = this rank's part of
# the input (a view of it). That function is replaced (a module attribute DeepSpeed looks up at
# call time) by one that runs CIERA's lossless reduce-scatter (a rank-order sum) for an optimizer
# enable_reduce_scatter() wrapped: the wrapper of its __avg_scatter_grads names the handle
# thread-locally for the call's duration. Everything else DeepSpeed does around it (the layout,
# the pre-division, the partitions it hands the optimizer) is its own.


class _ReduceScatterHooks:
    """DeepSpeed's reduce-scatter function, replaced while any optimizer's reduction goes through
    CIERA."""

    def __init__(self):
        self.lock = threading.Lock()
        self.local = threading.local()   # .active: the handle of the reduction running on this thread
        self.handles: dict[int, "_OptimizerHook"] = {}   # id(optimizer) -> its handle
        self.original = None
        self.installed = False   # _reduce_scatter_fn is in DeepSpeed's call chain

    def install(self) -> None:
        """As _Hooks.install: ours in place of DeepSpeed's function unless it is in the chain."""
        from deepspeed.runtime.comm import coalesced_collectives as cc

        if not self.installed:
            self.original, cc._torch_reduce_scatter_fn = cc._torch_reduce_scatter_fn, _reduce_scatter_fn
            self.installed = True

    def uninstall(self) -> None:
        """Puts DeepSpeed's function back once no handle is left, unless someone wrapped ours
        since (ours then stays under the wrapper, passing every call through). `original` stays:
        a call already past the dispatch on another thread still uses it."""
        from deepspeed.runtime.comm import coalesced_collectives as cc

        if self.installed and not self.handles and cc._torch_reduce_scatter_fn is _reduce_scatter_fn:
            cc._torch_reduce_scatter_fn = self.original
            self.installed = False


_rs_hooks = _ReduceScatterHooks()
_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"   # the optimizer's private method


def _reduce_scatter_fn(input_tensor, output_tensor, group=None, async_op=False, prof=False):
    handle = getattr(_rs_hooks.local, "active", None)
    if handle is not None:
        if handle.serves(input_tensor, output_tensor, group):
            return handle.reduce_scatter(input_tensor, output_tensor, group)
        # Raises on every rank where the ranks did not all decide alike (serves() reads this
        # rank's tensors alone): one rank in DeepSpeed's reduce-scatter and the others in CIERA's
        # would each wait for the other until their timeouts.
        handle.pass_through(input_tensor, output_tensor, group)
    return _rs_hooks.original(input_tensor, output_tensor, group=group, async_op=async_op, prof=prof)


def _stage3_optimizer(engine, what: str):
    """The engine's ZeRO-3 optimizer, or ConfigError."""
    optimizer = getattr(engine, "optimizer", None)
    if not callable(getattr(optimizer, _AVG_SCATTER, None)):
        raise _ext.ConfigError(f"ciera.deepspeed.{what}(): the engine's optimizer ({type(optimizer).__name__}) "
                               "is not ZeRO-3's DeepSpeedZeroOptimizer_Stage3")
    return optimizer


class _OptimizerHook:
    """One ZeRO-3 optimizer whose reductions _reduce_scatter_fn serves: its __avg_scatter_grads
    wrapped to name this hook for the call's duration; disable() undoes it (local; calling it
    again does nothing)."""

    def __init__(self, engine, what: str):
        optimizer = _stage3_optimizer(engine, what)
        self.records: list = RecordLog()   # the latest calls' (RecordLog.LIMIT)
        self.calls = 0                     # every call's, for the records' indices
        self.passed_through = 0   # reductions of this engine left to DeepSpeed (a layout CIERA did not serve)
        self._optimizer = optimizer
        self._on = False
        with _rs_hooks.lock:
            if id(optimizer) in _rs_hooks.handles:
                raise ValueError(f"ciera.deepspeed.{what}(): the engine's reduce-scatters already go through "
                                 "CIERA or are timed; call disable() on that handle first")
            original = getattr(optimizer, _AVG_SCATTER)

            def avg_scatter_grads(*args, **kwargs):
                previous = getattr(_rs_hooks.local, "active", None)
                _rs_hooks.local.active = self
                try:
                    return original(*args, **kwargs)
                finally:
                    _rs_hooks.local.active = previous

            setattr(optimizer, _AVG_SCATTER, avg_scatter_grads)   # the instance's, before the class's method
            _rs_hooks.handles[id(optimizer)] = self
            _rs_hooks.install()
            self._on = True

    def pass_through(self, input_tensor, output_tensor, group) -> None:
        """A reduction serves() left to DeepSpeed's own reduce-scatter: counted."""
        self.passed_through += 1

    @property
    def enabled(self) -> bool:
        return self._on

    def disable(self) -> None:
        if not self._on:
            return
        with _rs_hooks.lock:
            del _rs_hooks.handles[id(self._optimizer)]
            if _AVG_SCATTER in vars(self._optimizer):
                delattr(self._optimizer, _AVG_SCATTER)
            _rs_hooks.uninstall()
        self._on = False


class TimedReduceScatters(_OptimizerHook):
    """time_reduce_scatters(): DeepSpeed's own reduce-scatters of one engine, timed
    (ciera.fsdp.ReduceScatterRecord each)."""

    def __init__(self, engine):
        super().__init__(engine, "time_reduce_scatters")

    def serves(self, input_tensor, output_tensor, group) -> bool:
        return True

    def reduce_scatter(self, input_tensor, output_tensor, group):
        from ciera.fsdp.baseline import ReduceScatterRecord

        start = time.perf_counter()
        work = _rs_hooks.original(input_tensor, output_tensor, group=group)
        self.calls += 1
        self.records.append(ReduceScatterRecord(self.calls - 1, start, time.perf_counter() - start,
                                                input_tensor.numel() * input_tensor.element_size()))
        return work


def time_reduce_scatters(engine) -> TimedReduceScatters:
    """Times a ZeRO-3 engine's gradient reduce-scatters, DeepSpeed's own (the baseline of `ciera
    train --framework deepspeed --reduce-scatter`); disable() stops."""
    _version()
    return TimedReduceScatters(engine)


class ReduceScatterHandle(_OptimizerHook):
    """What enable_reduce_scatter() set up for one engine: the collectives on its data-parallel
    group, the records of every call (ciera.fsdp.LosslessReduceScatterRecord), disable()."""

    def __init__(self, engine, collectives, coding: str, group, world: int):
        self.collectives = collectives
        self.coding = coding
        self._group = group
        self._world = world
        super().__init__(engine, "enable_reduce_scatter")

    def serves(self, input_tensor, output_tensor, group) -> bool:
        return self.unserved(input_tensor, output_tensor, group) is None

    def unserved(self, input_tensor, output_tensor, group) -> str | None:
        """Why CIERA's reduce-scatter does not take this call on this rank, in words; None if it does."""
        if group is not self._group:
            return "another process group than the engine's data-parallel group"
        if input_tensor.dtype not in DTYPES or output_tensor.dtype != input_tensor.dtype:
            return (f"dtype {input_tensor.dtype} -> {output_tensor.dtype} (CIERA's takes bfloat16, float16 or "
                    "float32, the same for the output)")
        if input_tensor.device.type != "cpu" or output_tensor.device.type != "cpu":
            return f"device {input_tensor.device} -> {output_tensor.device} (CIERA's runs on the CPU)"
        if not (input_tensor.is_contiguous() and output_tensor.is_contiguous()):
            return f"a non-contiguous {'input' if not input_tensor.is_contiguous() else 'output'}"
        if input_tensor.numel() != output_tensor.numel() * self._world:
            return (f"an input of {input_tensor.numel()} values for an output of {output_tensor.numel()} on "
                    f"{self._world} ranks")
        return None

    def pass_through(self, input_tensor, output_tensor, group) -> None:
        """Leaves this call to DeepSpeed's reduce-scatter where every rank does (then counted):
        else a ConfigError on every rank, naming the ranks that served it and those that passed
        it through, and why. Agreed on the collectives' own transport (its record exchange: one
        small allgather, on pass-through calls only), so a call every rank serves costs nothing
        more; a call on a group smaller than the world is not CIERA's ranks' to agree on (its
        members alone run it), and goes through as it is."""
        # The engine's group is the world (_group refuses any other), so a group of its size has
        # every rank as a member: each of them makes this call and takes part in the agreement.
        if dist.get_world_size(group) == self._world:
            why = self.unserved(input_tensor, output_tensor, group) or "serves() declined it"
            self.collectives.pass_through_reduce_scatter(
                f"{why} (left to DeepSpeed's reduce-scatter)")
        self.passed_through += 1

    def reduce_scatter(self, input_tensor, output_tensor, group) -> None:
        from ciera.fsdp.reduce_scatter import LosslessReduceScatterRecord

        start = time.perf_counter()
        # DeepSpeed's output is this rank's part of the input: the sum goes to a buffer of its own
        # first, so that no value the collective still reads is overwritten.
        result = torch.empty_like(output_tensor)
        stats = self.collectives.reduce_scatter(DTYPES[input_tensor.dtype], _ext.ReduceOp.sum, input_tensor, result)
        output_tensor.copy_(result)
        self.calls += 1
        self.records.append(LosslessReduceScatterRecord.of_call(self.calls - 1, start, input_tensor, stats))
        return None

    def disable(self) -> None:
        """Restores DeepSpeed's own reduce-scatter for this engine and lets the collectives go;
        local (every rank calls it between steps). The records stay; calling it again does nothing."""
        super().disable()
        self.collectives = None


def _reduce_scatter_checked(engine, coding: str, transport: str, timeout_s: float, worker_niceness: int | None):
    """The collectives' configuration and the engine's data-parallel group, or the error
    enable_reduce_scatter() raises for them on this rank."""
    _version()
    check_transport("ciera.deepspeed.enable_reduce_scatter()", transport)
    if not hasattr(engine, "zero_optimization_stage") or not hasattr(engine, "optimizer"):
        raise TypeError(f"ciera.deepspeed.enable_reduce_scatter(): engine must be a DeepSpeedEngine, got "
                        f"{type(engine).__name__}")
    from ciera.fsdp.reduce_scatter import collectives_config

    config = collectives_config("ciera.deepspeed.enable_reduce_scatter()", coding, timeout_s, worker_niceness)
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise _ext.ConfigError(f"ciera.deepspeed.enable_reduce_scatter(): the engine runs ZeRO stage {stage}; CIERA "
                               "serves ZeRO-3's gradient reduce-scatter (zero_optimization.stage = 3)")
    zero = engine._config.zero_config
    if getattr(zero, "zero_quantized_gradients", False):
        raise _ext.ConfigError("ciera.deepspeed.enable_reduce_scatter(): zero_quantized_gradients is set; ZeRO++'s "
                               "quantised all-to-all replaces the reduce-scatter (and is lossy)")
    if not getattr(zero, "reduce_scatter", True):
        raise _ext.ConfigError("ciera.deepspeed.enable_reduce_scatter(): zero_optimization.reduce_scatter is off; "
                               "DeepSpeed then all-reduces the gradients")
    if id(_stage3_optimizer(engine, "enable_reduce_scatter")) in _rs_hooks.handles:   # before any group is made
        raise ValueError("ciera.deepspeed.enable_reduce_scatter(): the engine's reduce-scatters already go through "
                         "CIERA or are timed; call disable() on that handle first")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != "cpu":   # the gradients are reduced there, wherever the partitions are kept
        raise _ext.ConfigError(f"ciera.deepspeed.enable_reduce_scatter(): CIERA's reduce-scatter runs on host "
                               f"memory; DeepSpeed's accelerator is {accelerator!r}")
    params = _zero3_params(engine)
    group = _group(params, "enable_reduce_scatter")
    return config, group


def enable_reduce_scatter(engine, coding: str = "exponent", *, transport: str = "torch", timeout_s: float = 120.0,
                          worker_niceness: int | None = None) -> ReduceScatterHandle:
    """Routes a ZeRO-3 engine's gradient reduce-scatters through CIERA's lossless reduce-scatter:
    each rank's part for a peer exponent-coded where that is smaller ("exponent"), or sent as it
    is ("raw": the uncompressed twin, the same reduction), or whichever the ranks measure faster
    ("auto"); the parts summed in rank order (docs/format.md, "Reduction order"), so a coded run
    is bitwise its twin. DeepSpeed's own reduce-scatter sums in gloo's or NCCL's order: results
    differ from it in the last bits. `transport`: "torch" (a gloo group of its own beside the
    data-parallel group) or "mpi". Host memory (DeepSpeed's CPU accelerator) only.

    Collective: every rank calls it with the same engine and coding. Refused, with ConfigError
    naming the setting: a stage other than 3, ZeRO++'s quantised gradients (their all-to-all
    replaces the reduce-scatter, and is lossy), reduce_scatter off (DeepSpeed then all-reduces),
    an accelerator other than the CPU, parameters in more than one data-parallel group or in one
    smaller than the world; enabling an engine twice is a ValueError. A refusal on any rank is
    raised on every rank, naming the rank, and so is a `transport` or `coding` that differs between ranks.
    It can be combined with enable() (the parameter gathers), or used alone."""
    # Every check first, on every rank (a rank that refused alone would leave the others waiting
    # in the transport's set-up until its timeout), with the transport the ranks chose.
    config, group = checked_on_every_rank(
        "ciera.deepspeed.enable_reduce_scatter()",
        lambda: _reduce_scatter_checked(engine, coding, transport, timeout_s, worker_niceness),
        same={"transport": transport, "coding": coding}, parameters=lambda: _parameters(engine))
    native = make_transport(transport, group, timeout_s)
    return ReduceScatterHandle(engine, _ext.LosslessCollectives(native, config), coding, group,
                               dist.get_world_size(group))
