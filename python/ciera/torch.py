"""CIERA for PyTorch FSDP2: one call routes every ``fully_shard`` parameter group's all-gather
through the CIERA engine, and the training stays bitwise identical.

    model = ...                              # fully_shard(...) applied, FSDP2
    handle = ciera.torch.enable(model)       # collective: call on every rank
    ...train...
    handle.disable()                         # back to FSDP2's own all-gather

FSDP2 lets a custom all-gather (``FSDPModule.set_custom_all_gather``) fill its flat output
buffer; CIERA does so with exactly the bytes an uncompressed all-gather would produce. Each FSDP
parameter group becomes one engine bucket whose shards are the group's parameters (FSDP pads each
parameter's shard to the same size on every rank), so policies and statistics are per parameter.

Tensors cross into C++ as data pointers; this module never needs a compiled torch extension.
"""

from __future__ import annotations

import atexit
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from ciera import _ext

_DEBUG_TIMING = bool(__import__("os").environ.get("CIERA_DEBUG_TIMING"))
_DTYPES = {torch.bfloat16: _ext.DType.bf16, torch.float16: _ext.DType.fp16, torch.float32: _ext.DType.fp32}


# ---- Transports --------------------------------------------------------------------------------

def _as_tensor(view: memoryview) -> torch.Tensor:
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only inputs: torch warns, and we never write them
        return torch.frombuffer(view, dtype=torch.uint8)


class TorchTransport:
    """CIERA's collectives on a torch.distributed process group (gloo on CPU).

    Gloo has no allgatherv: the variable-size exchange pads every rank's payload to the largest
    (one collective instead of one broadcast per rank; CIERA payloads of one bucket differ by well
    under 1% across ranks, so the padding costs little)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def allgather(self, inp: memoryview, out: memoryview) -> None:
        dist.all_gather_into_tensor(_as_tensor(out), _as_tensor(inp), group=self.group)

    def allgatherv(self, inp: memoryview, out: memoryview, counts, displs) -> None:
        largest = max(counts)
        if largest == 0:
            return
        send = torch.zeros(largest, dtype=torch.uint8)
        send[: counts[self.rank]] = _as_tensor(inp)
        recv = torch.empty(largest * self.size, dtype=torch.uint8)
        dist.all_gather_into_tensor(recv, send, group=self.group)
        target = _as_tensor(out)
        for r in range(self.size):
            target[displs[r] : displs[r] + counts[r]] = recv[r * largest : r * largest + counts[r]]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def make(self):
        return _ext.python_transport(self.rank, self.size, self.allgather, self.allgatherv, self.barrier, "torch-gloo")


# ---- Layout: which bytes of FSDP's flat buffer belong to which parameter -----------------------

@dataclass
class ParamSlice:
    name: str
    numel: int    # padded shard values, the same on every rank
    offset: int   # first value of this parameter in a rank's shard of the bucket
    full_numel: int = 0  # values of the whole (unsharded, unpadded) parameter


@dataclass
class Bucket:
    index: int
    module_name: str
    dtype: torch.dtype
    params: list[ParamSlice]
    numel: int    # values per rank

    def param_range(self, rank: int, k: int) -> tuple[int, int]:
        """[first, end) value offsets of parameter k's shard of `rank` in the gathered buffer."""
        start = rank * self.numel + self.params[k].offset
        return start, start + self.params[k].numel


def _fsdp_param_group(module: FSDPModule):
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise _ext.ConfigError(f"{type(module).__name__}: CIERA needs one FSDP parameter group per module")
    return groups[0] if groups else None


def describe_buckets(model: torch.nn.Module) -> list[tuple[FSDPModule, Bucket]]:
    """One bucket per FSDP parameter group, in module order (the same on every rank)."""
    names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n for n, m in model.named_modules()}
    out = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = _fsdp_param_group(module)
        if group is None or not group.fsdp_params:
            continue
        dtypes = set()
        params, offset = [], 0
        mp = group.mp_policy
        for fp in group.fsdp_params:
            # What FSDP all-gathers: the mixed-precision param dtype for floating-point parameters
            # (FSDP sets param_dtype only at its lazy init, after enable() typically runs).
            orig = fp.sharded_param.dtype
            dtype = mp.param_dtype if (mp.param_dtype is not None and orig.is_floating_point) else orig
            dtypes.add(dtype)
            name = names.get(id(fp.sharded_param), f"{module_names.get(id(module), '?')}.<param>")
            if dtype not in _DTYPES:
                raise TypeError(f"CIERA carries bf16, fp16 and fp32 parameters; {name} is {dtype}")
            numel = fp.padded_sharded_param_size.numel()
            params.append(ParamSlice(name, numel, offset, fp.sharded_param.numel()))
            offset += numel
        if len(dtypes) != 1:
            raise TypeError(f"{module_names.get(id(module))}: parameters of one FSDP group must share a "
                            f"dtype for CIERA, found {sorted(map(str, dtypes))}")
        out.append((module, Bucket(len(out), module_names.get(id(module), ""), dtypes.pop(), params, offset)))
    return out


# ---- The custom all-gather -----------------------------------------------------------------

@dataclass
class GatherRecord:
    bucket: int
    seconds: float
    raw_bytes: int
    wire_bytes: int
    compressed: bool
    resynchronised: bool
    exposed_s: float = -1.0   # time the caller waited for it (overlapped gathers); -1: all of it
    started: float = 0.0      # time.perf_counter() when FSDP asked for it
    encode_s: float = 0.0     # change detection + encoding on this rank (the engine's encode_s)


@dataclass
class Runtime:
    engine: object
    buckets: list[Bucket]
    modules: list[FSDPModule]
    verify: bool
    records: list[GatherRecord] = field(default_factory=list)
    wrong_bytes: int = 0
    verified_bytes: int = 0
    on_gather: object = None   # optional callback(bucket index, this rank's input) for statistics
    on_output: object = None   # optional callback(Bucket, gathered output) for statistics
    selector: "Selector | None" = None
    overlap: bool = False      # return gathers in flight to FSDP (CCP) instead of finishing them

    def take_records(self) -> list[GatherRecord]:
        records, self.records = self.records, []
        return records


class CieraAllGather(AllGather):
    """FSDP2 custom all-gather that fills FSDP's output with the CIERA engine's result."""

    def __init__(self, runtime: Runtime, bucket: Bucket):
        self.runtime = runtime
        self.bucket = bucket

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        b = self.bucket
        if input_tensor.dtype != b.dtype or input_tensor.numel() != b.numel:
            raise _ext.ConfigError(
                f"FSDP all-gather input for {b.module_name or 'root'} is {input_tensor.numel()} x "
                f"{input_tensor.dtype}, but CIERA registered {b.numel} x {b.dtype}")
        if not (output_tensor.is_contiguous() and input_tensor.is_contiguous()):
            raise _ext.ConfigError("CIERA needs contiguous all-gather buffers")
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if self.runtime.selector is not None:
            self.runtime.selector.tracker(b.index, input_tensor)
        start = time.perf_counter()
        ticket = self.runtime.engine.start(b.index, input_tensor.data_ptr(), nbytes, output_tensor.data_ptr(),
                                           output_tensor.numel() * output_tensor.element_size())
        work = _GatherWork(self, ticket, start, output_tensor, input_tensor, group)
        if self.runtime.overlap:
            return work  # FSDP waits on it right before the module runs (CCP, paper §3.3)
        work.wait()
        return None


class _GatherWork(dist.distributed_c10d.Work):
    """A CIERA gather in flight: encoding, exchange and decoding run on the engine's threads while
    FSDP2 goes on (prefetching gathers overlap the previous module's compute); FSDP waits on this
    before it reads the output. Waiting twice is harmless."""

    def __init__(self, gather: "CieraAllGather", ticket, start: float, output_tensor, input_tensor, group):
        super().__init__()
        self.gather, self.ticket, self.start = gather, ticket, start
        self.output_tensor, self.input_tensor, self.group = output_tensor, input_tensor, group
        self.done = False

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.done = True
        runtime, b = self.gather.runtime, self.gather.bucket
        waited = time.perf_counter()
        stats = runtime.engine.wait(self.ticket)
        now = time.perf_counter()
        if _DEBUG_TIMING and dist.get_rank() == 0:
            print(f"ciera gather bucket {b.index}: {(now - self.start)*1e3:.1f} ms (waited {(now - waited)*1e3:.1f})"
                  f" = encode {stats.encode_s*1e3:.1f} exchange {stats.exchange_s*1e3:.1f} decode "
                  f"{stats.decode_s*1e3:.1f} wire {stats.wire_bytes} raw {stats.raw_bytes} "
                  f"compressed {stats.compressed}", flush=True)
        # A gather finished before FSDP got it back is exposed in full (-1), start() included.
        exposed = now - waited if runtime.overlap else -1.0
        runtime.records.append(GatherRecord(b.index, now - self.start, stats.raw_bytes, stats.wire_bytes,
                                            stats.compressed, stats.resynchronised, exposed, self.start,
                                            stats.encode_s))
        output_tensor, input_tensor = self.output_tensor, self.input_tensor
        self.output_tensor = self.input_tensor = None
        if runtime.verify:
            reference = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(reference, input_tensor, group=self.group)
            runtime.wrong_bytes += int((reference.view(torch.uint8) != output_tensor.view(torch.uint8)).sum())
            runtime.verified_bytes += reference.numel() * reference.element_size()
        if runtime.on_gather is not None:
            runtime.on_gather(b.index, input_tensor)
        if runtime.on_output is not None:
            runtime.on_output(b, output_tensor)
        return True


class TimedAllGather(DefaultAllGather):
    """FSDP2's own all-gather (torch.distributed), timed the same way, for the baseline. With
    `overlap` it is left in flight like CIERA's, so both sides get the same chance to overlap."""

    def __init__(self, records: list, index: int, observer=None, overlap: bool = False):
        self.records = records
        self.index = index
        self.observer = observer
        self.overlap = overlap

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        start = time.perf_counter()
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=self.overlap)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        if self.observer is not None:
            self.observer(self.index, input_tensor)
        if not self.overlap:
            elapsed = time.perf_counter() - start
            self.records.append(GatherRecord(self.index, elapsed, nbytes, nbytes, False, False, elapsed, start))
            return None
        return _TimedWork(work, self.records, GatherRecord(self.index, 0.0, nbytes, nbytes, False, False,
                                                           started=start), start)


class _TimedWork(dist.distributed_c10d.Work):
    def __init__(self, work, records: list, record: GatherRecord, start: float):
        super().__init__()
        self.work, self.records, self.record, self.start = work, records, record, start

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            waited = time.perf_counter()
            self.work.wait()
            now = time.perf_counter()
            self.record.seconds, self.record.exposed_s = now - self.start, now - waited
            self.records.append(self.record)
            self.work = None
        return True


@dataclass
class ReduceScatterRecord:
    bucket: int
    started: float
    seconds: float
    input_bytes: int


class TimedReduceScatter(ReduceScatter):
    """FSDP2's own reduce-scatter of gradients, timed (for the allgather share of communication
    time, the paper's O1, and for traces). The same call FSDP2 makes, so results are unchanged."""

    def __init__(self, records: list, index: int):
        self.records = records
        self.index = index

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        start = time.perf_counter()
        dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op)
        self.records.append(ReduceScatterRecord(self.index, start, time.perf_counter() - start,
                                                input_tensor.numel() * input_tensor.element_size()))
        return None


def time_reduce_scatters(model: torch.nn.Module) -> list:
    """Times FSDP2's gradient reduce-scatters; returns the list records accumulate in."""
    records: list = []
    for module, bucket in describe_buckets(model):
        module.set_custom_reduce_scatter(TimedReduceScatter(records, bucket.index))
    return records


def prefetch_forward(model: torch.nn.Module) -> None:
    """Makes each FSDP module start the next one's all-gather before it runs (FSDP2 prefetches
    backward gathers itself, forward ones only when told), so an in-flight gather overlaps compute."""
    modules = [m for m, _ in describe_buckets(model)]
    for current, following in zip(modules, modules[1:]):
        current.set_modules_to_forward_prefetch([following])


def time_plain_all_gathers(model: torch.nn.Module, observer=None, overlap: bool = False) -> list:
    """Times FSDP2's own all-gathers (the baseline); returns the list records accumulate in."""
    records: list = []
    for module, bucket in describe_buckets(model):
        module.set_custom_all_gather(TimedAllGather(records, bucket.index, observer, overlap))
    if overlap:
        prefetch_forward(model)
    return records


class ExponentTracker:
    """Counts how often the exponents of this rank's shards change from step to step (the paper's
    Fig. 2 and the q_i of §3.2): the first gather of each FSDP group in a step is compared with
    the same group's input a step earlier, by a C++ ChangeMonitor (one byte of memory per local
    value). With `buckets`, counts are per parameter and blocks are cut as the codec cuts them;
    without, each group's shard counts as one. Meant to run in every compared training alike."""

    def __init__(self, buckets: list[Bucket] | None = None, block_values: int = 512):
        self.layouts = {b.index: [p.numel for p in b.params] for b in buckets or []}
        self.block_values = block_values
        self.monitors: dict[int, object] = {}
        self.seen: set[int] = set()
        self.changed = 0   # values whose exponent changed, this step
        self.total = 0     # values compared, this step

    def new_step(self) -> None:
        self.seen.clear()
        self.changed = 0
        self.total = 0

    def __call__(self, bucket: int, shard: torch.Tensor) -> None:
        self.observe(bucket, shard.dtype, shard.data_ptr(), shard.numel())

    def observe(self, bucket: int, dtype: torch.dtype, data_ptr: int, values: int) -> None:
        if bucket in self.seen or dtype not in _DTYPES:
            return
        self.seen.add(bucket)
        monitor = self.monitors.get(bucket)
        if monitor is None:
            monitor = _ext.ChangeMonitor(_DTYPES[dtype], self.layouts.get(bucket, [values]), self.block_values)
            self.monitors[bucket] = monitor
        before = [(c.changed_values, c.values) for c in monitor.counts]
        monitor.observe(data_ptr, values * torch.tensor([], dtype=dtype).element_size())
        for (changed, compared), c in zip(before, monitor.counts):
            self.changed += c.changed_values - changed
            self.total += c.values - compared

    def clear_counts(self) -> None:
        """Starts the per-parameter counts afresh (the last exponents are kept)."""
        for monitor in self.monitors.values():
            monitor.clear_counts()

    @property
    def memory_bytes(self) -> int:
        return sum(m.memory_bytes for m in self.monitors.values())

    def merged_counts(self, buckets: list[Bucket], group=None) -> list[list]:
        """Per bucket, per parameter: ShardChangeCounts summed over the ranks of `group`.
        Collective (one all-reduce)."""
        rows = []
        for b in buckets:
            monitor = self.monitors.get(b.index)
            rows += ([c.as_list() for c in monitor.counts] if monitor is not None
                     else [[0] * 5 for _ in b.params])
        summed = torch.tensor(rows, dtype=torch.float64)  # exact: counts stay far below 2**53
        dist.all_reduce(summed, group=group)
        world = dist.get_world_size(group)
        merged, flat = [], iter(summed.tolist())
        for b in buckets:
            per_param = []
            for _ in b.params:
                row = [int(v) for v in next(flat)]
                row[0] //= world   # every rank saw the same number of steps
                per_param.append(_ext.ShardChangeCounts.from_list(row))
            merged.append(per_param)
        return merged


# ---- Benefit-driven selection (paper §3.2) --------------------------------------------------------

def shard_type(name: str) -> str:
    """expert_ffn, attention, router, norm, embedding, dense_ffn or other, from the parameter name."""
    return _ext.classify_parameter(name)


class Selector:
    """Chooses which parameters go through exponent reuse, per the paper's §3.2, on every rank
    alike: warmup statistics (q_i, the block change rate of each parameter's shards, measured in
    C++ on the shards about to be gathered), a cost model measured at enable() on the same
    transport, and a cache budget. Training steps are counted by a forward pre-hook on the root
    module (training mode only); each bucket's first gather of a step is observed."""

    def __init__(self, runtime: "Runtime", cost_model, budget_bytes: int, select_after: int,
                 reselect_every: int, overlap: bool, codec, group=None):
        self.runtime = runtime
        self.cost_model = cost_model
        self.budget_bytes = budget_bytes
        self.select_after = select_after
        self.reselect_every = reselect_every
        self.overlap = overlap
        self.codec = codec
        self.group = group
        self.tracker = ExponentTracker(runtime.buckets, codec.block_values)
        self.step = 0
        self.policies = {(b.index, k): _ext.ShardPolicy.raw for b in runtime.buckets for k in range(len(b.params))}
        self.selection: dict | None = None
        self.history: list[dict] = []   # one entry per selection: step, chosen count, cache bytes

    @property
    def monitor_bytes(self) -> int:
        return self.tracker.memory_bytes

    def on_step(self, module, args) -> None:
        if not module.training:
            return
        self.tracker.new_step()
        done = self.step
        self.step += 1
        if done == self.select_after or (self.reselect_every > 0 and done > self.select_after
                                         and (done - self.select_after) % self.reselect_every == 0):
            self.select()

    def select(self) -> dict:
        """Runs the selector on the statistics since the last selection and applies it. Collective."""
        merged = self.tracker.merged_counts(self.runtime.buckets, self.group)
        world = dist.get_world_size(self.group)
        candidates = []
        for b in self.runtime.buckets:
            for k, p in enumerate(b.params):
                counts = merged[b.index][k]
                c = _ext.ShardCandidate()
                c.bucket, c.param, c.name, c.type = b.index, k, p.name, shard_type(p.name)
                c.dtype = _DTYPES[b.dtype]
                c.shard_values = [p.numel] * world
                # No statistics yet: assume every block changes, so nothing is selected blindly.
                c.block_change_rate = counts.block_change_rate if counts.observations else 1.0
                c.value_change_rate = counts.value_change_rate if counts.observations else 1.0
                candidates.append(c)
        options = _ext.SelectorOptions()
        options.cache_budget_bytes = self.budget_bytes
        options.overlap = self.overlap
        options.codec = self.codec
        selection = _ext.select_shards(candidates, self.cost_model, options)
        for shard in selection["shards"]:
            key = (shard["bucket"], shard["param"])
            wanted = _ext.ShardPolicy.ciera if shard["chosen"] else _ext.ShardPolicy.raw
            if self.policies[key] != wanted:
                self.runtime.engine.set_policy(key[0], key[1], wanted)
                self.policies[key] = wanted
        self.tracker.clear_counts()
        selection["step"] = self.step - 1
        self.selection = selection
        self.history.append({"step": selection["step"], "chosen": sum(s["chosen"] for s in selection["shards"]),
                             "cache_bytes": selection["cache_bytes"]})
        return selection


def selection_table(selection: dict) -> str:
    """The selection as a readable table: one row per shard type, then the chosen shards' totals."""
    by_type: dict[str, list] = {}
    for s in selection["shards"]:
        by_type.setdefault(s["type"], []).append(s)
    lines = [f"{'shard type':<12} {'shards':>6} {'chosen':>6} {'values chg':>10} {'blocks chg':>10} "
             f"{'gain/gather':>12} {'cache':>10}"]
    for kind, shards in sorted(by_type.items()):
        chosen = [s for s in shards if s["chosen"]]
        q = sum(s["block_change_rate"] for s in shards) / len(shards)
        p = sum(s["value_change_rate"] for s in shards) / len(shards)
        gain = sum(s["gain_s"] for s in chosen)
        cache = sum(s["memory_bytes"] for s in chosen)
        lines.append(f"{kind:<12} {len(shards):>6} {len(chosen):>6} {100 * p:>9.3f}% {100 * q:>9.2f}% "
                     f"{1e3 * gain:>9.3f} ms "
                     f"{cache / 2**20:>7.2f} MiB")
    budget = selection["budget_bytes"]
    budget_text = "unlimited" if budget >= 2**63 else f"{budget / 2**20:.2f} MiB"
    lines.append(f"cache {selection['cache_bytes'] / 2**20:.2f} MiB of {budget_text}; expected gain "
                 f"{1e3 * selection['gain_s']:.3f} ms per gather round")
    return "\n".join(lines)

# ---- Public entry point -------------------------------------------------------------------------

class Handle:
    """What enable() returns: the engine, per-parameter layout, statistics, and disable()."""

    def __init__(self, runtime: Runtime, hook=None):
        self._runtime = runtime
        self._hook = hook

    @property
    def engine(self):
        return self._runtime.engine

    @property
    def buckets(self) -> list[Bucket]:
        return self._runtime.buckets

    @property
    def wrong_bytes(self) -> int:
        return self._runtime.wrong_bytes

    @property
    def verified_bytes(self) -> int:
        return self._runtime.verified_bytes

    def take_records(self) -> list[GatherRecord]:
        return self._runtime.take_records()

    def set_gather_observer(self, callback) -> None:
        self._runtime.on_gather = callback

    def set_output_observer(self, callback) -> None:
        """callback(bucket: Bucket, output: Tensor) after each gather, with every rank's shards."""
        self._runtime.on_output = callback

    @property
    def cache_bytes(self) -> int:
        """Codec state this rank holds now (encoder copies and peers' exponent caches)."""
        return self._runtime.engine.cache_bytes

    @property
    def selector(self) -> Selector | None:
        """The benefit-driven selector, when enable() was given a cache budget."""
        return self._runtime.selector

    def disable(self) -> None:
        """Restores FSDP2's default all-gather on every module; collective."""
        for module in self._runtime.modules:
            module.set_custom_all_gather(DefaultAllGather())
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._runtime.engine.close()


def enable(model: torch.nn.Module, config: _ext.EngineConfig | None = None, *, process_group=None,
           transport: str = "torch", verify: bool = False, policy=None,
           cache_budget_bytes: int | None = None, select_after_steps: int | None = None,
           reselect_every: int = 0, overlap: bool = True, cost_model=None) -> Handle:
    """Routes every FSDP2 parameter group's all-gather of `model` through CIERA.

    Collective: every rank calls it with the same model structure and configuration (checked;
    a difference raises ConfigError on every rank). `transport` is "torch" (a dedicated gloo
    group beside `process_group`, default the world) or "mpi" (CIERA's Open MPI transport; the
    job must run under mpirun). With `verify`, every gather is also done by torch.distributed
    and compared byte for byte (Handle.wrong_bytes). `policy(bucket, param) -> ShardPolicy`
    chooses per parameter; the default compresses everything.

    With `cache_budget_bytes`, the benefit-driven selector decides instead (paper §3.2): every
    parameter goes raw for `select_after_steps` training steps (default: config.warmup_steps)
    while its exponent changes are counted; then the parameters whose compression saves more
    time than it costs, ranked by gain per byte of cache, go through CIERA until the budget (per
    rank, bytes of codec state) is used. `reselect_every` > 0 re-runs the selection every that
    many steps on fresh statistics (results stay exact: a switched shard restarts with a key
    frame).

    With `overlap` (CCP, paper §3.3), a gather is handed back to FSDP in flight: encoding,
    exchange and decoding run on the engine's threads while the previous module computes
    (FSDP's backward prefetch, and forward prefetch which enable() turns on). `overlap=False`
    finishes each gather before returning, and makes the selector charge detection and encoding
    to the critical path. `cost_model` (an _ext.CostModel, the same on every rank) replaces the
    start-up measurement, for tests and for reusing one measured earlier."""
    selecting = cache_budget_bytes is not None
    if selecting and policy is not None:
        raise _ext.ConfigError("enable(): give either policy= or cache_budget_bytes=, not both")
    if selecting and cache_budget_bytes < 0:
        raise _ext.ConfigError(f"enable(): cache_budget_bytes must be >= 0, got {cache_budget_bytes}")
    config = config or _ext.EngineConfig()
    described = describe_buckets(model)
    if not described:
        raise _ext.ConfigError("enable(): the model has no FSDP2 (fully_shard) parameter groups")
    world = dist.get_world_size(process_group)
    layouts = []
    for _, bucket in described:
        layout = _ext.BucketLayout()
        layout.name = bucket.module_name or "<root>"
        layout.dtype = _DTYPES[bucket.dtype]
        layout.shard_values = [[p.numel for p in bucket.params] for _ in range(world)]
        if selecting:
            layout.policy = [_ext.ShardPolicy.raw for _ in bucket.params]
        else:
            layout.policy = [policy(bucket, p) if policy else _ext.ShardPolicy.ciera for p in bucket.params]
        layouts.append(layout)
    if transport == "torch":
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        group = dist.new_group(ranks=ranks, backend="gloo")
        native = TorchTransport(group).make()
    elif transport == "mpi":
        if not _ext.with_mpi:
            raise _ext.ConfigError("this build of CIERA has no MPI transport")
        _init_mpi_once()
        native = _ext.mpi_transport()
    else:
        raise _ext.ConfigError(f"unknown transport {transport!r} (expected 'torch' or 'mpi')")
    if selecting and cost_model is None:
        # Measured before the engine takes the transport over: Comm() up to the largest bucket.
        largest = max(b.numel * world * torch.tensor([], dtype=b.dtype).element_size() for _, b in described)
        dtypes = sorted({_DTYPES[b.dtype] for _, b in described}, key=int)
        cost_model = _ext.measure_cost_model(native, largest, dtypes, config.codec)
    engine = _ext.Engine(native, config, layouts)
    runtime = Runtime(engine, [b for _, b in described], [m for m, _ in described], verify, overlap=overlap)
    for module, bucket in described:
        module.set_custom_all_gather(CieraAllGather(runtime, bucket))
    if overlap:
        prefetch_forward(model)
    hook = None
    if selecting:
        after = config.warmup_steps if select_after_steps is None else select_after_steps
        runtime.selector = Selector(runtime, cost_model, int(cache_budget_bytes), after, reselect_every,
                                    overlap, config.codec, process_group)
        # Prepended: the step must be counted before FSDP's own pre-forward hook gathers the root.
        hook = model.register_forward_pre_hook(runtime.selector.on_step, prepend=True)
    handle = Handle(runtime, hook)
    _open_engines.append(engine)
    return handle


# Engines still open at exit are closed before MPI is finalised (an MPI rank that exits without
# MPI_Finalize makes mpirun fail the whole job).
_open_engines: list = []
_mpi_started = False


def _init_mpi_once() -> None:
    global _mpi_started
    if not _mpi_started:
        _ext.mpi_init()
        _mpi_started = True
        atexit.register(_shutdown_mpi)


def _shutdown_mpi() -> None:
    for engine in _open_engines:
        engine.close()
    _open_engines.clear()
    _ext.mpi_finalize()


def full_parameter(bucket: Bucket, k: int, output: torch.Tensor, world: int) -> torch.Tensor:
    """Parameter k of a gathered bucket as one flat tensor: its shards from every rank,
    concatenated, without FSDP's padding (which sits at the end: dim-0 chunks are ceil-sized)."""
    p = bucket.params[k]
    pieces = [output[r * bucket.numel + p.offset: r * bucket.numel + p.offset + p.numel] for r in range(world)]
    return torch.cat(pieces)[: p.full_numel]
