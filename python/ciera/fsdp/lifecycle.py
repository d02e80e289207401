"""The MPI lifecycle of a process that uses CIERA's Open MPI transport: MPI is initialised once,
and at exit every engine still open is closed before MPI is finalised (an MPI rank that exits
without MPI_Finalize makes mpirun fail the whole job) — unless something failed. After a failed
collective (CIERA's, counted by the transport) or an uncaught exception (which may come from any
other collective, e.g. a gloo timeout), MPI_Finalize could wait forever for a peer that is dead
or stopped, so the job is aborted instead: MPI_Abort, on which mpirun ends every rank, stopped
ones included, and the process exits non-zero.

Engines are held weakly and forgotten when closed, so enabling and disabling CIERA many times in
one process keeps nothing alive.

The torch.distributed groups CIERA makes for itself (transport="torch") are destroyed at exit,
while the interpreter is still whole: a gloo group left to the interpreter's finalization can
abort the process ("terminate called without an active exception"), when one of its worker
threads drops the last reference to a tensor and must take the GIL that finalization no longer
hands out (pytorch/pytorch#190489). A process that exits after an uncaught exception skips it,
as it skips MPI_Finalize: a group may still wait there on a peer that is gone."""

from __future__ import annotations

import atexit
import os
import sys
import weakref

from ciera import _ext

_open_engines: "weakref.WeakSet" = weakref.WeakSet()
_mpi_started = False
_mpi_timeout_s = 120.0  # how long MPI_Finalize may wait for the peers at exit
_uncaught = False  # an exception reached the top of the program (sys.excepthook ran)
# Process groups CIERA made, destroyed at exit (_release_groups). disable() does not release
# them (3 threads and 5 descriptors per enable() stay to exit): a release at disable() (217de71,
# reverted) made examples/fsdp2_train.py abort at exit in 2 of 6 runs. The core showed why: not
# CIERA's group but the script's default gloo group, whose worker thread dropped the last
# reference to the tensor of the script's final all_reduce after Py_FinalizeEx had begun, and
# died taking the GIL (std::terminate in a forced unwind). The exit handler's work here had
# given that thread time to finish; without it the race in torch shows. A release at disable()
# needs that race gone first.
_own_groups: list = []
_hooked = False  # sys.excepthook notes uncaught exceptions


def register_engine(engine) -> None:
    _open_engines.add(engine)


def close_engine(engine) -> None:
    """Closes `engine` and forgets it; collective when the engine's transport is. An engine that
    refuses to close (on its own communication thread) stays known, for the exit handler."""
    engine.close()
    _open_engines.discard(engine)


def open_engines() -> list:
    """Engines created by enable() that are neither closed nor garbage."""
    return [e for e in _open_engines if not e.closed]


def register_group(group):
    """Notes a torch.distributed group CIERA made, to destroy at exit; returns it. This is the one
    strong reference CIERA keeps: the transports hold it through held_weakly(), so that at exit
    the group object is freed (its worker threads joined) while the interpreter is whole."""
    if not _own_groups:
        atexit.register(_release_groups)
        _note_uncaught_exceptions()
    _own_groups.append(group)
    return group


def release_group(group) -> None:
    """Destroys a group register_group() noted, now rather than at exit (an owner that is done
    with it: a closed ciera.zero optimizer)."""
    if any(g is group for g in _own_groups):
        _own_groups[:] = [g for g in _own_groups if g is not group]
        destroy_group(group)


def release_groups(groups: list) -> None:
    """release_group() of each of an owner's `groups`, which is left empty (the owner is done)."""
    for group in groups:
        release_group(group)
    groups.clear()


class Owned:
    """The engines and process groups an owner (a ciera.zero optimizer, a Broadcaster) made, ended
    by release() in close()'s order: the engines closed, then the groups released (a group
    destroyed under an open engine could be in one of its gathers). release() runs once: from the
    owner's close(), or when the owner is collected unclosed (each gloo group keeps 3 threads and
    5 descriptors until released); not at exit, where the exit handler ends what is left."""

    def __init__(self, owner):
        self.engines: list = []   # open engines; the owner removes those it closes itself
        self.groups: list = []    # process groups made for them (make_transport's `made`)
        self._release = weakref.finalize(owner, Owned._end, self.engines, self.groups)
        self._release.atexit = False

    def release(self) -> None:
        """The owner's close(): an engine that refuses to close raises, and nothing more is
        released (a later close(), or the collection, tries again)."""
        for engine in list(self.engines):
            close_engine(engine)
            self.engines.remove(engine)
        self._release()

    @staticmethod
    def _end(engines: list, groups: list) -> None:
        for engine in engines:
            try:
                close_engine(engine)
            except Exception:
                # Collected on an engine's own communication thread, inside one of its gathers
                # (close() refuses there): the binding ends that engine once the gather is done,
                # and its groups stay to exit rather than go from under it.
                return
        engines.clear()
        release_groups(groups)


def held_weakly(group):
    """A callable that returns `group` (one register_group() holds; None stays None), or raises
    CommError once the group was released at exit: never another group in its place."""
    if group is None:
        return lambda: None
    ref = weakref.ref(group)

    def get():
        live = ref()
        if live is None:
            raise _ext.CommError("CIERA's process group was released: the process is exiting")
        return live

    return get


def destroy_group(group) -> None:
    """Destroys `group` unless torch.distributed no longer holds it (destroyed already, by its
    owner or by destroy_process_group() of everything)."""
    import torch.distributed as dist

    if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


def _release_groups() -> None:
    if _uncaught:
        return
    for engine in list(_open_engines):   # no engine thread may be left in a collective of a group
        close_engine(engine)
    for group in _own_groups:
        destroy_group(group)
    _own_groups.clear()


def init_mpi_once(timeout_s: float, start_up_s: float | None = None) -> None:
    """Starts MPI once for this process. Its start-up and, at exit, its MPI_Finalize wait for every
    rank; past `timeout_s` (a peer dead or stopped outside any collective) the process ends with
    one line naming the call (docs/reliability.md, row 22). `start_up_s`, if given, is the
    start-up's own limit: the ranks reach it as far apart as their imports and set-up make them.
    A later call keeps the longest timeout for the finalize."""
    global _mpi_started, _mpi_timeout_s
    _mpi_timeout_s = max(_mpi_timeout_s, timeout_s) if _mpi_started else timeout_s
    if not _mpi_started:
        _ext.mpi_init(timeout_s if start_up_s is None else start_up_s)
        _mpi_started = True
        atexit.register(_shutdown_mpi)
        _note_uncaught_exceptions()


def abort(code: int = 1):
    """Ends this process at once with exit status `code`, and under MPI the whole job: for a rank
    that failed and must not wait for its peers in any finalizer or exit handler. Without MPI
    (torchrun, or the torch transport under mpirun before MPI was started) the process just exits,
    and the launcher, seeing a rank end non-zero, ends the others."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _mpi_started:
        _ext.mpi_abort(code)
    os._exit(code)


def _note_uncaught_exceptions() -> None:
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        global _uncaught
        _uncaught = True
        previous(kind, value, tb)

    sys.excepthook = hook


def _shutdown_mpi() -> None:
    if _uncaught or _ext.mpi_communication_failed():
        abort(1)  # engines are not closed: a closing engine may wait out a gather in flight
    for engine in list(_open_engines):
        engine.close()
    _open_engines.clear()
    _ext.mpi_shutdown(timeout_s=_mpi_timeout_s)
