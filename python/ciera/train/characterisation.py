"""``ciera train --stats``: exponent-change characterisation during training (paper §2, O2-O4),
counted in C++ (ExponentChangeCounter per parameter, ChangeStatistics for the sums over
parameters, types and ranks). Python only renders the counts as JSON (ciera.analysis): "total",
each entry of "by_type" and each parameter's "total" are "counts" objects of ``ciera analyze
--json``, but the file as a whole is not such a report (docs/analysis.md)."""

from __future__ import annotations

import torch.distributed as dist

from ciera import _ext, fsdp
from ciera import analysis


class TrainingStats:
    """In-training characterisation on the CIERA run: the first gather of each bucket per step
    holds every parameter whole, so exponent changes can be counted for any block size and
    re-partitioned for any world size, as `ciera analyze` does from checkpoints. Rank r counts
    every W-th parameter, so the work is spread over the ranks."""

    def __init__(self, buckets, world: int, rank: int, warmup: int):
        self.world = world
        self.warmup = warmup
        self.grid = _ext.ChangeGrid()
        self.statistics = _ext.ChangeStatistics(self.grid, warmup)  # this rank's parameters
        self.counters = {}
        self.seen: set = set()
        index = 0
        for b in buckets:
            for k, p in enumerate(b.params):
                if index % world == rank:
                    counter = _ext.ExponentChangeCounter(fsdp.DTYPES[b.dtype], p.full_numel, warmup_steps=warmup)
                    self.counters[(b.index, k)] = (p.name, fsdp.shard_type(p.name), counter)
                index += 1

    def new_step(self) -> None:
        self.seen.clear()

    def __call__(self, bucket, output) -> None:
        if bucket.index in self.seen:
            return
        self.seen.add(bucket.index)
        for k in range(len(bucket.params)):
            entry = self.counters.get((bucket.index, k))
            if entry is not None:
                _, kind, counter = entry
                full = fsdp.full_parameter(bucket, k, output, self.world).contiguous()
                counts = counter.observe(full.data_ptr(), full.numel() * full.element_size())
                if counter.transitions:
                    self.statistics.add(counter.transitions, _ext.ShardType.__members__[kind], counts)

    def _mine(self) -> dict:
        """What this rank sends: its parameters' own counts, and its sums per step and type."""
        parameters, kinds = [], set()
        for name, kind, counter in self.counters.values():
            kinds.add(kind)
            parameters.append({"name": name, "type": kind, **analysis.summary(counter)})
        steps = [(step, kind, self.statistics.step(step, _ext.ShardType.__members__[kind]))
                 for step in range(1, self.statistics.steps + 1) for kind in sorted(kinds)]
        return {"parameters": parameters, "steps": steps}

    def gather(self) -> dict | None:
        """Every rank's counts, summed by ChangeStatistics per step, per shard type and overall.
        Collective; every rank gets the result."""
        everyone = [None] * self.world
        dist.all_gather_object(everyone, self._mine())
        params = [p for rank in everyone for p in rank["parameters"]]
        if not params:
            return None
        merged = _ext.ChangeStatistics(self.grid, self.warmup)
        for rank in everyone:
            for step, kind, counts in rank["steps"]:
                merged.add(step, _ext.ShardType.__members__[kind], counts)
        first, grid = params[0], self.grid
        worlds, blocks = first["worlds"], first["block_values"]
        steps = first["total"]["transitions"]  # after warmup; every parameter saw as many
        overall = analysis.counts_json(merged.total(), grid, steps)
        by_type = {}
        for kind in sorted({p["type"] for p in params}):
            by_type[kind] = analysis.counts_json(merged.total(_ext.ShardType.__members__[kind]), grid, steps)
        w4 = worlds.index(4) if 4 in worlds else 0
        b512 = blocks.index(512) if 512 in blocks else 0
        summary = {
            "element_change_rate": overall["element_change_rate"],
            "reusable_blocks_w4": dict(zip(map(str, blocks), (1 - r for r in overall["block_change_rate"][w4]))),
            "shard_change_rate": dict(zip(map(str, worlds), overall["shard_change_rate"])),
            "by_type": {t: {"element_change_rate": v["element_change_rate"],
                            "block_change_rate_w4_b512": v["block_change_rate"][w4][b512]}
                        for t, v in by_type.items()},
        }
        per_step = [merged.step(i).element_change_rate() for i in range(1, len(first["changed_values_per_step"]) + 1)]
        return {"worlds": worlds, "block_values": blocks, "warmup_steps": first["warmup_steps"], "total": overall,
                "by_type": by_type, "element_change_rate_per_step": per_step, "parameters": params,
                "summary": summary}
