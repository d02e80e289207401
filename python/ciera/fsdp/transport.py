"""Transports the engine's collectives can run on: a torch.distributed process group (gloo on CPU,
NCCL on CUDA, through Python callables), CIERA's Open MPI transport (CPU; the job runs under
mpirun) or CIERA's NCCL transport (CUDA; a communicator of its own)."""

from __future__ import annotations

import datetime
import hashlib
import threading
import warnings
import weakref

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import all_gather_single
from ciera.fsdp import lifecycle


def _as_tensor(view: memoryview) -> torch.Tensor:
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only inputs: torch warns, and we never write them
        return torch.frombuffer(view, dtype=torch.uint8)


def _padded_allgatherv(all_gather, inp: torch.Tensor, out: torch.Tensor, counts, displs, rank: int,
                       broadcast=None) -> None:
    """An allgatherv from a collective that has none (gloo, NCCL through torch): every rank's bytes
    padded to the largest count, one `all_gather(recv, send)`, then each rank's part copied to its
    place in `out` (on the device `inp` and `out` are on). When only one rank sends anything (a
    weight broadcast through the engine, ciera.broadcast), `broadcast(tensor, src)` moves its
    bytes once instead of every rank sending that many."""
    largest = max(counts)
    if largest == 0:
        return
    senders = [r for r, c in enumerate(counts) if c > 0]
    if broadcast is not None and len(senders) == 1:
        src = senders[0]
        part = out[displs[src] : displs[src] + counts[src]]
        if rank == src:
            part.copy_(inp)
        broadcast(part, src)
        return
    send = torch.zeros(largest, dtype=torch.uint8, device=out.device)
    send[: counts[rank]] = inp
    recv = torch.empty(largest * len(counts), dtype=torch.uint8, device=out.device)
    all_gather(recv, send)
    for r in range(len(counts)):
        out[displs[r] : displs[r] + counts[r]] = recv[r * largest : r * largest + counts[r]]


def _is_back_to_back(counts, displs) -> bool:
    return list(displs) == [sum(counts[:r]) for r in range(len(counts))]


def _back_to_back(data: torch.Tensor, counts, displs) -> torch.Tensor:
    """The parts of `data` (counts[r] bytes at displs[r]) back to back in rank order: a view of
    `data` where they already are, else a copy."""
    if _is_back_to_back(counts, displs):
        return data[: sum(counts)]
    return torch.cat([data[d : d + c] for c, d in zip(counts, displs)])


class TorchTransport:
    """CIERA's collectives on a torch.distributed process group (gloo on CPU).

    Gloo has no allgatherv: the variable-size exchange pads every rank's payload to the largest
    (one collective instead of one broadcast per rank; CIERA payloads of one bucket differ by well
    under 1% across ranks, so the padding costs little)."""

    def __init__(self, group):
        self._group = lifecycle.held_weakly(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    @property
    def group(self):
        return self._group()

    def allgather(self, inp: memoryview, out: memoryview) -> None:
        all_gather_single(_as_tensor(out), _as_tensor(inp), group=self.group)

    def allgatherv(self, inp: memoryview, out: memoryview, counts, displs) -> None:
        _padded_allgatherv(lambda recv, send: all_gather_single(recv, send, group=self.group),
                           _as_tensor(inp), _as_tensor(out), counts, displs, self.rank,
                           broadcast=lambda tensor, src: dist.broadcast(
                               tensor, src=dist.get_global_rank(self.group, src), group=self.group))

    def alltoallv(self, inp: memoryview, out: memoryview, send_counts, send_displs, recv_counts, recv_displs) -> None:
        """all_to_all_single with split sizes. That takes each side's parts back to back in rank
        order, as CIERA's collectives lay them; parts laid out otherwise (the transport contract,
        include/ciera/transport.hpp, allows any displacements) go through a packed copy, so that
        no rank refuses alone while its peers wait in the collective."""
        send, recv = _as_tensor(inp), _as_tensor(out)
        packed_send = _back_to_back(send, send_counts, send_displs)
        unpack = not _is_back_to_back(recv_counts, recv_displs)
        packed_recv = torch.empty(sum(recv_counts), dtype=torch.uint8) if unpack else recv[: sum(recv_counts)]
        dist.all_to_all_single(packed_recv, packed_send, output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=self.group)
        if unpack:
            at = 0
            for count, displ in zip(recv_counts, recv_displs):
                recv[displ : displ + count] = packed_recv[at : at + count]
                at += count

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def make(self):
        return _ext.python_transport(self.rank, self.size, self.allgather, self.allgatherv, self.barrier, "torch-gloo",
                                     alltoallv=self.alltoallv)


class _DeviceBytes:
    """`nbytes` bytes of device memory at `address`, for torch.as_tensor (CUDA array interface,
    version 3). No stream: CIERA hands a transport only data that is complete."""

    def __init__(self, address: int, nbytes: int, readonly: bool):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, readonly),
                                         "version": 3, "strides": None, "stream": None}


class TorchCudaTransport:
    """CIERA's collectives on a torch.distributed process group, for a CUDA engine: the
    callables get (address, bytes) of device memory (the engine stages its small host records
    through device memory, so nothing else arrives here).

    Each collective runs on a side stream of this transport and is complete when the callable
    returns (the engine's contract), without synchronising the training's streams. NCCL has no
    allgatherv: as over gloo, payloads are padded to the largest (device copies are cheap). On a
    gloo group (ranks sharing a GPU where NCCL refuses that) the bytes go through host memory."""

    def __init__(self, group, device: torch.device, backend: str):
        self._group = lifecycle.held_weakly(group)
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stream = torch.cuda.Stream(device=device)
        self.via_host = backend != "nccl"

    @property
    def group(self):
        return self._group()

    def _tensor(self, view) -> torch.Tensor:
        address, nbytes = view
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_DeviceBytes(address, nbytes, False), device=self.device)

    def _run(self, body) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            body()
        self.stream.synchronize()

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if not self.via_host:
            all_gather_single(out, inp, group=self.group)
            return
        host = torch.empty(out.numel(), dtype=torch.uint8)
        all_gather_single(host, inp.cpu(), group=self.group)
        out.copy_(host)

    def allgather(self, inp, out) -> None:
        self._run(lambda: self._all_gather(self._tensor(out), self._tensor(inp)))

    def allgatherv(self, inp, out, counts, displs) -> None:
        self._run(lambda: _padded_allgatherv(self._all_gather, self._tensor(inp), self._tensor(out), counts,
                                             displs, self.rank))

    def barrier(self) -> None:
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self._run(lambda: self._all_gather(torch.empty(self.size, dtype=torch.uint8, device=self.device), one))

    def make(self):
        return _ext.python_transport(self.rank, self.size, self.allgather, self.allgatherv, self.barrier,
                                     "torch-nccl" if not self.via_host else "torch-gloo (CUDA via host)",
                                     device=True)


def _cuda_backend(process_group) -> str:
    """The backend `process_group` (default the world) uses for CUDA tensors: "nccl" unless the
    job chose gloo for them (ranks sharing a GPU with an NCCL that refuses it)."""
    backend = str(dist.get_backend(process_group)).lower()
    for part in backend.split(","):
        device, _, name = part.partition(":")
        if name and device.strip() == "cuda":
            return name.strip()
    return "gloo" if backend == "gloo" else "nccl"


def _nccl_transport(process_group, device: torch.device, timeout_s: float):
    """CIERA's own NCCL communicator among the ranks of `process_group`: rank 0 draws the unique
    id and the group's existing backend carries it to the others."""
    if not _ext.with_nccl:
        raise _ext.ConfigError("transport 'nccl': this build of CIERA has no NCCL transport "
                               "(build it with nvcc: CIERA_CUDA=ON pip install .)")
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    box = [_ext.nccl_unique_id() if rank == 0 else None]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    return _ext.nccl_transport(box[0], rank, size, device.index, timeout_s)


def _mpi_transport(cuda: bool, timeout_s: float, ranks: list[int] | None = None):
    """CIERA's Open MPI transport on the world, or on the subgroup `ranks` (collective over the
    world: every rank names its own group); MPI initialised once per process. Its set-up, like its
    collectives, waits at most `timeout_s` for the peers."""
    if cuda:
        raise _ext.ConfigError("transport 'mpi' moves host memory; for a CUDA model use 'torch' or 'nccl'")
    if not _ext.with_mpi:
        raise _ext.ConfigError("this build of CIERA has no MPI transport")
    lifecycle.init_mpi_once(timeout_s)
    return _ext.mpi_transport(ranks, timeout_s)


def make_subgroup_transport(kind: str, partition, ranks, timeout_s: float, device: torch.device | None = None,
                            made: list | None = None):
    """The native transport on this rank's group `ranks`, one of the groups in `partition` (they
    split the world; every rank names the same partition). Collective over the world: every rank
    creates its group at once. As make_transport otherwise (`made`: the process group made for
    it, transport "torch" or "nccl")."""
    if len(partition) == 1:
        if tuple(partition[0]) != tuple(range(dist.get_world_size())):
            raise _ext.ConfigError(f"the ranks {tuple(partition[0])} are not the world in rank order")
        return make_transport(kind, None, timeout_s, device, made)
    cuda = device is not None and device.type == "cuda"
    timeout = datetime.timedelta(seconds=timeout_s)
    lists = [list(p) for p in partition]
    if kind == "mpi":
        native = _mpi_transport(cuda, timeout_s, list(ranks))
        _require_mpi_places(native, list(ranks))
        return native
    if kind == "torch":
        backend = _cuda_backend(None) if cuda else "gloo"
        group, _ = dist.new_subgroups_by_enumeration(lists, timeout=timeout, backend=backend)
        _made(lifecycle.register_group(group), made)
        return TorchCudaTransport(group, device, backend).make() if cuda else TorchTransport(group).make()
    if kind == "nccl":
        # A gloo group of our own carries the NCCL unique id.
        group, _ = dist.new_subgroups_by_enumeration(lists, timeout=timeout, backend="gloo")
        return make_transport(kind, _made(lifecycle.register_group(group), made), timeout_s, device)
    raise _ext.ConfigError(f"unknown transport {kind!r} (expected 'torch', 'mpi' or 'nccl')")


TRANSPORTS = ("torch", "mpi", "nccl")


def check_transport(what: str, kind) -> None:
    """ValueError naming `what` (the calling function) unless `kind` is a transport's name:
    checked with the other arguments, before anything is set up."""
    if kind not in TRANSPORTS:
        raise ValueError(f"{what}: transport must be 'torch', 'mpi' or 'nccl', got {kind!r}")


def check_engine_config(what: str, argument: str, config) -> None:
    """TypeError naming `what` (the calling function; "" where the caller's agreement names it)
    and `argument` unless `config` is None or an EngineConfig. (Its timeout needs no check here:
    EngineConfig refuses one that is not a finite number of seconds > 0 when it is set.)"""
    if config is not None and not isinstance(config, _ext.EngineConfig):
        prefix = f"{what}: " if what else ""
        raise TypeError(f"{prefix}{argument} must be a ciera.EngineConfig, got {type(config).__name__}")


# How many groups this process made beside each subgroup (its sorted ranks), under the default
# group they belong to: the serial in the next one's name. Every member makes the same groups over
# its subgroup in the same order (the callers are collective over it), so the members agree on it
# whatever else each has made; a new default group (init_process_group again) starts afresh.
_serials: dict[tuple[int, ...], int] = {}
_serials_world = None   # a weak reference to the default group _serials count under
_serials_lock = threading.Lock()
_pending = threading.local()   # the name this thread's next new_group takes


def _next_name(ranks: list[int]) -> str:
    global _serials_world
    world = dist.distributed_c10d._get_default_group()
    with _serials_lock:
        if _serials_world is None or _serials_world() is not world:
            _serials.clear()
            _serials_world = weakref.ref(world)
        key = tuple(ranks)
        serial = _serials.get(key, 0)
        _serials[key] = serial + 1   # taken even if the group then fails: the members stay equal
    digest = hashlib.sha1(",".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()[:16]
    return f"ciera-{digest}-{serial}"


def _name_groups_of_this_thread() -> None:
    """torch's new_group takes no name: its naming function, wrapped once, gives this thread's
    pending name to the one new_group call that follows, and every other call torch's own name."""
    c10d = dist.distributed_c10d
    if getattr(c10d._process_group_name, "ciera_names", False):
        return
    torch_names = c10d._process_group_name

    def named(*args, **kwargs):
        name = getattr(_pending, "name", None)
        if name is None:
            return torch_names(*args, **kwargs)
        _pending.name = None
        return name

    named.ciera_names = True
    c10d._process_group_name = named


def group_beside(process_group, backend: str, timeout: datetime.timedelta):
    """A new group of `process_group`'s ranks (None: the world), registered for release at exit.
    Over the world every process makes it, as torch.distributed asks of new_group. Over a
    subgroup only its members do (another subgroup's ranks build their own meanwhile, or none):
    with local synchronisation, under a name of CIERA's that no group had before. torch names a
    group by the world's counter, which two subgroups building at once both took (one store
    prefix, their gloo connections crossed); or, with local synchronisation, by its ranks and how
    many groups the process holds now, which gives a group made after one was destroyed that
    one's name (the peers read its stale addresses: a connect timeout), and differs between
    members that joined different groups before (a wait on two prefixes)."""
    if process_group is None or dist.get_world_size(process_group) == dist.get_world_size():
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        return lifecycle.register_group(dist.new_group(ranks=ranks, backend=backend, timeout=timeout))
    ranks = sorted(dist.get_process_group_ranks(process_group))
    _name_groups_of_this_thread()
    name = _pending.name = _next_name(ranks)
    try:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
        unnamed = _pending.name is not None   # new_group never asked c10d._process_group_name
    finally:
        _pending.name = None
    lifecycle.register_group(group)
    if unnamed or getattr(group, "group_name", name) != name:
        # The naming above is private to torch (2.13 here, 2.11 on the GPU image): without it two
        # subgroups' groups can cross (see above). Every member has the same torch: all refuse.
        raise _ext.ConfigError(f"CIERA could not name the process group it makes beside a subgroup: torch "
                               f"{torch.__version__}'s new_group names groups otherwise than CIERA knows")
    return group


def make_transport(kind: str, process_group, timeout_s: float, device: torch.device | None = None,
                   made: list | None = None):
    """The native transport for enable(transport=kind), for a model on `device` (CPU when None).
    "torch": a dedicated group beside `process_group` (default the world), gloo for a CPU model
    and NCCL for a CUDA one, whose collectives fail after `timeout_s` (the engine's timeout: a
    new group would otherwise wait torch's default 30 minutes for a stopped peer); "mpi": Open
    MPI, initialised once per process (the engine sets its timeout; host memory only); "nccl":
    CIERA's NCCL transport (CUDA only). A group made for "torch" is appended to `made` (if given),
    for an owner that releases it before exit (lifecycle.release_group)."""
    cuda = device is not None and device.type == "cuda"
    if kind == "torch":
        backend = _cuda_backend(process_group) if cuda else "gloo"
        group = _made(group_beside(process_group, backend, datetime.timedelta(seconds=timeout_s)), made)
        return TorchCudaTransport(group, device, backend).make() if cuda else TorchTransport(group).make()
    if kind == "nccl":
        if not cuda:
            raise _ext.ConfigError("transport 'nccl' moves device memory: the model must be on a CUDA device")
        return _nccl_transport(process_group, device, timeout_s)
    if kind == "mpi":
        native = _mpi_transport(cuda, timeout_s)
        _require_mpi_places(native, dist.get_process_group_ranks(process_group) if process_group is not None
                            else list(range(dist.get_world_size())), process_group)
        return native
    raise _ext.ConfigError(f"unknown transport {kind!r} (expected 'torch', 'mpi' or 'nccl')")


def _made(group, made: list | None):
    """`group`, appended to `made` (if given): an owner's list of the groups made for it."""
    if made is not None:
        made.append(group)
    return group


def _require_mpi_places(native, ranks: list[int], group=None) -> None:
    """Transport 'mpi' takes torch's ranks `ranks` (this process's group, in its order) as MPI's:
    each process's place in its MPI group must be its torch rank's place in `ranks`. Else shards
    of equal size would be gathered into each other's places, silently; and under torchrun each
    process is an MPI world of one, where the engine's agreement said only that a bucket
    "describes 2 ranks but the transport has 1", on every rank as rank 0. Every process's place
    is gathered over `group` (None: the world; the caller's call is collective over it), so that
    all decide alike: a rank whose own place looks right would otherwise go on into the engine's
    set-up and wait there."""
    places = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, (dist.get_rank(), tuple(ranks), native.rank, native.size), group=group)
    for torch_rank, members, mpi_rank, size in places:
        if size == 1 and len(members) > 1:
            raise _ext.ConfigError(f"transport 'mpi' found an MPI world of 1 process, but the process group has "
                                   f"{len(members)} ranks: start the ranks with mpirun (torchrun starts each as an "
                                   f"MPI world of its own), or use transport 'torch'")
        if size != len(members) or members[mpi_rank] != torch_rank:
            raise _ext.ConfigError(
                f"transport 'mpi': torch rank {torch_rank} took place {mpi_rank} of an MPI group of {size} "
                f"for the group {list(members)}: MPI's ranks are not torch's (start the ranks with mpirun, in "
                f"the same order; or use transport 'torch')")
