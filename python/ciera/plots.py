"""PNG plots of a `ciera train` run folder: loss of the CIERA run over the baseline, wire bits per
value, and the exponent change rate per step; with several gather schemes (--schemes), every
scheme's loss curve and its loss difference to FSDP2 per step."""

from __future__ import annotations

import json
from pathlib import Path


def _series(run_dir: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for line in open(run_dir / "metrics.jsonl"):
        rec = json.loads(line)
        runs.setdefault(rec["run"], []).append(rec)
    return runs


def write_all(run_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _series(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    title = f"{summary['model']}, {summary['ranks']} ranks, {summary['links']}"
    written = []
    main = summary.get("main_run", "ciera")
    label = "CIERA" if summary.get("main_scheme", "ciera") in ("ciera", "auto", "delta") else summary["main_scheme"]

    # The baseline: FSDP2's own all-gather, or DeepSpeed ZeRO-3's (--framework deepspeed).
    base = summary.get("baseline_run", "fsdp2")
    base_label = "DeepSpeed ZeRO-3" if base == "zero3" else "FSDP2"
    fig, ax = plt.subplots(figsize=(7, 4))
    if base in runs:
        ax.plot([r["step"] + 1 for r in runs[base]], [r["loss"] for r in runs[base]], lw=4, alpha=0.35,
                label=f"{base_label} all-gather (baseline)")
    ax.plot([r["step"] + 1 for r in runs[main]], [r["loss"] for r in runs[main]], lw=1.2, color="black",
            label=f"{label} all-gather")
    ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=title)
    if base in runs:  # with --no-baseline nothing was compared
        verdict = "bitwise identical" if summary["losses_identical"] else "NOT identical"
        ax.text(0.98, 0.95, f"losses {verdict}", transform=ax.transAxes, ha="right", va="top")
    ax.legend(loc="lower left")
    written.append(_save(fig, run_dir / "loss.png"))

    ciera = [r for r in runs[main] if r.get("bits_per_value")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] + 1 for r in ciera], [r["bits_per_value"] for r in ciera], marker=".", color="tab:blue")
    ax.axhline(16, color="grey", ls="--", lw=1, label="raw BF16 (16 bits)")
    ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1, label="end of warmup")
    ax.set(xlabel="step", ylabel="wire bits per value", title=title, ylim=(0, 17))
    ax.legend(loc="lower left")
    written.append(_save(fig, run_dir / "bits_per_value.png"))

    rates = [r for r in runs[main] if r.get("exponent_change_rate") is not None]
    if rates:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] + 1 for r in rates], [100 * r["exponent_change_rate"] for r in rates], marker=".",
                color="tab:red")
        ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1)
        ax.set(xlabel="step", ylabel="exponents changed since last step (%)", title=title)
        written.append(_save(fig, run_dir / "exponent_change_rate.png"))
    schemes = summary.get("schemes") or []
    if "fsdp2" in runs and (len(schemes) > 1 or any(x["lossy"] for x in schemes)):
        written += _scheme_plots(plt, runs, summary, title, run_dir)
    return written


def _scheme_plots(plt, runs: dict, summary: dict, title: str, run_dir: Path) -> list[str]:
    """Every scheme's loss curve beside FSDP2's, and |loss - FSDP2 loss| per step on a log scale
    (a scheme bitwise identical to FSDP2 has no point there, and says so in the legend)."""
    base = {r["step"]: r["loss"] for r in runs["fsdp2"]}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([k + 1 for k in sorted(base)], [base[k] for k in sorted(base)], lw=4, alpha=0.3, color="grey",
            label="fsdp2 (plain)")  # steps from 1, as every curve here
    for x in summary["schemes"]:
        recs = runs[x["run"]]
        ax.plot([r["step"] + 1 for r in recs], [r["loss"] for r in recs], lw=1.1,
                ls="--" if x["lossy"] else "-", label=x["name"] + (" (lossy)" if x["lossy"] else ""))
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=title)
    ax.legend(loc="upper right", fontsize=8)
    written = [_save(fig, run_dir / "schemes_loss.png")]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for x in summary["schemes"]:
        recs = runs[x["run"]]
        steps = [r["step"] + 1 for r in recs if abs(r["loss"] - base[r["step"]]) > 0]
        diffs = [abs(r["loss"] - base[r["step"]]) for r in recs if abs(r["loss"] - base[r["step"]]) > 0]
        if diffs:
            ax.plot(steps, diffs, marker=".", ms=3, lw=0.8, label=x["name"] + (" (lossy)" if x["lossy"] else ""))
        else:
            ax.plot([], [], ls="none", label=f"{x['name']}: 0 at every step (bitwise identical)")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="|loss - FSDP2 loss|", title=title)
    ax.legend(loc="lower right", fontsize=8)
    written.append(_save(fig, run_dir / "schemes_loss_diff.png"))
    return written


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
