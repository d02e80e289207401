"""Exponent change tracking on the shards about to be gathered (the paper's Fig. 2 and the q_i of
§3.2), counted in C++ by one ChangeMonitor per FSDP group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ciera import _ext
from ciera.fsdp.layout import DTYPES, Bucket, element_bytes


class ExponentTracker:
    """Counts how often the exponents of this rank's shards change from step to step: the first
    gather of each FSDP group in a step is compared with the same group's input a step earlier, by
    a C++ ChangeMonitor (one byte of memory per local value). With `buckets`, counts are per
    parameter and blocks are cut as the codec cuts them; without, each group's shard counts as
    one. Meant to run in every compared training alike."""

    def __init__(self, buckets: list[Bucket] | None = None, block_values: int = 512, track_values: bool = False):
        self.layouts = {b.index: [p.numel for p in b.params] for b in buckets or []}
        self.block_values = block_values
        # Also keep the previous values (value_bytes more per value) and estimate what value-delta
        # frames would cost: the selector's input for the delta policy.
        self.track_values = track_values
        self.monitors: dict[int, object] = {}
        self.seen: set[int] = set()
        self.changed = 0   # values whose exponent changed, this step
        self.total = 0     # values compared, this step

    def new_step(self) -> None:
        self.seen.clear()
        self.changed = 0
        self.total = 0

    def __call__(self, bucket: int, shard: torch.Tensor) -> None:
        if bucket in self.seen:
            return
        if shard.device.type != "cpu":
            shard = shard.to("cpu")  # the change monitor reads host memory (statistics only)
        self.observe(bucket, shard.dtype, shard.data_ptr(), shard.numel())

    def observe(self, bucket: int, dtype: torch.dtype, data_ptr: int, values: int) -> None:
        if bucket in self.seen or dtype not in DTYPES:
            return
        self.seen.add(bucket)
        monitor = self.monitors.get(bucket)
        if monitor is None:
            monitor = _ext.ChangeMonitor(DTYPES[dtype], self.layouts.get(bucket, [values]), self.block_values,
                                         track_values=self.track_values)
            self.monitors[bucket] = monitor
        before = [(c.changed_values, c.values) for c in monitor.counts]
        monitor.observe(data_ptr, values * element_bytes(dtype))
        for (changed, compared), c in zip(before, monitor.counts):
            self.changed += c.changed_values - changed
            self.total += c.values - compared

    def release(self) -> None:
        """Drops the monitors and their memory (the counts and last exponents or values)."""
        self.monitors.clear()
        self.seen.clear()

    def clear_counts(self) -> None:
        """Starts the per-parameter counts afresh (the last exponents are kept)."""
        for monitor in self.monitors.values():
            monitor.clear_counts()

    @property
    def memory_bytes(self) -> int:
        return sum(m.memory_bytes for m in self.monitors.values())

    def merged_counts(self, buckets: list[Bucket], group=None) -> list[list]:
        """Per bucket, per parameter: ShardChangeCounts of every rank of `group`, merged by
        ShardChangeCounts.merge. Collective."""
        mine = []
        for b in buckets:
            monitor = self.monitors.get(b.index)
            mine.append(list(monitor.counts) if monitor is not None
                        else [_ext.ShardChangeCounts() for _ in b.params])
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        merged = [[_ext.ShardChangeCounts() for _ in b.params] for b in buckets]
        for rank_counts in everyone:
            for row, theirs in zip(merged, rank_counts):
                for counts, other in zip(row, theirs):
                    counts.merge(other)
        return merged
