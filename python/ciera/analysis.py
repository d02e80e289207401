"""Exponent-change counts (C++ ``ChangeCounts``, ``ExponentChangeCounter``) rendered as the "counts"
objects of ``ciera analyze --json`` (docs/analysis.md), for ``ciera train --stats`` and training
loops. Rendering only: every count and rate comes from the C++ objects."""

from __future__ import annotations


def _per_cell(grid, value) -> list[list]:
    return [[value(grid.cell(w, b)) for b in range(len(grid.block_values))] for w in range(len(grid.worlds))]


def counts_json(counts, grid, transitions: int | None = None) -> dict:
    """Counts as one "counts" object of `ciera analyze --json` (docs/analysis.md lists its fields).
    ``transitions``: the step transitions the counts cover. The default, ``counts.transitions``, is
    right for one tensor's counts; a sum over tensors holds one transition per tensor and step, so
    pass the number of steps for it."""
    return {
        "transitions": counts.transitions if transitions is None else transitions,
        "values": counts.values,
        "changed_values": counts.changed_values,
        "element_change_rate": counts.element_change_rate(),
        "blocks": _per_cell(grid, lambda i: counts.blocks[i]),
        "changed_blocks": _per_cell(grid, lambda i: counts.changed_blocks[i]),
        "block_change_rate": _per_cell(grid, counts.block_change_rate),
        "shards": list(counts.shards),
        "changed_shards": list(counts.changed_shards),
        "shard_change_rate": [counts.shard_change_rate(w) for w in range(len(grid.worlds))],
    }


def summary(counter) -> dict:
    """An ExponentChangeCounter's state: its grid, changed values per step and, in "total", the
    counts after warmup in the shape of one "counts" object of `ciera analyze --json`."""
    grid = counter.grid
    return {"dtype": counter.dtype.name, "values": counter.values, "worlds": list(grid.worlds),
            "block_values": list(grid.block_values), "warmup_steps": counter.warmup_steps,
            "transitions": counter.transitions, "changed_values_per_step": counter.changed_values_per_step,
            "total": counts_json(counter.total, grid)}
