// Open MPI transport (library target ciera::mpi). Collectives run nonblocking and are polled
// against a deadline, so a dead or stalled peer becomes a CommError instead of a hang. MPI's own
// blocking calls that no poll can bound (MPI_Init_thread, MPI_Comm_split, MPI_Finalize) run under
// a watchdog with the same kind of deadline: past it, the process ends with one line naming the
// call (docs/reliability.md, row 22).
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ciera/transport.hpp"

namespace ciera {

// How long, unless the caller says otherwise, a collective of the MPI transport and each of MPI's
// start-up and finish calls may wait for the peers.
inline constexpr std::chrono::milliseconds kMpiDefaultTimeout{std::chrono::minutes(2)};

// Initialises MPI the way CIERA needs it and returns the thread level MPI provides (the caller
// checks it against MPI_THREAD_MULTIPLE, which the engine's threads need); if MPI is initialised
// already, only returns that level. Before MPI_Init_thread it turns on Open MPI's TCP progress
// thread (OMPI_MCA_btl_tcp_progress_thread=1) unless the caller chose that parameter: without it
// the last fragment of a large message can wait in a rank's send queue until that rank next
// calls MPI, and a peer still polling for it stalls (docs/reliability.md, row 21).
// MPI_Init_thread waits for every rank of the job and has no deadline of its own: if it has not
// returned within `timeout` (0: no deadline), a watchdog prints one line naming it and ends this
// process with status 1 (_exit; the launcher, seeing a rank end early, ends the job). So, as for
// any collective, the ranks must reach it within `timeout` of each other. (Open MPI 4.1 reports an
// error found while testing a nonblocking collective, such as a message truncated by a peer that
// sent more than it was told, through MPI_COMM_WORLD's handler: by default the job aborts, loudly,
// rather than the transport raising a CommError. The engine's records catch mismatched calls
// before any payload moves, so only a transport used outside them meets this.)
int mpi_init(int* argc = nullptr, char*** argv = nullptr,
             std::chrono::milliseconds timeout = kMpiDefaultTimeout);

// Duplicates `comm`, so CIERA's collectives never interleave with the caller's, and sets
// MPI_ERRORS_RETURN on the duplicate. The duplicate is a collective over `comm`, polled like the
// transport's own: a peer that does not join within `timeout` (also the transport's collective
// timeout, until set_timeout) is a CommError. MPI must be initialised and not finalised (else a
// CommError); an engine needs MPI_THREAD_MULTIPLE, since it calls MPI from its own thread while
// its caller may call it too (else the engine's constructor throws a ConfigError naming the level).
// MPI_COMM_NULL or a negative timeout is std::invalid_argument (zero: no timeout).
std::unique_ptr<Transport> make_mpi_transport(
    MPI_Comm comm, std::chrono::milliseconds timeout = kMpiDefaultTimeout);

// The transport on this rank's group `ranks` (ranks of `comm`, this one among them, in the order
// that becomes the group's), where the groups of all ranks partition `comm`: collective over
// `comm`, each rank naming its own group. The groups are gathered first (polled, like the
// transport's collectives): a group that leaves out its own rank, names a rank twice or one not
// in `comm`, or that one of its members names otherwise (other ranks, or another order) is the
// same ConfigError on every rank, before any split. The split (MPI_Comm_split) cannot be polled: it
// runs under a watchdog that, past `timeout`, prints one line naming it and ends the job with
// mpi_abort(1) (with MPI_THREAD_MULTIPLE; at a lower thread level, where MPI_Abort from the
// watchdog's thread is not allowed, this process only, with _exit(1)). MPI_COMM_NULL or a
// negative timeout is std::invalid_argument.
std::unique_ptr<Transport> make_mpi_transport(
    MPI_Comm comm, std::span<const int> ranks,
    std::chrono::milliseconds timeout = kMpiDefaultTimeout);

// Whether a collective of any MPI transport of this process (or mpi_wait_all) failed or timed
// out (CommError).
bool mpi_communication_failed();

// Waits for `requests` (the caller's own nonblocking MPI operations) as the transport waits for
// its own: polled, never longer than `timeout` (0: no deadline; negative: std::invalid_argument,
// before any wait); a timeout or an MPI error is a
// CommError naming `what`, and counts as a communication failure for mpi_shutdown().
void mpi_wait_all(std::span<MPI_Request> requests, std::chrono::milliseconds timeout,
                  const char* what);

// Every rank's `mine` (bytes of any length; the lengths may differ across ranks), gathered onto
// every rank of `comm` and returned in rank order: a collective over `comm` (the lengths first,
// then the bytes), each part waited for as mpi_wait_all waits, so a timeout or an MPI error is a
// CommError naming `what` (e.g. "the ranks' options"). For the checks that every rank agrees on
// something of variable size before anything depends on it.
std::vector<std::string> mpi_allgather_bytes(MPI_Comm comm, std::string_view mine,
                                             std::chrono::milliseconds timeout, const char* what);

// Ends MPI for this process, never blocking on a peer: MPI_Finalize when every collective
// succeeded; after a communication failure mpi_abort(abort_code) instead, since MPI_Finalize
// waits for every peer, and one that is dead or stopped (SIGSTOP) would keep it waiting forever.
// A peer can also stop after the last collective, before its own MPI_Finalize: so MPI_Finalize
// runs under a watchdog that, past `timeout` (0: no deadline), prints one line naming it and ends
// this process with `abort_code` (_exit: MPI_Abort is not allowed while MPI is finishing).
// Does nothing if MPI is not initialised or already finalised.
void mpi_shutdown(int abort_code = 1, std::chrono::milliseconds timeout = kMpiDefaultTimeout);

// Ends this process and the whole MPI job (MPI_Abort on MPI_COMM_WORLD: the launcher ends the
// other ranks, stopped ones included) with exit status `code`, after flushing stdout and stderr.
[[noreturn]] void mpi_abort(int code);

}  // namespace ciera
