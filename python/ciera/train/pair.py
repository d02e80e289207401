"""What the two-training comparisons outside FSDP2 share (``ciera train --zero``: torch's ZeRO-1/2
against CIERA's; ``--framework deepspeed``: plain ZeRO-3 against CIERA's): the interleaved
training loop, the bitwise comparison over ranks, the summary fields every comparison has, and
the printed table's layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ciera.train import options
from ciera.train.metrics import Run, RunCheck
from ciera.train.summary import (_compare, _links_text, _median, _ms, _ratio, mean_per_step, steady_steps,
                                 timed_steps)


def train(program, runs: dict[str, Run], step, handle, ours: str) -> None:
    """Every step: one step of each training in turn (the order rotating every step, as
    RankProgram.train_step does), all on the same batch; the peak of `handle.cache_bytes` on the
    run `ours`, and resident memory every --rss-every steps. Collective."""
    from ciera import data

    a = program.args
    corpus = data.load_corpus()
    for step_index in range(a.steps):
        tokens = data.batch(corpus, step_index, program.rank, a.batch, a.seq_len, a.seed).to(program.device)
        order = list(runs.values())
        shift = step_index % len(order)
        for run in order[shift:] + order[:shift]:
            program.status.update("training", run.name, step_index)
            program.emit(step(program, run, step_index, tokens))
        runs[ours].peak_cache_bytes = max(runs[ours].peak_cache_bytes, handle.cache_bytes)
        done = step_index + 1
        if done == 1 or done % a.rss_every == 0 or done == a.steps:
            program.sample_memory(done, {ours: handle})
    program.status.between_steps("final comparison", a.steps)


def compare(base: Run, ours: Run, wrong_bytes: int = 0, verified_bytes: int = 0, counts: tuple = ()):
    """The two trainings compared on every rank (loss bits per step, each rank's `final` tensors
    byte for byte), summed over ranks. Returns the summed RunCheck, per step whether any rank's
    loss differs, and `counts` (ours' peak codec state first, then any others) maxed over ranks.
    Collective."""
    check = RunCheck()
    differs = torch.tensor(_compare(base, ours, check), dtype=torch.int64)
    check.wrong_bytes, check.verified_bytes = wrong_bytes, verified_bytes
    total = RunCheck.sum_over_ranks([check])[0]
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    peaks = torch.tensor([ours.peak_cache_bytes, *counts], dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return total, differs, [int(x) for x in peaks]


# The summary's rules for a median, a time in ms and a ratio of times (None where not timed).
median, ms, ratio = _median, _ms, _ratio


def steps(program) -> tuple[slice, slice]:
    """(steady, timed): the steps after --warmup, which the byte figures cover, and those less
    the process's first (summary.timed_steps), which the time figures are medians of. These
    comparisons train every step in one process."""
    a = program.args
    return steady_steps(a.warmup, 0, a.steps), timed_steps(a.warmup, 0, a.steps)


def losses_identical(base: Run, ours: Run) -> bool:
    """Whether the two trainings' losses are bitwise equal at every step on every rank (each rank
    compares its own). Collective."""
    differs = torch.tensor([int(x != y) for x, y in zip(base.results["loss_bits"], ours.results["loss_bits"])]
                           + [int(len(base.results["loss_bits"]) != len(ours.results["loss_bits"]))],
                           dtype=torch.int64)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    return not bool(differs.any())


def steady_figures(program, base: Run, ours: Run, comm: str = "allgather_s") -> dict:
    """Steady-state (after --warmup) figures of both trainings: ours' raw and wire bytes per step
    (means) and its ratio and bits per value, all three over the steady steps together (medians of
    the bytes beside a ratio of sums disagreed where a few steps differ, as the adaptive switch's
    compressed probes among raw steps); both trainings' communication (`comm`: a Run.results key)
    and iteration seconds, medians over the timed steps (None where there are none)."""
    steady, timed = steps(program)
    b, c = base.results, ours.results
    raw, wire = sum(c["raw"][steady]), sum(c["wire"][steady])
    return {
        "raw": mean_per_step(c["raw"][steady]), "wire": mean_per_step(c["wire"][steady]),
        "control": mean_per_step(c["control"][steady]),   # of "wire": the engine's records
        "ratio": raw / wire if wire else None, "bits_per_value": 16.0 * wire / raw if raw else None,
        "comm_base": median(b[comm][timed]), "comm_ours": median(c[comm][timed]),
        "iteration_base": median(b["iteration_s"][timed]), "iteration_ours": median(c["iteration_s"][timed]),
        "encode_ours": median(c["encode_s"][timed]), "timed_steps": len(c["iteration_s"][timed]),
    }


def common_summary(program, runs: dict[str, Run], ours: Run, total: RunCheck, differs) -> dict:
    """The summary fields every two-training comparison has: where it ran, its losses and
    whether the trainings are bitwise identical."""
    a = program.args
    c = ours.results
    return {
        "model": a.model, "spec": ours.spec.describe(), "ranks": program.world,
        "links": _links_text(a), "rank_cores": program.rank_cores, "pin_cores": a.pin_cores,
        "launcher": a.launcher, "device": a.device, "process_group": program.backend, "transport": a.transport,
        # --reduce-scatter: every training gathers with the framework's own all-gather, through no codec.
        "codec": a.codec if a.reduce_scatter == "fsdp2" else None,
        "steps": a.steps, "warmup": a.warmup, "lr": a.lr, "block": a.block,
        "loss_first": c["loss"][0], "loss_last": c["loss"][-1],
        "losses_identical": total.loss_mismatches == 0, "params_identical": total.param_bytes_mismatched == 0,
        "loss_mismatches": total.loss_mismatches, "param_bytes_mismatched": total.param_bytes_mismatched,
        "steps_compared": a.steps, "steps_identical": int((differs == 0).sum()),
        "wrong_bytes": total.wrong_bytes, "verified_bytes": total.verified_bytes,
        "losses": {name: run.results["loss"] for name, run in runs.items()},
        "param_sha256": {name: run.digest for name, run in runs.items()},
        "memory": program.memory,
    }


def timing_fields(m: dict, comm: str, base: str) -> dict:
    """The summary's times from steady_figures(): `{comm}_ms_{base}` and `{comm}_ms_ciera`, the
    iteration's the same way, their speedups, CIERA's encoding time (each None where no step was
    timed) and how many steps they are medians of."""
    return {
        f"{comm}_ms_{base}": ms(m["comm_base"]), f"{comm}_ms_ciera": ms(m["comm_ours"]),
        f"{comm}_speedup": ratio(m["comm_base"], m["comm_ours"]),
        f"iteration_ms_{base}": ms(m["iteration_base"]), "iteration_ms_ciera": ms(m["iteration_ours"]),
        "iteration_speedup": ratio(m["iteration_base"], m["iteration_ours"]),
        "encode_ms_ciera": ms(m["encode_ours"]), "timed_steps": m["timed_steps"],
    }


def run_rows(s: dict, steps_note: str = "") -> list[tuple[str, str]]:
    """The table rows every comparison's summary starts with after its model: links, steps (the
    steady state, and the steps timed), loss."""
    steady = min(s["warmup"], s["steps"] - 1) + 1
    n = s.get("timed_steps")
    timed = "" if n is None else f"; times over {n} step{'' if n == 1 else 's'} (not the first)" if n \
        else "; no step timed"
    return [("links", s["links"]), ("cores", options.cores_text(s)),
            ("steps", f"{s['steps']} per run; steady state = steps {steady}..{s['steps']}{steps_note}{timed}"),
            ("loss (first -> last)", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}")]


def time_text(x) -> str:
    """A time in ms for a table; "-" where no step was timed."""
    return "-" if x is None else f"{x:.1f}"


def speedup(x) -> str:
    return "-" if x is None else f"{x:.3f}x"


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
