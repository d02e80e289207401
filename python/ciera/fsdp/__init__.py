"""CIERA for PyTorch FSDP2, organised as FSDP2 itself is (torch/distributed/fsdp/_fully_shard/):

    api.py        enable() and Handle, the public entry point (also ciera.torch)
    layout.py     FSDP parameter groups as engine buckets; the only reader of FSDP2's private state
    gather.py     the custom all-gather that runs the engine, in flight or synchronously
    baseline.py   FSDP2's own all-gather and reduce-scatter, timed, for comparisons
    transport.py  the engine's collectives on torch's process group or Open MPI
    lifecycle.py  MPI initialisation once, open engines closed before MPI is finalised
    tracking.py   per-step exponent change counts of the shards about to be gathered
    selection.py  benefit-driven selection (paper §3.2) applied during training
    zipnn.py      ZipNN as a gather scheme to compare with (enable_zipnn; needs ciera[peers])
"""

from ciera.fsdp.api import Handle, enable
from ciera.fsdp.baseline import (ReduceScatterRecord, TimedAllGather, TimedReduceScatter, time_plain_all_gathers,
                                 time_reduce_scatters)
from ciera.fsdp.gather import CieraAllGather, GatherRecord, Runtime
from ciera.fsdp.lifecycle import open_engines
from ciera.fsdp.reduce_scatter import LosslessReduceScatter, ReduceScatterHandle, enable_reduce_scatter
from ciera.fsdp.layout import (DTYPES, Bucket, ParamSlice, all_gather_comm, describe_buckets, full_parameter,
                               prefetch_forward)
from ciera.fsdp.selection import Selector, selection_table, shard_type
from ciera.fsdp.tracking import ExponentTracker
from ciera.fsdp.transport import TorchTransport
from ciera.fsdp.zipnn import ZipnnHandle, ZipnnUnavailable, enable_zipnn

__all__ = [
    "Bucket", "CieraAllGather", "DTYPES", "ExponentTracker", "GatherRecord", "Handle", "ParamSlice",
    "ReduceScatterRecord", "Runtime", "Selector", "TimedAllGather", "TimedReduceScatter", "TorchTransport",
    "ZipnnHandle", "ZipnnUnavailable", "all_gather_comm", "describe_buckets", "enable", "enable_zipnn",
    "full_parameter", "open_engines", "prefetch_forward", "selection_table", "shard_type", "time_plain_all_gathers",
    "time_reduce_scatters", "enable_reduce_scatter", "LosslessReduceScatter", "ReduceScatterHandle",
]
