"""Every bad input is one line naming the problem, a non-zero status and no traceback, before any
work starts: `ciera train` (no rank started, no run folder made), the native subcommands through
the Python entry point, and the arguments of ciera.torch.enable(). Also `ciera --help` (every
command, train included) and `ciera --version` (version, commit, wire format)."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import all_ok, needs_torch, spawn

import ciera
from ciera import _ext


def _env():
    # Wherever the tests import ciera from (installed, or this checkout), the commands do too.
    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


def _ciera(args, cwd=None):
    """`ciera ARGS` through the Python entry point, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ciera.cli", *args], capture_output=True, text=True,
                          env=_env(), cwd=cwd, timeout=120)


def _native_tool_or_skip():
    from ciera import cli

    try:
        return cli.native_tool()
    except SystemExit:
        pytest.skip("the native ciera tool is not built")


def _assert_refused(done, message):
    """Status 2, a command line no run could use (not 1, a run that failed, nor a signal), and
    stderr one line that names the problem."""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0], lines[0]
    assert done.stdout.strip() == "", done.stdout


def _fill(args, tmp_path):
    return [a.replace("{tmp}", str(tmp_path)) for a in args]


# --- ciera train --------------------------------------------------------------------------------

TRAIN = [
    (["--ranks", "0"], "--ranks must be >= 2"),
    (["--ranks", "1"], "--ranks must be >= 2 (one rank has nobody to gather from), got 1"),
    (["--ranks", "x"], "argument --ranks: invalid int value: 'x'"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "5", "--warmup", "5"], "--steps 5 must exceed --warmup 5 to measure a steady state: give more"),
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--hidden", "0"], "--hidden must be a positive multiple of 8"),
    (["--hidden", "12"], "--hidden must be a positive multiple of 8"),
    (["--experts", "1"], "--experts must be >= 2"),
    (["--expert-intermediate", "4"], "--expert-intermediate must be a positive multiple of 8"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr=-1e-4"], "--lr must be a finite number > 0"),
    (["--block", "0"], "--block 0: a block holds 64..4096 values"),
    (["--block", "63"], "--block 63:"),
    (["--block", "8192"], "--block 8192:"),
    (["--threads", "-1"], "--threads must be >= 0 (0: encode and decode on the gathering thread), got -1"),
    (["--timeout", "0"], "--timeout must be a finite number > 0 seconds, got 0.0"),
    (["--timeout", "nan"], "--timeout must be a finite number > 0 seconds, got nan"),
    (["--link-gbit", "-1"], "--link-gbit must be a finite number >= 0"),
    (["--link-gbit", "nan"], "--link-gbit must be a finite number >= 0"),
    (["--link-gbit", "1", "--ranks", "300"], "--ranks 300: the link lab has room for at most 253 ranks"),
    (["--nodes", "2"], "--nodes and --ranks-per-node go together"),
    (["--ranks-per-node", "2"], "--nodes and --ranks-per-node go together"),
    (["--nodes", "2", "--ranks-per-node", "2", "--ranks", "6"],
     "--ranks 6 disagrees with --nodes 2 --ranks-per-node 2 (4 ranks)"),
    (["--nodes", "0", "--ranks-per-node", "2"], "--nodes must be >= 1"),
    (["--reshard-after-forward", "3"], "--reshard-after-forward 3 must divide the 4 ranks"),
    (["--reshard-after-forward", "0"], "--reshard-after-forward 0 must divide the 4 ranks"),
    (["--hsdp"], "--hsdp replicates across nodes and shards inside each: give --nodes K --ranks-per-node R"),
    (["--hsdp", "--nodes", "4", "--ranks-per-node", "1"], "--hsdp replicates across nodes"),
    (["--hsdp", "--nodes", "2", "--ranks-per-node", "2", "--reshard-after-forward", "4"],
     "--reshard-after-forward 4 must divide the 2 ranks HSDP shards over"),
    (["--zero", "--reshard-after-forward", "2"],
     "--reshard-after-forward is an FSDP2 layout: it is for the FSDP2 trainings, not --zero"),
    (["--framework", "deepspeed", "--hsdp", "--nodes", "2", "--ranks-per-node", "2"],
     "--hsdp is an FSDP2 layout: it is for the FSDP2 trainings, not --zero or --framework deepspeed"),
    (["--reduce-bucket-size", "1000"], "--reduce-bucket-size is ZeRO-3's setting: it needs --framework deepspeed"),
    (["--framework", "deepspeed", "--overlap"], "--overlap is how the FSDP2 runs gather; under --framework "
                                                "deepspeed both runs always overlap"),
    (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
    (["--budget-mb", "-1"], "--budget-mb must be >= 0 MiB, got -1.0"),
    (["--budget-mb", "nan"], "--budget-mb must be >= 0 MiB, got nan"),
    (["--reselect-every", "-1"], "--reselect-every must be >= 0, got -1"),
    (["--reselect-every", "5"], "--reselect-every re-runs the selection of --budget-mb"),
    (["--budget-mb", "1", "--warmup", "1"], "--budget-mb selects from the exponent changes measured between warmup "
                                            "steps: --warmup 1 measures none"),
    (["--ablation", "--warmup", "0"], "--ablation selects from the exponent changes"),
    (["--codec", "zeropp-int8", "--verify"], "--verify compares lossless gathers with torch's; zeropp-int8 is lossy"),
    (["--hsdp", "--nodes", "2", "--ranks-per-node", "2", "--codec", "zipnn"],
     "zipnn exchanges on one group of every rank; with --hsdp FSDP2 gathers on smaller groups"),
    (["--reshard-after-forward", "2", "--schemes", "ciera,zipnn"], "zipnn exchanges on one group of every rank"),
    (["--capture-activations", "{tmp}"], "a folder, not a file"),
    (["--threads", "4294967296"], "--threads 4294967296: at most 256 codec threads per rank"),
    (["--block", "99999999999"], "--block 99999999999: a block holds 64..4096 values"),
    (["--ablation", "--no-baseline"], "--ablation compares with plain FSDP2"),
    (["--trace", "{tmp}/t.json", "--no-baseline"], "--trace takes its compute times from the plain FSDP2 run"),
    # Both wrote traces that looked right: compute moved between layers, delta frames as exponent reuse.
    (["--trace", "{tmp}/t.json", "--overlap"], "--trace measures each layer's compute as the gaps between blocking"),
    (["--trace", "{tmp}/t.json", "--codec", "delta"], "--trace records exponent reuse's codec speeds and no codec"),
    (["--trace", "{tmp}"], "a folder, not a file"),
    (["--trace", "{tmp}/absent/t.json"], "/absent does not exist"),
    (["--save-checkpoints", "/dev/null/ckpt"], "--save-checkpoints /dev/null/ckpt: /dev/null is not a folder"),
    (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--child"], "--child is the launcher's own option for its ranks"),
    (["--ranks", "100000"], "--ranks 100000: more than 16 ranks a core, and this machine has"),
]


@pytest.mark.parametrize("args,message", TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_train_refuses_before_any_rank_starts(tmp_path, args, message):
    out = tmp_path / "runs"
    done = _ciera(["train", *_fill(args, tmp_path), "--out", str(out)])
    _assert_refused(done, message)
    assert done.stderr.startswith("ciera train: ")
    assert not out.exists()  # no run folder: the launcher never got to start ranks


def test_train_asks_for_a_missing_package_after_the_options_conflicts(monkeypatch, tmp_path):
    """Without the zipnn package, a run that no installation could start is refused for its
    options; one that could is told what to install. --baselines leaves zipnn out."""
    from ciera.train import options, schemes

    monkeypatch.setattr(schemes, "zipnn_installed", lambda: False)

    def refusal(argv):
        args = options.parser().parse_args([*argv, "--out", str(tmp_path / "runs")])
        try:
            options.check(args)
        except SystemExit as e:
            return str(e)
        return f"accepted: {args.schemes or args.codec}"

    missing = "zipnn needs the zipnn package: pip install 'ciera[peers]'"
    assert refusal(["--codec", "zipnn"]) == f"ciera train: --codec zipnn: {missing}"
    assert refusal(["--schemes", "ciera,zipnn"]) == f"ciera train: --schemes: {missing}"
    assert "zipnn exchanges on one group of every rank" in refusal(["--hsdp", "--nodes", "2", "--ranks-per-node", "2",
                                                                     "--codec", "zipnn"])
    assert "--zero cannot run with --schemes" in refusal(["--schemes", "zipnn", "--zero"])
    assert "zipnn" not in refusal(["--baselines"])


@pytest.mark.parametrize("out,message", [("/dev/null", "--out /dev/null: not a folder"),
                                         ("/dev/null/runs", "--out /dev/null/runs: /dev/null is not a folder")])
def test_train_refuses_an_output_folder_it_cannot_make(out, message):
    _assert_refused(_ciera(["train", "--out", out]), message)


def test_train_run_folders_are_unique_within_one_second(tmp_path, monkeypatch):
    import datetime
    from types import SimpleNamespace

    from ciera.train import launcher

    class Frozen:  # every run starts in the same second
        class datetime:
            @staticmethod
            def now():
                return datetime.datetime(2030, 1, 2, 3, 4, 5)

    monkeypatch.setattr(launcher, "_dt", Frozen)
    args = SimpleNamespace(out=str(tmp_path / "runs"), model="olmoe", ranks=2)
    names = [launcher.new_run_dir(args).name for _ in range(3)]
    assert names == ["20300102-030405-olmoe-w2", "20300102-030405-olmoe-w2-2", "20300102-030405-olmoe-w2-3"]


# --- native subcommands, through the Python entry point -------------------------------------------

NATIVE = [
    ([], "`ciera` needs a command: one of bench, analyze, simulate, train"),
    (["bogus"], "unknown command 'bogus' for `ciera`"),
    (["bench"], "`ciera bench` needs a command"),
    (["bench", "codec", "--values", "0"], "--values must be at least 1"),
    (["--nope"], "unknown option '--nope' for `ciera`, which needs a command first: one of bench"),
    (["bench", "--nope"], "unknown option '--nope' for `ciera bench`, which needs a command first: one of codec"),
    (["bench", "codec", "--values", "-1"], "--values: '-1' is not a whole number >= 0"),
    (["bench", "codec", "--values", "99999999999999999999"], "--values: 99999999999999999999 is larger than 2^64 - 1"),
    (["bench", "codec", "--mode", "bogus"], "--mode bogus: expected auto, block, fine or delta"),
    (["bench", "codec", "--render-json", "{tmp}"], "a directory, not a report"),
    (["bench", "codec", "--values", "5", "--values", "6"], "--values given more than once"),
    (["bench", "codec", "--warmup", "-1"], "--warmup: '-1' is not a whole number >= 0"),
    (["bench", "codec", "--sample-every", "0", "--values", "1000", "--steps", "40"], "--sample-every must be at least 1"),
    (["bench", "codec", "--lr", "nan"], "--lr must be a finite number > 0"),
    (["bench", "codec", "--block", "0"], "--block must be in 64..4096 values (got 0)"),
    (["bench", "codec", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["bench", "codec", "--nope"], "The following argument was not expected: --nope"),
    # Counted step 0's key frame as steady, against exponents of zero (stop 67).
    (["bench", "codec", "--warmup", "0"], "--warmup must be at least 1 (step 0 is the key frame"),
    (["analyze"], "checkpoints is required"),
    (["analyze", "/nonexistent/a.safetensors", "/nonexistent/b.safetensors"], "cannot open"),
    (["analyze", "{tmp}/a.safetensors", "{tmp}/./a.safetensors"], "a.safetensors is given twice"),
    (["analyze", "{tmp}", "{tmp}/step_1.safetensors"], "step_1.safetensors is given twice"),
    (["analyze", "a", "b", "--max-interval", "0"], "--max-interval must be at least 1"),
    (["analyze", "a", "b", "--worlds", "0"], "world size W must be at least 1"),
    (["analyze", "a", "b", "--json-file", "/nonexistent/r.json"], "--json-file: directory /nonexistent does not exist"),
    (["analyze", "a", "b", "--plot", "/dev/null/figures"], "--plot /dev/null/figures: /dev/null is not a folder"),
    # Not writable though root passes every permission check there: found before the analysis.
    (["analyze", "a", "b", "--plot", "/proc/figures"], "--plot /proc/figures: /proc is not writable"),
    (["analyze", "a", "b", "--plot", "x", "--plot", "y"], "--plot given twice"),
    (["analyze", "a", "b", "--plot"], "--plot needs a value"),
    (["simulate", "--block", "0"], "--block must be in 64..4096"),
    (["simulate", "--gbit", "-1"], "--gbit must be in 1e-6..1e6 (Gbit/s)"),
    (["simulate", "--latency-ms", "1e308"], "--latency-ms must be in 0..1e6 (ms)"),
    (["simulate", "--gpus-per-node", "5000"], "--gpus-per-node must be in 1..1024"),
    (["simulate", "--gpus", "2000000"], "--gpus: 2000000 is more than 2^20 (1048576) GPUs"),
    (["simulate", "--model", "olmoe-1b-7b", "--gpus", "16", "--mfu", "1e-300"],
     "CIERA on 16 GPUs projects an iteration of 3.27e+298 s: a link, kernel or --mfu figure is too extreme"),
    # 1e-300 made every projected time infinite.
    (["simulate", "--gbit", "1e-300"], "--gbit must be in 1e-6..1e6 (Gbit/s)"),
    # Read for nothing, and silently, before.
    (["simulate", "--model", "olmoe-1b-7b", "--gpus", "16", "--baseline", "zero3", "--codec-bench", "x.json"],
     "--codec-bench gives the figures of the sdp4bit and stateless baselines: ask for one of them"),
    # Validated as a worst error of 0.0%, status 0, before.
    (["simulate", "--validate", "unmeasured.json"], "--validate: no trace given has a measurement"),
    (["simulate", "--mfu", "nan"], "--mfu must be in (0, 1]"),
    (["simulate", "--gpus", "8,0"], "--gpus: 0 is not a GPU count"),
    # Projected at 1.00x with no communication, while a trace of one rank was refused.
    (["simulate", "--model", "olmoe-1b-7b", "--gpus", "1"],
     "--gpus must be in 2..2^20 (1048576): one GPU runs no collective (got 1)"),
    (["simulate", "--trace", "/nonexistent.json"], "cannot read trace /nonexistent.json"),
    (["simulate", "--model", "gpt"], "unknown model \"gpt\""),
    # Found by a user audit (stop 67): each passed, or failed naming no cause.
    (["simulate", "--model", "olmoe-1b-7b", "--baseline", "zero3,zero3"], "--baseline: zero3 is given twice"),
    (["simulate", "--trace", "{tmp}"], "a folder, not a file"),
    (["simulate", "--trace", "overflow.json"], "trace overflow.json: not readable JSON: "),
    (["simulate", "--trace", "one_rank.json"], "must be in 2..2^20 (1048576): one rank runs no collective"),
    (["simulate", "--trace", "raw_mismatch.json"],
     'field "buckets[0].raw_bytes" must be the shards\' values x 2 bytes per bf16 value: 800000 bytes '
     '(400000 values), but it is 1000000'),
    (["simulate", "--model", "olmoe-1b-7b", "--rates", "rates.json"],
     "a block changes whenever one of its values does"),
    # Taken, every rate silently the paper's.
    (["simulate", "--model", "olmoe-1b-7b", "--rates", "no_rates.json"], "rates no_rates.json: gives no change rate"),
    (["analyze", "a", "b", "--json-file", "--quiet"], "--json-file needs a file name, got --quiet"),
    (["analyze", "a", "b", "--json-file", "{tmp}"], "a folder, not a file"),
    (["analyze", "/nonexistent/a.safetensors"], "checkpoint /nonexistent/a.safetensors does not exist"),
]
if _ext.with_mpi:
    NATIVE += [
        (["bench", "allgather", "--ranks", "1"], "--ranks must be at least 2 (one rank has nobody to send to)"),
        (["bench", "allgather", "--buckets", "0"], "--buckets must be at least 1"),
        # Refused by the engine on every rank once they had started (status 1), before stop 67.
        (["bench", "allgather", "--threads", "100000"], "--threads must be at most 256 (got 100000)"),
        (["bench", "allgather", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
        (["bench", "allgather", "--link-gbit", "-1"], "--link-gbit must be >= 0"),
        (["bench", "allgather", "--ranks", "300", "--link-gbit", "1"], "the link lab has room for at most 253"),
        # Tensors of another dtype were skipped without a word (a file mixing BF16 and F32 lost its
        # F32 ones), and one without values made "no BF16 tensor of activations in it".
        (["bench", "alltoall", "--ranks", "2", "--input", "mixed.safetensors"],
         "--input mixed.safetensors: tensor 'b' is F32; --input takes BF16 activations [tokens, hidden]"),
        (["bench", "alltoall", "--ranks", "2", "--input", "f32.safetensors"], "tensor 'a' is F32; --input takes BF16"),
        (["bench", "alltoall", "--ranks", "2", "--input", "no_values.safetensors"],
         "--input no_values.safetensors: tensor 'a' has no values (shape [4, 0])"),
        (["bench", "alltoall", "--ranks", "2", "--input", "a.safetensors"],
         "tensor 'w' has 1 dimensions; activations are [tokens, hidden]"),
    ]


def _safetensors(path: Path, values: list[int]) -> None:
    """A checkpoint of one BF16 tensor (the format: header length, JSON header, data)."""
    _safetensors_of(path, {"w": ("BF16", [len(values)], struct.pack(f"<{len(values)}H", *values))})


def _safetensors_of(path: Path, tensors: dict) -> None:
    """A safetensors file of these tensors: name -> (dtype, shape, data bytes), in order."""
    entries, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


# A trace of one bucket without "measured" (docs/simulator.md, "Trace format").
UNMEASURED_TRACE = """{"format": "ciera-trace", "version": 1, "model": {"family": "olmoe", "params": 1000000},
  "world_size": 4, "dtype": "bf16", "link": {"kind": "linklab", "gbit": 1.0, "latency_ms": 0.0},
  "codec": {"encode_GBps": 1000, "decode_GBps": 1000, "detect_GBps": 0},
  "comm": {"allgather": [{"bytes": 1000000, "seconds": 0.5}, {"bytes": 2000000, "seconds": 1.0}],
           "reduce_scatter": [{"bytes": 1000000, "seconds": 0.5}]},
  "optimizer_s": 0.1,
  "buckets": [{"name": "layers.0", "forward_s": 1.0, "backward_s": 2.0, "raw_bytes": 1000000, "wire_bytes": 500000,
               "grad_bytes": 1000000, "shards": [{"name": "experts", "type": "expert_ffn", "values": 500000,
                                                  "change_rate": 0.01}]}]}"""


@pytest.mark.parametrize("args,message", NATIVE, ids=[" ".join(a) or "(none)" for a, _ in NATIVE])
def test_native_commands_refuse_in_one_line(tmp_path, args, message):
    _native_tool_or_skip()
    _safetensors(tmp_path / "a.safetensors", [0x3F80] * 64)
    (tmp_path / "unmeasured.json").write_text(UNMEASURED_TRACE)
    (tmp_path / "overflow.json").write_text(UNMEASURED_TRACE.replace('"optimizer_s": 0.1', '"optimizer_s": 1e400'))
    (tmp_path / "one_rank.json").write_text(UNMEASURED_TRACE.replace('"world_size": 4', '"world_size": 1'))
    (tmp_path / "raw_mismatch.json").write_text(UNMEASURED_TRACE.replace('"values": 500000', '"values": 400000'))
    (tmp_path / "rates.json").write_text('{"expert_ffn": 0.004, "block": {"expert_ffn": 0.0001}}')
    (tmp_path / "no_rates.json").write_text('{}')
    if "--input" in args:   # activations for `bench alltoall` (the folder is a series elsewhere)
        bf16 = ("BF16", [4, 8], bytes(64))
        _safetensors_of(tmp_path / "mixed.safetensors", {"a": bf16, "b": ("F32", [4, 8], bytes(128)), "c": bf16})
        _safetensors_of(tmp_path / "f32.safetensors", {"a": ("F32", [4, 8], bytes(128))})
        _safetensors_of(tmp_path / "no_values.safetensors", {"a": ("BF16", [4, 0], b"")})
    if "{tmp}" in args:  # the folder as a series: only step-numbered files in it
        (tmp_path / "a.safetensors").rename(tmp_path / "step_1.safetensors")
        _safetensors(tmp_path / "step_2.safetensors", [0x3F80] * 64)
    done = _ciera(_fill(args, tmp_path), cwd=tmp_path)
    _assert_refused(done, message)
    assert re.match(r"ciera( analyze)?: error: ", done.stderr), done.stderr


def test_analyze_help_with_plot_is_the_native_help(tmp_path):
    _native_tool_or_skip()
    done = _ciera(["analyze", "--help", "--plot", str(tmp_path / "figures")])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "--json-file" in done.stdout, done.stdout


def test_analyze_plot_writes_the_users_json_file_too(tmp_path):
    pytest.importorskip("matplotlib")
    _native_tool_or_skip()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for step in range(4):
        _safetensors(ckpts / f"step_{step}.safetensors", [0x3F80 + ((i * 7 + step * 13) % 5) for i in range(4096)])
    report = tmp_path / "report.json"
    done = _ciera(["analyze", str(ckpts), "--quiet", "--max-interval", "2", "--plot", str(tmp_path / "figures"),
                   "--json-file", str(report)])
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(report.read_text())["total"]["transitions"] == 3
    assert len(list((tmp_path / "figures").glob("*.png"))) == 5


# --- ciera.torch.enable() -------------------------------------------------------------------------

def _config(timeout_s):
    config = ciera.EngineConfig()
    config.timeout_s = timeout_s  # the binding may refuse it here already
    return config


ENABLE = [
    (lambda e, m: e("model"), TypeError, "model must be a torch.nn.Module, got str"),
    (lambda e, m: e(m, "config"), TypeError, "config must be a ciera.EngineConfig, got str"),
    (lambda e, m: e(m, _config(0.0)), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (lambda e, m: e(m, _config(-5.0)), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (lambda e, m: e(m, _config(float("nan"))), ValueError, "timeout_s must be a finite number of seconds > 0"),
    (lambda e, m: e(m, transport="gloo"), ValueError, "transport must be 'torch', 'mpi' or 'nccl', got 'gloo'"),
    (lambda e, m: e(m, policy=3), TypeError, "policy must be callable"),
    (lambda e, m: e(m, cache_budget_bytes=-1), ValueError, "cache_budget_bytes must be >= 0, got -1"),
    (lambda e, m: e(m, cache_budget_bytes=1.5), TypeError, "cache_budget_bytes must be an int, got float 1.5"),
    (lambda e, m: e(m, cache_budget_bytes=True), TypeError, "cache_budget_bytes must be an int, got bool"),
    (lambda e, m: e(m, cache_budget_bytes=0, select_after_steps=-1), ValueError,
     "select_after_steps must be >= 0, got -1"),
    (lambda e, m: e(m, cache_budget_bytes=0, select_after_steps=1), ValueError,
     "the selector chooses after 1 steps, but it measures exponent changes between consecutive steps"),
    (lambda e, m: e(m, cache_budget_bytes=0, reselect_every=-2), ValueError, "reselect_every must be >= 0, got -2"),
    (lambda e, m: e(m, reselect_every=-2), ValueError, "reselect_every must be >= 0, got -2"),
    (lambda e, m: e(m, reselect_every=5), ValueError, "reselect_every=5 is for the selector; it needs cache_budget_bytes"),
    (lambda e, m: e(m, select_after_steps=3), ValueError, "select_after_steps=3 is for the selector"),
    (lambda e, m: e(m, cache_budget_bytes=0, policy=lambda b, p: None), ValueError, "not both"),
]


@pytest.mark.parametrize("call,error,message", ENABLE, ids=[m for _, _, m in ENABLE])
def test_enable_refuses_bad_arguments_before_setting_anything_up(call, error, message):
    torch = needs_torch()

    import ciera.torch as ct

    model = torch.nn.Linear(4, 4)  # no process group, no FSDP: the checks come before either is needed
    with pytest.raises(error) as raised:
        call(ct.enable, model)
    text = str(raised.value)
    assert message in text and "\n" not in text, text


def test_enable_with_good_arguments_gets_past_the_checks():
    torch = needs_torch()

    import ciera.torch as ct

    with pytest.raises(ciera.ConfigError, match="no FSDP2"):
        ct.enable(torch.nn.Linear(4, 4), _config(30.0), transport="torch", cache_budget_bytes=0,
                  select_after_steps=2, reselect_every=2)


def enable_twice(rank, world):
    """enable() on a model whose gathers already go through CIERA, then again after disable()."""
    import fsdp_workers as w

    import ciera.torch as ct

    model = w.build(w.tiny_spec("olmoe"), world)
    handle = ct.enable(model, ciera.EngineConfig())
    try:
        ct.enable(model, ciera.EngineConfig())
        second = "no error"
    except ValueError as e:
        second = str(e)
    handle.disable()
    ct.enable(model, ciera.EngineConfig()).disable()
    return second


def test_enable_twice_on_one_model_is_refused():
    needs_torch()
    for message in all_ok(spawn(enable_twice, 2)):
        assert "already go through CIERA" in message and "disable()" in message, message


# --- ciera --help, ciera --version ------------------------------------------------------------------

def test_help_lists_every_command_train_included():
    _native_tool_or_skip()
    done = _ciera(["--help"])
    assert done.returncode == 0, done.stderr
    commands = re.findall(r"^  (\w+) ", done.stdout.split("Subcommands:")[1], re.MULTILINE)
    assert commands == ["bench", "analyze", "simulate", "train"], done.stdout


VERSION = re.compile(r"^ciera (\d+\.\d+\.\d+) \(commit ([0-9a-f]{4,}|unknown)\), wire format (\d+)$")


def test_version_names_the_library_commit_and_wire_format():
    done = _ciera(["--version"])
    assert done.returncode == 0, done.stderr
    m = VERSION.match(done.stdout.strip())
    assert m, done.stdout
    assert m.group(1) == _ext.__version__
    assert m.group(2) == getattr(_ext, "git_commit", "unknown")
    assert int(m.group(3)) == _ext.format_version


def test_native_version_has_the_same_form():
    tool = _native_tool_or_skip()
    done = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    m = VERSION.match(done.stdout.strip())
    assert m, done.stdout
    assert m.group(1) == _ext.__version__


def test_the_train_launcher_refuses_without_importing_torch():
    """`ciera train` checks its options before anything imports torch (about 1.5 s here), so a
    refusal is immediate; torch is imported by the ranks."""
    probe = ("import sys, ciera.train.launcher, ciera.train.options; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_simulate_trace_json_has_the_byte_ratio_and_its_bound(tmp_path):
    """The text report of `ciera simulate --trace` printed the byte ratio and the bound from bytes
    alone; its JSON had neither (an audit)."""
    _native_tool_or_skip()
    trace = {"format": "ciera-trace", "version": 1, "model": {"family": "olmoe", "params": 1000000},
             "world_size": 4, "dtype": "bf16", "link": {"kind": "linklab", "gbit": 1.0, "latency_ms": 0.0},
             "codec": {"encode_GBps": 1000, "decode_GBps": 1000, "detect_GBps": 0},
             "comm": {"allgather": [{"bytes": 1e6, "seconds": 0.5}, {"bytes": 2e6, "seconds": 1.0}],
                      "reduce_scatter": [{"bytes": 1e6, "seconds": 0.5}]},
             "optimizer_s": 0.1,
             "buckets": [{"name": "layers.0", "forward_s": 1.0, "backward_s": 2.0, "raw_bytes": 1e6,
                          "wire_bytes": 5e5, "grad_bytes": 1e6,
                          "shards": [{"name": "experts", "type": "expert_ffn", "values": 500000,
                                      "change_rate": 0.01}]}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    done = _ciera(["simulate", "--trace", str(path), "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["allgather_byte_ratio"] == 2.0
    assert 1.0 < report["predicted_speedup"] <= report["byte_reduction_bound"] + 1e-9, report


def test_simulate_projection_notes_rates_from_a_trace_of_another_dtype(tmp_path):
    """A BF16 trace's change rates were applied to the FP16 projections (ZeRO++'s) without a word
    (an audit): the text and the JSON now say so, and only where the dtypes differ."""
    _native_tool_or_skip()
    path = tmp_path / "t.json"
    path.write_text(UNMEASURED_TRACE)
    base = ["simulate", "--model", "olmoe-1b-7b", "--gpus", "8", "--trace", str(path)]
    done = _ciera(base + ["--baseline", "zero3,zeropp", "--json"])
    assert done.returncode == 0, done.stderr
    model = json.loads(done.stdout)["models"][0]
    assert model["rates_measured_dtype"] == "bf16"
    assert "measured in bf16 and are applied unchanged to the fp16 projections" in model["rates_note"], model
    text = _ciera(base + ["--baseline", "zero3,zeropp"])
    assert text.returncode == 0, text.stderr
    assert "note: the trace's change rates were measured in bf16 and are applied unchanged to the fp16" \
        in text.stdout, text.stdout[:3000]
    same = _ciera(base + ["--baseline", "zero3", "--json"])   # BF16 against ZeRO-3: nothing to say
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["models"][0]["rates_note"] is None
    assert "note:" not in _ciera(base + ["--baseline", "zero3"]).stdout
