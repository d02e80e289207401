"""PNG plots of a `ciera train` run folder: loss of the CIERA run over the baseline, wire bits per
value, and the exponent change rate per step."""

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

    fig, ax = plt.subplots(figsize=(7, 4))
    if "fsdp2" in runs:
        ax.plot([r["step"] + 1 for r in runs["fsdp2"]], [r["loss"] for r in runs["fsdp2"]], lw=4, alpha=0.35,
                label="FSDP2 all-gather (baseline)")
    ax.plot([r["step"] + 1 for r in runs["ciera"]], [r["loss"] for r in runs["ciera"]], lw=1.2, color="black",
            label="CIERA all-gather")
    ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", title=title)
    verdict = "bitwise identical" if summary["losses_identical"] else "NOT identical"
    ax.text(0.98, 0.95, f"losses {verdict}", transform=ax.transAxes, ha="right", va="top")
    ax.legend(loc="lower left")
    written.append(_save(fig, run_dir / "loss.png"))

    ciera = [r for r in runs["ciera"] if r.get("bits_per_value")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] + 1 for r in ciera], [r["bits_per_value"] for r in ciera], marker=".", color="tab:blue")
    ax.axhline(16, color="grey", ls="--", lw=1, label="raw BF16 (16 bits)")
    ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1, label="end of warmup")
    ax.set(xlabel="step", ylabel="wire bits per value", title=title, ylim=(0, 17))
    ax.legend(loc="lower left")
    written.append(_save(fig, run_dir / "bits_per_value.png"))

    rates = [r for r in runs["ciera"] if r.get("exponent_change_rate") is not None]
    if rates:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] + 1 for r in rates], [100 * r["exponent_change_rate"] for r in rates], marker=".",
                color="tab:red")
        ax.axvline(summary["warmup"] + 0.5, color="grey", ls=":", lw=1)
        ax.set(xlabel="step", ylabel="exponents changed since last step (%)", title=title)
        written.append(_save(fig, run_dir / "exponent_change_rate.png"))
    return written


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
