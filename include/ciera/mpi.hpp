// Open MPI transport (library target ciera::mpi). Collectives run nonblocking and are polled
// against a deadline, so a dead or stalled peer becomes a CommError instead of a hang.
#pragma once

#include <mpi.h>

#include <memory>

#include "ciera/transport.hpp"

namespace ciera {

// Duplicates `comm`, so CIERA's collectives never interleave with the caller's, and sets
// MPI_ERRORS_RETURN on the duplicate. MPI must be initialised; if several threads use MPI, with
// MPI_THREAD_MULTIPLE.
std::unique_ptr<Transport> make_mpi_transport(MPI_Comm comm);

// Whether a collective of any MPI transport of this process failed or timed out (CommError).
bool mpi_communication_failed();

// Ends MPI for this process, never blocking on a peer: MPI_Finalize when every collective
// succeeded; after a communication failure mpi_abort(abort_code) instead, since MPI_Finalize
// waits for every peer, and one that is dead or stopped (SIGSTOP) would keep it waiting forever.
// Does nothing if MPI is not initialised or already finalised.
void mpi_shutdown(int abort_code = 1);

// Ends this process and the whole MPI job (MPI_Abort on MPI_COMM_WORLD: the launcher ends the
// other ranks, stopped ones included) with exit status `code`, after flushing stdout and stderr.
[[noreturn]] void mpi_abort(int code);

}  // namespace ciera
