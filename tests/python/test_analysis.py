"""Exponent-change characterisation from Python: the counter binding, parameter classification,
and `ciera analyze --plot` end to end (native tool + figures)."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT  # noqa: F401  (puts the package on sys.path)

import ciera
from ciera import _ext


def test_classify_parameter_names():
    assert _ext.classify_parameter("model.layers.0.mlp.experts.gate_up_proj") == "expert_ffn"
    assert _ext.classify_parameter("_fsdp_wrapped_module.model.layers.0.mlp.gate.weight") == "router"
    assert _ext.classify_parameter("model.layers.0.self_attn.kv_a_layernorm.weight") == "norm"
    assert _ext.classify_parameter("lm_head.weight") == "embedding"


def test_counter_counts_values_blocks_and_shards():
    n = 1000
    before = np.full(n, 0x3F80, dtype=np.uint16)  # BF16 1.0
    after = before.copy()
    after[[5, 700]] = 0x4000  # 2.0: exponent + 1
    after[9] = 0xBF80         # -1.0: sign only, not a change
    counter = _ext.ExponentChangeCounter(_ext.DType.bf16, n, worlds=[4], blocks=[64])
    assert counter.observe(before).values == 0  # the baseline
    step = counter.observe(after.ctypes.data, after.nbytes)
    assert step.changed_values == 2 and step.transitions == 1
    assert counter.transitions == 1 and counter.changed_values_per_step == [2]
    total = counter.total
    assert total.values == n and total.changed_values == 2
    assert total.shards == [4] and total.changed_shards == [2]   # shards of 250 values
    assert total.blocks == [4 * 4] and total.changed_blocks == [2]
    assert total.block_change_rate(counter.grid.cell(0, 0)) == 2 / 16
    assert total.element_change_rate() == 2 / n


def test_counter_observes_torch_tensors_and_rejects_wrong_sizes():
    torch = pytest.importorskip("torch")
    w = torch.randn(300, dtype=torch.float32)
    counter = _ext.ExponentChangeCounter(_ext.DType.fp32, w.numel(), warmup_steps=1)
    for step in range(3):
        counter.observe(w)
        w.mul_(2.0)  # every exponent moves by one
    assert counter.changed_values_per_step == [300, 300]
    assert counter.total.transitions == 1  # the first transition is warmup
    with pytest.raises(ciera.ConfigError, match="1200 bytes"):
        counter.observe(w.data_ptr(), 4)


def test_change_statistics_sum_counts_by_step_and_type_and_cross_ranks_by_pickle():
    import pickle

    grid = _ext.ChangeGrid([4], [64])
    counters = [_ext.ExponentChangeCounter(_ext.DType.bf16, 512, worlds=[4], blocks=[64], warmup_steps=1)
                for _ in range(2)]
    stats = _ext.ChangeStatistics(grid, 1)
    kinds = [_ext.ShardType.attention, _ext.ShardType.expert_ffn]
    x = np.full(512, 0x3F80, dtype=np.uint16)
    for step in range(4):
        for k, (counter, kind) in enumerate(zip(counters, kinds)):
            x[step * 10 + k] = 0x4000
            counts = counter.observe(x)
            if counter.transitions:
                stats.add(counter.transitions, kind, counts)
    assert stats.steps == 3 and stats.step(1).values == 1024
    assert stats.total().changed_values == sum(c.total.changed_values for c in counters)
    assert stats.total(_ext.ShardType.attention).changed_values == counters[0].total.changed_values
    copy = pickle.loads(pickle.dumps(stats.total()))  # how ranks exchange counts
    assert copy.blocks == stats.total().blocks and copy.changed_values == stats.total().changed_values
    summed = copy + stats.total()
    assert summed.changed_values == 2 * copy.changed_values
    with pytest.raises(ciera.ConfigError, match="different grids"):
        copy + _ext.ChangeCounts(_ext.ChangeGrid([4, 8], [64]))
    with pytest.raises(ValueError, match="from 1"):
        stats.add(0, _ext.ShardType.norm, copy)


def test_analyze_plot_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from ciera import cli

    try:
        cli.native_tool()
    except SystemExit:
        pytest.skip("the native ciera tool is not built")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    gen = torch.Generator().manual_seed(0)
    weights = {"model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 32, generator=gen) * 0.02,
               "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen) * 0.02,
               "model.norm.weight": torch.ones(64)}
    for step in range(6):
        safetensors_torch.save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
                                    str(ckpts / f"step_{step}.safetensors"))
        for v in weights.values():
            v.add_(torch.randn(v.shape, generator=gen) * 1e-3)
    figures = tmp_path / "figures"
    assert cli.main(["analyze", str(ckpts), "--warmup", "1", "--max-interval", "3", "--quiet",
                     "--plot", str(figures)]) == 0
    names = sorted(p.name for p in figures.glob("*.png"))
    assert names == ["fig2_exponent_change_rate.png", "fig3a_shard_change_rate.png",
                     "fig3b_reusable_blocks.png", "fig4_block_change_by_type.png", "fig5_check_interval.png"]
    # More intervals asked for than the 4 steps after the warmup span: said, not capped silently.
    report = tmp_path / "report.json"
    done = cli.run_native(cli.native_tool(), ["analyze", str(ckpts), "--warmup", "1", "--max-interval", "9",
                                              "--quiet", "--json-file", str(report)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = json.loads(report.read_text())
    assert written["max_interval"] == 9 and [i["interval"] for i in written["intervals"]] == [1, 2, 3, 4]
    assert "(up to 4, not --max-interval 9: after the warmup the checkpoints span 4 transitions)" in done.stdout


@pytest.mark.parametrize("report,out,message", [
    ("absent.json", "figures", "absent.json: [Errno 2] No such file or directory"),
    ("empty.json", "figures", "empty.json: not a report of `ciera analyze --json`"),
    ("trace.json", "figures", "trace.json: not a report of `ciera analyze --json`"),
    ("list.json", "figures", "list.json: not a report of `ciera analyze --json`"),
    ("bad.json", "figures", "bad.json: Expecting property name"),
    ("bad.json", "empty.json", "empty.json: not a folder"),
])
def test_plots_of_a_file_that_is_no_report_are_one_line(tmp_path, report, out, message):
    """python -m ciera.analysis_plots (docs/analysis.md) printed a traceback for each of these."""
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "trace.json").write_text('{"format": "ciera-trace", "version": 1}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "ciera.analysis_plots", report, out], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"python -m ciera.analysis_plots: error: {message}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "figures").exists()


def test_counter_summary_has_the_shape_of_ciera_analyze():
    from ciera import analysis

    counter = _ext.ExponentChangeCounter(_ext.DType.bf16, 256, worlds=[4, 8], blocks=[64])
    x = np.full(256, 0x3F80, dtype=np.uint16)
    counter.observe(x)
    x[3] = 0x4000
    counter.observe(x)
    s = analysis.summary(counter)
    assert s["dtype"] == "bf16" and s["worlds"] == [4, 8] and s["changed_values_per_step"] == [1]
    total = s["total"]
    assert total["blocks"] == [[4], [8]] and total["changed_blocks"] == [[1], [1]]
    assert total["block_change_rate"] == [[1 / 4], [1 / 8]] and total["shard_change_rate"] == [1 / 4, 1 / 8]


def test_indices_and_pickled_shapes_are_checked_not_read_past_the_end():
    # Each of these read past the end of a C++ vector (a segfault) before the binding checked it.
    import pickle

    grid = _ext.ChangeGrid([4], [64])
    counts = _ext.ChangeCounts(grid)
    with pytest.raises(IndexError, match="cell 1000000 is out of range"):
        counts.block_change_rate(10**6)
    with pytest.raises(IndexError, match="world index 1 is out of range"):
        counts.shard_change_rate(1)
    with pytest.raises(IndexError, match="world index 5"):
        grid.cell(5, 0)
    with pytest.raises(IndexError, match="block index 5"):
        grid.cell(0, 5)
    assert grid.cell(0, 0) == 0 and counts.block_change_rate(0) == 0
    assert pickle.loads(pickle.dumps(counts)).blocks == counts.blocks  # a genuine state loads...
    malformed = _ext.ChangeCounts.__new__(_ext.ChangeCounts)
    with pytest.raises(ciera.ConfigError, match="block cells"):
        malformed.__setstate__((1, 1, 1, [1], [], [1], [1]))  # ...a state with ragged cells does not


# --- `ciera analyze` on hand-made checkpoints (the native tool) -----------------------------------

def _native():
    from ciera import cli

    try:
        return cli.native_tool()
    except SystemExit:
        pytest.skip("the native ciera tool is not built")


def _analyze(*args):
    from ciera import cli

    return cli.run_native(_native(), ["analyze", *map(str, args)], capture_output=True, text=True)


def _checkpoint(path, tensors):
    """A safetensors file of (name, dtype, shape, values as uint16/uint64 words) tensors."""
    header, data = {}, b""
    for name, dtype, shape, words in tensors:
        raw = struct.pack(f"<{len(words)}{'Q' if dtype == 'I64' else 'H'}", *words)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def _series(folder, steps, extra=lambda step: []):
    """BF16 checkpoints step_<s>.safetensors of two tensors; a few exponents move each step."""
    folder.mkdir(exist_ok=True)
    for k, step in enumerate(steps):
        w = [0x3F80 + (0x80 if i % 97 == k else 0) for i in range(600)]
        _checkpoint(folder / f"step_{step}.safetensors",
                    [("model.layers.0.mlp.experts.down_proj", "BF16", [600], w),
                     ("model.norm.weight", "BF16", [40], w[:40]), *extra(step)])
    return folder


def test_unevenly_spaced_steps_are_refused_unless_asked_for(tmp_path):
    """step_10, step_20, step_90 were analysed as three consecutive steps: a 10-step and a 70-step
    gap averaged, "interval 2" 80 steps, and no step number in the report."""
    ckpts = _series(tmp_path / "uneven", [10, 20, 90])
    done = _analyze(ckpts, "--quiet")
    assert done.returncode == 2, done.stdout
    assert ("checkpoints unevenly spaced: step_20.safetensors -> step_90.safetensors is 70 training steps, "
            "but step_10.safetensors -> step_20.safetensors is 10") in done.stderr, done.stderr
    done = _analyze(ckpts, "--uneven-steps", "--max-interval", "2", "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "warning: checkpoints unevenly spaced (steps 10 20 90)" in done.stderr
    report = json.loads(done.stdout)
    assert report["checkpoint_steps"] == [10, 20, 90] and report["step_spacing"] is None
    assert [(s["from_step"], s["to_step"]) for s in report["steps"]] == [(10, 20), (20, 90)]
    assert [i["training_steps"] for i in report["intervals"]] == [None, None]


def test_step_numbers_and_spacing_are_reported(tmp_path):
    ckpts = _series(tmp_path / "every10", [0, 10, 20, 30])
    done = _analyze(ckpts, "--max-interval", "2", "--json-file", tmp_path / "r.json", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "steps: 0 to 30, every 10 training steps" in done.stdout
    assert re.search(r"^10 -> 20 +step_20.safetensors", done.stdout, re.M), done.stdout
    assert "% of values per transition of 10 training steps" in done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["checkpoint_steps"] == [0, 10, 20, 30] and report["step_spacing"] == 10
    steps = [(s["step"], s["from_step"], s["to_step"]) for s in report["steps"]]
    assert steps == [(1, 0, 10), (2, 10, 20), (3, 20, 30)]
    assert [(i["interval"], i["training_steps"], i["pairs"]) for i in report["intervals"]] == [(1, 10, 3), (2, 20, 2)]
    # Files without step numbers: consecutive, and said.
    for k, name in enumerate(("before", "after")):
        (tmp_path / f"{name}.safetensors").write_bytes((ckpts / f"step_{10 * k}.safetensors").read_bytes())
    done = _analyze(tmp_path / "before.safetensors", tmp_path / "after.safetensors", "--json", "--quiet")
    report = json.loads(done.stdout)
    assert report["checkpoint_steps"] is None and report["steps"][0]["to_step"] is None


def test_transitions_mean_the_same_in_analyze_and_train_stats(tmp_path):
    """"transitions" counted tensor transitions in `ciera analyze --json` (2 tensors x 3 steps = 6)
    and steps in `ciera train --stats` (ciera.analysis.totals_json), whose objects also lacked
    block_change_rate."""
    from ciera import analysis

    ckpts = _series(tmp_path / "c", [1, 2, 3, 4])
    done = _analyze(ckpts, "--warmup", "1", "--json", "--quiet")
    report = json.loads(done.stdout)
    assert report["total"]["transitions"] == 2  # steps after warmup, whatever the tensors
    assert {t["counts"]["transitions"] for t in report["tensors"]} == {2}
    assert {s["counts"]["transitions"] for s in report["steps"]} == {1}
    assert all(c["transitions"] == 2 for c in report["by_type"].values())
    # What train --stats renders: a sum over tensors, the steps passed.
    grid = _ext.ChangeGrid(report["grid"]["worlds"], report["grid"]["block_values"])
    stats = _ext.ChangeStatistics(grid, 0)
    for n in (600, 40):
        counter = _ext.ExponentChangeCounter(_ext.DType.bf16, n, worlds=grid.worlds, blocks=grid.block_values)
        x = np.full(n, 0x3F80, dtype=np.uint16)
        for step in range(3):
            x[step] = 0x4000
            counts = counter.observe(x)
            if counter.transitions:
                stats.add(counter.transitions, _ext.ShardType.norm, counts)
    summed = analysis.counts_json(stats.total(), grid, 2)
    assert summed.keys() == report["total"].keys()
    assert summed["transitions"] == 2 and stats.total().transitions == 4
    assert summed["block_change_rate"][0][0] == stats.total().block_change_rate(0)
    assert not hasattr(analysis, "totals_json")


def test_every_json_field_is_documented(tmp_path):
    ckpts = _series(tmp_path / "c", [0, 1, 2, 3])
    report = json.loads(_analyze(ckpts, "--max-interval", "2", "--json", "--quiet").stdout)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "analysis.md").read_text()
    keys = set(report) | set(report["steps"][0]) | set(report["total"]) | set(report["intervals"][0])
    keys |= set(report["tensors"][0]) | set(report["grid"]) | set(report["detail"])
    undocumented = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not undocumented, undocumented


def test_checkpoints_of_empty_tensors_are_an_error_not_zero_percent(tmp_path):
    for name in ("a", "b"):
        _checkpoint(tmp_path / f"{name}.safetensors", [("x.weight", "BF16", [0, 4], []), ("y.weight", "BF16", [0], [])])
    done = _analyze(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--quiet")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert "are all empty: no values to compare" in done.stderr, done.stderr


def test_skip_unsupported_does_not_require_the_skipped_tensors_everywhere(tmp_path):
    """An I64 step counter in the first checkpoint only was fatal even with --skip-unsupported."""
    ckpts = _series(tmp_path / "c", [0, 1, 2], extra=lambda step: [("step", "I64", [1], [step])] if step == 0 else [])
    assert _analyze(ckpts, "--quiet").returncode == 2
    done = _analyze(ckpts, "--skip-unsupported", "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["skipped_tensors"] == ["step"]


def test_help_says_what_the_options_take(tmp_path):
    done = _analyze("--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert re.search(r"--plot \S+ +folder to write PNG figures", text), text
    assert "up to this many checkpoints apart" in text and "many steps apart" not in text
    assert "peer died" not in text and "3 a result" not in text
    assert "end the list with -- or another option" in text
    # ... which is how the option parser behaves.
    ckpts = _series(tmp_path / "c", [0, 1])
    done = _analyze("--worlds", "4", "8", "--", ckpts, "--json", "--quiet")
    assert done.returncode == 0 and json.loads(done.stdout)["grid"]["worlds"] == [4, 8], done.stderr


def test_progress_names_the_tensor_being_read(tmp_path):
    ckpts = _series(tmp_path / "c", [0, 1])
    done = _analyze(ckpts)  # stderr is not a terminal: one line every 10%
    lines = done.stderr.splitlines()
    assert re.match(r"analyze +0% .* reading model.layers.0.mlp.experts.down_proj$", lines[0]), lines
    assert re.match(r"analyze 100% .* done$", lines[-1]), lines


# --- figures ------------------------------------------------------------------------------------

def _report(tmp_path, steps, *args):
    ckpts = _series(tmp_path / ("fig_" + "_".join(map(str, steps))), steps)
    done = _analyze(ckpts, "--json", "--quiet", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_figure2_of_two_checkpoints_shows_its_point_on_integer_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.ticker import MaxNLocator

    from ciera import analysis_plots

    figures = []
    analysis_plots._draw(_report(tmp_path, [0, 1]), figures)
    fig, name = figures[0]
    assert name == "fig2_exponent_change_rate.png"
    ax = fig.axes[0]
    assert all(line.get_marker() not in (None, "None", "") for line in ax.get_lines()[:2])
    assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    shown = [t for t in ax.get_xticks() if low <= t <= high]
    assert shown and all(float(t).is_integer() for t in shown), shown
    figures.clear()
    analysis_plots._draw(_report(tmp_path, [0, 10, 20], "--warmup", "1"), figures)
    ax = figures[0][0].axes[0]
    assert "3 checkpoints, 1 warmup transition" in ax.get_title() and "transitions" not in ax.get_title()
    assert list(ax.get_lines()[0].get_xdata()) == [10, 20]  # training steps, from the names


@pytest.mark.parametrize("damage", ["no tensor counts", "no tensors", "no intervals rate", "train stats"])
def test_plots_of_a_report_that_cannot_be_drawn_write_nothing(tmp_path, damage):
    """A report that broke Figure 4 or 5 left Figures 2 and 3 written, with status 2."""
    pytest.importorskip("matplotlib")
    report = _report(tmp_path, [0, 1, 2, 3], "--max-interval", "2")
    if damage == "no tensor counts":
        del report["tensors"][0]["counts"]
    elif damage == "no tensors":
        del report["tensors"]
    elif damage == "no intervals rate":
        del report["intervals"][1]["element_change_rate"]
    else:  # what ciera train --stats writes
        report = {"worlds": [4], "block_values": [64], "warmup_steps": 0, "total": report["total"],
                  "by_type": {}, "element_change_rate_per_step": [0.1], "parameters": [], "summary": {}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    done = subprocess.run([sys.executable, "-m", "ciera.analysis_plots", "r.json", "figures"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "figures").exists() or not list((tmp_path / "figures").iterdir())
    if damage == "train stats":
        assert "a `ciera train --stats` report (characterisation.json)" in done.stderr, done.stderr
