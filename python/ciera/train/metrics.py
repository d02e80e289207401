"""Typed records of a training's numbers. Each converts to and from the tensor torch.distributed
reduces over ranks, so a field is named once instead of being a position in a tensor."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch
import torch.distributed as dist

from ciera.train.options import BASELINE, CONTROL, PLAIN  # noqa: F401 (the trainings' names, here too)


@dataclass
class StepMetrics:
    """One rank's numbers of one training step, as float64. Reduced with SUM (the mean loss, the
    change rate) and with MAX (each time's slowest rank)."""
    loss: float
    iteration_s: float
    allgather_s: float          # on the critical path: all of a finished gather, the wait for one in flight
    reduce_scatter_s: float
    raw_bytes: float            # gathered outputs
    wire_bytes: float           # what the transport carried for them (CIERA's engine: payloads and control_bytes)
    changed_values: float       # values whose exponent changed since the previous step
    compared_values: float
    encode_s: float             # detection + encoding
    gather_duration_s: float    # from each gather's start to its end, hidden or not
    inter_node_bytes: float = 0.0   # what this rank's gathers sent to ranks on other nodes
    control_bytes: float = 0.0  # of wire_bytes: the records and verdicts (GatherStats or CollectiveStats.control_bytes)

    def __post_init__(self) -> None:
        for f in fields(self):  # what a float64 tensor holds, whatever the caller passed
            setattr(self, f.name, float(getattr(self, f.name)))

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "StepMetrics":
        return cls(*tensor.tolist())

    def all_reduce(self, op) -> "StepMetrics":
        """These metrics reduced over all ranks by `op` (collective)."""
        tensor = self.to_tensor()
        dist.all_reduce(tensor, op=op)
        return StepMetrics.from_tensor(tensor)


def resident_bytes() -> tuple[int, int]:
    """This process's resident memory now and its peak so far, in bytes (Linux): VmRSS and VmHWM,
    read together. (getrusage's ru_maxrss is updated lazily and was seen below the current RSS.)"""
    kib = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                kib[name] = int(value.split()[0])
    return kib["VmRSS"] * 1024, max(kib["VmHWM"], kib["VmRSS"]) * 1024


@dataclass
class RunCheck:
    """How one CIERA training compares with the baseline on this rank: counts that are summed
    over ranks (as int64)."""
    loss_mismatches: int = 0          # steps whose loss bits differ
    param_bytes_mismatched: int = 0   # bytes of the final parameters that differ
    wrong_bytes: int = 0              # --verify: gathered bytes that differ from torch's
    verified_bytes: int = 0

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "RunCheck":
        return cls(*(int(v) for v in tensor.tolist()))

    @staticmethod
    def sum_over_ranks(checks: list["RunCheck"]) -> list["RunCheck"]:
        """Every run's checks summed over ranks, in one collective."""
        if not checks:
            return []
        stacked = torch.stack([c.to_tensor() for c in checks])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return [RunCheck.from_tensor(row) for row in stacked]


class Run:
    """One of the trainings compared: its model, optimizer and per-step results (lists of floats
    by name, one entry per step, already reduced over ranks): times are the slowest rank's, bytes
    the mean over ranks (every rank's bytes summed, over the world size)."""

    def __init__(self, name, model, lr, take_records, optimizer=None):
        self.name = name
        self.model = model
        self.optimizer = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=lr)
        self.take_records = take_records
        self.final = None
        self.digest = None   # sha256 of the final parameters (rank 0)
        self.budget_mb = None
        self.peak_cache_bytes = 0
        self.rs_records: list = []
        self.ar_records: list = []   # HSDP's all-reduces across replicas (the baseline's, timed)
        # Steady-state wire bytes per gather, per (kind of group, bucket) (fsdp.GatherRecord.group).
        self.bucket_wire: dict[tuple[int, int], list] = {}
        self.results = {"loss_bits": [], "loss": [], "allgather_s": [], "reduce_scatter_s": [], "iteration_s": [],
                        "raw": [], "wire": [], "encode_s": [], "gather_duration_s": [], "inter_node": [],
                        "hidden_fraction": [], "control": []}

    def record(self, loss_bits: int, summed: StepMetrics, peak: StepMetrics, mine: StepMetrics, world: int) -> None:
        out = self.results
        out["loss_bits"].append(loss_bits)
        out["loss"].append(summed.loss / world)
        out["iteration_s"].append(peak.iteration_s)
        out["allgather_s"].append(peak.allgather_s)
        out["reduce_scatter_s"].append(peak.reduce_scatter_s)
        out["encode_s"].append(peak.encode_s)
        out["gather_duration_s"].append(peak.gather_duration_s)
        # Per rank, the mean over ranks: a rank's bytes differ from another's wherever their
        # parts compress unevenly (rank 0's alone once stood for all of them).
        out["raw"].append(summed.raw_bytes / world)
        out["wire"].append(summed.wire_bytes / world)
        out["control"].append(summed.control_bytes / world)
        out["inter_node"].append(summed.inter_node_bytes)
        out["hidden_fraction"].append(hidden_fraction(summed))


def sent_bytes(records) -> int:
    """What the transport carried for a step's gathers (GatherRecords): their payloads and, for
    CIERA's engine, the control records and verdicts beside them, which a plain all-gather does
    not send (counted since stop 69; until then the wire figures held the payloads only)."""
    return sum(r.wire_bytes + r.control_bytes for r in records)


def hidden_fraction(summed: StepMetrics) -> float | None:
    """Of one step's gathers on every rank together (from each one's start to its end), the share
    the training did not wait for; None for a step without gathers. Clamped to [0, 1]: CIERA's
    and FSDP2's gathers time their exposed part and their duration from one start, so it is at
    most the duration, but the records come from several gather implementations (ZipNN's, the
    peers' schemes), and one timed otherwise must not make this read as no fraction."""
    if summed.gather_duration_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - summed.allgather_s / summed.gather_duration_s))
