"""summary.json of a ``ciera train`` run, made on rank 0 from the trainings' per-step results;
other tools and docs read its keys, so they stay as they are."""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

from ciera import fsdp
from ciera.train.metrics import BASELINE, CONTROL, PLAIN, Run, RunCheck
from ciera.train import options, schemes
from ciera.train.options import budget_bytes


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ms(seconds):
    return seconds * 1e3 if seconds is not None else None


def _ratio(base_s, ours_s):
    return base_s / ours_s if base_s is not None and ours_s else None


def steady_steps(warmup: int, first: int, steps: int) -> slice:
    """The steady state within a process's results (which hold steps first+1..steps, 1-based):
    the steps after --warmup. Byte figures cover these."""
    return slice(max(0, warmup - first), steps - first)


def timed_steps(warmup: int, first: int, steps: int) -> slice:
    """The steps the time figures are medians of: the steady ones less each process's first step
    (the first after a --resume too). A process's first training step is about twice as slow
    as the next (memory and caches warming up), and the order of the trainings rotates from
    step 0, so the baseline always takes it: counted, it made CIERA look faster than it is.
    Empty when no other step is left (then every time figure is None: not measured)."""
    return slice(max(1, warmup - first), steps - first)


def mean_per_step(xs) -> int:
    """Bytes per step over the steps `xs` holds: their mean, rounded (0 for none). Byte figures
    are means, so that they give the ratios of sums printed beside them."""
    return round(sum(xs) / len(xs)) if xs else 0


def _compare(base: Run, run: Run, check: RunCheck) -> list[int]:
    """Fills `check` with this rank's differences between two trainings; returns, per step,
    whether their losses differ (1) or not (0)."""
    # strict: two trainings of different lengths, or of different parameter lists, are a bug to
    # raise, not a comparison of their common prefix to report as identical.
    differs = [int(x != y) for x, y in zip(base.results["loss_bits"], run.results["loss_bits"], strict=True)]
    check.loss_mismatches = sum(differs)
    check.param_bytes_mismatched = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
                                       for x, y in zip(base.final, run.final, strict=True))
    return differs


def check_runs(runs: dict, handles: dict, names: list[str]) -> tuple[list[RunCheck], list[int], list[list[int]]]:
    """Per CIERA run: its RunCheck against the baseline summed over ranks, the peak codec state of
    any rank, and per step whether any rank's loss differs from the baseline's (1) or not (0;
    every step 1 without a baseline: nothing was compared). Collective."""
    base = runs.get(BASELINE)
    checks, peaks = [], torch.zeros(len(names), dtype=torch.int64)
    steps = len(runs[names[0]].results["loss_bits"])
    differing = torch.ones(len(names), steps, dtype=torch.int64)   # per run and step: any rank's loss differs
    for i, name in enumerate(names):
        run, check = runs[name], RunCheck()
        if base:
            differing[i] = torch.tensor(_compare(base, run, check), dtype=torch.int64)
        check.wrong_bytes = handles[name].wrong_bytes
        check.verified_bytes = handles[name].verified_bytes
        checks.append(check)
        peaks[i] = run.peak_cache_bytes
    checks = RunCheck.sum_over_ranks(checks)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    dist.all_reduce(differing, op=dist.ReduceOp.MAX)
    return checks, [int(p) for p in peaks], differing.tolist()


def parameter_drift(runs: dict, names: list[str]) -> list[float | None]:
    """Per training: max |parameter - FSDP2's parameter| over every final (FP32 master) value, on
    any rank; None without a baseline. NaN where either holds a NaN the other does not. Collective."""
    base = runs.get(BASELINE)
    if base is None:
        return [None] * len(names)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    drift = torch.zeros(len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        for x, y in zip(base.final, runs[name].final):
            if x.numel():
                same = x.view(bits[x.element_size()]) == y.view(bits[y.element_size()])
                d = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
                drift[i] = max(float(drift[i]), float(torch.where(same, 0.0, d).max()))
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    return [float(v) for v in drift]


def check_control(runs: dict) -> bool | None:
    """Whether the control (--control: plain FSDP2 trained a second time) matched the baseline's
    losses and final parameters bit for bit on every rank; None without a control. Collective."""
    if CONTROL not in runs:
        return None
    check = RunCheck()
    _compare(runs[BASELINE], runs[CONTROL], check)
    total = RunCheck.sum_over_ranks([check])[0]
    return total.loss_mismatches == 0 and total.param_bytes_mismatched == 0


def selection_fields(handle) -> dict:
    """What the selector chose (every shard when there is none), for summary.json."""
    selection = handle.selector.selection if handle.selector else None
    if selection is None:
        n = sum(len(b.params) for b in handle.buckets)
        return {"selected_shards": n, "candidate_shards": n}
    shards = selection.shards
    chosen = [x for x in shards if x.chosen]
    return {
        "selected_shards": len(chosen),
        "candidate_shards": len(shards),
        "selected_by_type": {t: sum(1 for x in chosen if x.type == t) for t in sorted({x.type for x in shards})},
        "selection_table": fsdp.selection_table(selection),
        "selection_step": handle.selector.selection_step,
        "selection": [{k: getattr(x, k) for k in ("name", "type", "value_change_rate", "block_change_rate", "gain_s",
                                                  "memory_bytes", "chosen", "reason")}
                      for x in shards],
        "selections": handle.selector.history,
    }


def exactness_fields(described: dict, differing: dict, lossless: list[str], compared: bool) -> dict:
    """The top-level verdicts and the counts beside them, over the same trainings so that they
    agree: the lossless ones, each of which must match the baseline (not just the main one), their
    counts summed and steps_identical the steps at which every one matched; where every training is
    lossy, the verdicts false (nothing here is exact) and the counts over every training. Without a
    baseline (`compared` false) the verdicts are None: nothing was compared. `described`:
    describe_run()'s fields per training; `differing`: check_runs()'s per-step flags per training."""
    judged = lossless or list(described)
    rows = [described[name] for name in judged]
    return {
        "losses_identical": bool(lossless) and all(r["losses_identical"] for r in rows) if compared else None,
        "params_identical": bool(lossless) and all(r["params_identical"] for r in rows) if compared else None,
        "loss_mismatches": sum(r["loss_mismatches"] for r in rows),
        "param_bytes_mismatched": sum(r["param_bytes_mismatched"] for r in rows),
        "steps_compared": rows[0]["steps_compared"],
        "steps_identical": sum(1 for step in zip(*(differing[name] for name in judged)) if not any(step)),
    }


def describe_scheme(name: str, scheme: str, described: dict, run: Run, base: Run | None, drift: float | None) -> dict:
    """One gather scheme's row of the comparison (`--schemes`): what it sent, how long the
    gathers and iterations took, and how far its training went from plain FSDP2's. A lossy
    scheme is never exact, whatever its numbers; a lossless one without a baseline is neither
    (None: nothing was compared)."""
    losses = run.results["loss"]
    diffs = [abs(x - y) for x, y in zip(losses, base.results["loss"])] if base else []
    lossy = schemes.is_lossy(scheme)
    identical = described["losses_identical"] and described["params_identical"]
    return {
        "name": scheme, "run": name, "what": schemes.SCHEMES[scheme].what, "lossy": lossy,
        "exact": False if lossy else (None if base is None else identical),
        "bits_per_value": described["bits_per_value"], "ratio": described["ratio"],
        "allgather_ms": described["allgather_ms_ciera"], "allgather_speedup": described["allgather_speedup"],
        "iteration_ms": described["iteration_ms_ciera"], "iteration_speedup": described["iteration_speedup"],
        "final_loss": losses[-1],
        "max_loss_diff": max(diffs) if diffs else None,
        "max_param_diff": drift,
        "losses_identical": described["losses_identical"], "params_identical": described["params_identical"],
        "loss_mismatches": described["loss_mismatches"], "param_bytes_mismatched": described["param_bytes_mismatched"],
        "steps_identical": described["steps_identical"],
        "cache_bytes": described["cache_bytes"], "wrong_bytes": described["wrong_bytes"],
        "verified_bytes": described["verified_bytes"],
    }


def describe_run(run: Run, handle, check: RunCheck, peak: int, base: Run | None, steady: slice, timed: slice,
                 identical_steps: int) -> dict:
    """One CIERA training's part of the summary: bytes (over the `steady` steps), times and
    speedups (medians over the `timed` ones: None where there are none), exactness (None without
    a baseline: nothing was compared), selection."""
    r = run.results
    raw, wire = sum(r["raw"][steady]), sum(r["wire"][steady])
    ag, it = _median(r["allgather_s"][timed]), _median(r["iteration_s"][timed])
    ag_base = _median(base.results["allgather_s"][timed]) if base else None
    it_base = _median(base.results["iteration_s"][timed]) if base else None
    inter = mean_per_step(r["inter_node"][steady])
    inter_base = mean_per_step(base.results["inter_node"][steady]) if base else None
    return {
        "inter_node_allgather_bytes": inter,
        "inter_node_fraction": inter / inter_base if inter_base else None,
        # Medians beside a ratio of sums disagreed where a few steps differ (the adaptive
        # switch's compressed probes among raw steps).
        "allgather_raw_bytes": mean_per_step(r["raw"][steady]),
        "allgather_wire_bytes": mean_per_step(r["wire"][steady]),
        # Of the wire bytes: the engine's control records and verdicts (0 for other gathers).
        "allgather_control_bytes": mean_per_step(r["control"][steady]),
        "ratio": raw / wire if wire else None,
        "bits_per_value": 16.0 * wire / raw if raw else None,
        "allgather_ms_ciera": _ms(ag),
        "allgather_speedup": _ratio(ag_base, ag),
        "iteration_ms_ciera": _ms(it),
        "iteration_speedup": _ratio(it_base, it),
        "losses_identical": check.loss_mismatches == 0 if base else None,
        "params_identical": check.param_bytes_mismatched == 0 if base else None,
        "loss_mismatches": check.loss_mismatches, "param_bytes_mismatched": check.param_bytes_mismatched,
        "steps_compared": len(r["loss_bits"]) if base else 0, "steps_identical": identical_steps,
        "wrong_bytes": check.wrong_bytes, "verified_bytes": check.verified_bytes,
        "overlap": handle.overlap,
        "cache_bytes": peak,
        "budget_bytes": budget_bytes(run.budget_mb) if run.budget_mb is not None else None,
        **selection_fields(handle),
    }


def _communication_shares(runs: dict, timed: slice) -> dict:
    """O1: the allgather's share of the communication time (allgather + gradient reduce-scatter),
    for plain FSDP2 (and its --control), and CIERA."""
    out = {}
    for name in (BASELINE, CONTROL, "ciera"):
        if name in runs:
            key = "control" if name == CONTROL else name
            ag_s = _median(runs[name].results["allgather_s"][timed])
            rs_s = _median(runs[name].results["reduce_scatter_s"][timed])
            both = ag_s + rs_s if ag_s is not None and rs_s is not None else None
            out[f"allgather_share_{key}"] = ag_s / both if both else None
            out[f"reduce_scatter_ms_{key}"] = _ms(rs_s)
    return out


def control_fields(runs: dict, timed: slice) -> dict:
    """--control: plain FSDP2's second training, timed as the others: its times and the
    baseline's "speedup" over it. The two are the same training, so that speedup is the noise
    floor of this run's speedups (1 where the harness measures without bias); None without a
    control or without a timed step."""
    if CONTROL not in runs:
        return {}
    base, control = runs[BASELINE].results, runs[CONTROL].results
    ag, it = _median(control["allgather_s"][timed]), _median(control["iteration_s"][timed])
    return {
        "allgather_ms_control": _ms(ag), "iteration_ms_control": _ms(it),
        "allgather_speedup_control": _ratio(_median(base["allgather_s"][timed]), ag),
        "iteration_speedup_control": _ratio(_median(base["iteration_s"][timed]), it),
    }


def _links_text(a) -> str:
    """Where the ranks ran; for the link lab, with the TCP congestion control it gave their
    connections (scripts/linklab.sh: CUBIC unless CIERA_LINKLAB_CC says otherwise)."""
    if not a.link_gbit:
        return f"unshaped ({a.launcher} on one host)"
    cc = os.environ.get("CIERA_LINKLAB_CC", "cubic")
    tcp = "the host's TCP" if cc == "default" else f"TCP {cc}"
    if a.nodes and a.ranks_per_node > 1:
        return f"{a.link_gbit:g} Gbit/s per node between nodes, unshaped inside a node (link lab, {tcp})"
    return f"{a.link_gbit:g} Gbit/s (link lab, {tcp})"


def finish(program, runs: dict, handles: dict, spec, params: int) -> None:
    """Compares the trainings, collects the trace and statistics (collective), and on rank 0
    writes summary.json (and characterisation.json, the trace)."""
    a = program.args
    first = program.first_step   # results hold steps first+1..steps (1-based)
    steady = steady_steps(a.warmup, first, a.steps)
    timed = timed_steps(a.warmup, first, a.steps)
    base = runs.get(BASELINE)
    names = [n for n in runs if n not in PLAIN]
    checks, peaks, differing = check_runs(runs, handles, names)
    drifts = parameter_drift(runs, names)
    control_identical = check_control(runs)
    trace_doc = None
    if a.trace:
        from ciera.train.tracing import collect_trace

        trace_doc = collect_trace(program, runs, handles, params)
    characterisation = program.stats.gather() if program.stats is not None else None
    if program.rank != 0:
        return
    described = {name: describe_run(runs[name], handles[name], checks[i], peaks[i], base, steady, timed,
                                    differing[i].count(0))
                 for i, name in enumerate(names)}
    # The training the top-level fields describe: CIERA's, or with --schemes the first scheme.
    main_name = "ciera" if "ciera" in described else names[0]
    main = described[main_name]
    records = [json.loads(line) for line in open(program.run_dir / "metrics.jsonl")]
    rates = [r["exponent_change_rate"] for r in records
             if r["run"] == main_name and r["step"] >= a.warmup and r.get("exponent_change_rate") is not None]
    ag_base = _median(base.results["allgather_s"][timed]) if base else None
    it_base = _median(base.results["iteration_s"][timed]) if base else None
    c = runs[main_name].results
    scheme_rows = [] if a.ablation else [
        describe_scheme(name, program.scheme_of(name), described[name], runs[name], base, drifts[i])
        for i, name in enumerate(names)]
    # Exactness is asked of the lossless trainings; a lossy scheme's drift is its result.
    exact_names = [name for name in names if a.ablation or not schemes.is_lossy(program.scheme_of(name))]
    summary = {
        "model": a.model, "spec": spec.describe(), "params": params, "ranks": program.world,
        "buckets": len(handles[main_name].buckets), "links": _links_text(a),
        "rank_cores": program.rank_cores, "pin_cores": a.pin_cores,
        "topology": options.topology(a),
        "inter_node_allgather_bytes_fsdp2": mean_per_step(base.results["inter_node"][steady]) if base else None,
        "launcher": a.launcher, "device": a.device, "process_group": program.backend,
        # --schemes trains several (their names in "schemes"): no one codec is this run's.
        "transport": a.transport, "codec": None if a.schemes else a.codec,
        "steps": a.steps, "warmup": a.warmup, "lr": a.lr, "block": a.block,
        "loss_first": c["loss"][0], "loss_last": c["loss"][-1],
        "allgather_ms_fsdp2": _ms(ag_base), "iteration_ms_fsdp2": _ms(it_base),
        # The steps behind every time figure (the steady ones less each process's first).
        "timed_steps": len(range(a.steps - first)[timed]),
        **main,
        "exponent_change_rate": statistics.fmean(rates) if rates else None,  # None: no step measured it
        # Every lossless training of this run must match the baseline, not just the main one;
        # the counts beside the verdicts are over the same trainings (each one's in "schemes").
        **exactness_fields(described, dict(zip(names, differing)), exact_names, base is not None),
        "schemes": scheme_rows, "main_scheme": program.scheme_of(main_name), "main_run": main_name,
        # --verify: over every training, as the gathers each compared (the schemes' rows: each one's).
        "wrong_bytes": sum(d["wrong_bytes"] for d in described.values()),
        "verified_bytes": sum(d["verified_bytes"] for d in described.values()),
        # --control: the baseline trained twice, bitwise identical (the harness is deterministic).
        "control_identical": control_identical,
        # For comparing runs with each other (an uninterrupted run and a resumed one): each
        # training's mean loss of every step this run made, and a digest of its final parameters.
        "resumed_from": a.resume, "steps_before": first,
        "losses": {name: run.results["loss"] for name, run in runs.items()},
        "param_sha256": {name: run.digest for name, run in runs.items()},
        "memory": program.memory,
        "checkpoints": program.checkpoints,
    }
    # O5: change detection + encoding per step, and how much of the gathers' duration the
    # training did not wait for (0 with synchronous gathers; with --overlap, what CCP hid): per
    # step over every rank's gathers together, then the median of those fractions, so it is one
    # (a ratio of two medians of different steps' slowest ranks is not, and fell outside [0, 1]).
    summary["detect_encode_ms_ciera"] = _ms(_median(c["encode_s"][timed]))
    summary["allgather_hidden_fraction_ciera"] = _median(c["hidden_fraction"][timed])
    summary.update(_communication_shares(runs, timed))
    summary.update(control_fields(runs, timed))
    if characterisation is not None:
        (program.run_dir / "characterisation.json").write_text(json.dumps(characterisation, indent=1))
        summary["characterisation"] = characterisation["summary"]
    if trace_doc is not None:
        measured = {
            "baseline": {"iteration_s": it_base, "allgather_s": ag_base},
            "ciera": {"iteration_s": _median(c["iteration_s"][timed]), "allgather_s": _median(c["allgather_s"][timed])},
        }
        # Optional in a trace: left out where no step was timed (null is no time the simulator takes).
        measured = {k: v for k, v in measured.items() if None not in v.values()}
        if measured:
            trace_doc["measured"] = measured
        from ciera import trace

        trace.write(a.trace, trace_doc)
        summary["trace"] = a.trace
    if a.ablation:
        summary["ablation"] = [{"config": {"er": "+ER (all shards)", "bsc": "+BSC", "ciera": "+CCP"}[n],
                                **{k: described[n][k] for k in (
                                    "allgather_ms_ciera", "allgather_speedup", "iteration_ms_ciera",
                                    "iteration_speedup", "ratio", "cache_bytes", "selected_shards",
                                    "losses_identical")}} for n in names]
    (program.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
