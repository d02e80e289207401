"""Resume checkpoints of ``ciera train`` (--checkpoint-every, --resume), with PyTorch's own
distributed checkpointing. One checkpoint is the folder <run>/checkpoints/step-NNNNNN/, written
after NNNNNN steps:

    .metadata, *.distcp    torch.distributed.checkpoint: per training (fsdp2, ciera, ...) the FSDP2
                           model and its Adam state, sharded as the ranks hold them
    rng-rank<R>.pt         each rank's torch RNG state (no model here draws from it during training
                           today; kept so that one that does, with dropout say, resumes exactly)
    cuda-rng-rank<R>.pt    --device cuda only: each rank's CUDA RNG state (its GPU's), likewise
    ciera-checkpoint.json  the configuration the next steps depend on, the selectors' state and the
                           sha256 of every other file in the folder; written last, so a folder
                           without it is no checkpoint

torch keeps no checksum of its files: a changed byte in a .distcp, or files of another step copied
in, loaded without complaint and trained other numbers (with a baseline, reported as CIERA being
inexact; with --no-baseline, not at all). So a resume first checks every file against the sha256
recorded at save time, and refuses a checkpoint written before they were recorded (version 1):
nothing could show its files are the ones that were saved.

The data needs no state: ``data.batch`` is a pure function of (seed, step, rank).

CIERA's codec state is not saved: a resumed run starts a fresh engine, so every stream starts
again with a key frame on both sides (reliability item 7: reset on both sides, never one). Shards
that were compressed at the checkpoint are compressed from the first resumed step on: without a
selector, every shard after warmup; with one, see ``Selector.load_state_dict`` (its step count,
latest selection and statistics are restored). The codec is lossless, so none of this changes a
training result: steps N+1.. of a resumed run are bitwise identical to an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# 2: the files' sha256 ("sha256"), --device, and every config key below, always recorded.
VERSION = 2
METADATA = "ciera-checkpoint.json"

# What the next steps' numbers depend on: a resumed run must use the same values.
# And the gather scheme where either side's is lossy (--codec zeropp-int8, sdp4bit train other
# weights; the lossless ones train the same). And --device: CPU and CUDA kernels round
# differently, so a checkpoint resumed on the other device goes on with other numbers than the
# uninterrupted run. Not recorded: --threads and --transport, which move the same bits (CIERA is
# lossless whatever its collectives or codec threads, and every run with a baseline checks that bit
# for bit), nor --warmup, --block, --overlap and the selector's options, which choose how shards
# are sent, not what arrives.
_SAME = {"model": "--model", "layers": "--layers", "hidden": "--hidden", "experts": "--experts",
         "expert_intermediate": "--expert-intermediate", "seq_len": "--seq-len", "batch": "--batch",
         "lr": "--lr", "seed": "--seed", "codec": "--codec", "device": "--device"}
# The FSDP2 layout: HSDP reduces gradients in another order than one flat group, and a selector's
# state is per gather group. --ranks-per-node shapes the groups under --hsdp only (without it,
# --nodes only shapes the link lab).
_LAYOUT = {"hsdp": "--hsdp", "ranks_per_node": "--ranks-per-node",
           "reshard_after_forward": "--reshard-after-forward"}


def _differs(key: str, saved, wanted) -> bool:
    # By type too: JSON's 1 and true are not --hsdp's False, nor 3.0 an integer option's 3.
    if key != "codec":
        return type(saved) is not type(wanted) or saved != wanted
    from ciera.train import schemes

    lossy = [name for name in (saved, wanted) if name in schemes.SCHEMES and schemes.is_lossy(name)]
    return not isinstance(saved, str) or (bool(lossy) and saved != wanted)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_sha256(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


# The fields of ciera-checkpoint.json a resume reads, and what each must be.
_FIELDS = {"steps_done": ("an integer", _is_int),
           "ranks": ("an integer", _is_int),
           "trainings": ("a list of names", lambda x: isinstance(x, list) and all(isinstance(n, str) for n in x)),
           "config": ("an object", lambda x: isinstance(x, dict)),
           "selectors": ("an object of selector states by training",
                         lambda x: isinstance(x, dict) and all(isinstance(v, dict) for v in x.values())),
           "sha256": ("an object of sha256 digests by file",
                      lambda x: isinstance(x, dict) and all(_is_sha256(v) for v in x.values()))}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _checked_files(folder: Path) -> list[str]:
    """The files a checksum covers: all in the folder but ciera-checkpoint.json (which holds them)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(METADATA))


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
    except (OSError, ValueError) as e:
        raise SystemExit(f"{where}: unreadable {METADATA} ({type(e).__name__}: {e})")
    # The version first: another version may name its fields differently.
    version = meta.get("version") if isinstance(meta, dict) else None
    if _is_int(version) and version == 1:
        raise SystemExit(f"{where}: written by an older ciera (checkpoint version 1), before checkpoints recorded "
                         "their files' sha256: nothing shows its files are the ones saved, so it is not resumed; "
                         "start a new run")
    if not _is_int(version) or version != VERSION:
        raise SystemExit(f"{where}: checkpoint version {json.dumps(version)}, this ciera reads {VERSION}")
    for key, (kind, valid) in _FIELDS.items():
        if key not in meta:
            raise SystemExit(f"{where}: {METADATA} has no \"{key}\"")
        if not valid(meta[key]):
            raise SystemExit(f"{where}: {METADATA}'s \"{key}\" must be {kind}, got {json.dumps(meta[key])[:80]}")
    done, ranks, saved, config = meta["steps_done"], meta["ranks"], meta["trainings"], meta["config"]
    absent = [key for key in (*_SAME, *_LAYOUT) if key not in config]
    if absent:
        raise SystemExit(f"{where}: {METADATA}'s \"config\" has no \"{absent[0]}\"")
    if ranks != args.ranks:
        raise SystemExit(f"{where}: written by {ranks} ranks, this run has --ranks {args.ranks} "
                         "(each rank's data and RNG state are its own: the rank count must match)")
    for key, flag in _SAME.items():
        if _differs(key, config[key], getattr(args, key)):
            raise SystemExit(f"{where}: written with {flag} {config[key]}, this run has {flag} "
                             f"{getattr(args, key)} (a resumed run trains the same model on the same data)")
    hsdp = bool(args.hsdp or config["hsdp"])
    for key, flag in _LAYOUT.items():
        if (key != "ranks_per_node" or hsdp) and _differs(key, config[key], getattr(args, key)):
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
    missing = [name for name in selecting if name not in meta["selectors"]]
    if missing:
        raise SystemExit(f"{where}: written without the selector of {', '.join(missing)} (a run without "
                         "--budget-mb); resume it without --budget-mb, or start a new run with it")
    storage = _check_files(folder, ranks, where, args.device)
    _check_sha256(folder, meta["sha256"], where, [*storage, *(f"rng-rank{r}.pt" for r in range(ranks))])
    return done


def _check_sha256(folder: Path, recorded: dict, where: str, needed: list[str]) -> None:
    """Every file as it was saved: a changed byte, or a file of another checkpoint copied in."""
    unrecorded = sorted(set(needed) - set(recorded))
    if unrecorded:
        raise SystemExit(f"{where}: {METADATA} records no sha256 of {unrecorded[0]}, which the load reads")
    for name, digest in sorted(recorded.items()):
        path = folder / name
        if os.sep in name or (os.altsep and os.altsep in name) or name in ("", ".", "..") or not path.is_file():
            raise SystemExit(f"{where}: {name} is missing (the checkpoint recorded its sha256)")
        found = sha256_of(path)
        if found != digest:
            raise SystemExit(f"{where}: checkpoint damaged or mixed: {name}'s sha256 is {found}, the checkpoint "
                             f"recorded {digest}")


def _check_files(folder: Path, ranks: int, where: str, device: str) -> list[str]:
    """The files a load reads, there and whole, before any rank starts: each rank's RNG state
    (and CUDA RNG state with --device cuda), the .metadata of torch.distributed.checkpoint, and
    every byte range it names. Returns the files .metadata names and itself; their contents are
    _check_sha256's."""
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
        # --device cuda only (untested here: no GPU in CI). Its size is the GPU generator's, which
        # the launcher does not know without a GPU; the sha256 covers its bytes.
        if device == "cuda" and not (folder / f"cuda-rng-rank{rank}.pt").is_file():
            raise SystemExit(f"{where}: cuda-rng-rank{rank}.pt is missing (rank {rank}'s CUDA RNG state)")
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
    return [".metadata", *ends, *((f"cuda-rng-rank{r}.pt" for r in range(ranks)) if device == "cuda" else ())]


def _training_state(run) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(run.model, run.optimizer)
    return {"model": model, "optimizer": optimizer}


def check_shapes(state: dict, folder: Path) -> None:
    """Each parameter the load fills (state: _training_state's by training) has its shape in the
    checkpoint's .metadata (ValueError naming the first that does not). Without this a model
    another than the checkpoint's failed inside dcp.load on every rank, reported as
    "CheckpointException ranks:dict_keys([0, 1])". Checked in the ranks, where the model is
    built: the launcher would have to build it too (models.build makes it on the CPU, whole), and
    the checkpoint's own files are already checked against their sha256 there."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    for training, parts in state.items():
        for name, value in parts["model"].items():
            key = f"{training}.model.{name}"   # dcp's flattened name of state[training]["model"][name]
            if key not in saved or not hasattr(saved[key], "size"):
                raise ValueError(f"checkpoint {folder} does not fit this run's model: it holds no {name} "
                                 f"of {training} (shape {list(value.shape)} here)")
            if tuple(saved[key].size) != tuple(value.shape):
                raise ValueError(f"checkpoint {folder} does not fit this run's model: {training}'s {name} has "
                                 f"shape {list(saved[key].size)} in the checkpoint, {list(value.shape)} here")


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
    if a.device == "cuda":   # untested here (no GPU in CI); a CPU run writes no such file
        torch.save(torch.cuda.get_rng_state(program.device), folder / f"cuda-rng-rank{program.rank}.pt")
    selectors = {name: h.selector.state_dict() for name, h in handles.items() if h.selector is not None}
    dist.barrier(group=group)  # every rank's files are complete before they are hashed
    # Each rank hashes a share of the files, and rank 0 gathers the digests: the others wait for
    # it on the checkpoint group (--checkpoint-timeout), not in the next step's collectives.
    names = _checked_files(folder)
    mine = {name: sha256_of(folder / name) for name in names[program.rank::program.world]}
    shares = [None] * program.world
    dist.all_gather_object(shares, mine, group=group)
    if program.rank == 0:
        digests = {name: digest for share in shares for name, digest in share.items()}
        meta = {"version": VERSION, "steps_done": steps_done, "ranks": program.world,
                "trainings": list(runs), "config": {key: getattr(a, key) for key in (*_SAME, *_LAYOUT)},
                "selectors": selectors, "resumed_from": a.resume, "sha256": dict(sorted(digests.items()))}
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
    check_shapes(state, folder)
    dcp.load(state, checkpoint_id=str(folder), process_group=program.checkpoint_group)
    for name, run in runs.items():
        set_state_dict(run.model, run.optimizer, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optimizer"])
    torch.set_rng_state(torch.load(folder / f"rng-rank{program.rank}.pt"))
    if program.args.device == "cuda":   # check_resume found it (untested here: no GPU in CI)
        torch.cuda.set_rng_state(torch.load(folder / f"cuda-rng-rank{program.rank}.pt"), program.device)
    for name, handle in handles.items():
        if handle.selector is not None:   # check_resume found its state in the checkpoint
            handle.selector.load_state_dict(meta["selectors"][name])
    return int(meta["steps_done"])
