"""Exponent-change characterisation from Python: the counter binding, parameter classification,
and `ciera analyze --plot` end to end (native tool + figures)."""

import json
import os
import subprocess
import sys

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
    assert "(up to 4, not --max-interval 9: after the warmup the checkpoints span 4 steps)" in done.stdout


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
