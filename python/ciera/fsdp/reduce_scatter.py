"""FSDP2's gradient reduce-scatter through CIERA's lossless collectives (issue 20): each rank's
part for a peer exponent-coded (stateless, ZipCCL's idea) where that is smaller, and the parts
added in rank order (docs/format.md, "Reduction order"), so that a run is reproducible bit for bit
and a compressed run equals its uncompressed twin (coding "raw": the same reduction, the parts
sent as they are). The order differs from gloo's or NCCL's, so results differ from FSDP2's own
reduction in the last bits; `ciera train --reduce-scatter` reports both comparisons."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import checked_on_every_rank, parameter_shapes, refused_on_every_rank
from ciera.fsdp.gather import RecordLog
from ciera.fsdp.layout import (DTYPES, DefaultReduceScatter, ReduceScatter, describe_buckets, describe_groups,
                               reduce_scatter_comm)
from ciera.fsdp.transport import check_transport, make_subgroup_transport, make_transport

CODINGS = ("exponent", "raw", "auto")


@dataclass
class LosslessReduceScatterRecord:
    """One gradient reduce-scatter of a bucket, as ciera train's metrics read it (the fields of
    baseline.ReduceScatterRecord, and what the collective sent)."""
    bucket: int
    started: float
    seconds: float
    input_bytes: int
    raw_bytes: int = 0      # this rank's parts for its peers, as values
    wire_bytes: int = 0     # the same, as sent
    control_bytes: int = 0  # and the call records and verdicts beside them (CollectiveStats.control_bytes)
    compressed: bool = False
    encode_s: float = 0.0
    decode_s: float = 0.0
    reduce_s: float = 0.0
    coded_values: int = 0              # over the parts sent coded: their values,
    coded_exponent_bytes: int = 0      # their frames beyond the sign-mantissa plane,
    exponent_entropy_bits: float = 0.0  # and the order-0 entropy of their exponents
    arrival_wait_s: float = 0.0  # of `seconds`: waiting for the last rank to enter the call
    busiest_link_raw_bytes: int = 0   # the call's busiest link (CollectiveStats), had every part gone raw
    busiest_link_wire_bytes: int = 0  # and as sent: the same on every rank

    @classmethod
    def of_call(cls, bucket: int, started: float, input_tensor, stats) -> "LosslessReduceScatterRecord":
        """The record of a call that began at `started` (time.perf_counter()) and has just
        returned `stats` (CollectiveStats)."""
        return cls(bucket, started, time.perf_counter() - started, input_tensor.numel() * input_tensor.element_size(),
                   stats.raw_bytes, stats.wire_bytes, stats.control_bytes, stats.compressed, stats.encode_s,
                   stats.decode_s, stats.reduce_s, stats.coded_values, stats.coded_exponent_bytes,
                   stats.exponent_entropy_bits, stats.arrival_wait_s, stats.busiest_link_raw_bytes,
                   stats.busiest_link_wire_bytes)


def _reduce_op(op) -> _ext.ReduceOp:
    if op == dist.ReduceOp.SUM:
        return _ext.ReduceOp.sum
    if op == dist.ReduceOp.AVG:
        return _ext.ReduceOp.avg
    # A ReduceOp object (PREMUL_SUM, with its factor) prints as its address; its .op has the name.
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", str(kind))
    raise _ext.ConfigError(f"CIERA's reduce-scatter sums or averages; FSDP2 asked for {name} (a gradient divide "
                           "factor other than the shard group's size, the world's on a flat mesh: "
                           "set_gradient_divide_factor; with set_force_sum_reduction_for_comms(True) FSDP2 "
                           "sums and divides afterwards, which CIERA serves)")


class LosslessReduceScatter(ReduceScatter):
    """One FSDP2 module's reduce-scatter on the shared collectives (every module of a model
    calls them in the same order on every rank, as FSDP2 calls its own)."""

    def __init__(self, handle: "ReduceScatterHandle", index: int):
        self.handle = handle
        self.index = index

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        collectives = self.handle.collectives
        if collectives is None:
            raise _ext.ConfigError("CIERA's reduce-scatter was disabled (ReduceScatterHandle.disable())")
        reduce_op = None

        def check():
            nonlocal reduce_op
            ranks = tuple(dist.get_process_group_ranks(group))
            if ranks != self.handle.ranks or len(ranks) != collectives.size:
                raise _ext.ConfigError(f"FSDP2 reduce-scatters over ranks {ranks}; CIERA's collectives were set "
                                       f"up for {self.handle.ranks}")
            if input_tensor.dtype not in DTYPES or output_tensor.dtype != input_tensor.dtype:
                raise _ext.ConfigError(f"CIERA's reduce-scatter takes BF16, FP16 or FP32 gradients, got "
                                       f"{input_tensor.dtype} -> {output_tensor.dtype}")
            if input_tensor.device.type != "cpu":
                raise _ext.ConfigError("CIERA's reduce-scatter runs on host memory; not yet on "
                                       f"{input_tensor.device.type}")
            reduce_op = _reduce_op(op)

        # A rank whose call is refused still takes part in it, so its peers fail at once.
        refused_on_every_rank(check, collectives.refuse_reduce_scatter)
        start = time.perf_counter()
        stats = collectives.reduce_scatter(DTYPES[input_tensor.dtype], reduce_op, input_tensor, output_tensor)
        self.handle.records.append(LosslessReduceScatterRecord.of_call(self.index, start, input_tensor, stats))
        return None


class ReduceScatterHandle:
    """What enable_reduce_scatter() set up: the collectives (on this rank's shard group) and the
    records of every call."""

    def __init__(self, collectives, coding: str, ranks: tuple[int, ...], modules: list):
        self.collectives = collectives
        self.coding = coding
        self.ranks = ranks      # this rank's shard group (world ranks, in group rank order)
        self.records: list[LosslessReduceScatterRecord] = RecordLog()   # appended to by every call (the latest kept)
        # Each module with the reduce-scatter it had before (FSDP2's default, or one set on it).
        self._modules = [(module, reduce_scatter_comm(module)) for module in modules]

    @property
    def enabled(self) -> bool:
        return self.collectives is not None

    def disable(self) -> None:
        """Restores the reduce-scatter each module had before (FSDP2's own, unless another was set)
        and lets the collectives go (their worker and transport). Local: every rank calls it
        between steps, as it called enable. The records stay; calling it again does nothing."""
        if self.collectives is None:
            return
        for module, previous in self._modules:
            module.set_custom_reduce_scatter(previous if previous is not None else DefaultReduceScatter())
        self._modules = []
        self.collectives = None


def collectives_config(what: str, coding: str, timeout_s: float, worker_niceness: int | None):
    """The lossless collectives' configuration from the arguments of `what` (FSDP2's or
    DeepSpeed's enable_reduce_scatter()), or the error it raises for them on this rank: checked
    before any transport is made (a bad timeout would fail in the group's set-up on this rank
    alone, its peers waiting there)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"{what}: timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if coding not in CODINGS:
        raise _ext.ConfigError(f"reduce-scatter coding must be one of {', '.join(CODINGS)}, got {coding!r}")
    config = _ext.CollectivesConfig()
    config.coding = _ext.parse_collective_coding(coding)
    if worker_niceness is not None:
        if isinstance(worker_niceness, bool) or not isinstance(worker_niceness, int):
            raise TypeError(f"{what}: worker_niceness must be an int (0..19), got "
                            f"{type(worker_niceness).__name__} {worker_niceness!r}")
        config.worker_niceness = worker_niceness
    config.validate()   # worker_niceness out of 0..19
    return config


def _checked(model: torch.nn.Module, coding: str, transport: str, process_group, timeout_s: float,
             worker_niceness: int | None):
    """The collectives' configuration, the model's FSDP2 buckets and the group it reduce-scatters
    on, or the error enable_reduce_scatter() raises for them on this rank."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_reduce_scatter(): model must be a torch.nn.Module, got {type(model).__name__}")
    check_transport("enable_reduce_scatter()", transport)
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"enable_reduce_scatter(): process_group must be a torch.distributed process group or "
                        f"None, got {type(process_group).__name__} {process_group!r}")
    config = collectives_config("enable_reduce_scatter()", coding, timeout_s, worker_niceness)
    buckets = describe_buckets(model)
    if not buckets:
        raise _ext.ConfigError("enable_reduce_scatter(): the model has no fully_shard'ed module")
    if any(isinstance(reduce_scatter_comm(module), LosslessReduceScatter) for module, _ in buckets):
        raise ValueError("enable_reduce_scatter(): the model's reduce-scatters already go through CIERA; call "
                         "disable() on the handle of that call first")
    devices = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
    if devices:
        raise _ext.ConfigError(f"enable_reduce_scatter(): CIERA's reduce-scatter runs on host memory; the model "
                               f"has parameters on {', '.join(devices)}")
    shard = describe_groups(buckets)[0]   # kind 0: the group FSDP2 reduce-scatters on
    if len(shard.partition) == 1:
        # One shard group: the world (a 1-D slice of a larger mesh shows only this rank's row).
        world = tuple(range(dist.get_world_size()))
        if shard.ranks != world:
            raise _ext.ConfigError(f"enable_reduce_scatter(): the model is sharded over ranks {shard.ranks}, which "
                                   f"the mesh gives as its only group; CIERA needs the world {world} or the whole "
                                   "mesh (an HSDP mesh: a group per node)")
        if process_group is not None and tuple(dist.get_process_group_ranks(process_group)) != world:
            raise _ext.ConfigError(f"enable_reduce_scatter(): process_group holds ranks "
                                   f"{tuple(dist.get_process_group_ranks(process_group))}, the model is sharded over "
                                   f"{world}")
    elif process_group is not None and not set(shard.ranks) <= set(dist.get_process_group_ranks(process_group)):
        # HSDP: the collectives run on the shard groups, whatever process_group says; one that
        # lacks this rank's shard group was accepted and ignored.
        raise _ext.ConfigError(f"enable_reduce_scatter(): FSDP2 reduce-scatters this rank's gradients on ranks "
                               f"{shard.ranks}, not all in process_group (ranks "
                               f"{tuple(dist.get_process_group_ranks(process_group))}); under HSDP pass the world "
                               "or the shard group, not the replicate group")
    return config, buckets, shard


def enable_reduce_scatter(model: torch.nn.Module, coding: str = "exponent", *, transport: str = "torch",
                          process_group=None, timeout_s: float = 120.0,
                          worker_niceness: int | None = None) -> ReduceScatterHandle:
    """Routes every FSDP2 gradient reduce-scatter of `model` (each fully_shard'ed module) through
    CIERA's lossless reduce-scatter. `coding`: "exponent" (parts exponent-coded where smaller),
    "raw" (the uncompressed twin: the same rank-order reduction) or "auto" (whichever the ranks
    measure faster). `transport` as for enable(): "torch" (a gloo group of its own beside
    `process_group`, default the world) or "mpi". `worker_niceness`: the coding threads' nice
    value (0..19; default the library's, 19, so that they give way to the transport's thread).

    FSDP2 reduce-scatters on each module's shard group: the world for a flat mesh; on an HSDP
    mesh, this rank's row of the shard dimension (the collectives run there, and FSDP2's own
    all-reduce across the replicas follows as before). Collective over the world: every rank
    calls it with the same model and coding. Host memory (CPU models) only. `disable()` on the
    handle restores FSDP2's own reduce-scatter; enabling a model whose reduce-scatters already
    go through CIERA is a ValueError. A refusal on any rank is raised on every rank, naming the
    rank, and so is a `transport` or `coding` that differs between ranks (ConfigError)."""
    # Every check first, on every rank (a rank that refused alone would leave the others waiting
    # in the transport's set-up until its timeout), with the transport the ranks chose.
    config, buckets, shard = checked_on_every_rank(
        "enable_reduce_scatter()", lambda: _checked(model, coding, transport, process_group, timeout_s,
                                                    worker_niceness),
        same={"transport": transport, "coding": coding}, parameters=lambda: parameter_shapes(model))
    if len(shard.partition) == 1:
        native = make_transport(transport, process_group, timeout_s)
    else:
        native = make_subgroup_transport(transport, shard.partition, shard.ranks, timeout_s)
    handle = ReduceScatterHandle(_ext.LosslessCollectives(native, config), coding, shard.ranks,
                                 [module for module, _ in buckets])
    for module, bucket in buckets:
        module.set_custom_reduce_scatter(LosslessReduceScatter(handle, bucket.index))
    return handle
