"""Weight broadcast in lossless value-delta frames: one rank (a trainer) sends its tensors to the
others (evaluation or inference replicas) again and again, and the receivers, which keep the
values they got last time, take only the exact step-to-step differences — a fraction of a bit
per BF16 value once training has warmed up, against 16 for a plain broadcast.

    bcast = ciera.broadcast.Broadcaster(model.parameters(), root=0)   # collective, every rank
    ...
    bcast.broadcast()     # collective: every rank's tensors now hold the root's, bit for bit
    bcast.close()

The engine does the work: a broadcast is an allgather of a bucket that only the root holds
values of (docs/format.md, "Value-delta frames"). Each tensor is one bucket whose output is the
tensor itself (the root's input is the same memory), so nothing is copied on the way; a gather
that fails raises the same error on every rank and leaves no silently wrong value behind.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import (agree_before_set_up, refuse_each, refused_on_every_rank, set_up_on_every_rank, start_each,
                         wait_each)
from ciera._tensors import refuse_unwritable
from ciera.fsdp import lifecycle
from ciera.fsdp.layout import DTYPES
from ciera.fsdp.transport import check_engine_config, check_transport, make_transport

_POLICIES = ("delta", "ciera", "raw")   # ShardPolicy names


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.4, or built without distributed
        return False
    return isinstance(tensor, DTensor)


@dataclass
class BroadcastStats:
    """One broadcast() on this rank: bytes of the tensors, the root's payloads, the wall time,
    and the control records and verdicts that went with the payloads (all ranks': with
    wire_bytes, what the transport carried)."""
    raw_bytes: int
    wire_bytes: int
    seconds: float
    control_bytes: int = 0


def _agree_shapes(tensors: list, group) -> None:
    """ConfigError on every rank unless every rank holds tensors of the same shapes: the engine
    compares element counts and dtypes only, and a receiver's (3, 2) tensor would take a root's
    (2, 3) values in the wrong places. Collective (one all_gather_object)."""
    shapes = [tuple(t.shape) for t in tensors]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    # Errors name world ranks, the ranks a user launched, not ranks within the group.
    world_ranks = dist.get_process_group_ranks(group) if group is not None else range(len(everyone))
    for i in range(max(len(s) for s in everyone)):
        held = [s[i] if i < len(s) else None for s in everyone]
        if any(h != held[0] for h in held[1:]):
            ranks = "; ".join(f"{list(h) if h is not None else 'no tensor'} on rank {r}"
                              for r, h in zip(world_ranks, held))
            raise _ext.ConfigError(f"Broadcaster: the ranks differ in the shape of tensor {i}: {ranks}")


class Broadcaster:
    """Broadcasts `tensors` (contiguous CPU tensors of dtypes CIERA codes: bfloat16, float16,
    float32; the same shapes and dtypes on every rank) from rank `root` of `process_group` to
    the others, every time broadcast() is called. `policy`: "delta" (value-delta frames; the
    receivers keep the last values, value_bytes per value), "ciera" (exponent reuse) or "raw".
    `transport` as for ciera.torch.enable ("torch": a gloo group of its own; "mpi" under mpirun).
    Collective: every rank constructs it with the same arguments (checked, shapes included:
    ConfigError on every rank otherwise); the tensors must not share memory nor be negated views.
    A rank whose own arguments are refused (no tensors, a tensor CIERA cannot code) fails every
    rank alike, naming it: ValueError or TypeError as for bad arguments, ConfigError for tensors
    CIERA cannot take. For autograd a broadcast writes the receivers' tensors in place (their
    versions move), so a backward that saved one before it fails rather than use the new values."""

    def __init__(self, tensors, root: int = 0, *, process_group=None, transport: str = "torch",
                 config: _ext.EngineConfig | None = None, policy: str = "delta"):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"Broadcaster: process_group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(process_group).__name__}")
        world = dist.get_world_size(process_group)
        failure = None
        try:
            self.tensors = list(tensors)
            self._check(root, policy, world, config)
            check_transport("Broadcaster", transport)
        except Exception as e:  # noqa: BLE001 - raised on every rank by agree_before_set_up
            failure = e
        # The checks read this rank's own tensors (receivers are often set up unlike the root):
        # every rank learns of any rank's failure here, rather than the others waiting in the
        # transport's set-up for the one that raised.
        # `config`: None takes a delta stream's own defaults (no warmup), so a rank that passes
        # one where another does not would differ in a setting it never wrote.
        agree_before_set_up("Broadcaster", failure, process_group,
                            same={"root": root, "policy": policy, "transport": transport,
                                  "config": "None" if config is None else "an EngineConfig"})
        _agree_shapes(self.tensors, process_group)
        self._calling = threading.Lock()   # held by the thread in broadcast()
        self.root = root = operator.index(root)
        self.rank = dist.get_rank(process_group)
        self._dtypes = [t.dtype for t in self.tensors]   # what each bucket's bytes are
        self._shapes = [t.shape for t in self.tensors]   # agreed across ranks at set-up
        shard_policy = getattr(_ext.ShardPolicy, policy)
        layouts = []
        for i, t in enumerate(self.tensors):
            layout = _ext.BucketLayout()
            layout.name = f"tensor{i}"
            layout.dtype = DTYPES[t.dtype]
            layout.shard_values = [[t.numel() if r == root else 0] for r in range(world)]
            layout.policy = [shard_policy]
            layouts.append(layout)
        if config is None:
            config = _ext.EngineConfig()
            if policy == "delta":
                # A value-delta stream needs no warmup: its frames are small from the second on.
                config.warmup_steps = 0
        # The engine and the group made for a "torch" transport, ended by close() or when the
        # Broadcaster is collected unclosed: one Broadcaster per evaluation pass would otherwise
        # leave a gloo group (5 descriptors, 3 threads) each.
        self._owned = lifecycle.Owned(self)

        def make_engine():
            engine = _ext.Engine(native, config, layouts)
            lifecycle.register_engine(engine)
            self._owned.engines.append(engine)
            return engine

        def failed(rank: int) -> str:
            return f"Broadcaster: rank {rank} could not set up CIERA"

        with contextlib.ExitStack() as undo:
            # Each stage agreed on every rank (set_up_on_every_rank): a transport or engine that
            # failed on one rank alone left its peers in the engine's configuration agreement, or
            # in their first broadcast, until the timeout. On a failure anywhere every rank ends
            # what it made here, now, not when the half-built Broadcaster goes (the error's
            # traceback holds it as long as the caller holds the error).
            undo.callback(self._owned.release)
            native = set_up_on_every_rank(
                lambda: make_transport(transport, process_group, config.timeout_s, made=self._owned.groups),
                process_group, failed)
            self.engine = set_up_on_every_rank(make_engine, process_group, failed)
            undo.pop_all()

    def _check(self, root: int, policy: str, world: int, config) -> None:
        if not self.tensors:
            raise ValueError("no tensors to broadcast")
        if isinstance(root, bool) or not hasattr(root, "__index__"):   # an int, a NumPy integer
            raise TypeError(f"root must be an int (a rank of the group), got {type(root).__name__} {root!r}")
        check_engine_config("", "config", config)
        if not 0 <= root < world:
            raise ValueError(f"root {root} is not a rank of the group (size {world})")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be 'delta', 'ciera' or 'raw', got {policy!r}")
        for i, t in enumerate(self.tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"item {i} is a {type(t).__name__}, not a tensor")
            if _is_dtensor(t):
                # FSDP2's parameters: data_ptr() is 0 and numel() counts every rank's shard.
                raise TypeError(f"tensor {i} is a DTensor (a sharded tensor, e.g. an FSDP2 parameter): "
                                "pass its local shard, .to_local()")
            if t.dtype not in DTYPES:
                raise _ext.ConfigError(f"tensor {i} is {t.dtype}; CIERA codes bfloat16, float16 and float32")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise _ext.ConfigError(f"tensor {i} must be a contiguous CPU tensor")
        refuse_unwritable(self.tensors, "")

    @property
    def cache_bytes(self) -> int:
        """Codec state this rank holds (the root: copies of what it sent; the others: the values
        they received last)."""
        if self.engine.closed:   # the engine's own text names Handle.disable(), as in broadcast()
            raise ValueError("Broadcaster is closed (close()); it holds no cache")
        return self.engine.cache_bytes

    def broadcast(self) -> BroadcastStats:
        """Every rank's tensors become the root's, bit for bit. Collective. CommError or
        ConfigError (the same on every rank) if it fails. One call at a time: a call from a
        second thread while one is in flight is a RuntimeError on its rank, nothing started."""
        # A second thread's call would start buckets the first has in flight, and this rank would
        # gather more than its peers: refused here, before anything starts, the engine untouched.
        if not self._calling.acquire(blocking=False):
            raise RuntimeError("Broadcaster.broadcast: another thread's broadcast() on this Broadcaster is in "
                               "flight; calls must not overlap")
        if self.engine.closed:   # the engine's own text named Handle.disable(), which a Broadcaster has not
            self._calling.release()
            raise ValueError("Broadcaster is closed (close()); it cannot broadcast")
        try:
            return self._broadcast()
        finally:
            self._calling.release()

    def _broadcast(self) -> BroadcastStats:
        start = time.perf_counter()
        # A tensor changed since set-up on this rank alone (`.data` replaced by one of another
        # dtype of the same size, or moved, or made non-contiguous) would take the root's bytes
        # as values of the wrong type: refused, every bucket, so the peers fail at once too.
        refused_on_every_rank(self._check_unchanged, self._refuse)

        def start_one(i: int):
            t = self.tensors[i]
            nbytes = t.numel() * t.element_size()
            # The root's input is its tensor, which is also its slot of the output (in place).
            in_bytes = nbytes if self.rank == self.root else 0
            return self.engine.start(i, t.data_ptr(), in_bytes, t.data_ptr(), nbytes, keep=t)

        try:
            tickets = start_each([(self.engine, i) for i in range(len(self.tensors))], start_one)
            stats = wait_each([(self.engine, ticket) for ticket in tickets])
        finally:
            if self.rank != self.root:
                # The engine writes a receiver's tensors through their pointers, unseen by autograd:
                # a backward that saved one (a forward before this call) would otherwise go on with
                # the new values. A failed call may have written some of them too. The root's
                # values are unchanged, so its backward stays valid.
                torch.autograd.graph.increment_version(self.tensors)
        return BroadcastStats(sum(s.raw_bytes for s in stats), sum(s.wire_bytes for s in stats),
                              time.perf_counter() - start, sum(s.control_bytes for s in stats))

    def _check_unchanged(self) -> None:
        for i, (t, dtype) in enumerate(zip(self.tensors, self._dtypes)):
            if t.dtype != dtype:
                raise _ext.ConfigError(f"Broadcaster: tensor {i} is now {t.dtype}; it was {dtype} at set-up")
            if t.shape != self._shapes[i]:
                raise _ext.ConfigError(f"Broadcaster: tensor {i} is now of shape {list(t.shape)}; it was "
                                       f"{list(self._shapes[i])} at set-up")
            if t.device.type != "cpu" or not t.is_contiguous():
                raise _ext.ConfigError(f"Broadcaster: tensor {i} is no longer a contiguous CPU tensor")
        refuse_unwritable(self.tensors, "Broadcaster: ")

    def _refuse(self, reason: str) -> None:
        """This broadcast, refused on every bucket in the order the peers wait for them."""
        refuse_each([(self.engine, i) for i in range(len(self.tensors))], reason)

    def close(self) -> None:
        """Ends the engine (collective: every rank closes). Not while this rank's broadcast() is
        in flight on another thread: a RuntimeError then, the engine left open."""
        if not self._calling.acquire(blocking=False):
            raise RuntimeError("Broadcaster.close: a broadcast() on this Broadcaster is in flight; close it after")
        try:
            self._owned.release()
        finally:
            self._calling.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
