"""``ciera train --zero``: the same MoE model trained data-parallel with DDP (gloo, CPU) and
PyTorch's ZeroRedundancyOptimizer (ZeRO-1/2: optimizer state sharded, BF16 parameters with FP32
master weights in the optimizer), twice from the same seed and data: once with PyTorch's
parameter sync (one broadcast per rank's partition), once with CIERA's (ciera.zero: one in-place
gather, value-delta frames by default). The two are interleaved step by step as the FSDP2
comparison is (RankProgram.train_step), and must end bitwise identical: every rank holds the full
parameters, so every rank compares all of them.

Per step and training it records the loss, the iteration time, the time of the parameter sync
alone (``_sync_params`` wrapped) and the bytes it moved; rank 0 writes metrics.jsonl and
summary.json (``mode: zero``) as the FSDP2 comparison does."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import ciera
from ciera.train import options, pair
from ciera.train.metrics import Run, StepMetrics

PLAIN_ZERO = "zero"      # torch's ZeroRedundancyOptimizer: the baseline
CIERA_ZERO = "ciera"     # the same, its parameter sync through CIERA


def _time_sync(optimizer, records: list, clock) -> None:
    """Wraps the optimizer's parameter sync (the part of step() that communicates) so that
    each call's duration lands in `records`; the local optimizer step is not included."""
    sync = optimizer._sync_params

    def timed_sync():
        start = clock()
        sync()
        records.append(clock() - start)

    optimizer._sync_params = timed_sync


def _sync_bytes(model) -> int:
    """What PyTorch's broadcasts deliver to every rank each step: all trainable parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def build(program, name: str) -> Run:
    """One training: the model in BF16 from the seed, DDP over the world group (gloo), and
    ZeroRedundancyOptimizer with FP32-master Adam: PyTorch's for the baseline, CIERA's for the
    other."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel

    from ciera import models, zero

    a = program.args
    spec = models.ModelSpec(family=a.model, hidden=a.hidden, layers=a.layers, experts=a.experts,
                            expert_intermediate=a.expert_intermediate, max_positions=max(1024, a.seq_len))
    module = models.build(spec, a.seed).to(torch.bfloat16)
    # The buffers (rotary frequencies) are built from the seed on every rank alike: no need for
    # DDP to broadcast them before every forward pass.
    ddp = DistributedDataParallel(module, broadcast_buffers=False)
    optimizer_class = zero.fp32_master(torch.optim.Adam)
    if name == PLAIN_ZERO:
        optimizer = TorchZero(ddp.parameters(), optimizer_class, parameters_as_bucket_view=True, lr=a.lr)
    else:
        config = ciera.EngineConfig()
        config.codec.block_values = a.block
        config.warmup_steps = 0   # a value-delta stream needs none; exponent reuse is exact without
        config.adaptive = a.codec == "auto"
        config.worker_threads = a.threads
        config.timeout_s = a.timeout
        optimizer = zero.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class, transport=a.transport,
                                                 engine_config=config, policy=policy(a), lr=a.lr)
    syncs: list[float] = []
    _time_sync(optimizer, syncs, program.clock)

    def take_records():
        taken = list(syncs)
        syncs.clear()
        return taken

    run = Run(name, ddp, a.lr, take_records, optimizer=optimizer)
    run.spec = spec
    run.raw_bytes = _sync_bytes(module)
    return run


def policy(args) -> str:
    """The shard policy of CIERA's sync for --codec: delta (also under auto, which then lets the
    engine fall back to raw where coding does not pay) or ciera (exponent reuse)."""
    return "ciera" if args.codec == "ciera" else "delta"


def step(program, run: Run, step_index: int, tokens) -> dict:
    """One optimizer step of `run`; returns its line of metrics.jsonl."""
    program.status.phase("forward pass")
    start = program.clock()
    loss = run.model(input_ids=tokens, labels=tokens).loss
    program.status.phase("backward pass")
    loss.backward()            # DDP all-reduces the gradients
    backward_done = program.clock()
    program.status.phase("optimizer step")
    run.optimizer.step()       # this rank's partition, then the parameter sync
    run.optimizer.zero_grad(set_to_none=True)
    end = program.clock()
    sync_s = sum(run.take_records())
    last = getattr(run.optimizer, "last_sync", None)   # CIERA's: what the engine moved
    raw = last.raw_bytes if last is not None else run.raw_bytes
    control = last.control_bytes if last is not None else 0
    wire = last.wire_bytes + control if last is not None else run.raw_bytes   # all the engine sent
    local = loss.detach().float()
    mine = StepMetrics(loss=float(local), iteration_s=end - start, allgather_s=sync_s, reduce_scatter_s=0.0,
                       raw_bytes=raw, wire_bytes=wire, changed_values=0, compared_values=0,
                       encode_s=last.encode_s if last is not None else 0.0, gather_duration_s=sync_s,
                       control_bytes=control)
    program.status.phase("metrics all-reduce")
    summed = mine.all_reduce(dist.ReduceOp.SUM)
    peak = mine.all_reduce(dist.ReduceOp.MAX)
    run.record(int(local.view(torch.int32).item()), summed, peak, mine, program.world)
    record = {"run": run.name, "step": step_index, "loss": run.results["loss"][-1],
              "iteration_ms": 1e3 * peak.iteration_s, "sync_ms": 1e3 * peak.allgather_s,
              "allgather_ms": 1e3 * peak.allgather_s, "raw_bytes": raw, "wire_bytes": wire, "control_bytes": control,
              # this rank's forward + backward (DDP's gradient all-reduce included), and its step
              "forward_backward_ms": 1e3 * (backward_done - start), "optimizer_step_ms": 1e3 * (end - backward_done)}
    if run.name == CIERA_ZERO:
        record["ratio"] = raw / max(1.0, wire)
        record["bits_per_value"] = 16.0 * wire / max(1.0, raw)
    return record


def train_zero(program) -> None:
    """Both trainings side by side, one step of each in turn, then the comparison and the
    summary. Collective."""
    runs = {name: build(program, name) for name in (PLAIN_ZERO, CIERA_ZERO)}
    optimizer = runs[CIERA_ZERO].optimizer
    pair.train(program, runs, step, optimizer, CIERA_ZERO)
    for run in runs.values():
        # ZeRO-1/2 replicate the parameters: every rank's copy is the whole model.
        run.final = program.local_params(run.model.module)
        run.digest = program.param_digest(run.model.module)
    finish(program, runs)
    optimizer.close()


def finish(program, runs: dict) -> None:
    """Compares the two trainings on every rank (losses and all parameters, bit for bit), and
    on rank 0 writes summary.json. Collective."""
    base, ours = runs[PLAIN_ZERO], runs[CIERA_ZERO]
    total, differs, (peak,) = pair.compare(base, ours)
    if program.rank != 0:
        return
    m = pair.steady_figures(program, base, ours)
    values = ours.raw_bytes // 2   # BF16
    summary = {
        "mode": "zero", **pair.common_summary(program, runs, ours, total, differs), "params": values,
        "policy": ours.optimizer.policy,
        "optimizer": "Adam on FP32 masters of BF16 parameters (ciera.zero.fp32_master)",
        "values_per_rank": [int(n) for n in ours.optimizer._syncs[0].counts] if ours.optimizer._syncs else [],
        "sync_raw_bytes": m["raw"], "sync_wire_bytes": m["wire"], "sync_control_bytes": m["control"],
        "first_sync_wire_bytes": int(ours.results["wire"][0]),
        "ratio": m["ratio"], "bits_per_value": m["bits_per_value"],
        **pair.timing_fields(m, "sync", "zero"),
        "cache_bytes": peak,
    }
    (program.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def render(s: dict, run_dir) -> str:
    """The table the launcher prints for a --zero run."""
    speedup = pair.speedup
    identical = s["losses_identical"] and s["params_identical"]
    rows = [
        ("model", f"{s['model']} ({s['params']:,} BF16 parameters), {s['ranks']} ranks, DDP + ZeRO-1/2 "
                  f"(Adam on FP32 masters); values per rank {', '.join(f'{n:,}' for n in s['values_per_rank'])}"),
        *pair.run_rows(s, " (step 1 carries the key frames)" if s["warmup"] == 1 else ""),
        ("sync bytes/step", f"raw {s['sync_raw_bytes']:,}  wire {s['sync_wire_bytes']:,}"
                            f"{options.control_text(s.get('sync_control_bytes'))}  ratio "
                            f"{s['ratio'] or float('nan'):.3f}x ({s['bits_per_value'] or float('nan'):.3f} bits/value, "
                            f"policy {s['policy']}; first sync {s['first_sync_wire_bytes']:,})"),
        ("param sync time/step", f"torch ZeRO {pair.time_text(s['sync_ms_zero'])} ms  CIERA {pair.time_text(s['sync_ms_ciera'])} ms  "
                                 f"speedup {speedup(s['sync_speedup'])}"),
        ("iteration time/step", f"torch ZeRO {pair.time_text(s['iteration_ms_zero'])} ms  CIERA {pair.time_text(s['iteration_ms_ciera'])} ms  "
                                f"speedup {speedup(s['iteration_speedup'])}"),
        ("encode", f"{pair.time_text(s['encode_ms_ciera'])} ms/step on the slowest rank"),
        ("codec state (peak)", f"{s['cache_bytes'] / 2**20:.2f} MiB per rank"),
        ("identical", "yes: losses and parameters (every rank's full copy) bitwise identical to torch's ZeRO"
                      if identical else f"NO: {s['loss_mismatches']} loss mismatches, "
                                        f"{s['param_bytes_mismatched']:,} parameter bytes differ"),
        ("run folder", str(run_dir)),
    ]
    return pair.table(rows)
