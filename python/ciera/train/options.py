"""The options of ``ciera train``, checked before any rank starts."""

from __future__ import annotations

import argparse
import sys

from ciera.train import checkpoint


def parser() -> argparse.ArgumentParser:
    description = sys.modules[__package__].__doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="ciera train", description=description,
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
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="every K steps, checkpoint every training (model, optimizer, RNG; "
                        "torch.distributed.checkpoint) to <run>/checkpoints/step-NNNNNN for --resume")
    p.add_argument("--resume", metavar="DIR",
                   help="continue from the checkpoint folder DIR (<run>/checkpoints/step-NNNNNN) up to --steps; "
                        "same model, data and --ranks as the run that wrote it")
    p.add_argument("--rss-every", type=int, default=100, metavar="N",
                   help="sample every rank's resident memory every N steps (and after the first and last)")
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


def check(args) -> None:
    """Refuses option values no run could use (SystemExit with the reason)."""
    if args.warmup >= args.steps:
        raise SystemExit("ciera train: --steps must exceed --warmup to measure a steady state")
    if args.budget_mb is not None and not args.budget_mb >= 0:
        raise SystemExit(f"ciera train: --budget-mb must be >= 0 MiB, got {args.budget_mb}")
    if args.reselect_every < 0:
        raise SystemExit(f"ciera train: --reselect-every must be >= 0, got {args.reselect_every}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise SystemExit(f"ciera train: --checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.rss_every < 1:
        raise SystemExit(f"ciera train: --rss-every must be >= 1, got {args.rss_every}")
    checkpoint.check_resume(args)


def budget_bytes(budget_mb: float) -> int:
    """--budget-mb in bytes; an infinite budget (selection by gain alone) is the largest uint64."""
    return 2**64 - 1 if budget_mb == float("inf") else int(budget_mb * 2**20)


def budget_text(nbytes: int) -> str:
    return "an unlimited" if nbytes >= 2**63 else f"a {nbytes / 2**20:.2f} MiB"
