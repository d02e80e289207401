"""Resume checkpoints of ``ciera train`` (--checkpoint-every, --resume), with PyTorch's own
distributed checkpointing. One checkpoint is the folder <run>/checkpoints/step-NNNNNN/, written
after NNNNNN steps:

    .metadata, *.distcp    torch.distributed.checkpoint: per training (fsdp2, ciera, ...) the FSDP2
                           model and its Adam state, sharded as the ranks hold them
    rng-rank<R>.pt         each rank's torch RNG state (no model here draws from it during training
                           today; kept so that one that does, with dropout say, resumes exactly)
    ciera-checkpoint.json  the configuration the next steps depend on and the selectors' state;
                           written last, so a folder without it is no checkpoint

The data needs no state: ``data.batch`` is a pure function of (seed, step, rank).

CIERA's codec state is not saved: a resumed run starts a fresh engine, so every stream starts
again with a key frame on both sides (reliability item 7: reset on both sides, never one). Shards
that were compressed at the checkpoint are compressed from the first resumed step on: without a
selector, every shard after warmup; with one, see ``Selector.load_state_dict`` (its step count,
latest selection and statistics are restored). The codec is lossless, so none of this changes a
training result: steps N+1.. of a resumed run are bitwise identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VERSION = 1
METADATA = "ciera-checkpoint.json"

# What the next steps' numbers depend on: a resumed run must use the same values.
# And the gather scheme where either side's is lossy (--codec zeropp-int8, sdp4bit train other
# weights; the lossless ones train the same). Checkpoints written before it was recorded have no
# "codec" and are not checked for it.
_SAME = {"model": "--model", "layers": "--layers", "hidden": "--hidden", "experts": "--experts",
         "expert_intermediate": "--expert-intermediate", "seq_len": "--seq-len", "batch": "--batch",
         "lr": "--lr", "seed": "--seed", "codec": "--codec"}
# The FSDP2 layout: HSDP reduces gradients in another order than one flat group, and a selector's
# state is per gather group. --ranks-per-node shapes the groups under --hsdp only (without it,
# --nodes only shapes the link lab). Checkpoints written before these were recorded have none
# and are not checked for them.
_LAYOUT = {"hsdp": "--hsdp", "ranks_per_node": "--ranks-per-node",
           "reshard_after_forward": "--reshard-after-forward"}


def _differs(key: str, saved, wanted) -> bool:
    if key != "codec":
        return saved != wanted
    from ciera.train import schemes

    lossy = [name for name in (saved, wanted) if name in schemes.SCHEMES and schemes.is_lossy(name)]
    return saved is not None and bool(lossy) and saved != wanted


def folder_for(run_dir: Path, steps_done: int) -> Path:
    return run_dir / "checkpoints" / f"step-{steps_done:06d}"


def trainings(args) -> list[str]:
    """The trainings a run holds, by name (RankProgram.variants names the CIERA ones)."""
    return ([] if args.no_baseline else ["fsdp2"]) + (["er", "bsc", "ciera"] if args.ablation else ["ciera"])


def read_metadata(folder: Path) -> dict:
    return json.loads((folder / METADATA).read_text())


def resumed_steps(args) -> int:
    """The steps done before this run: those of its --resume checkpoint (checked), else 0."""
    return int(read_metadata(Path(args.resume))["steps_done"]) if args.resume else 0


def check_resume(args) -> int:
    """Checks --resume DIR against this run's options (SystemExit with the reason); returns the
    steps the checkpoint has done, 0 without --resume."""
    if args.resume is None:
        return 0
    if not str(args.resume).strip():   # an unset shell variable, say: never a fresh run in its place
        raise SystemExit("ciera train: --resume needs a checkpoint folder, <run>/checkpoints/step-NNNNNN; got an "
                         "empty path")
    folder = Path(args.resume)
    where = f"ciera train: --resume {folder}"
    if not folder.is_dir():
        raise SystemExit(f"{where}: no such folder")
    if not (folder / METADATA).is_file() or not (folder / ".metadata").is_file():
        # Only whole ones: a checkpoint cut short (no metadata, written last) is refused too.
        found = sorted(p.name for p in (folder / "checkpoints").glob("step-*") if (p / METADATA).is_file())
        hint = f" (its checkpoints/ holds {', '.join(found)})" if found else ""
        raise SystemExit(f"{where}: not a checkpoint folder; give one <run>/checkpoints/step-NNNNNN{hint}")
    try:
        meta = read_metadata(folder)
        # The version first: another version may name its fields differently.
        if not isinstance(meta, dict) or meta.get("version") != VERSION:
            version = meta.get("version") if isinstance(meta, dict) else None
            raise SystemExit(f"{where}: checkpoint version {version}, this ciera reads {VERSION}")
        done, ranks = int(meta["steps_done"]), int(meta["ranks"])
        saved, config = list(meta["trainings"]), dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{where}: unreadable {METADATA} ({type(e).__name__}: {e})")
    if ranks != args.ranks:
        raise SystemExit(f"{where}: written by {ranks} ranks, this run has --ranks {args.ranks} "
                         "(each rank's data and RNG state are its own: the rank count must match)")
    for key, flag in _SAME.items():
        if _differs(key, config.get(key), getattr(args, key)):
            raise SystemExit(f"{where}: written with {flag} {config.get(key)}, this run has {flag} "
                             f"{getattr(args, key)} (a resumed run trains the same model on the same data)")
    hsdp = bool(args.hsdp or config.get("hsdp"))
    for key, flag in _LAYOUT.items():
        if (key != "ranks_per_node" or hsdp) and key in config and config[key] != getattr(args, key):
            raise SystemExit(f"{where}: written with {flag} {config[key]}, this run has {flag} "
                             f"{getattr(args, key)} (a resumed run goes on in the same FSDP2 layout)")
    missing = [name for name in trainings(args) if name not in saved]
    if missing:
        raise SystemExit(f"{where}: holds the trainings {', '.join(saved)}, not {', '.join(missing)} "
                         "(resume with the same --no-baseline / --ablation)")
    named = folder.name.removeprefix("step-")
    if done < 1 or (folder.name.startswith("step-") and named.isdigit() and int(named) != done):
        raise SystemExit(f"{where}: {METADATA} says {done} steps were done, which its folder's name does not")
    if args.steps <= done:
        raise SystemExit(f"{where}: --steps {args.steps} must exceed the {done} steps the checkpoint has done")
    # The selectors this run has (rank.py's variants): a run written without one has no
    # statistics to go on from, and a selector past its warmup would never select.
    selecting = ["bsc", "ciera"] if args.ablation else ["ciera"] if args.budget_mb is not None else []
    selectors = meta.get("selectors") or {}
    missing = [name for name in selecting if name not in selectors]
    if missing:
        raise SystemExit(f"{where}: written without the selector of {', '.join(missing)} (a run without "
                         "--budget-mb); resume it without --budget-mb, or start a new run with it")
    _check_files(folder, ranks, where)
    return done


def _check_files(folder: Path, ranks: int, where: str) -> None:
    """The files a load reads, there and whole, before any rank starts: each rank's RNG state,
    the .metadata of torch.distributed.checkpoint, and every byte range it names. (A byte
    changed inside a .distcp file is not found: torch keeps no checksum of them.)"""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    def first_line(error: Exception) -> str:
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"

    for rank in range(ranks):
        rng = folder / f"rng-rank{rank}.pt"
        if not rng.is_file():
            raise SystemExit(f"{where}: {rng.name} is missing (rank {rank}'s RNG state)")
        try:
            state = torch.load(rng, weights_only=True)
        except Exception as error:  # noqa: BLE001 - whatever torch.load raises, the file is damaged
            raise SystemExit(f"{where}: {rng.name} is damaged ({first_line(error)})") from None
        # What torch.set_rng_state takes: a CPU generator's state, a byte tensor of its size (a
        # loadable file of anything else failed only in the ranks' load, after they started).
        like = torch.get_rng_state()
        if not (isinstance(state, torch.Tensor) and state.dtype == like.dtype and state.shape == like.shape):
            got = (f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, torch.Tensor)
                   else f"a {type(state).__name__}")
            raise SystemExit(f"{where}: {rng.name} is damaged (it holds {got}, not a CPU RNG state of "
                             f"{like.numel()} bytes)")
    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001 - as above
        raise SystemExit(f"{where}: .metadata is damaged ({first_line(error)})") from None
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise SystemExit(f"{where}: {name} is missing (.metadata names it)")
        if path.stat().st_size < end:
            raise SystemExit(f"{where}: {name} is {path.stat().st_size} bytes, but .metadata reads it up to byte "
                             f"{end} (truncated)")


def _training_state(run) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(run.model, run.optimizer)
    return {"model": model, "optimizer": optimizer}


def save(program, runs: dict, handles: dict, steps_done: int) -> Path:
    """Writes the checkpoint after `steps_done` steps of every training. Collective."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    a = program.args
    program.status.between_steps("checkpoint write", steps_done)
    folder = folder_for(program.run_dir, steps_done)
    group = program.checkpoint_group   # --checkpoint-timeout (RankProgram.init_process_group)
    dcp.save({name: _training_state(run) for name, run in runs.items()}, checkpoint_id=str(folder),
             process_group=group)
    torch.save(torch.get_rng_state(), folder / f"rng-rank{program.rank}.pt")
    selectors = {name: h.selector.state_dict() for name, h in handles.items() if h.selector is not None}
    dist.barrier(group=group)  # every rank's files are complete before the metadata says so
    if program.rank == 0:
        meta = {"version": VERSION, "steps_done": steps_done, "ranks": program.world,
                "trainings": list(runs), "config": {key: getattr(a, key) for key in (*_SAME, *_LAYOUT)},
                "selectors": selectors, "resumed_from": a.resume}
        tmp = folder / (METADATA + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / METADATA)
    return folder


def load(program, runs: dict, handles: dict, folder: Path) -> int:
    """Loads every training of this run from `folder` (models and optimizers as built, the RNG
    state after building them); returns the steps done. Collective."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    meta = read_metadata(folder)
    program.status.between_steps("checkpoint load", int(meta["steps_done"]))
    state = {name: _training_state(run) for name, run in runs.items()}
    dcp.load(state, checkpoint_id=str(folder), process_group=program.checkpoint_group)
    for name, run in runs.items():
        set_state_dict(run.model, run.optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optimizer"])
    torch.set_rng_state(torch.load(folder / f"rng-rank{program.rank}.pt"))
    for name, handle in handles.items():
        if handle.selector is not None:   # check_resume found its state in the checkpoint
            handle.selector.load_state_dict(meta["selectors"][name])
    return int(meta["steps_done"])
