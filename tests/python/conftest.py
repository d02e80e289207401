"""Helpers for tests that need several torch.distributed ranks (gloo on CPU)."""

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
try:  # the installed package (pip install .); else this checkout's sources with a built _ext
    import ciera  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))

# torch and transformers are imported by the tests that use them (`needs_torch()`), so the codec,
# binding and command-line tests also run where only `pip install .` (no PyTorch) was done.


def needs_torch():
    """torch for a test module that trains or spawns ranks; the module is skipped without torch
    and transformers (`pip install '.[train]'`). Call at module level: `torch = needs_torch()`."""
    pytest.importorskip("transformers")
    return pytest.importorskip("torch")


def _entry(rank, world, store, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        import datetime

        # A file store (`store`, a path no rank has used): no port to pick ahead, which another
        # process could take between the pick and rank 0's bind.
        timeout = datetime.timedelta(seconds=60)
        file_store = dist.FileStore(store, world)
        file_store.set_timeout(timeout)
        dist.init_process_group("gloo", store=file_store, rank=rank, world_size=world, timeout=timeout)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # report every rank's failure, then let the test decide
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def ranks_store():
    """The spawned ranks' store (the file store beside their gloo group): for a test's own signals
    between ranks while one of them is inside a collective."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def until(condition, what: str, seconds: float = 30) -> None:
    """Waits until condition() holds (a thread got somewhere), or fails naming `what`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.005)


# What every rank imports, imported once by the fork server that starts the ranks: each rank is
# a fork of it (no threads have started there) instead of a fresh interpreter importing torch
# and transformers again, about two seconds of CPU per rank on this machine.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "transformers", "ciera",
            "ciera.torch", "fsdp_workers"]


def spawn(fn, world, *args, timeout=240):
    """Runs fn(rank, world, *args) on `world` processes; returns {rank: ("ok"|"error", value)}.
    A rank that never reports (ended without a word, or hung past `timeout`) is reported as
    "missing"; the wait ends as soon as every process has ended."""
    import queue as queue_module

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first spawn)
    queue = ctx.Queue()
    # The ranks' torch.distributed store: a file in a folder of this call's own.
    with tempfile.TemporaryDirectory(prefix="ciera-spawn-") as store_dir:
        store = os.path.join(store_dir, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout
        ended = False
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5 if ended else 2)
            except queue_module.Empty:
                if ended:
                    break
                # A rank that ended without reporting (killed, os._exit) never will: once every
                # process has ended, take what is still in the pipe and stop waiting for the rest.
                ended = not any(p.is_alive() for p in procs)
                continue
            results[rank] = (status, value)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        for r in range(world):
            results.setdefault(r, ("missing", None))
        return results


def all_ok(results):
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not bad, "\n".join(f"rank {r}: {v}" for r, v in bad.items())
    return [results[r][1] for r in sorted(results)]


def error_of(call) -> str | None:
    """What `call()` raised on this rank ("Type: text"), or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares each rank's error
        return f"{type(e).__name__}: {e}"
    return None


def set_up_stages_failing(failing: bool, enable, transport_owner) -> list:
    """enable() (a call that sets CIERA up and returns a handle), with its transport, then its
    engine, failing on this rank if `failing`, each just after its collective part (the torch
    group made, the engine's configuration agreed): what enable() raised here and the seconds it
    took, per stage. `transport_owner` is the module whose make_transport enable() calls; the
    engine is made by ciera.fsdp.api.make_engine."""
    import time

    from ciera.fsdp import api, lifecycle

    out = []
    for owner, name, error, close in (
            (transport_owner, "make_transport", RuntimeError("no route to the peers on this node"), None),
            (api, "make_engine", MemoryError("no room for the codec state"), lifecycle.close_engine)):
        original = getattr(owner, name)
        setattr(owner, name, _failing_after(original, failing, error, close))
        start = time.time()
        try:
            raised = error_of(lambda: enable().disable())
        finally:
            setattr(owner, name, original)
        out.append((raised, time.time() - start))
    return out


def _failing_after(original, failing: bool, error: BaseException, close=None):
    """`original`, failing on this rank if `failing` just after it returned (what it made closed
    by `close`, if given), with a copy of `error`: an error raised again holds the frames of its
    earlier raises, and any made then, to the next garbage collection. What it made is not left
    in its frame, which the error's traceback keeps (for group_beside, the group itself)."""
    def call(*args, **kwargs):
        made = original(*args, **kwargs)
        if not failing:
            return made
        if close is not None:
            close(made)
        made = None
        raise type(error)(*error.args)
    return call


def held_by_process() -> dict:
    """What this process holds that a set-up can leave behind: its threads, its open file
    descriptors, and the torch transports (ciera.fsdp.transport.TorchTransport) still alive."""
    import gc
    import warnings

    from ciera.fsdp.transport import TorchTransport

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # isinstance() on some of torch's objects warns of deprecations
        transports = sum(isinstance(o, TorchTransport) for o in gc.get_objects())
    return {"threads": len(os.listdir("/proc/self/task")), "descriptors": len(os.listdir("/proc/self/fd")),
            "torch transports": transports}


def grown(before: dict, now: dict) -> dict:
    """What `now` (held_by_process(), or part of it) holds more of than `before`: {key: (before,
    now)}, empty where nothing grew. Less is no leak: a descriptor or thread that something else
    opened before may have closed since."""
    return {k: (before[k], v) for k, v in now.items() if v > before[k]}


def later_set_up_stage_failing(failing: bool, enable, stage: str) -> dict:
    """enable() (a call that sets CIERA up on transport "torch" and returns a handle) whose stage
    `stage` (ciera.fsdp.api's measured_cost_model or make_engine: after the transport) fails on
    this rank if `failing`, just after its collective part: stage_failing()'s record of it."""
    from ciera.fsdp import api, lifecycle

    close = lifecycle.close_engine if stage == "make_engine" else None
    return stage_failing(failing, lambda: enable().disable(), api, stage, MemoryError("no room for the codec state"),
                         close)


def stage_failing(failing: bool, make, owner, stage: str, error: BaseException, close=None) -> dict:
    """`make()` (a collective set-up: a ciera.broadcast.Broadcaster, a ciera.zero optimizer, a
    step that rebuilds its engines) with its stage `owner.stage` (make_transport, group_beside,
    or the extension's Engine class) failing on this rank if `failing`, just after it returned
    (what it made closed by `close`, if given). What make() raised here ("Type: text", or None)
    and its seconds; what the process held (held_by_process()) before it, while its error (or
    what it returned) was still held, as a caller that keeps the error to report it would, and
    after that was dropped. While held, only threads and descriptors count: the traceback keeps
    the set-up's frames, and in them the transport object, whose group is what must be gone.
    Every rank is past make() before any measures (a barrier): the failing rank, holding its
    error, cannot end the peers' wait by releasing its group."""
    import torch.distributed as dist

    before = held_by_process()
    original = getattr(owner, stage)
    setattr(owner, stage, _failing_after(original, failing, error, close))
    start = time.perf_counter()
    kept = raised = None
    try:
        kept = make()
    except Exception as e:  # noqa: BLE001 - the test compares each rank's error
        kept, raised = e, f"{type(e).__name__}: {e}"
    finally:
        setattr(owner, stage, original)
    seconds = time.perf_counter() - start
    dist.barrier()
    held = {k: v for k, v in held_by_process().items() if k != "torch transports"}
    kept = None
    return {"error": raised, "seconds": seconds, "before": before, "held": held, "after": held_by_process()}


def policy_failing_on(failing_rank: int, rank: int):
    """A shard policy (the user's callable) that fails on `failing_rank` only, as one reading a
    file that only some nodes have would."""
    from ciera import ShardPolicy

    def policy(bucket, param):
        if rank == failing_rank:
            raise RuntimeError("no policy file on this node")
        return ShardPolicy.ciera

    return policy


def rank_statuses(out: Path) -> dict:
    """The `ciera train` rank status files under `out` (ciera.train.watch), by rank; a file being
    replaced is skipped."""
    import json

    statuses = {}
    for path in out.glob("*/ranks/*.json"):
        try:
            status = json.loads(path.read_text())
        except ValueError:
            continue  # being replaced
        statuses[status["rank"]] = status
    return statuses


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"
