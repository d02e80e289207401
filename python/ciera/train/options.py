"""The options of ``ciera train``, checked before any rank starts."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from ciera import _ext
from ciera.models import ModelSpec
from ciera.paths import folder_problem
from ciera.train import checkpoint, schemes

# The trainings' names. Here, not in metrics (which imports torch), so that the launcher refuses
# a bad option before anything imports torch.
BASELINE = "fsdp2"             # plain FSDP2, which every CIERA training is compared with
CONTROL = "fsdp2-control"      # --control: plain FSDP2 again, which must match BASELINE bit for bit
PLAIN = (BASELINE, CONTROL)    # the trainings without CIERA

LINK_LAB_MAX_RANKS = 253  # scripts/linklab.sh puts the ranks on one /24 beside its hub
# The ranks are processes on this machine: more than this many a core is a typo (--ranks 4000
# for 4) that would start thousands of them (the native tool's kMaxRanksPerCore).
MAX_RANKS_PER_CORE = 16
MAX_THREADS = _ext.MAX_WORKER_THREADS  # the library's own limit (kMaxWorkerThreads)


class _Parser(argparse.ArgumentParser):
    """argparse, its errors one line (no usage block) as every other check's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """An option's default after its help, "(default: X)", where it has one (not None, not an off
    flag) and the help does not give it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        # `is`, not ==: a default of 0 or 0.0 is a default to show (0 == False).
        if (action.default is None or action.default is False or action.default is argparse.SUPPRESS
                or not action.option_strings or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"


def parser() -> argparse.ArgumentParser:
    description = sys.modules[__package__].__doc__.split("\n\n")[0]
    p = _Parser(prog="ciera train", description=description,
                formatter_class=_HelpFormatter,
                epilog="Exit status: 0 when every comparison the run made is exact; 1 when the run failed "
                       "(a rank died or stalled past --timeout); 2 for a command line no run could use; "
                       "3 when a comparison that must be exact was not; 128 + the signal when interrupted (130 "
                       "SIGINT, 143 SIGTERM, 129 SIGHUP, 131 SIGQUIT), after ending the ranks.")
    p.add_argument("--model", default="olmoe", choices=["olmoe", "mixtral", "qwen2_moe", "deepseek"],
                   help="the MoE architecture (Hugging Face transformers), built small from a config, no download")
    p.add_argument("--ranks", type=int, default=None, help="data-parallel ranks (processes); default 4, or "
                                                               "--nodes x --ranks-per-node")
    p.add_argument("--nodes", type=int, default=None,
                   help="simulated nodes (with --ranks-per-node, instead of --ranks): in the link lab only the links "
                        "between nodes are shaped (--link-gbit per node); the summary counts the allgather bytes "
                        "that cross them")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks on each node of --nodes")
    p.add_argument("--reshard-after-forward", type=int, default=None, metavar="N",
                   help="FSDP2's partial resharding (fully_shard(reshard_after_forward=N)) for every decoder layer "
                        "in every training: after forward a layer is resharded to N ranks, and its backward "
                        "re-gather runs on those N (a node: N = --ranks-per-node)")
    p.add_argument("--hsdp", action="store_true",
                   help="HSDP in every training: a 2-D mesh, replicated across --nodes and sharded over the "
                        "--ranks-per-node ranks of each (gathers stay inside a node; gradients are all-reduced "
                        "across nodes)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=None,
                   help="steps before exponent reuse starts, and outside the steady state the summary reports "
                        "(default: 30; 1 when no trained scheme waits for it, as with --codec delta, the "
                        "alternatives and --zero, whose first step carries the key frames or values; 0 with "
                        "--reduce-scatter ciera, whose trainings all gather with the framework's own all-gather "
                        "and whose reduce-scatter keeps no codec state between calls: every step is steady; 8 with "
                        "--reduce-scatter auto, whose first 8 calls of each shape probe coded and raw)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (one FSDP2 parameter group each)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 8")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--expert-intermediate", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--block", type=int, default=512, help="CIERA values per block")
    p.add_argument("--codec", default=None, choices=list(schemes.SCHEMES),
                   help="the gather scheme trained against FSDP2. ciera: exponent reuse on every shard after warmup; "
                        "auto: let the engine keep whichever of that and raw is faster; delta: value differences on "
                        "every shard from the first step (receivers keep the previous values); with --budget-mb the "
                        "selector chooses among raw, ciera and delta per shard. The alternatives CIERA is compared "
                        "with: stateless (every exponent entropy-coded every step), zipnn (ZipNN on each shard; "
                        "pip install 'ciera[peers]'), zeropp-int8 (ZeRO++'s int8 weights, LOSSY), sdp4bit "
                        "(SDP4Bit's 4-bit weight differences, LOSSY). Default: ciera, and delta with --zero")
    p.add_argument("--schemes", metavar="A,B,...",
                   help="train several gather schemes (names as for --codec) side by side with FSDP2, same seed "
                        "and batches, interleaved step by step; a table per scheme: bytes, times, loss and parameter "
                        "drift from FSDP2, exactness")
    p.add_argument("--baselines", action="store_true",
                   help="--schemes with every scheme this installation can run: "
                        + ", ".join(schemes.BASELINES) + " (zipnn when installed, and not with --hsdp or "
                        "--reshard-after-forward)")
    p.add_argument("--zero", action="store_true",
                   help="ZeRO-1/2 instead of FSDP2: DDP with torch's ZeroRedundancyOptimizer (BF16 parameters, "
                        "FP32 master weights) against the same with its parameter sync through CIERA "
                        "(ciera.zero), interleaved step by step")
    p.add_argument("--framework", default="fsdp2", choices=["fsdp2", "deepspeed"],
                   help="the sharded training compared: PyTorch FSDP2 (fully_shard), or DeepSpeed ZeRO-3 (its CPU "
                        "accelerator; plain ZeRO-3 against the same through ciera.deepspeed, interleaved step by "
                        "step; needs pip install 'ciera[deepspeed]')")
    p.add_argument("--reduce-bucket-size", type=int, default=None, metavar="VALUES",
                   help="with --framework deepspeed: ZeRO-3's zero_optimization.reduce_bucket_size, the gradient "
                        "values it reduces in one call (DeepSpeed's default, 500,000,000, holds these models "
                        "whole: one call at the end of the backward pass, which waits for the slowest rank's "
                        "whole backward pass)")
    p.add_argument("--reduce-scatter", default="fsdp2", choices=["fsdp2", "ciera", "auto"],
                   help="ciera: FSDP2's gradient reduce-scatter through CIERA's lossless collectives (parts "
                        "exponent-coded, added in a documented rank order), trained beside the same reduction "
                        "uncompressed (plain-deterministic, which it must match bit for bit) and FSDP2's own; all "
                        "three gather with FSDP2's own all-gather (with --framework deepspeed: ZeRO-3's reduce-scatter "
                        "and all-gather instead). auto: coded or raw, whichever is faster. "
                        "Default fsdp2: FSDP2's own reduce-scatter in every training")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="with --reduce-scatter: the gradients' dtype in the reduce-scatter (FSDP2's "
                        "MixedPrecisionPolicy.reduce_dtype; default fp32, as the main job)")
    p.add_argument("--worker-niceness", type=int, default=None, metavar="N",
                   help="with --reduce-scatter: the nice value (0..19) of the threads that code beside the "
                        "transport; default the library's (19: they give way to the transport's thread)")
    p.add_argument("--capture-activations", metavar="FILE", default=None,
                   help="write the inputs of every MoE layer (rank 0's tokens, BF16, the plain FSDP2 training's "
                        "last 16 steps) to this safetensors file: the token activations an expert-parallel layer "
                        "would exchange, for ciera bench alltoall --input")
    p.add_argument("--launcher", default="auto", choices=["auto", "mpirun", "torchrun"],
                   help="what starts the ranks: Open MPI's mpirun or torch.distributed.run (torchrun); "
                        "auto: mpirun when it is on PATH (and for the link lab), else torchrun")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the models train; cuda: each rank on GPU LOCAL_RANK %% GPUs (ranks may share one), "
                        "deterministic algorithms on")
    p.add_argument("--transport", default="auto", choices=["auto", "torch", "mpi", "nccl"],
                   help="CIERA's collectives: torch's process group, Open MPI (mpirun, cpu) or CIERA's NCCL "
                        "communicator (cuda); auto: mpi under mpirun on cpu, else torch")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                   help="also train plain FSDP2 a second time (fsdp2-control), which must match the first bit for "
                        "bit: shows that the harness itself is deterministic (default: on with --device cuda)")
    p.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=None,
                   help="give each rank on this host its own share of the cores it may use (fewer cores than "
                        "ranks: rank i shares core i mod cores): the ranks stand in for nodes, and a scheduler "
                        "moving them between cores scatters their arrival at each collective (default: on in "
                        "the link lab, --link-gbit, where a run measures links; off elsewhere, where pinned "
                        "jobs running side by side would crowd the same cores)")
    p.add_argument("--threads", type=int, default=2, help="CIERA encode/decode threads per rank")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="benefit-driven selection (paper §3.2) with this cache budget per rank, MiB; "
                        "default: every parameter through exponent reuse after warmup")
    p.add_argument("--reselect-every", type=int, default=0,
                   help="with --budget-mb, re-run the selection every K steps on fresh statistics")
    p.add_argument("--ablation", action="store_true",
                   help="the paper's Table 3 in one run: FSDP2, +ER (all shards), +BSC, +CCP side by side")
    p.add_argument("--overlap", action="store_true",
                   help="CCP: gathers run in flight while the previous module computes (both runs). Without it "
                        "the FSDP2 runs gather synchronously, so that the allgather times are the gathers' own; "
                        "ciera.torch.enable() overlaps by default, and --framework deepspeed always does")
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
    p.add_argument("--seed", type=int, default=0, help="the initial weights' and batches' seed, the same in every training")
    p.add_argument("--out", default="runs", help="folder for run folders")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may wait for peers before every rank fails (a stopped or dead rank)")
    p.add_argument("--checkpoint-timeout", type=float, default=600.0,
                   help="seconds the ranks may wait for each other while they write or read a checkpoint "
                        "(--checkpoint-every, --resume): a busy disk can hold a rank far longer than a step")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p


def _fail(message: str) -> NoReturn:
    raise SystemExit(f"ciera train: {message}")


def _at_least(flag: str, value: int, low: int, why: str = "") -> None:
    if value < low:
        _fail(f"{flag} must be >= {low}{why}, got {value}")


def _finite_above(flag: str, value: float, low: float, inclusive: bool = False, unit: str = "") -> None:
    if not (math.isfinite(value) and (value >= low if inclusive else value > low)):
        _fail(f"{flag} must be a finite number {'>=' if inclusive else '>'} {low:g}{unit}, got {value}")


def _writable_folder(flag: str, path: str) -> None:
    problem = folder_problem(path)
    if problem:
        _fail(f"{flag} {path}: {problem}")


def _check_model(args) -> None:
    """The shapes the models can train in BF16: `heads` attention heads of an even size (rotary
    embeddings turn pairs), BF16 rows of whole 16-byte units for the grouped expert matmuls,
    and at least the experts each token is routed to."""
    spec = ModelSpec()
    unit = math.lcm(2 * spec.heads, 8)
    rows = "BF16 rows of whole 16-byte units"
    for flag, value, why in (("--hidden", args.hidden, f"{rows}, {spec.heads} heads of an even size"),
                             ("--expert-intermediate", args.expert_intermediate, rows)):
        if value < unit or value % unit:
            _fail(f"{flag} must be a positive multiple of {unit} ({why}), got {value}")
    _at_least("--layers", args.layers, 1)
    _at_least("--experts", args.experts, spec.experts_per_token,
              f" (each token is routed to {spec.experts_per_token} experts)")
    _at_least("--seq-len", args.seq_len, 2, " (the loss predicts each next token)")
    _at_least("--batch", args.batch, 1)


def _check_topology(args) -> None:
    """--ranks, or --nodes and --ranks-per-node (which imply it), and the FSDP2 layouts that use
    them: --reshard-after-forward and --hsdp."""
    if (args.nodes is None) != (args.ranks_per_node is None):
        _fail("--nodes and --ranks-per-node go together (K nodes of R ranks each)")
    if args.nodes is not None:
        _at_least("--nodes", args.nodes, 1)
        _at_least("--ranks-per-node", args.ranks_per_node, 1)
        if args.ranks is not None and args.ranks != args.nodes * args.ranks_per_node:
            _fail(f"--ranks {args.ranks} disagrees with --nodes {args.nodes} --ranks-per-node "
                  f"{args.ranks_per_node} ({args.nodes * args.ranks_per_node} ranks)")
        args.ranks = args.nodes * args.ranks_per_node
    elif args.ranks is None:
        args.ranks = 4
    layouts = [flag for flag, on in (("--reshard-after-forward", args.reshard_after_forward is not None),
                                     ("--hsdp", args.hsdp)) if on]
    if layouts and (args.zero or args.framework == "deepspeed"):
        _fail(f"{layouts[0]} is an FSDP2 layout: it is for the FSDP2 trainings, not --zero or --framework deepspeed")
    if args.reshard_after_forward is not None:
        n = args.reshard_after_forward
        if n < 1 or args.ranks % n:
            _fail(f"--reshard-after-forward {n} must divide the {args.ranks} ranks")
        if args.hsdp and args.ranks_per_node % n:
            _fail(f"--reshard-after-forward {n} must divide the {args.ranks_per_node} ranks HSDP shards over")
    if args.hsdp and (args.nodes is None or args.nodes < 2 or args.ranks_per_node < 2):
        _fail("--hsdp replicates across nodes and shards inside each: give --nodes K --ranks-per-node R, both >= 2")


def topology(args) -> dict:
    """The run's nodes and FSDP2 layout, for the summary and the trace."""
    return {"nodes": args.nodes or args.ranks, "ranks_per_node": args.ranks_per_node or 1,
            "reshard_after_forward": args.reshard_after_forward or 0, "hsdp": bool(args.hsdp)}


def _check_values(args) -> None:
    """Every option on its own, and the pairs that only make sense together."""
    _check_topology(args)
    _at_least("--ranks", args.ranks, 2, " (one rank has nobody to gather from)")
    _at_least("--steps", args.steps, 1)
    _at_least("--warmup", args.warmup, 0)
    _check_model(args)
    _finite_above("--lr", args.lr, 0)
    low, high = _ext.CodecConfig.MIN_BLOCK_VALUES, _ext.CodecConfig.MAX_BLOCK_VALUES
    if not low <= args.block <= high:
        _fail(f"--block {args.block}: a block holds {low}..{high} values")
    _at_least("--threads", args.threads, 0, " (0: encode and decode on the gathering thread)")
    if args.threads > MAX_THREADS:
        _fail(f"--threads {args.threads}: at most {MAX_THREADS} codec threads per rank")
    _finite_above("--timeout", args.timeout, 0, unit=" seconds")
    _finite_above("--checkpoint-timeout", args.checkpoint_timeout, 0, unit=" seconds")
    _finite_above("--link-gbit", args.link_gbit, 0, inclusive=True, unit=" (0: no link lab)")
    if not 0 <= args.seed < 2**32:
        _fail(f"--seed must be in 0..{2**32 - 1}, got {args.seed}")
    _at_least("--reselect-every", args.reselect_every, 0)
    if args.reselect_every and args.budget_mb is None and not args.ablation:
        _fail("--reselect-every re-runs the selection of --budget-mb (or --ablation); give one of them")
    if args.no_baseline and args.ablation:
        _fail("--ablation compares with plain FSDP2; it cannot run with --no-baseline")
    if args.no_baseline and args.trace:
        _fail("--trace takes its compute times from the plain FSDP2 run; it cannot run with --no-baseline")
    if args.trace and args.overlap and not args.ablation:
        # trace.compute_times reads the gaps between blocking collectives as compute; prefetched
        # gathers overlap it (a layer's compute went to the next, the last one's backward to 0).
        _fail("--trace measures each layer's compute as the gaps between blocking collectives; with --overlap "
              "the plain run's gathers overlap compute: trace without --overlap (the simulator schedules the "
              "overlap itself; --ablation traces a sequential baseline)")
    if args.trace and args.codec == "delta":
        _fail("--trace records exponent reuse's codec speeds and no codec name: a --codec delta run's frames "
              "would be predicted as exponent reuse's; trace with --codec ciera or auto")
    if args.link_gbit > 0 and args.ranks > LINK_LAB_MAX_RANKS:
        _fail(f"--ranks {args.ranks}: the link lab has room for at most {LINK_LAB_MAX_RANKS} ranks")
    _check_combinations(args)
    _check_schemes(args)
    _check_zero(args)
    _check_reduce_scatter(args)
    _check_deepspeed(args)
    _check_installed(args)
    # After the checks above, which refuse --budget-mb / --ablation where they cannot run at all
    # (--zero, delta, the peer schemes default to --warmup 1): their reason comes first.
    if (args.budget_mb is not None or args.ablation) and args.warmup < 2:
        _fail(f"--{'budget-mb' if args.budget_mb is not None else 'ablation'} selects from the exponent changes "
              f"measured between warmup steps: --warmup {args.warmup} measures none; give --warmup 2 or more")
    _writable_folder("--out", args.out)
    if args.capture_activations:
        if args.zero or args.framework == "deepspeed" or args.reduce_scatter != "fsdp2" or args.no_baseline:
            _fail("--capture-activations records the plain FSDP2 training of the main job")
        _output_file("--capture-activations", args.capture_activations)
    if args.save_checkpoints:
        _writable_folder("--save-checkpoints", args.save_checkpoints)
    if args.trace:
        _output_file("--trace", args.trace)


def _output_file(flag: str, path: str) -> None:
    """A file the run writes at its end: refused now, not after the training, if it cannot be."""
    file = Path(path)
    if file.is_dir():
        _fail(f"{flag} {path}: a folder, not a file")
    if not file.absolute().parent.is_dir():
        _fail(f"{flag} {path}: folder {file.absolute().parent} does not exist")
    _writable_folder(flag, str(file.absolute().parent))


def _defaults(args) -> None:
    """The defaults that depend on other options: --codec (delta with --zero, where this build
    has it), --schemes (every available one with --baselines), --warmup (1 where no scheme
    waits for warmup: the first step carries the key frames or values; 0 with --reduce-scatter
    ciera, which trains no gather scheme, 8 with auto, which probes; else 30) and --pin-cores (in the link lab)."""
    has_delta = hasattr(_ext.ShardPolicy, "delta")
    if args.pin_cores is None:
        args.pin_cores = bool(args.link_gbit)
    if args.baselines or args.schemes is not None:
        if args.codec is not None:
            _fail("--codec trains one scheme; --schemes and --baselines train several: give one of them")
        if args.baselines and args.schemes is not None:
            _fail("--baselines is every available scheme; give it or --schemes, not both")
        try:
            names = schemes.available_baselines() if args.baselines else schemes.parse(args.schemes)
        except ValueError as e:
            _fail(str(e))
        args.schemes = ",".join(names)
    if args.reduce_scatter != "fsdp2" and args.codec is not None:
        _fail(f"--codec {args.codec}: --reduce-scatter compares reduce-scatters; every training there gathers "
              "with FSDP2's own all-gather")
    if args.codec is None:
        args.codec = "delta" if args.zero and has_delta else "ciera"
    problem = schemes.unknown(args.codec)
    if problem:
        _fail(f"--codec {args.codec}: {problem}")
    args.warmup_given = args.warmup is not None
    if args.warmup is None:
        if args.reduce_scatter != "fsdp2":
            # Its --codec is the unused default (every training gathers with the framework's own
            # all-gather), and "ciera" codes every call afresh: every step is steady. "auto" first
            # probes each call shape both ways, 4 calls coded then 4 raw (AdaptiveSwitch's
            # kProbeGathers, src/common/adaptive_switch.hpp; one call a shape a step): those 8
            # steps are its warmup.
            args.warmup = 8 if args.reduce_scatter == "auto" else 0
        else:
            # With --budget-mb the warmup is the selector's statistics: as long as for exponent reuse.
            waits = any(schemes.switches_after_warmup(name) for name in scheme_names(args))
            args.warmup = 1 if args.zero or (args.budget_mb is None and not waits) else 30


def scheme_names(args) -> list[str]:
    """The schemes this run trains beside FSDP2: --schemes (resolved), else --codec's."""
    return args.schemes.split(",") if args.schemes else [args.codec]


def _check_schemes(args) -> None:
    """--schemes / --baselines and the peer schemes of --codec: the options they cannot run with."""
    names = scheme_names(args)
    peers = [n for n in names if n not in ("ciera", "auto", "delta")]
    if args.schemes:
        for flag, given in (("--zero", args.zero), ("--ablation", args.ablation), ("--budget-mb", args.budget_mb is not None),
                            ("--trace", args.trace), ("--stats", args.stats), ("--save-checkpoints", args.save_checkpoints),
                            ("--checkpoint-every", args.checkpoint_every), ("--resume", args.resume),
                            ("--no-baseline", args.no_baseline)):
            if given:
                _fail(f"{flag} cannot run with --schemes/--baselines (every scheme runs on every shard beside plain FSDP2)")
    elif peers:
        for flag, given in (("--zero", args.zero), ("--ablation", args.ablation), ("--budget-mb", args.budget_mb is not None),
                            ("--trace", args.trace)):
            if given:
                _fail(f"--codec {args.codec} is an alternative CIERA is compared with; it cannot run with {flag}")
    if peers and args.device == "cuda":
        _fail(f"{', '.join(peers)}: the peer schemes run on the host codec backend only; not with --device cuda")
    if getattr(args, "verify", False) and all(schemes.is_lossy(n) for n in names):
        _fail(f"--verify compares lossless gathers with torch's; {', '.join(names)} "
              f"{'is' if len(names) == 1 else 'are'} lossy (its drift is in the table)")
    if "zipnn" in names and _sub_groups(args):
        if args.baselines:  # every scheme this layout can run: zipnn cannot
            args.schemes = ",".join(n for n in names if n != "zipnn")
        else:
            _fail(f"zipnn exchanges on one group of every rank; with {_sub_groups(args)} FSDP2 gathers on smaller "
                  "groups (the CIERA schemes run there)")


def _check_installed(args) -> None:
    """What this installation lacks for the schemes asked for (the zipnn package, a build's shard
    policy): after the options' conflicts, so that a run no installation could start is refused
    for that first."""
    for name in scheme_names(args):
        problem = schemes.unavailable(name)
        if problem:
            _fail(f"{'--schemes' if args.schemes else f'--codec {args.codec}'}: {problem}")


def _sub_groups(args) -> str:
    """The option that makes FSDP2 gather on groups smaller than the world, if any (after
    _check_topology). reshard_after_forward=1 keeps the parameters gathered (no backward
    gather), and N equal to the shard group is plain resharding: neither makes a sub-group."""
    if args.hsdp:
        return "--hsdp"
    n = args.reshard_after_forward
    return "--reshard-after-forward" if n is not None and n not in (1, args.ranks) else ""


def _check_zero(args) -> None:
    """--zero compares torch's ZeroRedundancyOptimizer with CIERA's parameter sync; the options
    of the FSDP2 comparison that it has no counterpart for are refused by name."""
    if not args.zero:
        if args.codec not in ("ciera", "auto") and args.ablation:
            _fail(f"--codec {args.codec} is not exponent reuse; --ablation measures exponent reuse's parts")
        return
    unsupported = [("--ablation", args.ablation), ("--budget-mb", args.budget_mb is not None),
                   ("--reselect-every", args.reselect_every), ("--overlap", args.overlap), ("--stats", args.stats),
                   ("--save-checkpoints", args.save_checkpoints), ("--checkpoint-every", args.checkpoint_every),
                   ("--resume", args.resume), ("--trace", args.trace), ("--verify", args.verify),
                   ("--no-baseline", args.no_baseline), ("--control", args.control)]
    for flag, given in unsupported:
        if given:
            _fail(f"{flag} is for the FSDP2 comparison; it cannot run with --zero")
    if args.device == "cuda":
        _fail("--zero trains with DDP on gloo on the CPU; not yet with --device cuda")


def _check_reduce_scatter(args) -> None:
    """--reduce-scatter compares CIERA's reduce-scatter with its uncompressed twin and FSDP2's own;
    the options of the allgather comparison are refused by name."""
    if args.reduce_scatter == "fsdp2":
        if args.reduce_dtype != "fp32":
            _fail("--reduce-dtype is for --reduce-scatter ciera/auto")
        if args.worker_niceness is not None:
            _fail("--worker-niceness is for --reduce-scatter ciera/auto")
        return
    if args.worker_niceness is not None and not 0 <= args.worker_niceness <= 19:
        _fail(f"--worker-niceness must be 0..19, got {args.worker_niceness}")
    unsupported = [("--zero", args.zero),
                   ("--ablation", args.ablation), ("--budget-mb", args.budget_mb is not None),
                   ("--reselect-every", args.reselect_every), ("--stats", args.stats), ("--verify", args.verify),
                   ("--save-checkpoints", args.save_checkpoints), ("--checkpoint-every", args.checkpoint_every),
                   ("--resume", args.resume), ("--trace", args.trace), ("--no-baseline", args.no_baseline),
                   ("--control", args.control), ("--baselines", args.baselines), ("--schemes", args.schemes)]
    for flag, given in unsupported:
        if given:
            _fail(f"{flag} cannot run with --reduce-scatter {args.reduce_scatter}")
    if args.device == "cuda":
        _fail("--reduce-scatter runs CIERA's reduce-scatter on host memory; not yet with --device cuda")
    if args.transport == "nccl":
        _fail("--reduce-scatter moves host memory: use --transport torch or mpi")


def _check_deepspeed(args) -> None:
    """--framework deepspeed compares plain ZeRO-3 with CIERA's; the options of the FSDP2
    comparison it has no counterpart for are refused by name."""
    if args.framework != "deepspeed":
        if args.reduce_bucket_size is not None:
            _fail("--reduce-bucket-size is ZeRO-3's setting: it needs --framework deepspeed")
        return
    if args.reduce_bucket_size is not None and args.reduce_bucket_size < 1:
        _fail(f"--reduce-bucket-size must be at least 1 value, got {args.reduce_bucket_size}")
    unsupported = [("--zero", args.zero), ("--ablation", args.ablation), ("--stats", args.stats),
                   ("--save-checkpoints", args.save_checkpoints), ("--checkpoint-every", args.checkpoint_every),
                   ("--resume", args.resume), ("--trace", args.trace), ("--no-baseline", args.no_baseline),
                   ("--control", args.control), ("--baselines", args.baselines), ("--schemes", args.schemes)]
    for flag, given in unsupported:
        if given:
            what = "its own comparison (ZeRO-1/2 against PyTorch's)" if flag == "--zero" else "for the FSDP2 comparison"
            _fail(f"{flag} is {what}; it cannot run with --framework deepspeed")
    if args.overlap:
        _fail("--overlap is how the FSDP2 runs gather; under --framework deepspeed both runs always overlap their "
              "gathers with compute (DeepSpeed's prefetching): drop it")
    if args.codec not in ("ciera", "auto", "delta"):
        _fail(f"--codec {args.codec}: --framework deepspeed compares CIERA's own codecs (ciera, auto, delta) with "
              "plain ZeRO-3; the alternatives run beside FSDP2 (--schemes)")
    if args.device == "cuda":
        _fail("--framework deepspeed trains on DeepSpeed's CPU accelerator; not yet with --device cuda")
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:   # not imported here: it is slow and chatty
        _fail("--framework deepspeed needs DeepSpeed: pip install 'ciera[deepspeed]'")


def _check_combinations(args) -> None:
    """Launcher, device, transport and control: the pairs no run can use."""
    if args.transport == "nccl" and args.device == "cpu":
        _fail("--transport nccl is CIERA's NCCL communicator, for GPU memory: it needs --device cuda")
    if args.transport == "mpi" and args.device == "cuda":
        _fail("--transport mpi carries host memory; with --device cuda use --transport torch or nccl")
    if args.launcher == "torchrun":
        if args.transport == "mpi":
            _fail("--transport mpi needs the ranks under mpirun; with --launcher torchrun use --transport torch")
        if args.link_gbit > 0:
            _fail("--link-gbit: the link lab starts its ranks under mpirun; it cannot run with --launcher torchrun")
    if args.trace and args.device == "cuda":
        _fail("--trace times collectives of CPU tensors (its communication curves); not yet with --device cuda")
    if (args.budget_mb is not None or args.ablation) and args.device == "cuda":
        flag = "--budget-mb" if args.budget_mb is not None else "--ablation"
        _fail(f"{flag}: the selector's cost model is measured with host coders and transfers; "
              "not yet with --device cuda")
    if args.control and args.no_baseline:
        _fail("--control trains plain FSDP2 twice and compares the two; it cannot run with --no-baseline")


def resolve(args) -> None:
    """Replaces `auto` and unset options by what this run uses (after the values are checked):
    the launcher, the transport and the control. The launcher hands the ranks these values."""
    if args.launcher == "auto":
        mpirun_needed = args.link_gbit > 0 or args.transport == "mpi"
        args.launcher = "mpirun" if mpirun_needed or shutil.which("mpirun") else "torchrun"
    if args.transport == "auto":
        mpi = args.launcher == "mpirun" and args.device == "cpu" and _ext.with_mpi
        args.transport = "mpi" if mpi else "torch"
    if args.control is None:
        args.control = args.device == "cuda" and not args.no_baseline


def _check_machine(args) -> None:
    """What this machine must provide for the run; checked after the values."""
    cores = os.cpu_count() or 1
    if args.ranks > MAX_RANKS_PER_CORE * cores:
        _fail(f"--ranks {args.ranks}: more than {MAX_RANKS_PER_CORE} ranks a core, and this machine has {cores} "
              f"core{'s' if cores != 1 else ''}")
    if args.transport == "mpi" and not _ext.with_mpi:
        _fail("--transport mpi: this build of CIERA has no MPI transport (use --transport torch)")
    if args.transport == "nccl" and not getattr(_ext, "with_nccl", False):
        _fail("--transport nccl: this build of CIERA has no NCCL transport (use --transport torch)")
    if args.link_gbit > 0:
        if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
            _fail("--link-gbit runs the ranks in the link lab, which needs root and iproute2 (ip, tc)")
    if args.launcher == "mpirun" and shutil.which("mpirun") is None:
        needs = ("--link-gbit" if args.link_gbit > 0 else "--transport mpi" if args.transport == "mpi"
                 else "--launcher mpirun")
        _fail(f"mpirun not found (apt-get install openmpi-bin); {needs} needs it")
    if args.device == "cuda":
        import torch  # only here: checking the other options does not load torch

        if not torch.cuda.is_available():
            _fail(f"--device cuda: no CUDA device is available here (torch {torch.__version__}: "
                  "torch.cuda.is_available() is False)")
        from ciera.train.rank import nccl_shares_gpus

        gpus = torch.cuda.device_count()
        if args.transport == "nccl" and args.ranks > gpus and not nccl_shares_gpus():
            _fail(f"--transport nccl: this NCCL takes one rank per GPU (several share one from NCCL 2.30 "
                  f"with NCCL_MULTI_RANK_GPU_ENABLE=1), and this machine has {gpus} "
                  f"GPU{'s' if gpus != 1 else ''} for --ranks {args.ranks} (use --transport torch)")


def check(args) -> None:
    """Refuses option values no run could use (SystemExit with the reason), before anything is
    created or started."""
    _defaults(args)
    _check_values(args)
    if args.warmup >= args.steps:
        default = "" if args.warmup_given else " (the default here)"
        raise SystemExit(f"ciera train: --steps {args.steps} must exceed --warmup {args.warmup}{default} to measure "
                         "a steady state: give more --steps or a smaller --warmup")
    if args.budget_mb is not None and not args.budget_mb >= 0:
        raise SystemExit(f"ciera train: --budget-mb must be >= 0 MiB, got {args.budget_mb}")
    if args.budget_mb is not None and args.budget_mb != float("inf") and args.budget_mb * 2**20 >= 2**64:
        raise SystemExit(f"ciera train: --budget-mb {args.budget_mb} is more bytes than a 64-bit count holds; "
                         "give inf for an unlimited budget")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise SystemExit(f"ciera train: --checkpoint-every must be >= 1, got {args.checkpoint_every}")
    if args.rss_every < 1:
        raise SystemExit(f"ciera train: --rss-every must be >= 1, got {args.rss_every}")
    done = checkpoint.check_resume(args)
    every = args.checkpoint_every
    if every and args.steps // every * every <= done:   # a checkpoint after every step that `every` divides
        raise SystemExit(f"ciera train: --checkpoint-every {every} would write no checkpoint: this run trains steps "
                         f"{done + 1}..{args.steps}; give a smaller --checkpoint-every or more --steps")
    resolve(args)
    _check_machine(args)


def resolved_argv(args) -> list[str]:
    """The options resolve() decided, for the ranks' command line (given last, they win)."""
    resolved = ["--launcher", args.launcher, "--transport", args.transport, "--ranks", str(args.ranks),
                "--control" if args.control else "--no-control", "--warmup", str(args.warmup),
                "--pin-cores" if args.pin_cores else "--no-pin-cores"]
    # The ranks get the resolved scheme list, never --baselines (what is installed is decided here).
    return resolved + ["--codec", args.codec] + (["--schemes", args.schemes] if args.schemes else [])


def budget_bytes(budget_mb: float) -> int:
    """--budget-mb in bytes; an infinite budget (selection by gain alone) is the largest uint64."""
    return 2**64 - 1 if budget_mb == float("inf") else int(budget_mb * 2**20)


def budget_text(nbytes: int) -> str:
    return "an unlimited" if nbytes >= 2**63 else f"a {nbytes / 2**20:.2f} MiB"


def control_text(control_bytes: int | None) -> str:
    """The part of a wire figure that was CIERA's control records and verdicts (the engine's, or
    the lossless collectives' call records), in words."""
    return f" (control records {control_bytes:,})" if control_bytes else ""


def cores_text(s: dict) -> str:
    """The summary's rank_cores for people: "pinned: rank 0 on core 0, rank 1 on cores 2-3, ..."."""
    def cores(c: list[int]) -> str:
        if len(c) > 1 and c == list(range(c[0], c[-1] + 1)):
            return f"cores {c[0]}-{c[-1]}"
        return ("core " if len(c) == 1 else "cores ") + ",".join(map(str, c))
    ranks = ", ".join(f"rank {r} on {cores(c)}" for r, c in enumerate(s.get("rank_cores") or []))
    return f"pinned (--pin-cores): {ranks}" if s.get("pin_cores") else f"not pinned: {ranks}"
