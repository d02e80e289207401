"""The process the user started: launches the ranks (under mpirun or torchrun, or inside the link
lab), draws their progress from the metrics rank 0 appends, and renders the summary they wrote."""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ciera.train import checkpoint, options
from ciera.train.options import BASELINE, CONTROL, budget_text
from ciera.train.watch import Stall, Watch, stat_fields

ROOT = Path(__file__).resolve().parents[1]   # the ciera package


def linklab_script() -> str:
    for candidate in (ROOT / "share" / "linklab.sh", ROOT.parents[1] / "scripts" / "linklab.sh"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("ciera train: scripts/linklab.sh not found")


def rank_launcher(args) -> list[str]:
    """The command that starts the ranks, up to the rank program's arguments: the link lab, mpirun,
    or torchrun (torch.distributed.run of this Python: the torch the ranks import)."""
    program = [sys.executable, "-m", "ciera.train"]
    if args.launcher == "torchrun":
        # One node; a rank that fails ends the others (no restarts), as under mpirun.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(args.ranks), "--max-restarts", "0", "-m", "ciera.train"]
    if args.link_gbit > 0:
        ranks = (["--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node)] if args.nodes
                 else ["--ranks", str(args.ranks)])
        return [linklab_script(), *ranks, "--gbit", str(args.link_gbit), "--", *program]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("ciera train: mpirun not found (apt-get install openmpi-bin)")
    return [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(args.ranks),
            "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED", "-x", "OMP_NUM_THREADS",
            "-x", "CUBLAS_WORKSPACE_CONFIG", *program]


def new_run_dir(args) -> Path:
    """A run folder of its own under --out, <time>-<model>-w<ranks>, with -2, -3, ... appended
    when runs started in the same second: mkdir is atomic, so two launchers never share one."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    deepspeed = getattr(args, "framework", "") == "deepspeed"
    rs = getattr(args, "reduce_scatter", "fsdp2") != "fsdp2"
    mode = "-zero" if getattr(args, "zero", False) else ("-deepspeed" if deepspeed else "") + ("-rs" if rs else "")
    base = f"{stamp}-{args.model}{mode}-w{args.ranks}"
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            run_dir = out / (base if n == 1 else f"{base}-{n}")
            try:
                run_dir.mkdir()
                return run_dir
            except FileExistsError:
                continue
    except OSError as e:
        raise SystemExit(f"ciera train: --out {args.out}: cannot create a run folder ({e.strerror or e})")


def launch(args, argv: list[str]) -> int:
    launcher = rank_launcher(args)
    run_dir = new_run_dir(args)
    child = [*argv, *options.resolved_argv(args), "--child", "--run-dir", str(run_dir.resolve())]
    # CUBLAS_WORKSPACE_CONFIG: deterministic cuBLAS (--device cuda); read when cuBLAS starts.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               CUBLAS_WORKSPACE_CONFIG=":4096:8")
    # glibc raises its mmap threshold (up to 32 MiB) as large blocks are freed, after which the
    # trainings' gathered buffers and gradients come from the heap and fragment it: a rank of
    # the medium model with seven trainings grew from 2.2 to 5.4 GB RSS in 64 steps (OOM-killed).
    # A fixed 1 MiB threshold returns them to the OS: 0.8 -> 1.3 GB over 16 steps instead of 2.2.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT.parent), env.get("PYTHONPATH")]))
    # The link lab writes what crossed the links between nodes (the uplinks), all trainings together.
    env["CIERA_LINKLAB_COUNTERS"] = str((run_dir / "uplinks.json").resolve())
    cmd = [*launcher, *child]
    log_path = run_dir / "log.txt"
    watch = Watch(run_dir, args.ranks)
    with open(log_path, "w") as log, _interruptible() as interrupted:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            interrupted.arm()   # a signal that came while Popen ran is raised now
            status = follow(proc, run_dir / "metrics.jsonl", args, watch)
        except (KeyboardInterrupt, _Terminated):   # raised once: a second signal is let be
            _end(proc)
            name = signal.Signals(interrupted.signum).name
            after_bar = "\n" if sys.stderr.isatty() else ""   # a progress bar is drawn in place only on a terminal
            sys.stderr.write(f"{after_bar}ciera train: interrupted ({name}); the ranks were ended "
                             f"(their output: {log_path})\n")
            return 128 + interrupted.signum
    try:
        (run_dir / "rendezvous").unlink(missing_ok=True)  # the ranks' torch.distributed store
    except OSError:
        pass  # a run folder no longer writable: the failure below (or the summary) says more
    summary_path = run_dir / "summary.json"
    if status != 0 or not summary_path.is_file():
        watch.read_statuses()  # the processes are gone now; what was seen of them stands
        sys.stderr.write(f"{watch.failure_line(status, log_path.read_text(errors='replace'))} "
                         f"(the ranks' output: {log_path})\n")
        # The work failed: 1, whatever the launcher's own status (mpirun's 137 for a rank killed
        # by a signal, torchrun's 1), as `ciera --help` documents.
        return 1
    summary = json.loads(summary_path.read_text())
    uplinks = run_dir / "uplinks.json"
    if uplinks.is_file():
        summary["uplinks"] = json.loads(uplinks.read_text())
    try:
        from ciera import plots

        # The plots draw the FSDP2 comparison; a --zero run has its numbers in the files.
        summary["plots"] = [] if summary.get("mode") in ("zero", "reduce_scatter") else plots.write_all(run_dir)
    except Exception as e:  # plots are a convenience; the numbers are in the files
        summary["plots"] = []
        sys.stderr.write(f"ciera train: plots skipped: {e}\n")
    # Whole or not at all: the ranks' summary is the run's result, and a signal may come now.
    rewritten = summary_path.with_name(summary_path.name + ".tmp")
    rewritten.write_text(json.dumps(summary, indent=2))
    os.replace(rewritten, summary_path)
    print(render_summary(summary, run_dir))
    if summary.get("trace"):
        from ciera import trace

        refusal = trace.simulate_refusal(summary["trace"])
        if refusal:
            sys.stderr.write(f"ciera train: warning: ciera simulate will refuse {summary['trace']} ({refusal}); "
                             "a small run on unshaped links measures noisy Comm() times: trace a larger one, "
                             "or on shaped links (--link-gbit)\n")
    if args.json:
        # The per-shard selection stays in summary.json; the line is for scripts.
        line = {k: v for k, v in summary.items() if k not in ("selection", "selection_table")}
        print(json.dumps(line, separators=(",", ":")))
    return exit_status(summary)


class _Terminated(Exception):
    """SIGTERM (a scheduler's, `timeout`'s), SIGHUP (a closed terminal or ssh session, unless
    nohup ignores it) or SIGQUIT while the ranks run, raised in the launcher's loop."""


_ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _raise_for(signum: int):
    raise KeyboardInterrupt if signum == signal.SIGINT else _Terminated


class _Caught:
    """The signal _interruptible() caught. Until arm() (the rank launcher started, so there is
    something to end) a signal is held, and raised by arm(). Raised once: a second signal (a
    double Ctrl-C) must not cut the ending of the ranks short."""

    def __init__(self):
        self.signum = signal.SIGINT
        self._pending = False
        self._armed = False
        self._raised = False

    def __call__(self, signum, frame):  # the handler
        if self._raised:
            return
        self.signum = signum
        if not self._armed:
            self._pending = True
            return
        self._raised = True
        _raise_for(signum)

    def arm(self) -> None:
        self._armed = True
        if self._pending and not self._raised:
            self._pending, self._raised = False, True
            _raise_for(self.signum)


@contextlib.contextmanager
def _interruptible():
    """While the ranks run: SIGINT raises KeyboardInterrupt, SIGTERM, SIGHUP and SIGQUIT
    _Terminated in the launcher, which then ends the rank launcher (mpirun, torchrun) and its ranks, instead of
    exiting alone and leaving them training in the run folder. Yields the _Caught signal."""
    caught = _Caught()
    # A SIGHUP ignored already stays ignored: under nohup it must not end the run. (SIGINT and
    # SIGQUIT are ignored in any job a script starts in the background, where a kill -INT is
    # still meant: they are always handled.)
    before = {sig: signal.signal(sig, caught) for sig in _ENDING_SIGNALS
              if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield caught
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _descendants(pid: int) -> dict[int, str]:
    """Every process under `pid` (mpirun or torchrun, its ranks, the link lab's ip netns exec),
    each with its start time, which tells it from a later process given the same pid."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields:   # a process not gone meanwhile
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def _signal_each(processes: dict[int, str], sig: int) -> None:
    """`sig` to each of `processes` (pid -> start time) that is still the process it was."""
    for pid, start in processes.items():
        fields = stat_fields(pid)
        if fields and fields[19] == start:
            try:
                os.kill(pid, sig)
            except OSError:
                pass   # gone since


def _end(proc: subprocess.Popen) -> None:
    """Ends the rank launcher: SIGTERM, which mpirun and torchrun pass on to their ranks, and
    SIGCONT to it and every process under it, so that a stopped rank takes it. If it has not
    exited in 45 s (torchrun gives its ranks 30), SIGKILL to every process under it first (the
    link lab's script then still removes its namespaces), then to it; whatever of them outlived
    it is killed too, so that no rank trains on in the run folder. The processes under it are
    looked for every second while it runs: ranks it started after the signal count too."""
    under = _descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        pass
    _signal_each(under, signal.SIGCONT)
    for _ in range(45):
        try:
            proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            under.update(_descendants(proc.pid))
    else:
        _signal_each(under, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _signal_each(under, signal.SIGKILL)


def exit_status(summary: dict) -> int:
    """0 when every comparison the run made holds: CIERA against the baseline (with one), the
    gathers against torch's (--verify) and the baseline against its control (--control); else 3.
    A lossy scheme's drift is its result, not a failed comparison: a run of lossy schemes alone
    has nothing that must be exact. A --zero run: CIERA's ZeRO against torch's. A --reduce-scatter
    run in which CIERA's collectives served no call (every one passed through) compared nothing."""
    if summary.get("mode") == "reduce_scatter" and summary.get("reduce_scatter_ciera_calls") == 0:
        return 3   # CIERA reduced nothing: its trainings' identity proves nothing about it
    if summary.get("mode") in ("zero", "reduce_scatter"):
        return 0 if summary["losses_identical"] and summary["params_identical"] else 3
    if summary.get("mode") == "deepspeed":
        exact = summary["losses_identical"] and summary["params_identical"] and summary["wrong_bytes"] == 0
        return 0 if exact else 3
    only_lossy = bool(summary.get("schemes")) and all(x["lossy"] for x in summary["schemes"])
    # Losses alone can agree while the final parameters do not (a wrong last update, a wrong
    # gather whose effect has not reached a loss yet): both must be identical.
    identical = ((summary["losses_identical"] and summary["params_identical"]) or only_lossy
                 or summary["losses_identical"] is None)  # no baseline run: nothing compared
    deterministic = summary.get("control_identical") is not False  # None: no control run
    return 0 if identical and deterministic and summary["wrong_bytes"] == 0 else 3


def follow(proc: subprocess.Popen, metrics: Path, args, watch: Watch) -> int:
    """Draws a progress bar from the metrics rank 0 appends, until the ranks exit; while no
    step completes, says every 10 s which rank the others are waiting for."""
    tty = sys.stderr.isatty()

    def say(line: str) -> None:
        sys.stderr.write(("\r" if tty else "") + line + ("\033[K" if tty else "") + "\n")
        sys.stderr.flush()

    stall = Stall(watch, say)
    trained = len(options.scheme_names(args)) if args.schemes else (3 if args.ablation else 1)
    names = [CONTROL if args.control else BASELINE, *(options.scheme_names(args) if args.schemes else ["ciera"])]
    runs = 2 if args.zero or args.framework == "deepspeed" else (0 if args.no_baseline else 1) + (1 if args.control else 0) + trained
    if args.framework == "deepspeed":
        names = ["zero3", "ciera"]
    if args.reduce_scatter != "fsdp2":
        from ciera.train.reduce_scatter import TWIN

        names, runs = ["zero3" if args.framework == "deepspeed" else "fsdp2", TWIN, "ciera"], 3
    total = (args.steps - checkpoint.resumed_steps(args)) * runs
    width = max(8, *map(len, names))   # the longest run name
    seen, last_line, offset, started = 0, "", 0, time.time()
    while True:
        status = proc.poll()
        if metrics.is_file():
            with open(metrics) as f:
                f.seek(offset)
                for line in f:
                    if not line.endswith("\n"):
                        break
                    offset += len(line)
                    rec = json.loads(line)
                    seen += 1
                    stall.progressed()
                    frac = seen / total
                    bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
                    extra = (f" ratio {rec['ratio']:.2f}x" if rec.get("ratio") else "")
                    # --zero: the parameter sync; --reduce-scatter: the gradient reduce-scatter
                    comm, ms = (("sync", rec["allgather_ms"]) if "sync_ms" in rec else
                                ("reduce-scatter", rec["reduce_scatter_ms"]) if "reduce_scatters" in rec else
                                ("allgather", rec["allgather_ms"]))
                    last_line = (f"{rec['run']:>{width}} [{bar}] {seen}/{total} step {rec['step'] + 1} "
                                 f"loss {rec['loss']:.4f} {comm} {ms:.1f} ms{extra} "
                                 f"{time.time() - started:.0f}s")
                    if tty:
                        sys.stderr.write("\r" + last_line + "\033[K")
                        sys.stderr.flush()
                    elif seen % max(1, total // 10) == 0 or seen == total:
                        sys.stderr.write(last_line + "\n")
        if status is not None:
            if tty and last_line:
                sys.stderr.write("\n")
            return status
        watch.poll()
        if args.launcher == "torchrun":
            watch.continue_stopped()
        stall.check()
        time.sleep(0.2)


def render_summary(s: dict, run_dir: Path) -> str:
    if s.get("mode") == "zero":
        from ciera.train.zero import render

        return render(s, run_dir)
    if s.get("mode") == "deepspeed":
        from ciera.train.deepspeed import render

        return render(s, run_dir)
    if s.get("mode") == "reduce_scatter":
        from ciera.train.reduce_scatter import render

        return render(s, run_dir)

    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    def times(x):  # a ratio; none without a baseline run
        return "-" if x is None else f"{x:.3f}x"

    def timing(row: str) -> str:   # a time row, or why it has no figures
        return row if s.get("timed_steps", 1) else NOT_TIMED

    # --codec delta without a budget: value differences on every shard from the first step, no
    # warmup; with one, the selector chooses per shard after warmup, delta among the choices.
    # The training the rows below describe: CIERA's, or the alternative --codec (or the first of
    # --schemes) named.
    main = s.get("main_scheme", "ciera")
    delta = main == "delta" and s.get("budget_bytes") is None
    who = "CIERA" if main in ("ciera", "auto", "delta") else main
    first = s.get("steps_before", 0) + 1   # this run's first step

    rows = [
        ("model", f"{s['model']} ({s['params']:,} parameters, {s['buckets']} FSDP groups), {s['ranks']} ranks"),
        ("links", s["links"]), ("cores", options.cores_text(s)),
        *([("device", f"cuda: process group {s['process_group']}, deterministic algorithms")]
          if s.get("device") == "cuda" else []),
        ("steps", f"{s['steps']} per run, "
                  + (f"value-delta frames on every shard from step {first}" if delta else f"{s['warmup']} warmup")
                  + "; steady state = steps "
                  f"{max(s['warmup'], s.get('steps_before', 0)) + 1}..{s['steps']}"
                  # A run's first step sends key frames, a resumed run's too (a fresh engine).
                  + (f" (step {first} carries the key frames)" if delta and (s["warmup"] == 1 or first > 1) else "")
                  # Exponent reuse's first frames after the warmup (or a resume) resend every
                  # exponent: counted in the steady state, which a short run's ratio shows.
                  + (f" (step {max(s['warmup'], s.get('steps_before', 0)) + 1} carries the key frames)"
                     if main in ("ciera", "auto") and s.get("budget_bytes") is None else "")
                  + (f"; resumed after step {s['steps_before']} from {s['resumed_from']}" if s.get("resumed_from") else "")
                  + timed_text(s)),
        *layout_row(s),
        ("loss (first -> last)", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
        ("allgather bytes/step", f"raw {s['allgather_raw_bytes']:,}  wire {s['allgather_wire_bytes']:,}"
                                 f"{options.control_text(s.get('allgather_control_bytes'))}  "
                                 f"ratio {s['ratio']:.3f}x ({s['bits_per_value']:.3f} bits/value)"),
        *([("inter-node allgather", f"FSDP2 {s['inter_node_allgather_bytes_fsdp2']:,}  {who} "
                                    f"{s['inter_node_allgather_bytes']:,} bytes/step = "
                                    f"{s['inter_node_fraction'] or float('nan'):.3f} of FSDP2's")]
          if two_level(s) and s.get("inter_node_allgather_bytes_fsdp2") else []),
        ("allgather time/step", timing(f"FSDP2 {ms(s['allgather_ms_fsdp2'])} ms  {who} {ms(s['allgather_ms_ciera'])} ms  "
                                       f"speedup {times(s['allgather_speedup'])}" + control_text(s, "allgather"))),
        ("iteration time/step", timing(f"FSDP2 {ms(s['iteration_ms_fsdp2'])} ms  {who} {ms(s['iteration_ms_ciera'])} ms  "
                                       f"speedup {times(s['iteration_speedup'])}" + control_text(s, "iteration"))),
        ("detect + encode", timing(f"{ms(s['detect_encode_ms_ciera'])} ms/step on the slowest rank; "
                                   + ("-" if s["allgather_hidden_fraction_ciera"] is None
                                      else f"{100 * s['allgather_hidden_fraction_ciera']:.0f}%")
                                   + " of the gathers' duration hidden"
                                   + (" (--overlap)" if s.get("overlap") else " (synchronous gathers)"))),
        ("codec state (peak)", f"{s['cache_bytes'] / 2**20:.2f} MiB per rank"
                               + (f" of {budget_text(s['budget_bytes'])} budget; selected "
                                  f"{s['selected_shards']} of {s['candidate_shards']} shards "
                                  + ", ".join(f"{t} {n}" for t, n in s["selected_by_type"].items() if n)
                                  + (f"; {s['selections'][-1]['delta']} of them value-delta"
                                     if s.get("codec") == "delta" and s.get("selections") else "")
                                  if s.get("budget_bytes") is not None
                                  else "; all shards value-delta (receivers keep the previous values)" if delta
                                  else "; all shards compressed")),
        *([("characterisation", "element changes {:.3f}%/step; reusable blocks W=4: ".format(
            100 * s["characterisation"]["element_change_rate"]) + ", ".join(
            f"B={b} {100 * r:.1f}%" for b, r in s["characterisation"]["reusable_blocks_w4"].items()))]
          if s.get("characterisation") else []),
        ("exponent change rate", "-" if s["exponent_change_rate"] is None
            else f"{100 * s['exponent_change_rate']:.3f}% of values per step (steady state)"),
        ("exactness", exactness_text(s) + (f"; verify: {s['wrong_bytes']} wrong bytes of {s['verified_bytes']:,}"
                                           + (" (every training)" if len(s.get("schemes") or []) > 1 else "")
                                           if s["verified_bytes"] else "")),
        *([("control", "plain FSDP2 trained twice: bitwise identical, the harness itself is deterministic"
            if s["control_identical"] else "plain FSDP2 trained twice: NOT identical, the harness itself is "
                                           "NOT deterministic (no comparison above can be trusted)")]
          if s.get("control_identical") is not None else []),
        ("run folder", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if len(s.get("schemes") or []) > 1 or any(x["lossy"] for x in s.get("schemes") or []):
        text += "\n\n" + scheme_table(s)
    if s.get("selection_table"):
        # The latest selection: with --reselect-every, not the one warmup ended with.
        at = s.get("selection_step")
        text += (f"\n\nselection (paper §3.2), the latest{f' (step {at})' if at is not None else ''}:\n"
                 + s["selection_table"])
    if s.get("ablation"):
        text += ("\n\nablation (cumulative, speedups over plain FSDP2 in this run):\n"
                 f"{'config':<18} {'allgather ms':>12} {'speedup':>8} {'iteration ms':>12} {'speedup':>8} "
                 f"{'ratio':>6} {'cache MiB':>9} {'shards':>6}\n"
                 f"{'FSDP2':<18} {ms(s['allgather_ms_fsdp2']):>12} {'1.000':>8} {ms(s['iteration_ms_fsdp2']):>12} "
                 f"{'1.000':>8} {'1.000':>6} {'0':>9} {'0':>6}")
        for row in s["ablation"]:
            text += (f"\n{row['config']:<18} {ms(row['allgather_ms_ciera']):>12} {row['allgather_speedup'] or 0:>8.3f} "
                     f"{ms(row['iteration_ms_ciera']):>12} {row['iteration_speedup'] or 0:>8.3f} "
                     f"{row['ratio'] or 0:>6.3f} {row['cache_bytes'] / 2**20:>9.2f} {row['selected_shards']:>6}")
    return text


NOT_TIMED = "not measured: no step after each process's first (more --steps, or less --warmup)"


def timed_text(s: dict) -> str:
    """The steps row's note on the time figures: they leave out each process's first step."""
    n = s.get("timed_steps")
    if n is None:   # a summary from before timed_steps
        return ""
    return f"; times over {n} step{'' if n == 1 else 's'} (not a process's first)" if n else "; no step timed"


def control_text(s: dict, what: str) -> str:
    """--control: plain FSDP2 against itself beside a time row, the noise floor of its speedup."""
    if s.get(f"{what}_ms_control") is None:
        return ""
    speedup = s[f"{what}_speedup_control"]
    return (f"  (noise floor: FSDP2 against its control {s[f'{what}_ms_control']:.1f} ms, speedup "
            + ("-" if speedup is None else f"{speedup:.3f}x") + ")")


def two_level(s: dict) -> bool:
    """Whether the run had nodes of several ranks (--nodes K --ranks-per-node R, R > 1). In a flat
    run the summary's topology counts each rank as a node of its own (each has its own link in
    the link lab), and nodes or an inter-node line would only restate the allgather's."""
    return (s.get("topology") or {}).get("ranks_per_node", 1) > 1


def layout_row(s: dict) -> list:
    """The table's layout line: for nodes of several ranks, or a layout other than one shard
    group; none for a flat run of plain FSDP2."""
    t = s.get("topology")
    if not t or not (two_level(s) or t["hsdp"] or t["reshard_after_forward"]):
        return []
    return [("layout", layout_text(t))]


def layout_text(t: dict) -> str:
    """The nodes and FSDP2 layout of a run, in words."""
    nodes = f"{t['nodes']} nodes of {t['ranks_per_node']} ranks; " if t["ranks_per_node"] > 1 else ""
    n = t["reshard_after_forward"]
    resharded = ""
    if n == 1:
        resharded = "reshard_after_forward=1 (parameters stay gathered for backward: no re-gather)"
    elif n:
        resharded = f"reshard_after_forward={n} (backward gathers on that many ranks)"
    if t["hsdp"]:
        return f"{nodes}HSDP (replicated across nodes, sharded inside each)" + (f", {resharded}" if resharded else "")
    if resharded:
        return f"{nodes}FSDP2 {resharded}"
    return f"{nodes}FSDP2, one shard group"


def exactness_text(s: dict) -> str:
    if s["losses_identical"] is None:
        return "not compared (--no-baseline)"
    rows = s.get("schemes") or []
    lossy = [x for x in rows if x["lossy"]]
    drift = ", ".join(f"{x['name']} max |dloss| {x['max_loss_diff']:.2e}" for x in lossy)
    if lossy and len(lossy) == len(rows):
        return f"LOSSY scheme, not exact: {drift}"
    exact = "losses and parameters bitwise identical to FSDP2" if s["losses_identical"] and s["params_identical"] \
        else "NOT IDENTICAL"
    return exact + (f" (the lossless schemes); LOSSY: {drift}" if lossy else "")


def scheme_table(s: dict) -> str:
    """One row per gather scheme of the run, plain FSDP2 first: bits on the wire, times and
    speedups over FSDP2, and how far its training went from FSDP2's."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    header = (f"{'scheme':<12} {'exact':>5} {'bits/value':>10} {'allgather ms':>12} {'speedup':>7} "
              f"{'iteration ms':>12} {'speedup':>7} {'final loss':>10} {'max|dloss|':>10} {'max|dparam|':>11}")
    lines = ["gather schemes side by side (same model, seed and batches, interleaved step by step):", header,
             f"{'fsdp2':<12} {'-':>5} {16:>10.3f} {num(s['allgather_ms_fsdp2'], '.1f'):>12} {'1.000':>7} "
             f"{num(s['iteration_ms_fsdp2'], '.1f'):>12} {'1.000':>7} "
             f"{num(s['losses'].get('fsdp2', [None])[-1], '.4f'):>10} {'0':>10} {'0':>11}"]
    for x in s["schemes"]:
        exact = "LOSSY" if x["lossy"] else "-" if x["exact"] is None else "yes" if x["exact"] else "NO"
        lines.append(f"{x['name']:<12} {exact:>5} {num(x['bits_per_value'], '.3f'):>10} {num(x['allgather_ms'], '.1f'):>12} "
                     f"{num(x['allgather_speedup'], '.3f'):>7} {num(x['iteration_ms'], '.1f'):>12} "
                     f"{num(x['iteration_speedup'], '.3f'):>7} {num(x['final_loss'], '.4f'):>10} "
                     f"{num(x['max_loss_diff'], '.2e'):>10} {num(x['max_param_diff'], '.2e'):>11}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = options.parser().parse_args(argv)
    if args.child:
        if not args.run_dir:   # the launcher gives its ranks both; a user who types --child, neither
            return _refused("ciera train: --child is the launcher's own option for its ranks (with --run-dir); "
                            "run `ciera train` without it")
        from ciera.train.rank import RankProgram

        return RankProgram(args).run()
    try:
        options.check(args)
    except SystemExit as refused:  # check's one way out: an option value no run could use
        if not isinstance(refused.code, str):
            raise
        return _refused(refused.code)
    return launch(args, argv)


def _refused(line: str) -> int:
    """A command line no run could use: its one line on stderr, and status 2, as argparse gives
    for the options it checks itself and the native tool for its own (so scripts can tell a bad
    command line, 2, from a run that failed, 1)."""
    sys.stderr.write(line + "\n")
    return 2
