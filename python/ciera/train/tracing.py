"""``ciera train --trace``: the trace of this run for ``ciera simulate`` (docs/simulator.md,
trace format v1): per FSDP group its compute times, bytes and change rates, and Comm() curves."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ciera import _ext, fsdp, trace
from ciera.train import options


def _mean_over_ranks(values: list[float], world: int) -> list[float]:
    times = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.SUM)
    return (times / world).tolist()


def _in_situ_curves(tracer) -> dict:
    """Comm() as measured inside the training (per bucket, the slowest rank's). Collective."""
    in_situ = tracer.in_situ_curves()
    for kind in sorted(in_situ):   # the same kinds on every rank
        seconds = torch.tensor([p["seconds"] for p in in_situ[kind]], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        for p, t in zip(in_situ[kind], seconds.tolist()):
            p["seconds"] = t
    return in_situ


def collect_trace(program, runs: dict, handles: dict, params: int) -> dict:
    """The trace document (without its "measured" part, which the summary adds). Collective."""
    a, world, tracer = program.args, program.world, program.tracer
    if tracer is None or not tracer.forward:
        raise SystemExit("ciera train: --trace needs the baseline run and steps after warmup")
    buckets = handles["ciera"].buckets
    forward, backward, optimizer = tracer.medians()
    times = _mean_over_ranks(forward + backward + [optimizer], world)
    n = len(buckets)
    counts = program.trackers["ciera"].merged_counts(buckets)
    # Mean CIERA bytes per gather of each bucket, payloads and control records (as train's own
    # wire figures): on the shard group, and on the post-forward group (reshard_after_forward=N;
    # 0 where the bucket has none there).
    wire = torch.tensor([statistics.fmean(runs["ciera"].bucket_wire.get((kind, b.index), [0]))
                         for kind in (0, 1) for b in buckets], dtype=torch.float64)
    dist.all_reduce(wire, op=dist.ReduceOp.MAX)  # the same on every rank (all ranks' bytes)
    element = {b.index: fsdp.layout.element_bytes(b.dtype) for b in buckets}
    group = handles["ciera"].groups[0].size   # the shard group: the world, or a node under HSDP
    largest = max(b.numel * group * element[b.index] for b in buckets)
    # Comm() inside the training, and a probe of the same collectives outside it, for reference.
    in_situ = _in_situ_curves(tracer)
    probe = trace.measure_comm_curves(None, 4 * largest)
    codec_config = _ext.CodecConfig()
    codec_config.block_values = a.block
    speed = _ext.measure_codec(codec_config)
    doc = {
        "format": "ciera-trace", "version": 1,
        "model": {"family": a.model, "params": params},
        "world_size": world, "dtype": "bf16",
        "link": {"kind": "linklab" if a.link_gbit else "local", "gbit": a.link_gbit, "latency_ms": 0.0},
        "codec": {"encode_GBps": speed.encode_bytes_per_s / 1e9, "decode_GBps": speed.decode_bytes_per_s / 1e9,
                  "detect_GBps": speed.detect_bytes_per_s / 1e9},
        "topology": options.topology(a),
        "comm": in_situ,
        "comm_probe": probe,
        "optimizer_s": times[2 * n],
        # How the traced run scheduled its collectives: on CPU ranks FSDP2's gathers and
        # reduce-scatters block (no prefetch overlap) unless --overlap was given.
        # Under --ablation the baseline is sequential and the measured CIERA run (+CCP) overlaps.
        "schedule": {"overlap": bool(a.overlap and not a.ablation),
                     "ciera_overlap": bool(a.overlap or a.ablation), "block_values": a.block},
        "buckets": [],
    }
    for i, b in enumerate(buckets):
        shards = [{"name": p.name, "type": fsdp.shard_type(p.name), "values": p.numel * group,
                   "change_rate": c.value_change_rate, "block_change_rate": c.block_change_rate}
                  for p, c in zip(b.params, counts[i])]
        entry = {
            "name": b.module_name or "<root>", "forward_s": times[i], "backward_s": times[n + i],
            "raw_bytes": b.numel * group * element[b.index], "wire_bytes": wire[i].item(),
            "grad_bytes": program.grad_bytes.get(b.index, 0), "shards": shards,
            "gathers_per_step": tracer.gathers_per_step(b.index),
        }
        if "allgather_post_forward" in in_situ:
            entry["post_forward_wire_bytes"] = wire[n + i].item() or entry["raw_bytes"]
        if tracer.all_reduces:
            entry["allreduce_bytes"] = tracer.all_reduce_bytes(b.index)
        doc["buckets"].append(entry)
    return doc
