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

}  // namespace ciera
