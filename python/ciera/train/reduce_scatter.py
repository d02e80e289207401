"""``ciera train --reduce-scatter ciera``: the gradient reduce-scatter through CIERA's lossless
collectives, measured against its uncompressed twin; FSDP2's (ciera.fsdp.enable_reduce_scatter)
or, with ``--framework deepspeed``, ZeRO-3's (ciera.deepspeed.enable_reduce_scatter).

Three trainings from the same seed on the same batches, one step of each in turn:

* ``plain-deterministic``: the reduce-scatter in CIERA's documented rank order, parts sent raw;
* ``ciera``: the same reduction, parts exponent-coded where smaller (``--reduce-scatter auto``:
  coded or raw, whichever the ranks measure faster);
* ``fsdp2`` (``zero3``): the framework's own reduce-scatter (gloo), for reference.

Every training gathers parameters with the framework's own all-gather, so the reduce-scatter is
the only difference. ``losses_identical`` and ``params_identical`` compare ``ciera`` with
``plain-deterministic``, which must match bit for bit; ``reduce_scatter_ratio`` and
``reduce_scatter_speedup`` are that pair's byte and time ratios. The framework's own reduction
adds in another order, so its results differ in the last bits: ``max_loss_diff_vs_fsdp2`` and
``max_param_diff_vs_fsdp2`` (``..._zero3``) say by how much."""

from __future__ import annotations

import json
from functools import partial

import torch
import torch.distributed as dist

from ciera import fsdp
from ciera.train import options, pair
from ciera.train.metrics import BASELINE, Run, StepMetrics
from ciera.train.summary import parameter_drift

TWIN = "plain-deterministic"   # the same rank-order reduction, uncompressed: the baseline arm
CIERA = "ciera"

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _enable(run: Run, a, enable) -> None:
    """CIERA's reduce-scatter on `run` (`enable`: the framework's enable_reduce_scatter, bound to
    the model): the uncompressed twin, or coded as --reduce-scatter says."""
    coding = "raw" if run.name == TWIN else {"ciera": "exponent", "auto": "auto"}[a.reduce_scatter]
    run.handle = enable(coding, transport=a.transport, timeout_s=a.timeout, worker_niceness=a.worker_niceness)
    run.rs_records = run.handle.records


class Fsdp2:
    """FSDP2's trainings: the model under fully_shard, FSDP2's own all-gathers (timed)."""
    own = BASELINE    # the arm with the framework's own reduce-scatter
    label = "FSDP2"

    def __init__(self, program):
        self.program = program

    def build(self, name: str) -> Run:
        program, a = self.program, self.program.args
        model, spec = program.build(reduce_dtype=REDUCE_DTYPES[a.reduce_dtype])
        gathers = fsdp.time_plain_all_gathers(model, overlap=a.overlap)

        def take_gathers():
            taken = list(gathers)
            gathers.clear()
            return taken

        run = Run(name, model, a.lr, take_gathers)
        run.spec = spec
        run.params = sum(p.numel() for p in model.parameters())
        if name == self.own:
            run.rs_records = fsdp.time_reduce_scatters(model)
        else:
            _enable(run, a, partial(fsdp.enable_reduce_scatter, model))
        return run

    def train_step(self, run: Run, tokens):
        self.program.status.phase("forward pass")
        loss = run.model(input_ids=tokens, labels=tokens).loss
        self.program.status.phase("backward pass")
        loss.backward()
        self.program.status.phase("optimizer step")
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        return loss

    def final(self, run: Run) -> None:
        run.final = self.program.local_params(run.model)
        run.digest = self.program.param_digest(run.model)


class DeepSpeed:
    """ZeRO-3's trainings (DeepSpeed's CPU accelerator): its own all-gathers (timed); the
    gradients communicated in --reduce-dtype (DeepSpeed's communication_data_type)."""
    own = "zero3"
    label = "ZeRO-3"

    def __init__(self, program):
        from ciera.train import deepspeed as ds_train

        self.program = program
        self.ds_train = ds_train
        self.deepspeed = ds_train.start_deepspeed(program)

    def build(self, name: str) -> Run:
        import ciera.deepspeed as ciera_ds

        a = self.program.args
        engine, optimizer, spec = self.ds_train.make_engine(self.program, self.deepspeed)
        gathers = ciera_ds.time_gathers(engine)
        run = Run(name, engine, a.lr, gathers.take_records, optimizer=optimizer)
        run.spec = spec
        run.params = sum(int(p.ds_numel) for p in engine.module.parameters())
        if name == self.own:
            run.handle = ciera_ds.time_reduce_scatters(engine)
            run.rs_records = run.handle.records
        else:
            _enable(run, a, partial(ciera_ds.enable_reduce_scatter, engine))
        return run

    def train_step(self, run: Run, tokens):
        engine = run.model
        self.program.status.phase("forward pass")
        loss = engine(input_ids=tokens, labels=tokens).loss
        self.program.status.phase("backward pass")
        engine.backward(loss)
        self.program.status.phase("optimizer step")
        engine.step()
        return loss

    def final(self, run: Run) -> None:
        run.final = self.ds_train.partitions(run.model)
        run.digest = self.ds_train.digest(self.deepspeed, run.model, self.program.rank)


def step(program, framework, run: Run, step_index: int, tokens) -> dict:
    """One optimizer step of `run`; returns its line of metrics.jsonl. Its bytes are the
    reduce-scatter's: what a rank sent its peers, as values and as sent (CIERA's collectives, the
    twin's too: with the call records and verdicts beside the parts, control_bytes), the mean over
    ranks (Run.record)."""
    start = program.clock()
    loss = framework.train_step(run, tokens)
    end = program.clock()
    gathers = run.take_records()
    scatters = list(run.rs_records)
    run.rs_records.clear()
    world = program.world
    # The framework's own reduce-scatter sends (R - 1)/R of its input, uncoded, on a group of R
    # ranks (the world, or a node's ranks with FSDP2's --hsdp).
    shard = program.args.ranks_per_node if program.args.hsdp else world
    raw = sum(getattr(r, "raw_bytes", r.input_bytes * (shard - 1) // shard) for r in scatters)
    # CIERA's collectives (and the twin's) also send call records and verdicts; the framework's none.
    control = sum(getattr(r, "control_bytes", 0) for r in scatters)
    wire = sum(getattr(r, "wire_bytes", r.input_bytes * (shard - 1) // shard) for r in scatters) + control
    local = loss.detach().float()
    mine = StepMetrics(
        loss=float(local), iteration_s=end - start,
        allgather_s=sum(r.seconds if r.exposed_s < 0 else r.exposed_s for r in gathers),
        reduce_scatter_s=sum(r.seconds for r in scatters), raw_bytes=raw, wire_bytes=wire,
        changed_values=0, compared_values=0, encode_s=sum(getattr(r, "encode_s", 0.0) for r in scatters),
        gather_duration_s=sum(r.seconds for r in gathers), control_bytes=control)
    program.status.phase("metrics all-reduce")
    summed = mine.all_reduce(dist.ReduceOp.SUM)
    peak = mine.all_reduce(dist.ReduceOp.MAX)
    run.record(int(local.view(torch.int32).item()), summed, peak, mine, world)
    # The same less each call's wait for the last rank to enter it (CIERA's collectives know it;
    # the framework's own reduction does not say): the collective's own time, without the other ranks'
    # backward compute that a training step's reduce-scatter time also holds.
    after_arrival = torch.tensor([sum(r.seconds - getattr(r, "arrival_wait_s", 0.0) for r in scatters)],
                                 dtype=torch.float64)
    dist.all_reduce(after_arrival, op=dist.ReduceOp.MAX)
    run.results.setdefault("reduce_scatter_after_arrival_s", []).append(float(after_arrival))
    run.results.setdefault("reduce_scatter_calls", []).append(len(scatters))
    # Calls whose parts went coded (--reduce-scatter auto may keep some raw).
    run.results.setdefault("reduce_scatter_coded_calls", []).append(
        sum(1 for r in scatters if getattr(r, "compressed", False)))
    # Each call's busiest link (every rank has the same: every rank reads every call record).
    run.results.setdefault("reduce_scatter_busiest_link_bytes", []).append(
        (sum(getattr(r, "busiest_link_raw_bytes", 0) for r in scatters),
         sum(getattr(r, "busiest_link_wire_bytes", 0) for r in scatters)))
    record = {"run": run.name, "step": step_index, "loss": run.results["loss"][-1],
              "iteration_ms": 1e3 * peak.iteration_s, "allgather_ms": 1e3 * peak.allgather_s,
              "reduce_scatter_ms": 1e3 * peak.reduce_scatter_s, "raw_bytes": run.results["raw"][-1],
              "wire_bytes": run.results["wire"][-1], "control_bytes": run.results["control"][-1],
              "reduce_scatters": len(scatters)}
    if run.name == CIERA:
        record["ratio"] = summed.raw_bytes / max(1.0, summed.wire_bytes)
        if step_index >= program.args.warmup:   # this rank's coded parts over the steady state
            for r in scatters:
                run.coding += torch.tensor([r.coded_values, r.coded_exponent_bytes, r.exponent_entropy_bits],
                                           dtype=torch.float64)
    return record


def train_reduce_scatter(program) -> None:
    """The three trainings side by side, then the comparisons and the summary. Collective."""
    framework = DeepSpeed(program) if program.args.framework == "deepspeed" else Fsdp2(program)
    runs = {name: framework.build(name) for name in (framework.own, TWIN, CIERA)}
    for run in runs.values():
        run.coding = torch.zeros(3, dtype=torch.float64)   # coded values, their exponent bytes, entropy bits
    pair.train(program, runs, lambda _, run, i, tokens: step(program, framework, run, i, tokens), _NoCache(),
               CIERA)
    for run in runs.values():
        framework.final(run)
    finish(program, framework, runs)
    for run in runs.values():
        if getattr(run, "handle", None) is not None:
            run.handle.disable()


class _NoCache:
    """The reduce-scatter keeps no codec state between calls (stateless coding)."""
    cache_bytes = 0


def finish(program, framework, runs: dict) -> None:
    """Compares ciera with its twin on every rank (losses, each rank's FP32 master partitions bit
    for bit) and with the framework's own reduction; on rank 0 writes summary.json. Collective."""
    a = program.args
    twin, ours, own = runs[TWIN], runs[CIERA], runs[framework.own]
    # Calls a handle left to the framework's own reduction (DeepSpeed: a layout CIERA did not serve).
    passed = sum(getattr(getattr(run, "handle", None), "passed_through", 0) for run in (twin, ours))
    total, differs, (_, passed) = pair.compare(twin, ours, counts=(passed,))
    drift_vs_own = parameter_drift({BASELINE: own, CIERA: ours}, [CIERA])[0]
    identical_to_own = pair.losses_identical(own, ours)
    coding = ours.coding.clone()
    dist.all_reduce(coding)
    if program.rank != 0:
        return
    values, exponent_bytes, entropy_bits = coding.tolist()
    m = pair.steady_figures(program, twin, ours, comm="reduce_scatter_s")
    steady, timed = pair.steps(program)
    own_rs = pair.median(own.results["reduce_scatter_s"][timed])
    value_bits = 8 * torch.empty(0, dtype=REDUCE_DTYPES[a.reduce_dtype]).element_size()
    summary = {
        "mode": "reduce_scatter", **pair.common_summary(program, runs, ours, total, differs),
        "framework": a.framework, "own_run": framework.own,
        "baseline_run": TWIN, "main_run": CIERA, "reduce_scatter": a.reduce_scatter,
        "reduce_dtype": a.reduce_dtype, "params": ours.params, "reduce_scatter_passed_through": passed,
        # Calls CIERA's collectives served in the CIERA training, every step: none (every call passed
        # through) makes the comparison with the twin empty, two runs of the framework's own reduction.
        "reduce_scatter_ciera_calls": sum(ours.results["reduce_scatter_calls"]),
        "topology": options.topology(a),   # with --hsdp, the reduce-scatter runs inside each node
        "reduce_scatter_raw_bytes": m["raw"], "reduce_scatter_wire_bytes": m["wire"],
        # Of the wire bytes: the collectives' call records and verdicts (the ratio is over both).
        "reduce_scatter_control_bytes": m["control"],
        "reduce_scatter_ratio": m["ratio"],
        "reduce_scatter_bits_per_value": value_bits / m["ratio"] if m["ratio"] else None,
        # Calls a step (ZeRO-3: one per filled reduce bucket; FSDP2: one per fully_shard group).
        "reduce_scatter_calls_per_step": pair.median(ours.results["reduce_scatter_calls"][steady]),
        "reduce_scatter_steady_calls": sum(ours.results["reduce_scatter_calls"][steady]),
        "reduce_scatter_coded_calls": sum(ours.results["reduce_scatter_coded_calls"][steady]),
        **({"ds_config": framework.ds_train.ds_config(a)} if a.framework == "deepspeed" else {}),
        **pair.timing_fields(m, "reduce_scatter", "plain_deterministic"),
        # Each call's time from the moment every rank was in it (the slowest rank's sum per step).
        **after_arrival_fields(twin, ours, timed),
        # The slowest link's byte ratio: what the links allow where ranks' shards compress unevenly.
        "reduce_scatter_busiest_link_ratio": busiest_link_ratio(ours, steady),
        # The framework's own reduction ("fsdp2" or "zero3" in the names).
        f"reduce_scatter_ms_{framework.own}": pair.ms(own_rs),
        f"iteration_ms_{framework.own}": pair.ms(pair.median(own.results["iteration_s"][timed])),
        f"max_loss_diff_vs_{framework.own}": max(abs(x - y) for x, y in zip(ours.results["loss"],
                                                                            own.results["loss"])),
        f"max_param_diff_vs_{framework.own}": drift_vs_own,
        # Every rank's losses, as losses_identical compares with the twin.
        f"losses_identical_to_{framework.own}": identical_to_own,
        # The exponents of the coded parts (every rank, steady state): bits per value as sent (the
        # frame beyond the raw sign and mantissa: exponent section, header, tables, checksum) and
        # their order-0 entropy, each part with its own table as the code has.
        "coded_values": int(values),
        "exponent_bits_per_value": 8 * exponent_bytes / values if values else None,
        "exponent_entropy_per_value": entropy_bits / values if values else None,
        "exponent_overhead_vs_entropy": 8 * exponent_bytes / entropy_bits - 1 if entropy_bits else None,
    }
    (program.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def after_arrival_fields(twin, ours, timed) -> dict:
    base = pair.median(twin.results["reduce_scatter_after_arrival_s"][timed])
    mine = pair.median(ours.results["reduce_scatter_after_arrival_s"][timed])
    return {"reduce_scatter_after_arrival_ms_plain_deterministic": base * 1e3 if base is not None else None,
            "reduce_scatter_after_arrival_ms_ciera": mine * 1e3 if mine is not None else None,
            "reduce_scatter_after_arrival_speedup": pair.ratio(base, mine)}


def busiest_link_ratio(run, steady) -> float | None:
    """Over the steady steps, each call's busiest link raw over the same as sent (CollectiveStats)."""
    pairs = run.results["reduce_scatter_busiest_link_bytes"][steady]
    raw, wire = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return raw / wire if wire else None


def calls_text(s: dict) -> str:
    """", in N calls" (and ZeRO-3's bucket where --reduce-bucket-size set one) for the bytes row."""
    calls = s.get("reduce_scatter_calls_per_step")
    if calls is None:
        return ""
    bucket = (s.get("ds_config") or {}).get("zero_optimization", {}).get("reduce_bucket_size")
    return f", in {calls:g} calls" + (f" (reduce_bucket_size {bucket:,})" if bucket is not None else "")


def identical_text(s: dict, identical: bool, label: str) -> str:
    """The table's verdict on CIERA against its twin; not a "yes" where CIERA reduced nothing."""
    if s.get("reduce_scatter_ciera_calls") == 0:
        return (f"NOT TESTED: every reduce-scatter of the CIERA training went to {label}'s own (passed "
                "through), so both trainings ran that reduction")
    if not identical:
        return f"NO: {s['loss_mismatches']} loss mismatches, {s['param_bytes_mismatched']:,} bytes differ"
    return "yes: losses and every rank's FP32 master partitions bitwise identical to the same reduction uncompressed"


def render(s: dict, run_dir) -> str:
    """The table the launcher prints for a --reduce-scatter run."""
    from ciera.train.launcher import layout_row

    speedup = pair.speedup
    identical = s["losses_identical"] and s["params_identical"]
    framework = DeepSpeed if s.get("framework") == "deepspeed" else Fsdp2
    own, label = framework.own, framework.label
    rows = [
        ("model", f"{s['model']} ({s['params']:,} parameters), {s['ranks']} ranks, {label} with its own all-gather; "
                  f"{s['reduce_dtype'].upper()} gradients"),
        *(layout_row(s) if framework is Fsdp2 else []),
        *pair.run_rows(s),
        ("reduce-scatter bytes/step", f"raw {s['reduce_scatter_raw_bytes']:,}  wire {s['reduce_scatter_wire_bytes']:,}"
                                      f"{options.control_text(s.get('reduce_scatter_control_bytes'))}"
                                      f"  ratio {s['reduce_scatter_ratio'] or float('nan'):.3f}x over the steady steps "
                                      f"({s['reduce_scatter_bits_per_value'] or float('nan'):.2f} bits/value)"
                                      f"{calls_text(s)}"),
        ("  coding", f"--reduce-scatter {s['reduce_scatter']}: {s['reduce_scatter_coded_calls']} of "
                     f"{s['reduce_scatter_steady_calls']} steady-state calls sent coded parts, the rest raw"),
        ("  busiest link", f"ratio {s['reduce_scatter_busiest_link_ratio'] or float('nan'):.3f}x (the most one rank sent or "
                           "received in each call: the speedup the links allow; the byte ratio above is every "
                           "link's together)"),
        ("gradient exponents", f"{s['exponent_bits_per_value'] or float('nan'):.3f} bits/value as sent, order-0 "
                               f"entropy {s['exponent_entropy_per_value'] or float('nan'):.3f} "
                               f"({100 * (s['exponent_overhead_vs_entropy'] or float('nan')):+.2f}%)"),
        ("reduce-scatter time/step", f"deterministic raw {pair.time_text(s['reduce_scatter_ms_plain_deterministic'])} ms  CIERA "
                                     f"{pair.time_text(s['reduce_scatter_ms_ciera'])} ms  speedup "
                                     f"{speedup(s['reduce_scatter_speedup'])}  ({label}'s own "
                                     f"{pair.time_text(s[f'reduce_scatter_ms_{own}'])} ms)"),
        ("  after every rank entered", f"deterministic raw {pair.time_text(s['reduce_scatter_after_arrival_ms_plain_deterministic'])} ms  "
                                       f"CIERA {pair.time_text(s['reduce_scatter_after_arrival_ms_ciera'])} ms  speedup "
                                       f"{speedup(s['reduce_scatter_after_arrival_speedup'])}  (the rest: waiting "
                                       "for other ranks' backward)"),
        ("iteration time/step", f"deterministic raw {pair.time_text(s['iteration_ms_plain_deterministic'])} ms  CIERA "
                                f"{pair.time_text(s['iteration_ms_ciera'])} ms  speedup {speedup(s['iteration_speedup'])}"),
        ("identical", identical_text(s, identical, label)),
        (f"vs {label}'s reduction", f"max |loss diff| {s[f'max_loss_diff_vs_{own}']:.3g}, max |parameter diff| "
                                    f"{s[f'max_param_diff_vs_{own}']:.3g} (another summation order)"),
    ]
    if s.get("reduce_scatter_passed_through"):
        rows.append(("passed through", f"{s['reduce_scatter_passed_through']} reduce-scatters of the CIERA trainings "
                                       f"went to {label}'s own (a layout CIERA did not serve)"))
    rows.append(("run folder", str(run_dir)))
    return pair.table(rows)
