"""PNG figures of a ``ciera analyze --json`` report, after the paper's Figures 2-5 (§2): exponent
change rate over steps, shard change rate vs W, reusable blocks vs B, block change rate by shard
type, and changes vs check interval. All numbers come from the report; nothing is computed here
but percentages. Also runs as ``python -m ciera.analysis_plots REPORT.json OUT_DIR``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# Paper order (Figure 4), then the types the paper does not plot.
TYPE_ORDER = ("expert_ffn", "attention", "router", "norm", "embedding", "dense_ffn", "other")
TYPE_LABELS = {"expert_ffn": "Expert FFN", "attention": "Attention", "router": "Routing gate",
               "norm": "Layer norm", "embedding": "Embed / LM head", "dense_ffn": "Dense FFN", "other": "Other"}


def _types(report: dict) -> list[str]:
    return [t for t in TYPE_ORDER if t in report["by_type"]]


# The sections write_figures reads; "intervals" is optional (no Figure 5 without it).
REPORT_KEYS = ("checkpoints", "warmup", "grid", "detail", "steps", "total", "by_type", "tensors")


def report_problem(report) -> str | None:
    """Why ``report`` is not a ``ciera analyze --json`` report these figures can be drawn from, or
    None. Checked before anything is written."""
    if not isinstance(report, dict):
        return "not a report of `ciera analyze --json` (a JSON object)"
    if "grid" not in report and {"parameters", "element_change_rate_per_step"} <= report.keys():
        return ("a `ciera train --stats` report (characterisation.json), not one of `ciera analyze --json`: "
                "run `ciera analyze` on the checkpoints of `ciera train --save-checkpoints DIR` to plot")
    missing = [k for k in REPORT_KEYS if k not in report]
    if missing:
        return ("not a report of `ciera analyze --json` (an object with "
                + ", ".join(f'"{k}"' for k in REPORT_KEYS) + "); no " + ", ".join(f'"{k}"' for k in missing))
    return None


def write_figures(report: dict, out_dir) -> list[str]:
    """Writes the figures into ``out_dir`` (created if needed); returns their paths. Every figure
    is drawn before the first is written, so a report that cannot be drawn leaves no files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problem = report_problem(report)
    if problem:
        raise ValueError(problem)
    figures = []
    try:
        _draw(report, figures)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for fig, name in figures:
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            written.append(str(out / name))
        return written
    finally:
        for fig, _ in figures:
            plt.close(fig)


def _draw(report: dict, figures: list) -> None:
    """Draws every figure into ``figures`` as (figure, file name), writing nothing."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    grid = report["grid"]
    worlds, blocks = grid["worlds"], grid["block_values"]
    detail_w, detail_b = report["detail"]["world"], report["detail"]["block_values"]
    wi, bi = worlds.index(detail_w), blocks.index(detail_b)
    warmup = report["warmup"]
    steps = report["steps"]
    types = _types(report)
    title = f"{len(report['checkpoints'])} checkpoints, {warmup} warmup transition{'' if warmup == 1 else 's'}"
    spacing = report.get("step_spacing")

    # Figure 2: fraction of values whose exponent changed, per transition, at the later
    # checkpoint's training step when the names number the steps. Markers: with two checkpoints
    # there is one point, which a line alone does not show.
    fig, ax = plt.subplots(figsize=(7, 4))
    numbered = all(s.get("to_step") is not None for s in steps)
    xs = [s["to_step"] if numbered else s["step"] for s in steps]
    ax.plot(xs, [100 * s["counts"]["element_change_rate"] for s in steps], color="black", lw=1.8, marker="o",
            ms=4, label="all")
    for t in types:
        ax.plot(xs, [100 * s["by_type"][t]["element_change_rate"] if t in s["by_type"] else float("nan")
                     for s in steps], lw=1, marker=".", label=TYPE_LABELS[t])
    if warmup:
        ax.axvline((xs[warmup - 1] + xs[warmup]) / 2, color="grey", ls=":", lw=1, label="end of warmup")
    if len(xs) == 1:  # else the view is a sliver around the point, ticked in fractions
        ax.set_xlim(xs[0] - 1, xs[0] + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set(xlabel="training step (of the later checkpoint)" if numbered else "transition between checkpoints",
           ylabel="exponents changed (%)", title=f"Exponent change rate (O2); {title}")
    ax.legend(fontsize=8)
    figures.append((fig, "fig2_exponent_change_rate.png"))

    # Figure 3a: shards with any change vs world size.
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(worlds, [100 * r for r in report["total"]["shard_change_rate"]], marker="o", color="black", label="all")
    for t in types:
        ax.plot(worlds, [100 * r for r in report["by_type"][t]["shard_change_rate"]], marker=".", lw=1, ls="--",
                label=TYPE_LABELS[t])
    ax.set(xlabel="world size W", ylabel="shard change rate (%)", xticks=worlds, ylim=(-2, 102),
           title="Shards with a changed exponent (O3)")
    ax.legend(fontsize=8)
    figures.append((fig, "fig3a_shard_change_rate.png"))

    # Figure 3b: reusable blocks vs block size, per W, with the uniform model (1 - c)^B.
    fig, ax = plt.subplots(figsize=(6, 4))
    for w_index, w in enumerate(worlds):
        rates = report["total"]["block_change_rate"][w_index]
        ax.plot(blocks, [100 * (1 - r) for r in rates], marker="o", label=f"W={w}")
    c = report["total"]["element_change_rate"]
    ax.plot(blocks, [100 * (1 - c) ** b for b in blocks], color="grey", ls=":",
            label=f"uniform model (1-c)^B, c={100 * c:.2f}%")
    ax.set(xlabel="block size B (values)", ylabel="reusable blocks (%)", xscale="log", ylim=(-2, 102),
           title="Blocks with no changed exponent (O3)")
    ax.set_xticks(blocks, [str(b) for b in blocks])
    ax.legend(fontsize=8)
    figures.append((fig, "fig3b_reusable_blocks.png"))

    # Figure 4: block change rate per tensor, grouped by shard type.
    per_type = {t: [] for t in types}
    for tensor in report["tensors"]:
        counts = tensor["counts"]
        if counts["blocks"][wi][bi]:
            per_type.setdefault(tensor["type"], []).append(counts["block_change_rate"][wi][bi])
    shown = [t for t in types if per_type.get(t)]
    fig, ax = plt.subplots(figsize=(7, 4))
    if shown:
        data = [per_type[t] for t in shown]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(shown) + 1), [TYPE_LABELS[t] for t in shown], fontsize=8)
        for i, values in enumerate(data, start=1):
            median = statistics.median(values)
            ax.annotate(f"{median:.2f}", (i + 0.3, median), fontsize=8, va="center")  # beside the box
    ax.set(ylabel="block change rate", ylim=(-0.02, 1.02),
           title=f"Block change rate by shard type (O4), W={detail_w}, B={detail_b}, one point per tensor")
    figures.append((fig, "fig4_block_change_by_type.png"))

    # Figure 5b: changes between checks k steps apart.
    intervals = report.get("intervals", [])
    if len(intervals) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([i["interval"] for i in intervals], [100 * i["element_change_rate"] for i in intervals],
                marker="o", color="black")
        unit = f", {spacing} training step{'' if spacing == 1 else 's'} each" if spacing else ""
        ax.set(xlabel=f"check interval (checkpoints apart{unit})", ylabel="exponents changed between checks (%)",
               xticks=[i["interval"] for i in intervals], title="Exponent changes vs check interval")
        figures.append((fig, "fig5_check_interval.png"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ciera.analysis_plots REPORT.json OUT_DIR", file=sys.stderr)
        return 2
    report_path, out = argv

    def fail(problem: str) -> int:
        print(f"python -m ciera.analysis_plots: error: {problem}", file=sys.stderr)
        return 2

    from ciera.paths import folder_problem

    problem = folder_problem(out)
    if problem:
        return fail(f"{out}: {problem}")
    try:
        lines = Path(report_path).read_text().strip().splitlines()
        report = json.loads(lines[-1]) if lines else None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return fail(f"{report_path}: {e}")
    # The report `ciera analyze --json` writes (its last line), checked before anything is written.
    problem = report_problem(report)
    if problem:
        return fail(f"{report_path}: {problem}")
    try:
        written = write_figures(report, out)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return fail(f"{report_path}: a report this tool cannot draw ({type(e).__name__}: {e})")
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
