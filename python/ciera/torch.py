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
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
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
            params.append(ParamSlice(name, numel, offset))
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


@dataclass
class Runtime:
    engine: object
    buckets: list[Bucket]
    modules: list[FSDPModule]
    verify: bool
    records: list[GatherRecord] = field(default_factory=list)
    wrong_bytes: int = 0
    verified_bytes: int = 0
    on_gather: object = None   # optional callback(bucket, output tensor) for statistics

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
        start = time.perf_counter()
        nbytes = input_tensor.numel() * input_tensor.element_size()
        stats = self.runtime.engine.run(b.index, input_tensor.data_ptr(), nbytes, output_tensor.data_ptr(),
                                        output_tensor.numel() * output_tensor.element_size())
        elapsed = time.perf_counter() - start
        if _DEBUG_TIMING and dist.get_rank() == 0:
            print(f"ciera gather bucket {b.index}: {elapsed*1e3:.1f} ms = encode {stats.encode_s*1e3:.1f} "
                  f"exchange {stats.exchange_s*1e3:.1f} decode {stats.decode_s*1e3:.1f} "
                  f"(engine total {stats.total_s*1e3:.1f}) wire {stats.wire_bytes} raw {stats.raw_bytes} "
                  f"compressed {stats.compressed}", flush=True)
        self.runtime.records.append(GatherRecord(b.index, elapsed, stats.raw_bytes, stats.wire_bytes,
                                                 stats.compressed, stats.resynchronised))
        if self.runtime.verify:
            reference = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(reference, input_tensor, group=group)
            self.runtime.wrong_bytes += int((reference.view(torch.uint8) != output_tensor.view(torch.uint8)).sum())
            self.runtime.verified_bytes += reference.numel() * reference.element_size()
        if self.runtime.on_gather is not None:
            self.runtime.on_gather(b.index, input_tensor)
        return None


class TimedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, timed the same way, for the baseline."""

    def __init__(self, records: list, index: int, observer=None):
        self.records = records
        self.index = index
        self.observer = observer

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        start = time.perf_counter()
        dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=False)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        self.records.append(GatherRecord(self.index, time.perf_counter() - start, nbytes, nbytes, False, False))
        if self.observer is not None:
            self.observer(self.index, input_tensor)
        return None


def time_plain_all_gathers(model: torch.nn.Module, observer=None) -> list:
    """Times FSDP2's own all-gathers (the baseline); returns the list records accumulate in."""
    records: list = []
    for module, bucket in describe_buckets(model):
        module.set_custom_all_gather(TimedAllGather(records, bucket.index, observer))
    return records


class ExponentTracker:
    """Counts, per step, the values of this rank's shards whose exponent changed since the
    previous step (the paper's Fig. 2): the first gather of each FSDP group in a step is compared
    with the same group's input a step earlier. Cheap (one pass in C++ over 1/W of the values),
    and meant to run in every compared training alike."""

    def __init__(self):
        self.previous: dict[int, torch.Tensor] = {}
        self.seen: set[int] = set()
        self.changed = 0
        self.total = 0

    def new_step(self) -> None:
        self.seen.clear()
        self.changed = 0
        self.total = 0

    def __call__(self, bucket: int, shard: torch.Tensor) -> None:
        if bucket in self.seen or shard.dtype not in _DTYPES:
            return
        self.seen.add(bucket)
        before = self.previous.get(bucket)
        if before is None or before.shape != shard.shape:
            self.previous[bucket] = shard.detach().clone()
            return
        self.changed += _ext.exponent_changes(_DTYPES[shard.dtype], before.data_ptr(), shard.data_ptr(), shard.numel())
        self.total += shard.numel()


# ---- Public entry point -------------------------------------------------------------------------

class Handle:
    """What enable() returns: the engine, per-parameter layout, statistics, and disable()."""

    def __init__(self, runtime: Runtime):
        self._runtime = runtime

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

    def disable(self) -> None:
        """Restores FSDP2's default all-gather on every module; collective."""
        for module in self._runtime.modules:
            module.set_custom_all_gather(DefaultAllGather())
        self._runtime.engine.close()


def enable(model: torch.nn.Module, config: _ext.EngineConfig | None = None, *, process_group=None,
           transport: str = "torch", verify: bool = False, policy=None) -> Handle:
    """Routes every FSDP2 parameter group's all-gather of `model` through CIERA.

    Collective: every rank calls it with the same model structure and configuration (checked;
    a difference raises ConfigError on every rank). `transport` is "torch" (a dedicated gloo
    group beside `process_group`, default the world) or "mpi" (CIERA's Open MPI transport; the
    job must run under mpirun). With `verify`, every gather is also done by torch.distributed
    and compared byte for byte (Handle.wrong_bytes). `policy(bucket, param) -> ShardPolicy`
    chooses per parameter; the default compresses everything."""
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
    engine = _ext.Engine(native, config, layouts)
    runtime = Runtime(engine, [b for _, b in described], [m for m, _ in described], verify)
    for module, bucket in described:
        module.set_custom_all_gather(CieraAllGather(runtime, bucket))
    handle = Handle(runtime)
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
