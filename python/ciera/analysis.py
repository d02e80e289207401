"""Exponent-change counts (C++ ``ChangeCounts``, ``ExponentChangeCounter``) rendered as JSON in the
shapes ``ciera analyze --json`` writes (docs/analysis.md). Rendering only: every count and rate
comes from the C++ objects."""

from __future__ import annotations


def _per_cell(grid, value) -> list[list]:
    return [[value(grid.cell(w, b)) for b in range(len(grid.block_values))] for w in range(len(grid.worlds))]


def counts_json(counts, grid) -> dict:
    """One tensor's counts, as one "counts" object of `ciera analyze --json`."""
    return {
        "transitions": counts.transitions,
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


def totals_json(counts, grid, transitions: int) -> dict:
    """Counts summed over tensors; `transitions` is per tensor (every one saw as many)."""
    return {
        "values": counts.values,
        "changed_values": counts.changed_values,
        "transitions": transitions,
        "blocks": _per_cell(grid, lambda i: counts.blocks[i]),
        "changed_blocks": _per_cell(grid, lambda i: counts.changed_blocks[i]),
        "shards": list(counts.shards),
        "changed_shards": list(counts.changed_shards),
        "element_change_rate": counts.element_change_rate(),
        "reusable_blocks": _per_cell(grid, lambda i: 1 - counts.block_change_rate(i)),
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
