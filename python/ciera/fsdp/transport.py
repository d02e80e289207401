"""Transports the engine's collectives can run on: the process group torch already uses (gloo on
CPU, through Python callables) or CIERA's Open MPI transport (the job runs under mpirun)."""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist

from ciera import _ext
from ciera.fsdp import lifecycle


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


def make_transport(kind: str, process_group, timeout_s: float):
    """The native transport for enable(transport=kind). "torch": a dedicated gloo group beside
    `process_group` (default the world) whose collectives fail after `timeout_s` (the engine's
    timeout: a new group would otherwise wait torch's default 30 minutes for a stopped peer);
    "mpi": Open MPI, initialised once per process (the engine sets its timeout)."""
    if kind == "torch":
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return TorchTransport(group).make()
    if kind == "mpi":
        if not _ext.with_mpi:
            raise _ext.ConfigError("this build of CIERA has no MPI transport")
        lifecycle.init_mpi_once()
        return _ext.mpi_transport()
    raise _ext.ConfigError(f"unknown transport {kind!r} (expected 'torch' or 'mpi')")
