"""``ciera train``: trains a real MoE architecture with FSDP2 on W CPU ranks, once with FSDP2's
own all-gather (the baseline) and once through CIERA, from the same seed and data, and shows
that the two trainings are bitwise identical while CIERA moves fewer bytes.

    ciera train                          # 4 ranks, OLMoE, defaults that finish in minutes
    ciera train --model mixtral --link-gbit 1 --verify --json

The command launches its own ranks (under mpirun, or inside the link lab with --link-gbit) and
draws the progress; the ranks write per-step metrics to <run>/metrics.jsonl and rank 0 writes
<run>/summary.json, from which the final table and the PNG plots are made.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


# ---- Options ------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ciera train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="olmoe", choices=["olmoe", "mixtral", "qwen2_moe", "deepseek"])
    p.add_argument("--ranks", type=int, default=4, help="data-parallel ranks (processes)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=30, help="steps before exponent reuse starts")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-intermediate", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--block", type=int, default=512, help="CIERA values per block")
    p.add_argument("--codec", default="ciera", choices=["ciera", "auto"],
                   help="always compress, or let the engine keep whichever is faster")
    p.add_argument("--transport", default="mpi", choices=["torch", "mpi"],
                   help="CIERA's collectives: torch's gloo process group, or Open MPI")
    p.add_argument("--threads", type=int, default=2, help="CIERA encode/decode threads per rank")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="benefit-driven selection (paper §3.2) with this cache budget per rank, MiB; "
                        "default: every parameter through exponent reuse after warmup")
    p.add_argument("--reselect-every", type=int, default=0,
                   help="with --budget-mb, re-run the selection every K steps on fresh statistics")
    p.add_argument("--ablation", action="store_true",
                   help="the paper's Table 3 in one run: FSDP2, +ER (all shards), +BSC, +CCP side by side")
    p.add_argument("--overlap", action="store_true",
                   help="CCP: gathers run in flight while the previous module computes (both runs)")
    p.add_argument("--link-gbit", type=float, default=0.0, help="run in the link lab, links shaped to G Gbit/s")
    p.add_argument("--stats", action="store_true",
                   help="characterise exponent changes during training (paper §2, O2-O4): per parameter "
                        "and shard type, per block size and re-partitioned world size (costs time)")
    p.add_argument("--save-checkpoints", metavar="DIR",
                   help="write the BF16 parameters of the CIERA run as safetensors at the start of every "
                        "step (for `ciera analyze`)")
    p.add_argument("--trace", metavar="FILE",
                   help="write a trace for `ciera simulate` (per-group compute, comm curves, change rates)")
    p.add_argument("--verify", action="store_true", help="compare every gather with torch.distributed's")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain FSDP2 run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs", help="folder for run folders")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait for peers")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p


# ---- Launcher and user interface (the process the user started) ---------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def linklab_script() -> str:
    for candidate in (ROOT / "share" / "linklab.sh", ROOT.parents[1] / "scripts" / "linklab.sh"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("ciera train: scripts/linklab.sh not found")


def launch(args, argv: list[str]) -> int:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out) / f"{stamp}-{args.model}-w{args.ranks}"
    run_dir.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, "-m", "ciera.train", *argv, "--child", "--run-dir", str(run_dir.resolve())]
    env = dict(os.environ, CIERA_MASTER_PORT=str(free_port()), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT.parent), env.get("PYTHONPATH")]))
    if args.link_gbit > 0:
        cmd = [linklab_script(), "--ranks", str(args.ranks), "--gbit", str(args.link_gbit), "--", *child]
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("ciera train: mpirun not found (apt-get install openmpi-bin)")
        cmd = [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(args.ranks),
               "-x", "CIERA_MASTER_PORT", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED", "-x", "OMP_NUM_THREADS", *child]
    log_path = run_dir / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        status = follow(proc, run_dir / "metrics.jsonl", args)
    summary_path = run_dir / "summary.json"
    if status != 0 or not summary_path.is_file():
        sys.stderr.write(f"\nciera train: the ranks failed (exit {status}); last lines of {log_path}:\n")
        sys.stderr.write("".join(open(log_path).readlines()[-25:]))
        return status or 1
    summary = json.loads(summary_path.read_text())
    try:
        from ciera import plots

        summary["plots"] = plots.write_all(run_dir)
    except Exception as e:  # plots are a convenience; the numbers are in the files
        summary["plots"] = []
        sys.stderr.write(f"ciera train: plots skipped: {e}\n")
    summary_path.write_text(json.dumps(summary, indent=2))
    print(render_summary(summary, run_dir))
    if args.json:
        # The per-shard selection stays in summary.json; the line is for scripts.
        line = {k: v for k, v in summary.items() if k not in ("selection", "selection_table")}
        print(json.dumps(line, separators=(",", ":")))
    identical = summary["losses_identical"] or summary.get("iteration_ms_fsdp2") is None  # no baseline run
    return 0 if identical and summary["wrong_bytes"] == 0 else 3


def follow(proc: subprocess.Popen, metrics: Path, args) -> int:
    """Draws a progress bar from the metrics rank 0 appends, until the ranks exit."""
    tty = sys.stderr.isatty()
    total = args.steps * ((0 if args.no_baseline else 1) + (3 if args.ablation else 1))
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
                    frac = seen / total
                    bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
                    extra = (f" ratio {rec['ratio']:.2f}x" if rec.get("ratio") else "")
                    last_line = (f"{rec['run']:>8} [{bar}] {seen}/{total} step {rec['step'] + 1} "
                                 f"loss {rec['loss']:.4f} allgather {rec['allgather_ms']:.1f} ms{extra} "
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
        time.sleep(0.2)


def budget_bytes(budget_mb: float) -> int:
    """--budget-mb in bytes; an infinite budget (selection by gain alone) is the largest uint64."""
    return 2**64 - 1 if budget_mb == float("inf") else int(budget_mb * 2**20)


def budget_text(nbytes: int) -> str:
    return "an unlimited" if nbytes >= 2**63 else f"a {nbytes / 2**20:.2f} MiB"


def render_summary(s: dict, run_dir: Path) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    rows = [
        ("model", f"{s['model']} ({s['params']:,} parameters, {s['buckets']} FSDP groups), {s['ranks']} ranks"),
        ("links", s["links"]),
        ("steps", f"{s['steps']} per run, {s['warmup']} warmup; steady state = steps {s['warmup'] + 1}..{s['steps']}"),
        ("loss (first -> last)", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
        ("allgather bytes/step", f"raw {s['allgather_raw_bytes']:,}  wire {s['allgather_wire_bytes']:,}  "
                                 f"ratio {s['ratio']:.3f}x ({s['bits_per_value']:.3f} bits/value)"),
        ("allgather time/step", f"FSDP2 {ms(s['allgather_ms_fsdp2'])} ms  CIERA {ms(s['allgather_ms_ciera'])} ms  "
                                f"speedup {s['allgather_speedup'] or float('nan'):.3f}x"),
        ("iteration time/step", f"FSDP2 {ms(s['iteration_ms_fsdp2'])} ms  CIERA {ms(s['iteration_ms_ciera'])} ms  "
                                f"speedup {s['iteration_speedup'] or float('nan'):.3f}x"),
        ("detect + encode", f"{s['detect_encode_ms_ciera']:.1f} ms/step on the slowest rank; "
                            f"{100 * s['allgather_hidden_fraction_ciera']:.0f}% of the gathers' duration hidden"
                            + (" (--overlap)" if s.get("overlap") else " (synchronous gathers)")),
        ("codec state (peak)", f"{s['cache_bytes'] / 2**20:.2f} MiB per rank"
                               + (f" of {budget_text(s['budget_bytes'])} budget; selected "
                                  f"{s['selected_shards']} of {s['candidate_shards']} shards "
                                  + ", ".join(f"{t} {n}" for t, n in s["selected_by_type"].items() if n)
                                  if s.get("budget_bytes") is not None else "; all shards compressed")),
        *([("characterisation", "element changes {:.3f}%/step; reusable blocks W=4: ".format(
            100 * s["characterisation"]["element_change_rate"]) + ", ".join(
            f"B={b} {100 * r:.1f}%" for b, r in s["characterisation"]["reusable_blocks_w4"].items()))]
          if s.get("characterisation") else []),
        ("exponent change rate", f"{100 * s['exponent_change_rate']:.3f}% of values per step (steady state)"),
        ("exactness", ("not compared (--no-baseline)" if s.get("iteration_ms_fsdp2") is None
                       else "losses and parameters bitwise identical to FSDP2"
                       if s["losses_identical"] and s["params_identical"] else "NOT IDENTICAL") + (f"; verify: {s['wrong_bytes']} wrong bytes of {s['verified_bytes']:,}"
                                               if s["verified_bytes"] else "")),
        ("run folder", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if s.get("selection_table"):
        text += "\n\nselection (paper §3.2) at the end of warmup:\n" + s["selection_table"]
    if s.get("ablation"):
        text += ("\n\nablation (cumulative, speedups over plain FSDP2 in this run):\n"
                 f"{'config':<18} {'allgather ms':>12} {'speedup':>8} {'iteration ms':>12} {'speedup':>8} "
                 f"{'ratio':>6} {'cache MiB':>9} {'shards':>6}\n"
                 f"{'FSDP2':<18} {ms(s['allgather_ms_fsdp2']):>12} {'1.000':>8} {ms(s['iteration_ms_fsdp2']):>12} "
                 f"{'1.000':>8} {'1.000':>6} {'0':>9} {'0':>6}")
        for row in s["ablation"]:
            text += (f"\n{row['config']:<18} {row['allgather_ms_ciera']:>12.1f} {row['allgather_speedup'] or 0:>8.3f} "
                     f"{row['iteration_ms_ciera']:>12.1f} {row['iteration_speedup'] or 0:>8.3f} "
                     f"{row['ratio'] or 0:>6.3f} {row['cache_bytes'] / 2**20:>9.2f} {row['selected_shards']:>6}")
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.child:
        return Child(args).run()
    if args.warmup >= args.steps:
        raise SystemExit("ciera train: --steps must exceed --warmup to measure a steady state")
    if args.budget_mb is not None and not args.budget_mb >= 0:
        raise SystemExit(f"ciera train: --budget-mb must be >= 0 MiB, got {args.budget_mb}")
    if args.reselect_every < 0:
        raise SystemExit(f"ciera train: --reselect-every must be >= 0, got {args.reselect_every}")
    return launch(args, argv)


# ---- One rank ---------------------------------------------------------------------------------

class Child:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        self.world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        self.run_dir = Path(args.run_dir)
        self.tracer = None
        self.stats = None
        self.grad_bytes: dict[int, int] = {}

    def run(self) -> int:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        in_lab = "CIERA_LINKLAB_PREFIX" in os.environ
        master = "10.231.0.1" if in_lab else "127.0.0.1"
        if in_lab:
            os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{os.environ['CIERA_MASTER_PORT']}",
                                rank=self.rank, world_size=self.world,
                                timeout=_dt.timedelta(seconds=self.args.timeout))
        try:
            self.train_both()
        finally:
            dist.destroy_process_group()
        return 0

    def emit(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def build(self):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ciera import models

        a = self.args
        spec = models.ModelSpec(family=a.model, hidden=a.hidden, layers=a.layers, experts=a.experts,
                                expert_intermediate=a.expert_intermediate, max_positions=max(1024, a.seq_len))
        model = models.build(spec, a.seed)
        mesh = init_device_mesh("cpu", (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in models.decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, spec

    def variants(self) -> list[tuple[str, float | None, bool]]:
        """(name, cache budget in MiB or None for every shard, overlap) of each CIERA training."""
        a = self.args
        if not a.ablation:
            return [("ciera", a.budget_mb, a.overlap)]
        budget = a.budget_mb if a.budget_mb is not None else float("inf")  # BSC by gain alone
        # The paper's Table 3, cumulative: exponent reuse on every shard, + selection, + pipelining.
        return [("er", None, False), ("bsc", budget, False), ("ciera", budget, True)]

    def train_both(self) -> None:
        """Trains the baseline and the CIERA model(s) side by side, one step of each in turn: all
        start from the same seed and see the same data, and interleaving keeps the machine's state
        (memory warm-up, other load) the same for all, so their times are comparable. (Run one
        after the other, the first training in a process is about twice as slow.)"""
        import ciera
        import ciera.torch as ct
        from ciera import data

        a = self.args
        corpus = data.load_corpus()
        runs, handles = {}, {}
        # Exponent statistics are collected in every training alike (same cost for all); they
        # are identical anyway, since the parameters are.
        self.trackers = trackers = {}
        if not a.no_baseline:
            plain, _ = self.build()
            trackers["fsdp2"] = ct.ExponentTracker()
            records = ct.time_plain_all_gathers(plain, trackers["fsdp2"], overlap=a.overlap and not a.ablation)

            def take_plain_records():
                taken = list(records)
                records.clear()
                return taken

            runs["fsdp2"] = Run("fsdp2", plain, a.lr, take_plain_records)
            runs["fsdp2"].rs_records = ct.time_reduce_scatters(plain)
            if a.trace:
                from ciera import trace

                self.tracer = trace.Tracer(len(ct.describe_buckets(plain)))
        for name, budget_mb, overlap in self.variants():
            model, spec = self.build()
            config = ciera.EngineConfig()
            config.codec.block_values = a.block
            config.warmup_steps = 0  # warmup is driven per training step below
            config.adaptive = a.codec == "auto"
            config.worker_threads = a.threads
            config.timeout_s = a.timeout
            if budget_mb is not None:
                # The selector counts steps itself and selects at the start of step `warmup`.
                handle = ct.enable(model, config, transport=a.transport, verify=a.verify, overlap=overlap,
                                   cache_budget_bytes=budget_bytes(budget_mb), select_after_steps=a.warmup,
                                   reselect_every=a.reselect_every)
            else:
                handle = ct.enable(model, config, transport=a.transport, verify=a.verify, overlap=overlap,
                                   policy=lambda bucket, param: ciera.ShardPolicy.raw)
            # The main run's tracker counts per parameter: a trace takes its change rates from it.
            trackers[name] = (ct.ExponentTracker(handle.buckets, a.block) if name == "ciera"
                              else ct.ExponentTracker())
            handle.set_gather_observer(trackers[name])
            if a.stats and name == "ciera":
                self.stats = TrainingStats(handle.buckets, self.world, self.rank, a.warmup)
                handle.set_output_observer(self.stats)
            runs[name] = Run(name, model, a.lr, handle.take_records)
            runs[name].budget_mb = budget_mb
            runs[name].rs_records = ct.time_reduce_scatters(model)
            handles[name] = handle
        for step in range(a.steps):
            if step == a.warmup:
                # Warmup over: without a selector every parameter now goes through exponent reuse
                # (all ranks at once).
                for name, handle in handles.items():
                    if handle.selector is None:
                        for bucket in handle.buckets:
                            for k in range(len(bucket.params)):
                                handle.engine.set_policy(bucket.index, k, ciera.ShardPolicy.ciera)
            tokens = data.batch(corpus, step, self.rank, a.batch, a.seq_len, a.seed)
            # Whichever model steps first after the previous pair is measurably slower on an
            # oversubscribed machine (caches and schedulers settle); rotating the order every
            # step gives every run the same share of that cost.
            order = list(runs.values())
            shift = step % len(order)
            order = order[shift:] + order[:shift]
            if step == a.warmup:
                trackers["ciera"].clear_counts()  # per-parameter rates of the steady state only
            if self.stats is not None:
                self.stats.new_step()
            if a.save_checkpoints:
                self.save_checkpoint(runs["ciera"].model, step)
            for run in order:
                trackers[run.name].new_step()
                self.emit(self.step(run, step, tokens, trackers[run.name]))
                if run.name in handles:
                    run.peak_cache_bytes = max(run.peak_cache_bytes, handles[run.name].cache_bytes)
        for run in runs.values():
            run.final = self.local_params(run.model)
        self.finish(runs, handles, spec, sum(p.numel() for p in model.parameters()))
        for handle in handles.values():
            handle.disable()

    def step(self, run, step: int, tokens, tracker) -> dict:
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        loss = run.model(input_ids=tokens, labels=tokens).loss
        loss_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        iteration = end - start
        records = run.take_records()
        rs_records = list(run.rs_records)
        run.rs_records.clear()
        for r in rs_records:
            self.grad_bytes[r.bucket] = r.input_bytes
        if step >= self.args.warmup:
            for r in records:
                run.bucket_wire.setdefault(r.bucket, []).append(r.wire_bytes)
            if self.tracer is not None and run.name == "fsdp2":
                from ciera import trace

                self.tracer.add(trace.StepEvents(start, loss_done, backward_done, end, records, rs_records))
        local = loss.detach().float()
        out = run.results
        out["loss_bits"].append(int(local.view(torch.int32).item()))
        # Two small all-reduces per step: the mean loss, and each time's slowest rank.
        # The allgather time on the critical path: all of a finished gather, the wait for one in flight.
        stats = torch.tensor([float(local), iteration,
                              sum(r.seconds if r.exposed_s < 0 else r.exposed_s for r in records),
                              sum(r.seconds for r in rs_records),
                              sum(r.raw_bytes for r in records), sum(r.wire_bytes for r in records),
                              tracker.changed, tracker.total,
                              sum(r.encode_s for r in records), sum(r.seconds for r in records)],
                             dtype=torch.float64)
        summed = stats.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        peak = stats.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["loss"].append(summed[0].item() / self.world)
        out["iteration_s"].append(peak[1].item())
        out["allgather_s"].append(peak[2].item())
        out["reduce_scatter_s"].append(peak[3].item())
        out["encode_s"].append(peak[8].item())
        out["gather_duration_s"].append(peak[9].item())
        out["raw"].append(stats[4].item())
        out["wire"].append(stats[5].item())
        record = {"run": run.name, "step": step, "loss": out["loss"][-1], "iteration_ms": 1e3 * peak[1].item(),
                  "allgather_ms": 1e3 * peak[2].item(), "reduce_scatter_ms": 1e3 * peak[3].item(),
                  "raw_bytes": stats[4].item(), "wire_bytes": stats[5].item()}
        if summed[7] > 0:
            record["exponent_change_rate"] = summed[6].item() / summed[7].item()
        if run.name != "fsdp2":
            record["ratio"] = stats[4].item() / max(1.0, stats[5].item())
            record["bits_per_value"] = 16.0 * stats[5].item() / max(1.0, stats[4].item())
        return record

    def local_params(self, model) -> list:
        return [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
                for p in model.parameters()]

    def finish(self, runs: dict, handles: dict, spec, params) -> None:
        import torch
        import torch.distributed as dist

        import ciera.torch as ct

        a = self.args
        steady = slice(a.warmup, a.steps)
        base = runs.get("fsdp2")
        names = [n for n in runs if n != "fsdp2"]
        # Per CIERA run: loss mismatches, parameter bytes mismatched, wrong bytes, verified bytes,
        # and (MAX-reduced) the peak codec state of any rank.
        counts = torch.zeros(len(names), 4, dtype=torch.int64)
        peaks = torch.zeros(len(names), dtype=torch.int64)
        for i, name in enumerate(names):
            run = runs[name]
            if base:
                counts[i, 0] = sum(x != y for x, y in zip(base.results["loss_bits"], run.results["loss_bits"]))
                counts[i, 1] = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
                                   for x, y in zip(base.final, run.final))
            counts[i, 2] = handles[name].wrong_bytes
            counts[i, 3] = handles[name].verified_bytes
            peaks[i] = run.peak_cache_bytes
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        trace_doc = self.collect_trace(runs, handles, params) if a.trace else None
        characterisation = self.stats.gather() if self.stats is not None else None
        if self.rank != 0:
            return

        def med(xs):
            return statistics.median(xs) if xs else None

        def describe(i: int, name: str) -> dict:
            r = runs[name].results
            raw, wire = sum(r["raw"][steady]), sum(r["wire"][steady])
            ag, it = med(r["allgather_s"][steady]), med(r["iteration_s"][steady])
            ag_base = med(base.results["allgather_s"][steady]) if base else None
            it_base = med(base.results["iteration_s"][steady]) if base else None
            handle = handles[name]
            out = {
                "allgather_raw_bytes": int(statistics.median(r["raw"][steady])),
                "allgather_wire_bytes": int(statistics.median(r["wire"][steady])),
                "ratio": raw / wire if wire else None,
                "bits_per_value": 16.0 * wire / raw if raw else None,
                "allgather_ms_ciera": ag * 1e3,
                "allgather_speedup": ag_base / ag if ag_base else None,
                "iteration_ms_ciera": it * 1e3,
                "iteration_speedup": it_base / it if it_base else None,
                "losses_identical": bool(base) and int(counts[i, 0]) == 0,
                "params_identical": bool(base) and int(counts[i, 1]) == 0,
                "loss_mismatches": int(counts[i, 0]), "param_bytes_mismatched": int(counts[i, 1]),
                "wrong_bytes": int(counts[i, 2]), "verified_bytes": int(counts[i, 3]),
                "overlap": handle._runtime.overlap,
                "cache_bytes": int(peaks[i]),
                "budget_bytes": budget_bytes(runs[name].budget_mb) if runs[name].budget_mb is not None else None,
            }
            selection = handle.selector.selection if handle.selector else None
            if selection is not None:
                chosen = [x for x in selection["shards"] if x["chosen"]]
                out["selected_shards"] = len(chosen)
                out["candidate_shards"] = len(selection["shards"])
                out["selected_by_type"] = {t: sum(1 for x in chosen if x["type"] == t)
                                           for t in sorted({x["type"] for x in selection["shards"]})}
                out["selection_table"] = ct.selection_table(selection)
                out["selection"] = [{k: x[k] for k in ("name", "type", "value_change_rate", "block_change_rate", "gain_s",
                                                       "memory_bytes", "chosen", "reason")}
                                    for x in selection["shards"]]
                out["selections"] = handle.selector.history
            else:
                out["selected_shards"] = out["candidate_shards"] = sum(len(b.params) for b in handle.buckets)
            return out

        described = {name: describe(i, name) for i, name in enumerate(names)}
        main = described["ciera"]
        records = [json.loads(line) for line in open(self.run_dir / "metrics.jsonl")]
        rates = [r["exponent_change_rate"] for r in records
                 if r["run"] == "ciera" and r["step"] >= a.warmup and r.get("exponent_change_rate") is not None]
        ag_base = med(base.results["allgather_s"][steady]) if base else None
        it_base = med(base.results["iteration_s"][steady]) if base else None
        c = runs["ciera"].results
        summary = {
            "model": a.model, "spec": spec.describe(), "params": params, "ranks": self.world,
            "buckets": len(handles["ciera"].buckets), "links": (f"{a.link_gbit:g} Gbit/s (link lab)" if a.link_gbit
                                                                 else "unshaped (mpirun on one host)"),
            "transport": a.transport, "codec": a.codec,
            "steps": a.steps, "warmup": a.warmup, "lr": a.lr, "block": a.block,
            "loss_first": c["loss"][0], "loss_last": c["loss"][-1],
            "allgather_ms_fsdp2": ag_base * 1e3 if ag_base else None,
            "iteration_ms_fsdp2": it_base * 1e3 if it_base else None,
            **main,
            "exponent_change_rate": statistics.fmean(rates) if rates else 0.0,
            # Every CIERA training of this run must match the baseline, not just the main one.
            "losses_identical": all(d["losses_identical"] for d in described.values()),
            "params_identical": all(d["params_identical"] for d in described.values()),
            "wrong_bytes": sum(d["wrong_bytes"] for d in described.values()),
        }
        # O5: change detection + encoding per step, and how much of the gathers' duration the
        # training did not wait for (0 with synchronous gathers; with --overlap, what CCP hid).
        enc = med(c["encode_s"][steady])
        duration = med(c["gather_duration_s"][steady])
        summary["detect_encode_ms_ciera"] = enc * 1e3
        summary["allgather_hidden_fraction_ciera"] = (1 - main["allgather_ms_ciera"] / 1e3 / duration
                                                      if duration else 0.0)
        # O1: the allgather's share of the communication time (allgather + gradient reduce-scatter).
        for name in ("fsdp2", "ciera"):
            if name in runs:
                ag_s = med(runs[name].results["allgather_s"][steady])
                rs_s = med(runs[name].results["reduce_scatter_s"][steady])
                summary[f"allgather_share_{name}"] = ag_s / (ag_s + rs_s) if ag_s + rs_s > 0 else None
                summary[f"reduce_scatter_ms_{name}"] = rs_s * 1e3
        if characterisation is not None:
            (self.run_dir / "characterisation.json").write_text(json.dumps(characterisation, indent=1))
            summary["characterisation"] = characterisation["summary"]
        if trace_doc is not None:
            trace_doc["measured"] = {
                "baseline": {"iteration_s": it_base, "allgather_s": ag_base},
                "ciera": {"iteration_s": main["iteration_ms_ciera"] / 1e3, "allgather_s": main["allgather_ms_ciera"] / 1e3},
            }
            from ciera import trace

            trace.write(a.trace, trace_doc)
            summary["trace"] = a.trace
        if a.ablation:
            summary["ablation"] = [{"config": {"er": "+ER (all shards)", "bsc": "+BSC", "ciera": "+CCP"}[n],
                                    **{k: described[n][k] for k in (
                                        "allgather_ms_ciera", "allgather_speedup", "iteration_ms_ciera",
                                        "iteration_speedup", "ratio", "cache_bytes", "selected_shards",
                                        "losses_identical")}} for n in names]
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


    def save_checkpoint(self, model, step: int) -> None:
        """The parameters as FSDP gathers them (BF16 casts of the FP32 masters). Collective."""
        import torch
        from safetensors.torch import save_file

        tensors = {name: p.full_tensor().detach().to(torch.bfloat16).contiguous()
                   for name, p in model.named_parameters()}
        if self.rank == 0:
            folder = Path(self.args.save_checkpoints)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / f"step_{step:05d}.safetensors"))

    def collect_trace(self, runs: dict, handles: dict, params: int) -> dict:
        """The trace of this run (docs/simulator.md, trace format v1). Collective."""
        import torch
        import torch.distributed as dist

        import ciera._ext as ext
        import ciera.torch as ct
        from ciera import trace

        a = self.args
        if self.tracer is None or not self.tracer.forward:
            raise SystemExit("ciera train: --trace needs the baseline run and steps after warmup")
        handle = handles["ciera"]
        buckets = handle.buckets
        forward, backward, optimizer = self.tracer.medians()
        times = torch.tensor(forward + backward + [optimizer], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.SUM)
        times = (times / self.world).tolist()
        n = len(buckets)
        counts = self.trackers["ciera"].merged_counts(buckets)
        wire = torch.tensor([statistics.fmean(runs["ciera"].bucket_wire.get(b.index, [0])) for b in buckets],
                            dtype=torch.float64)
        dist.all_reduce(wire, op=dist.ReduceOp.MAX)  # the same on every rank (all ranks' payloads)
        element = {b.index: torch.tensor([], dtype=b.dtype).element_size() for b in buckets}
        largest = max(b.numel * self.world * element[b.index] for b in buckets)
        # Comm() as measured inside the training (per bucket, slowest rank), and a probe of the same
        # collectives outside it, for reference.
        in_situ = self.tracer.in_situ_curves()
        for kind in ("allgather", "reduce_scatter"):
            seconds = torch.tensor([p["seconds"] for p in in_situ[kind]], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            for p, t in zip(in_situ[kind], seconds.tolist()):
                p["seconds"] = t
        probe = trace.measure_comm_curves(None, 4 * largest)
        codec_config = ext.CodecConfig()
        codec_config.block_values = a.block
        speed = ext.measure_codec(codec_config)
        doc = {
            "format": "ciera-trace", "version": 1,
            "model": {"family": a.model, "params": params},
            "world_size": self.world, "dtype": "bf16",
            "link": {"kind": "linklab" if a.link_gbit else "local", "gbit": a.link_gbit, "latency_ms": 0.0},
            "codec": {"encode_GBps": speed.encode_bytes_per_s / 1e9, "decode_GBps": speed.decode_bytes_per_s / 1e9,
                      "detect_GBps": speed.detect_bytes_per_s / 1e9},
            "comm": in_situ,
            "comm_probe": probe,
            "optimizer_s": times[2 * n],
            # How the traced run scheduled its collectives: on CPU ranks FSDP2's gathers and
            # reduce-scatters block (no prefetch overlap) unless --overlap was given.
            # Under --ablation the baseline is sequential and the measured CIERA run (+CCP) overlaps.
            "schedule": {"overlap": bool(a.overlap and not a.ablation),
                         "ciera_overlap": bool(a.overlap or a.ablation), "block_values": a.block},
            "buckets": [],
        }
        for i, b in enumerate(buckets):
            shards = []
            for p, c in zip(b.params, counts[i]):
                shards.append({"name": p.name, "type": ct.shard_type(p.name), "values": p.numel * self.world,
                               "change_rate": c.value_change_rate, "block_change_rate": c.block_change_rate})
            doc["buckets"].append({
                "name": b.module_name or "<root>", "forward_s": times[i], "backward_s": times[n + i],
                "raw_bytes": b.numel * self.world * element[b.index], "wire_bytes": wire[i].item(),
                "grad_bytes": self.grad_bytes.get(b.index, 0), "shards": shards,
                "gathers_per_step": self.tracer.gathers_per_step(b.index),
            })
        return doc


class TrainingStats:
    """In-training characterisation (paper §2, O2-O4) on the CIERA run: the first gather of each
    bucket per step holds every parameter whole, so exponent changes can be counted for any block
    size and re-partitioned for any world size, as `ciera analyze` does from checkpoints. Rank r
    counts every W-th parameter, so the work is spread over the ranks."""

    def __init__(self, buckets, world: int, rank: int, warmup: int):
        import ciera._ext as ext
        import ciera.torch as ct

        self.world = world
        self.counters = {}
        self.seen: set = set()
        index = 0
        for b in buckets:
            for k, p in enumerate(b.params):
                if index % world == rank:
                    counter = ext.ExponentChangeCounter(ct._DTYPES[b.dtype], p.full_numel, warmup_steps=warmup)
                    self.counters[(b.index, k)] = (p.name, counter)
                index += 1

    def new_step(self) -> None:
        self.seen.clear()

    def __call__(self, bucket, output) -> None:
        import ciera.torch as ct

        if bucket.index in self.seen:
            return
        self.seen.add(bucket.index)
        for k in range(len(bucket.params)):
            entry = self.counters.get((bucket.index, k))
            if entry is not None:
                full = ct.full_parameter(bucket, k, output, self.world).contiguous()
                entry[1].observe(full.data_ptr(), full.numel() * full.element_size())

    def gather(self) -> dict | None:
        """Every rank's counters, merged on rank 0 per parameter, per shard type and overall."""
        import torch.distributed as dist

        import ciera.torch as ct

        mine = [{"name": name, "type": ct.shard_type(name), **counter.summary()}
                for name, counter in self.counters.values()]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        params = [p for rank in everyone for p in rank]
        if not params:
            return None
        first = params[0]

        def merged(group: list) -> dict:
            total = {"values": 0, "changed_values": 0, "transitions": group[0]["total"]["transitions"]}
            for key in ("blocks", "changed_blocks"):
                total[key] = [[sum(p["total"][key][w][b] for p in group) for b in range(len(first["block_values"]))]
                              for w in range(len(first["worlds"]))]
            for key in ("shards", "changed_shards"):
                total[key] = [sum(p["total"][key][w] for p in group) for w in range(len(first["worlds"]))]
            total["values"] = sum(p["total"]["values"] for p in group)
            total["changed_values"] = sum(p["total"]["changed_values"] for p in group)
            total["element_change_rate"] = total["changed_values"] / total["values"] if total["values"] else 0.0
            total["reusable_blocks"] = [[1 - c / n if n else 1.0 for c, n in zip(cw, nw)]
                                        for cw, nw in zip(total["changed_blocks"], total["blocks"])]
            total["shard_change_rate"] = [c / n if n else 0.0 for c, n in zip(total["changed_shards"], total["shards"])]
            return total

        types = sorted({p["type"] for p in params})
        overall = merged(params)
        by_type = {t: merged([p for p in params if p["type"] == t]) for t in types}
        w4 = first["worlds"].index(4) if 4 in first["worlds"] else 0
        b512 = first["block_values"].index(512) if 512 in first["block_values"] else 0
        summary = {
            "element_change_rate": overall["element_change_rate"],
            "reusable_blocks_w4": dict(zip(map(str, first["block_values"]), overall["reusable_blocks"][w4])),
            "shard_change_rate": dict(zip(map(str, first["worlds"]), overall["shard_change_rate"])),
            "by_type": {t: {"element_change_rate": v["element_change_rate"],
                            "block_change_rate_w4_b512": 1 - v["reusable_blocks"][w4][b512]}
                        for t, v in by_type.items()},
        }
        steps = len(first["changed_values_per_step"])
        per_step = [sum(p["changed_values_per_step"][i] for p in params) / sum(p["values"] for p in params)
                    for i in range(steps)]
        return {"worlds": first["worlds"], "block_values": first["block_values"],
                "warmup_steps": first["warmup_steps"], "total": overall, "by_type": by_type,
                "element_change_rate_per_step": per_step, "parameters": params, "summary": summary}


class Run:
    """One of the two trainings: its model, optimizer and per-step results."""

    def __init__(self, name, model, lr, take_records):
        import torch

        self.name = name
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.take_records = take_records
        self.final = None
        self.budget_mb = None
        self.peak_cache_bytes = 0
        self.rs_records: list = []
        self.bucket_wire: dict[int, list] = {}   # steady-state wire bytes per gather, per bucket
        self.results = {"loss_bits": [], "loss": [], "allgather_s": [], "reduce_scatter_s": [], "iteration_s": [],
                        "raw": [], "wire": [], "encode_s": [], "gather_duration_s": []}


if __name__ == "__main__":
    sys.exit(main())
