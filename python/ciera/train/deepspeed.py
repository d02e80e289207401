"""``ciera train --framework deepspeed``: the same MoE model trained with DeepSpeed ZeRO-3 (its CPU
accelerator, gloo) twice from the same seed and batches: once with DeepSpeed's own parameter
all-gathers (timed, unchanged), once with them through CIERA (ciera.deepspeed.enable). The two
are interleaved step by step as the FSDP2 comparison is, and must end bitwise identical: the
losses at every step, and every rank's partitions of the BF16 parameters and of the optimizer's
FP32 masters.

Rank 0 writes metrics.jsonl and summary.json (``mode: deepspeed``) with the FSDP2 job's fields
(losses_identical, params_identical, ratio, bits_per_value, allgather_speedup, ...), the
baseline's named ``zero3``."""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist

import ciera
from ciera.train import options, pair, schemes
from ciera.train.metrics import Run, StepMetrics, sent_bytes

PLAIN = "zero3"    # DeepSpeed ZeRO-3's own gathers: the baseline
CIERA = "ciera"    # the same, its gathers through CIERA


def start_deepspeed(program):
    """DeepSpeed on this rank's existing process group (gloo). Its CPU accelerator would JIT-build
    a shared-memory all-reduce used only for inference: switched off."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(program.rank), WORLD_SIZE=str(program.world), LOCAL_RANK=str(program.local_rank),
                      LOCAL_SIZE=str(program.local_ranks))
    import logging

    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def ds_config(args) -> dict:
    """ZeRO-3 with BF16 parameters, DeepSpeed's defaults otherwise (prefetching, persistence);
    with --reduce-scatter, the gradients reduced in --reduce-dtype (communication_data_type);
    with --reduce-bucket-size, that many values reduced per call (reduce_bucket_size)."""
    zero = {"stage": 3}
    if getattr(args, "reduce_bucket_size", None) is not None:
        zero["reduce_bucket_size"] = args.reduce_bucket_size
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    if getattr(args, "reduce_scatter", "fsdp2") != "fsdp2":
        config["communication_data_type"] = args.reduce_dtype
    return config


def engine_config(a) -> ciera.EngineConfig:
    config = ciera.EngineConfig()
    config.codec.block_values = a.block
    # The engine's warmup counts a bucket's gathers (about two a step under ZeRO-3): --warmup
    # counts steps, so exponent reuse starts at step --warmup by policy instead (train_deepspeed),
    # as under FSDP2. Value-delta frames start at once (their first frame carries the values), and
    # under a budget the selector keeps every shard raw until it selects.
    config.warmup_steps = 0
    config.adaptive = a.codec == "auto"
    config.worker_threads = a.threads
    config.timeout_s = a.timeout
    return config


def gather_options(a) -> dict:
    """What ciera.deepspeed.enable() is given beside the engine configuration, as for FSDP2:
    --budget-mb: the selector, after --warmup steps, among raw and exponent reuse (and value-delta
    frames with --codec delta); else --codec delta: every parameter in value-delta frames; else
    raw until step --warmup, then exponent reuse (train_deepspeed). Always in flight, as
    DeepSpeed's own gathers are: its prefetching overlaps them with compute."""
    from ciera.train.options import budget_bytes

    if a.budget_mb is not None:
        return {"cache_budget_bytes": budget_bytes(a.budget_mb), "select_after_steps": a.warmup,
                "reselect_every": a.reselect_every, "allow_delta": a.codec == "delta"}
    first = schemes.first_policy(a.codec)   # raw until warmup ends, for exponent reuse
    return {"policy": lambda bucket, param: first}


def make_engine(program, deepspeed):
    """The model in BF16 from the seed, Adam, DeepSpeed ZeRO-3: (engine, optimizer, spec)."""
    from ciera import models

    a = program.args
    spec = models.ModelSpec(family=a.model, hidden=a.hidden, layers=a.layers, experts=a.experts,
                            expert_intermediate=a.expert_intermediate, max_positions=max(1024, a.seq_len))
    module = models.build(spec, a.seed).to(torch.bfloat16)
    optimizer = torch.optim.Adam(module.parameters(), lr=a.lr)
    engine, optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config(a))
    return engine, optimizer, spec


def build(program, deepspeed, name: str):
    """One training: make_engine's, its gathers timed (the baseline) or through CIERA. Returns the
    Run and the handle."""
    import ciera.deepspeed as ciera_ds

    a = program.args
    engine, optimizer, spec = make_engine(program, deepspeed)
    if name == PLAIN:
        handle = ciera_ds.time_gathers(engine)
    else:
        handle = ciera_ds.enable(engine, engine_config(a), transport=a.transport, verify=a.verify,
                                 overlap=True, **gather_options(a))
    run = Run(name, engine, a.lr, handle.take_records, optimizer=optimizer)
    run.spec = spec
    run.params = sum(int(p.ds_numel) for p in engine.module.parameters())
    return run, handle


def step(program, run: Run, step_index: int, tokens) -> dict:
    """One optimizer step of `run`; returns its line of metrics.jsonl."""
    engine = run.model
    program.status.phase("forward pass")
    start = program.clock()
    loss = engine(input_ids=tokens, labels=tokens).loss
    program.status.phase("backward pass")
    engine.backward(loss)
    program.status.phase("optimizer step")
    engine.step()
    end = program.clock()
    records = run.take_records()
    local = loss.detach().float()
    mine = StepMetrics(
        loss=float(local), iteration_s=end - start,
        allgather_s=sum(r.seconds if r.exposed_s < 0 else r.exposed_s for r in records), reduce_scatter_s=0.0,
        raw_bytes=sum(r.raw_bytes for r in records), wire_bytes=sent_bytes(records),
        changed_values=0, compared_values=0, encode_s=sum(r.encode_s for r in records),
        gather_duration_s=sum(r.seconds for r in records), control_bytes=sum(r.control_bytes for r in records))
    program.status.phase("metrics all-reduce")
    summed = mine.all_reduce(dist.ReduceOp.SUM)
    peak = mine.all_reduce(dist.ReduceOp.MAX)
    run.record(int(local.view(torch.int32).item()), summed, peak, mine, program.world)
    record = {"run": run.name, "step": step_index, "loss": run.results["loss"][-1],
              "iteration_ms": 1e3 * peak.iteration_s, "allgather_ms": 1e3 * peak.allgather_s,
              # the mean over ranks, as every mode's records (Run.record)
              "raw_bytes": run.results["raw"][-1], "wire_bytes": run.results["wire"][-1],
              "control_bytes": run.results["control"][-1], "gathers": len(records)}
    if run.name == CIERA:
        record["ratio"] = summed.raw_bytes / max(1.0, summed.wire_bytes)
        record["bits_per_value"] = 16.0 * summed.wire_bytes / max(1.0, summed.raw_bytes)
    return record


def partitions(engine) -> list[torch.Tensor]:
    """This rank's state of a ZeRO-3 training: its partition of every BF16 parameter (ds_id order)
    and of the optimizer's FP32 masters."""
    params = sorted((p for p in engine.module.parameters() if hasattr(p, "ds_tensor")), key=lambda p: p.ds_id)
    masters = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])
    return [p.ds_tensor.detach().clone() for p in params] + [m.detach().clone() for m in masters]


def digest(deepspeed, engine, rank: int) -> str | None:
    """sha256 of the full BF16 parameters (names, shapes, bytes), gathered by DeepSpeed, on rank 0.
    Collective."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            if rank == 0:
                h.update(f"{name} {tuple(p.ds_shape)} {p.dtype}\n".encode())
                h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest() if rank == 0 else None


def train_deepspeed(program) -> None:
    """Both trainings side by side, one step of each in turn, then the comparison and the
    summary. Collective."""
    deepspeed = start_deepspeed(program)
    built = {name: build(program, deepspeed, name) for name in (PLAIN, CIERA)}
    runs = {name: run for name, (run, _) in built.items()}
    handle = built[CIERA][1]
    a = program.args

    def stepped(program, run: Run, step_index: int, tokens) -> dict:
        if (run.name == CIERA and step_index == a.warmup and a.budget_mb is None
                and schemes.switches_after_warmup(a.codec)):
            schemes.end_warmup(handle)   # warmup over: every parameter through exponent reuse
        return step(program, run, step_index, tokens)

    pair.train(program, runs, stepped, handle, CIERA)
    for run in runs.values():
        run.final = partitions(run.model)
        run.digest = digest(deepspeed, run.model, program.rank)
    finish(program, runs, handle, deepspeed.__version__)
    for _, h in built.values():
        h.disable()


def finish(program, runs: dict, handle, version: str) -> None:
    """Compares the two trainings on every rank (losses, and each rank's partitions bit for bit),
    and on rank 0 writes summary.json. Collective."""
    base, ours = runs[PLAIN], runs[CIERA]
    total, differs, (peak, passed_through) = pair.compare(base, ours, handle.wrong_bytes, handle.verified_bytes,
                                                          (handle.passed_through,))
    if program.rank != 0:
        return
    from ciera.train.options import budget_bytes
    from ciera.train.summary import selection_fields

    a = program.args
    m = pair.steady_figures(program, base, ours)
    summary = {
        "mode": "deepspeed", **pair.common_summary(program, runs, ours, total, differs),
        "framework": "deepspeed", "deepspeed_version": version, "params": ours.params,
        "overlap": True, "ds_config": ds_config(program.args), "baseline_run": PLAIN, "main_run": CIERA,
        "buckets": len(handle.buckets),
        "allgather_raw_bytes": m["raw"], "allgather_wire_bytes": m["wire"], "allgather_control_bytes": m["control"],
        "ratio": m["ratio"], "bits_per_value": m["bits_per_value"],
        **pair.timing_fields(m, "allgather", "zero3"),
        "cache_bytes": peak, "passed_through": passed_through,
        "budget_bytes": budget_bytes(a.budget_mb) if a.budget_mb is not None else None,
        **selection_fields(handle),
    }
    (program.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _codec_line(s: dict) -> str:
    if s["budget_bytes"] is None:
        return {"ciera": "exponent reuse after warmup", "auto": "exponent reuse or raw, whichever is faster",
                "delta": "value-delta frames from the first step"}[s["codec"]]
    choices = "raw, exponent reuse and value-delta frames" if s["codec"] == "delta" else "raw and exponent reuse"
    return (f"the selector, after warmup, among {choices}: {s['selected_shards']} of {s['candidate_shards']} "
            "parameters coded")


def render(s: dict, run_dir) -> str:
    """The table the launcher prints for a --framework deepspeed run."""
    speedup = pair.speedup
    identical = s["losses_identical"] and s["params_identical"]
    rows = [
        ("model", f"{s['model']} ({s['params']:,} BF16 parameters), {s['ranks']} ranks, DeepSpeed "
                  f"{s['deepspeed_version']} ZeRO-3 ({s['buckets']} parameters, one engine bucket each)"),
        *pair.run_rows(s),
        ("allgather bytes/step", f"raw {s['allgather_raw_bytes']:,}  wire {s['allgather_wire_bytes']:,}"
                                 f"{options.control_text(s.get('allgather_control_bytes'))}  ratio "
                                 f"{s['ratio'] or float('nan'):.3f}x ({s['bits_per_value'] or float('nan'):.3f} "
                                 "bits/value)"),
        ("allgather time/step", f"ZeRO-3 {pair.time_text(s['allgather_ms_zero3'])} ms  CIERA {pair.time_text(s['allgather_ms_ciera'])} ms  "
                                f"speedup {speedup(s['allgather_speedup'])}"),
        ("iteration time/step", f"ZeRO-3 {pair.time_text(s['iteration_ms_zero3'])} ms  CIERA {pair.time_text(s['iteration_ms_ciera'])} ms  "
                                f"speedup {speedup(s['iteration_speedup'])}"),
        ("codec state (peak)", f"{s['cache_bytes'] / 2**20:.2f} MiB per rank" +
                               (f" (budget {s['budget_bytes'] / 2**20:.2f} MiB)" if s["budget_bytes"] is not None else "")),
        ("codec", _codec_line(s)),
        ("identical", "yes: losses and every rank's parameter and FP32 master partitions bitwise identical to "
                      "plain ZeRO-3's" if identical else
                      f"NO: {s['loss_mismatches']} loss mismatches, {s['param_bytes_mismatched']:,} bytes differ"),
    ]
    if s["verified_bytes"]:
        rows.append(("verify", f"{s['wrong_bytes']:,} wrong bytes of {s['verified_bytes']:,} compared with "
                               "torch's all-gather"))
    if s["passed_through"]:
        rows.append(("passed through", f"{s['passed_through']} gathers went to DeepSpeed's own all-gather"))
    rows.append(("run folder", str(run_dir)))
    return pair.table(rows)
