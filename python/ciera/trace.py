"""Traces of real training runs for the simulator (``ciera train --trace FILE``; format:
docs/simulator.md, "Trace format v1").

Per FSDP group (bucket) the trace holds the forward and backward compute time, measured as the
gaps between the step's communication events: in forward, the time after a group's all-gather
until the next event is that group's compute (the root's forward owns the time before the first
gather; the tail after the last gather up to the loss, the last group's compute and the root's
head + loss, which no event separates, goes to the last gathered group, where it runs); in
backward, the time before a group's gradient reduce-scatter since the previous event is
that group's backward compute (FSDP reduce-scatters a group's gradients as soon as its backward
is done). Gathers and reduce-scatters are timed synchronously, so the gaps are pure compute.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field


@dataclass
class StepEvents:
    """What one rank saw in one training step (time.perf_counter() seconds)."""
    start: float
    loss_done: float
    backward_done: float
    end: float
    gathers: list        # GatherRecord (with .started, .seconds, .bucket, .ranks)
    reduce_scatters: list  # ReduceScatterRecord
    all_reduces: list = field(default_factory=list)  # HSDP's all-reduces across replicas (ReduceScatterRecord)


def compute_times(ev: StepEvents, buckets: int, root: int = 0) -> tuple[list[float], list[float], float]:
    """(forward_s per bucket, backward_s per bucket, optimizer_s) of one step."""
    forward = [0.0] * buckets
    backward = [0.0] * buckets
    comm = sorted([(g.started, g.started + g.seconds, "ag", g.bucket) for g in ev.gathers] +
                  [(r.started, r.started + r.seconds, "rs", r.bucket) for r in ev.reduce_scatters] +
                  [(r.started, r.started + r.seconds, "ar", r.bucket) for r in ev.all_reduces])
    fwd = [e for e in comm if e[0] < ev.loss_done]
    bwd = [e for e in comm if ev.loss_done <= e[0] < ev.backward_done]
    # Forward: the gap after each gather belongs to the gathered group; before the first gather,
    # to the root (embedding); after the last, to the last gathered group (its compute, then the
    # root's head and loss, which no event separates from it).
    cursor, owner = ev.start, root
    for began, ended, _, bucket in fwd:
        forward[owner] += max(0.0, began - cursor)
        cursor, owner = ended, bucket
    forward[owner] += max(0.0, ev.loss_done - cursor)
    # Backward: the gap before each reduce-scatter belongs to that group; gathers (and HSDP's
    # all-reduces, which follow their reduce-scatter at once) only advance the cursor. A tail after the last reduce-scatter (none in FSDP2) goes to the root.
    # Before the first reduce-scatter, gaps before gathers are the root's head backward.
    cursor, pending, seen_rs = ev.loss_done, 0.0, False
    for began, ended, kind, bucket in bwd:
        pending += max(0.0, began - cursor)
        if kind == "rs":
            backward[bucket] += pending
            pending, seen_rs = 0.0, True
        elif not seen_rs:
            backward[root] += pending
            pending = 0.0
        cursor = max(cursor, ended)
    backward[root] += pending + max(0.0, ev.backward_done - cursor)
    return forward, backward, ev.end - ev.backward_done


@dataclass
class Tracer:
    """Accumulates the steady-state steps of the baseline run and writes the trace. Gathers on
    the shard group (`shard_ranks` ranks) and on a smaller post-forward group
    (reshard_after_forward=N) are kept apart: they run on different links."""
    buckets: int
    shard_ranks: int = 0   # size of the shard group; 0: every gather is on it
    forward: list = field(default_factory=list)    # per step: list per bucket
    backward: list = field(default_factory=list)
    optimizer: list = field(default_factory=list)
    gathers: dict = field(default_factory=dict)    # bucket -> [(bytes, seconds)] of every gather
    post_forward_gathers: dict = field(default_factory=dict)  # the same, on the post-forward group
    reduce_scatters: dict = field(default_factory=dict)
    all_reduces: dict = field(default_factory=dict)  # HSDP: bucket -> [(bytes per rank, seconds)]

    def add(self, ev: StepEvents) -> None:
        f, b, o = compute_times(ev, self.buckets)
        self.forward.append(f)
        self.backward.append(b)
        self.optimizer.append(o)
        for g in ev.gathers:
            post_forward = self.shard_ranks and g.ranks and len(g.ranks) < self.shard_ranks
            kept = self.post_forward_gathers if post_forward else self.gathers
            kept.setdefault(g.bucket, []).append((g.raw_bytes, g.seconds))
        for r in ev.reduce_scatters:
            self.reduce_scatters.setdefault(r.bucket, []).append((r.input_bytes, r.seconds))
        for r in ev.all_reduces:
            self.all_reduces.setdefault(r.bucket, []).append((r.input_bytes, r.seconds))

    def gathers_per_step(self, bucket: int) -> float:
        gathers = len(self.gathers.get(bucket, [])) + len(self.post_forward_gathers.get(bucket, []))
        return gathers / max(1, len(self.forward))

    def all_reduce_bytes(self, bucket: int) -> int:
        samples = self.all_reduces.get(bucket)
        return samples[0][0] if samples else 0

    def in_situ_curves(self) -> dict:
        """Comm() points as the training saw them: per bucket, its size and the mean time of its
        collectives (with the ranks' real arrival skew, which micro-benchmarks do not have; the
        mean, because a step's total is a sum and rare slow gathers belong in it). The
        post-forward and all-reduce curves only when the run had them."""
        def points(by_bucket):
            return [{"bytes": samples[0][0], "seconds": statistics.fmean(t for _, t in samples)}
                    for _, samples in sorted(by_bucket.items())]
        curves = {"allgather": points(self.gathers), "reduce_scatter": points(self.reduce_scatters)}
        if self.post_forward_gathers:
            curves["allgather_post_forward"] = points(self.post_forward_gathers)
        if self.all_reduces:
            curves["allreduce"] = points(self.all_reduces)
        return curves

    def medians(self) -> tuple[list[float], list[float], float]:
        med = statistics.median
        f = [med(step[i] for step in self.forward) for i in range(self.buckets)]
        b = [med(step[i] for step in self.backward) for i in range(self.buckets)]
        return f, b, med(self.optimizer)


def measure_comm_curves(group, largest_bytes: int, repeats: int = 3) -> dict:
    """Comm() of torch.distributed's all-gather and reduce-scatter (the baseline's collectives):
    sizes from 64 KiB to `largest_bytes` by factors of 4, the slowest rank's median per size."""
    import time

    import torch
    import torch.distributed as dist

    from ciera._dist import all_gather_single, reduce_scatter_single

    world = dist.get_world_size(group)
    sizes, s = [], 65536
    while s < largest_bytes:
        sizes.append(s)
        s *= 4
    sizes.append(max(largest_bytes, 65536))
    out = {"allgather": [], "reduce_scatter": []}
    for total in sizes:
        per_rank = max(1, total // world // 4)  # fp32 elements per rank
        shard = torch.ones(per_rank, dtype=torch.float32)
        full = torch.empty(per_rank * world, dtype=torch.float32)
        for kind, call in (("allgather", lambda: all_gather_single(full, shard, group=group)),
                           ("reduce_scatter", lambda: reduce_scatter_single(shard, full, group=group))):
            times = []
            for i in range(repeats + 1):
                dist.barrier(group=group)
                t = time.perf_counter()
                call()
                if i:
                    times.append(time.perf_counter() - t)
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            out[kind].append({"bytes": per_rank * world * 4, "seconds": slowest.item()})
    return out


def simulate_refusal(path: str) -> str | None:
    """Why ``ciera simulate --trace PATH`` refuses the trace at `path` (its error line), asked of
    the simulator itself; None when it accepts it, or when the native tool is not built (then
    there is no simulator to refuse it). A small run on an unshaped link of a busy machine can
    measure Comm() times that do not rise with bytes, which the simulator refuses."""
    import subprocess

    from ciera import cli

    try:
        tool = cli.native_tool()
    except SystemExit:
        return None
    done = subprocess.run([str(tool), "simulate", "--trace", path, "--json"], capture_output=True, text=True,
                          timeout=120)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def write(path: str, trace: dict) -> None:
    with open(path, "w") as f:
        json.dump(trace, f, indent=1)
