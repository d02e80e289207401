// Open MPI transport (library target ciera::mpi). Collectives run nonblocking and are polled
// against a deadline, so a dead or stalled peer becomes a CommError instead of a hang.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <span>

#include "ciera/transport.hpp"

namespace ciera {

// Initialises MPI the way CIERA needs it and returns the thread level MPI provides (the caller
// checks it against MPI_THREAD_MULTIPLE, which the engine's threads need); if MPI is initialised
// already, only returns that level. Before MPI_Init_thread it turns on Open MPI's TCP progress
// thread (OMPI_MCA_btl_tcp_progress_thread=1) unless the caller chose that parameter: without it
// the last fragment of a large message can wait in a rank's send queue until that rank next
// calls MPI, and a peer still polling for it stalls (docs/reliability.md, row 21).
int mpi_init(int* argc = nullptr, char*** argv = nullptr);

// Duplicates `comm`, so CIERA's collectives never interleave with the caller's, and sets
// MPI_ERRORS_RETURN on the duplicate. MPI must be initialised; if several threads use MPI, with
// MPI_THREAD_MULTIPLE.
std::unique_ptr<Transport> make_mpi_transport(MPI_Comm comm);

// Whether a collective of any MPI transport of this process (or mpi_wait_all) failed or timed
// out (CommError).
bool mpi_communication_failed();

// Waits for `requests` (the caller's own nonblocking MPI operations) as the transport waits for
// its own: polled, never longer than `timeout` (0: no deadline); a timeout or an MPI error is a
// CommError naming `what`, and counts as a communication failure for mpi_shutdown().
void mpi_wait_all(std::span<MPI_Request> requests, std::chrono::milliseconds timeout,
                  const char* what);

// Ends MPI for this process, never blocking on a peer: MPI_Finalize when every collective
// succeeded; after a communication failure mpi_abort(abort_code) instead, since MPI_Finalize
// waits for every peer, and one that is dead or stopped (SIGSTOP) would keep it waiting forever.
// Does nothing if MPI is not initialised or already finalised.
void mpi_shutdown(int abort_code = 1);

// Ends this process and the whole MPI job (MPI_Abort on MPI_COMM_WORLD: the launcher ends the
// other ranks, stopped ones included) with exit status `code`, after flushing stdout and stderr.
[[noreturn]] void mpi_abort(int code);

}  // namespace ciera
