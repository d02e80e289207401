// What the MPI benchmarks (`bench allgather`, `bench broadcast`, `bench alltoall`,
// `bench reduce-scatter`) share: launching their ranks (under mpirun, or under the link lab when
// links are shaped), and the MPI collectives their measurements use, each waiting no longer than
// --timeout (mpi_wait_all), so a dead or stopped peer is a CommError on every other rank, never
// a hang, and both sides of a comparison wait alike.
#pragma once

#include <mpi.h>

#include <functional>
#include <span>
#include <string>

namespace ciera::tools {

// The link lab puts the ranks on one /24 beside its hub (scripts/linklab.sh).
constexpr int kLinkLabMaxRanks = 253;

struct Links {
  double link_gbit = 0;  // 0: unshaped
  double delay_ms = 0;
  bool link_lab = false;  // in the lab even without shaping (TCP over veth)
};

// From the command line (not `child`, not under MPI): re-executes this command as `ranks` ranks
// with --child appended, under mpirun or, when `links` asks for the lab, under
// scripts/linklab.sh; does not return. As one of those ranks: returns the links, which inside
// the link lab are what the lab says, whatever this rank was told.
Links launch_or_join(int ranks, Links links, bool child, int argc, char** argv);
std::string describe_links(const Links& links);

// One rank's life: MPI up (MPI_THREAD_MULTIPLE), `body()` (everything MPI-backed gone before it
// returns), MPI down; returns body's status. An error is printed by the rank that sees it, and
// the job is aborted: peers may be gone or stopped, and MPI_Finalize could wait for them forever.
int run_mpi_rank(const std::function<int()>& body);

void set_mpi_timeout(double seconds);
void wait_all(std::span<MPI_Request> requests, const char* what);
void barrier();
double max_over_ranks(double mine);
uint64_t sum_over_ranks(uint64_t mine);

}  // namespace ciera::tools
