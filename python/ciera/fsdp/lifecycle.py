"""The MPI lifecycle of a process that uses CIERA's Open MPI transport: MPI is initialised once,
and at exit every engine still open is closed before MPI is finalised (an MPI rank that exits
without MPI_Finalize makes mpirun fail the whole job).

Engines are held weakly and forgotten when closed, so enabling and disabling CIERA many times in
one process keeps nothing alive."""

from __future__ import annotations

import atexit
import weakref

from ciera import _ext

_open_engines: "weakref.WeakSet" = weakref.WeakSet()
_mpi_started = False


def register_engine(engine) -> None:
    _open_engines.add(engine)


def close_engine(engine) -> None:
    """Closes `engine` and forgets it; collective when the engine's transport is."""
    _open_engines.discard(engine)
    engine.close()


def open_engines() -> list:
    """Engines created by enable() that are neither closed nor garbage."""
    return [e for e in _open_engines if not e.closed]


def init_mpi_once() -> None:
    global _mpi_started
    if not _mpi_started:
        _ext.mpi_init()
        _mpi_started = True
        atexit.register(_shutdown_mpi)


def _shutdown_mpi() -> None:
    for engine in list(_open_engines):
        engine.close()
    _open_engines.clear()
    _ext.mpi_finalize()
