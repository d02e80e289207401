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
    p.add_argument("--link-gbit", type=float, default=0.0, help="run in the link lab, links shaped to G Gbit/s")
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
        print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["losses_identical"] and summary["wrong_bytes"] == 0 else 3


def follow(proc: subprocess.Popen, metrics: Path, args) -> int:
    """Draws a progress bar from the metrics rank 0 appends, until the ranks exit."""
    tty = sys.stderr.isatty()
    total = args.steps * (1 if args.no_baseline else 2)
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
        ("exponent change rate", f"{100 * s['exponent_change_rate']:.3f}% of values per step (steady state)"),
        ("exactness", ("losses and parameters bitwise identical to FSDP2" if s["losses_identical"] and s["params_identical"]
                       else "NOT IDENTICAL") + (f"; verify: {s['wrong_bytes']} wrong bytes of {s['verified_bytes']:,}"
                                               if s["verified_bytes"] else "")),
        ("run folder", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.child:
        return Child(args).run()
    if args.warmup >= args.steps:
        raise SystemExit("ciera train: --steps must exceed --warmup to measure a steady state")
    return launch(args, argv)


# ---- One rank ---------------------------------------------------------------------------------

class Child:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        self.world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        self.run_dir = Path(args.run_dir)

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

    def train_both(self) -> None:
        """Trains the baseline and the CIERA model side by side, one step of each in turn: both
        start from the same seed and see the same data, and interleaving keeps the machine's state
        (memory warm-up, other load) the same for both, so their times are comparable. (Run one
        after the other, the first training in a process is about twice as slow.)"""
        import ciera
        import ciera.torch as ct
        from ciera import data

        a = self.args
        corpus = data.load_corpus()
        runs = {}
        # Exponent statistics are collected in both trainings alike (same cost for both); they
        # are identical anyway, since the parameters are.
        trackers = {"fsdp2": ct.ExponentTracker(), "ciera": ct.ExponentTracker()}
        if not a.no_baseline:
            plain, _ = self.build()
            records = ct.time_plain_all_gathers(plain, trackers["fsdp2"])

            def take_plain_records():
                taken = list(records)
                records.clear()
                return taken

            runs["fsdp2"] = Run("fsdp2", plain, a.lr, take_plain_records)
        model, spec = self.build()
        config = ciera.EngineConfig()
        config.codec.block_values = a.block
        config.warmup_steps = 0  # warmup is driven per training step below
        config.adaptive = a.codec == "auto"
        config.worker_threads = a.threads
        config.timeout_s = a.timeout
        handle = ct.enable(model, config, transport=a.transport, verify=a.verify,
                           policy=lambda bucket, param: ciera.ShardPolicy.raw)
        handle.set_gather_observer(trackers["ciera"])
        runs["ciera"] = Run("ciera", model, a.lr, handle.take_records)
        for step in range(a.steps):
            if step == a.warmup:
                # Warmup over: every parameter now goes through exponent reuse (all ranks at once).
                for bucket in handle.buckets:
                    for k in range(len(bucket.params)):
                        handle.engine.set_policy(bucket.index, k, ciera.ShardPolicy.ciera)
            tokens = data.batch(corpus, step, self.rank, a.batch, a.seq_len, a.seed)
            # Whichever model steps first after the previous pair is measurably slower on an
            # oversubscribed machine (caches and schedulers settle); alternating the order every
            # step gives both runs the same share of that cost.
            order = list(runs.values())
            if step % 2:
                order.reverse()
            for run in order:
                trackers[run.name].new_step()
                self.emit(self.step(run, step, tokens, trackers[run.name]))
        for run in runs.values():
            run.final = self.local_params(run.model)
        self.finish({name: run.results for name, run in runs.items()} |
                    {"final": {name: run.final for name, run in runs.items()}},
                    handle, spec, sum(p.numel() for p in model.parameters()))
        handle.disable()

    def step(self, run, step: int, tokens, tracker) -> dict:
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        loss = run.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        iteration = time.perf_counter() - start
        records = run.take_records()
        local = loss.detach().float()
        out = run.results
        out["loss_bits"].append(int(local.view(torch.int32).item()))
        # Two small all-reduces per step: the mean loss, and each time's slowest rank.
        stats = torch.tensor([float(local), iteration, sum(r.seconds for r in records),
                              sum(r.raw_bytes for r in records), sum(r.wire_bytes for r in records),
                              tracker.changed, tracker.total], dtype=torch.float64)
        summed = stats.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        peak = stats.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["loss"].append(summed[0].item() / self.world)
        out["iteration_s"].append(peak[1].item())
        out["allgather_s"].append(peak[2].item())
        out["raw"].append(stats[3].item())
        out["wire"].append(stats[4].item())
        record = {"run": run.name, "step": step, "loss": out["loss"][-1], "iteration_ms": 1e3 * peak[1].item(),
                  "allgather_ms": 1e3 * peak[2].item(), "raw_bytes": stats[3].item(), "wire_bytes": stats[4].item()}
        if summed[6] > 0:
            record["exponent_change_rate"] = summed[5].item() / summed[6].item()
        if run.name == "ciera":
            record["ratio"] = stats[3].item() / max(1.0, stats[4].item())
            record["bits_per_value"] = 16.0 * stats[4].item() / max(1.0, stats[3].item())
        return record

    def local_params(self, model) -> list:
        return [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
                for p in model.parameters()]

    def finish(self, runs, handle, spec, params) -> None:
        import torch
        import torch.distributed as dist

        a = self.args
        steady = slice(a.warmup, a.steps)
        c = runs["ciera"]
        base = runs.get("fsdp2")
        mismatches = torch.zeros(2, dtype=torch.int64)
        if base:
            mismatches[0] = sum(x != y for x, y in zip(base["loss_bits"], c["loss_bits"]))
            mismatches[1] = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
                                for x, y in zip(runs["final"]["fsdp2"], runs["final"]["ciera"]))
        dist.all_reduce(mismatches, op=dist.ReduceOp.SUM)
        verified = torch.tensor([handle.wrong_bytes, handle.verified_bytes], dtype=torch.int64)
        dist.all_reduce(verified, op=dist.ReduceOp.SUM)
        if self.rank != 0:
            return

        def med(xs):
            return statistics.median(xs) if xs else None

        raw = sum(c["raw"][steady])
        wire = sum(c["wire"][steady])
        ag_base = med(base["allgather_s"][steady]) if base else None
        ag_ciera = med(c["allgather_s"][steady])
        it_base = med(base["iteration_s"][steady]) if base else None
        it_ciera = med(c["iteration_s"][steady])
        records = [json.loads(line) for line in open(self.run_dir / "metrics.jsonl")]
        rates = [r["exponent_change_rate"] for r in records
                 if r["run"] == "ciera" and r["step"] >= a.warmup and r.get("exponent_change_rate") is not None]
        summary = {
            "model": a.model, "spec": spec.describe(), "params": params, "ranks": self.world,
            "buckets": len(handle.buckets), "links": (f"{a.link_gbit:g} Gbit/s (link lab)" if a.link_gbit
                                                       else "unshaped (mpirun on one host)"),
            "transport": a.transport, "codec": a.codec,
            "steps": a.steps, "warmup": a.warmup, "lr": a.lr, "block": a.block,
            "loss_first": c["loss"][0], "loss_last": c["loss"][-1],
            "allgather_raw_bytes": int(statistics.median(c["raw"][steady])),
            "allgather_wire_bytes": int(statistics.median(c["wire"][steady])),
            "ratio": raw / wire if wire else None,
            "bits_per_value": 16.0 * wire / raw if raw else None,
            "allgather_ms_fsdp2": ag_base * 1e3 if ag_base else None,
            "allgather_ms_ciera": ag_ciera * 1e3,
            "allgather_speedup": ag_base / ag_ciera if ag_base else None,
            "iteration_ms_fsdp2": it_base * 1e3 if it_base else None,
            "iteration_ms_ciera": it_ciera * 1e3,
            "iteration_speedup": it_base / it_ciera if it_base else None,
            "exponent_change_rate": statistics.fmean(rates) if rates else 0.0,
            "losses_identical": bool(base) and int(mismatches[0]) == 0,
            "params_identical": bool(base) and int(mismatches[1]) == 0,
            "loss_mismatches": int(mismatches[0]), "param_bytes_mismatched": int(mismatches[1]),
            "wrong_bytes": int(verified[0]), "verified_bytes": int(verified[1]),
            "cache_bytes": handle.engine.cache_bytes,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


class Run:
    """One of the two trainings: its model, optimizer and per-step results."""

    def __init__(self, name, model, lr, take_records):
        import torch

        self.name = name
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.take_records = take_records
        self.final = None
        self.results = {"loss_bits": [], "loss": [], "allgather_s": [], "iteration_s": [], "raw": [], "wire": []}


if __name__ == "__main__":
    sys.exit(main())
