// What the MPI benchmarks (`bench allgather`, `bench broadcast`, `bench alltoall`,
// `bench reduce-scatter`) share: launching their ranks (under mpirun, or under the link lab when
// links are shaped), and the MPI collectives their measurements use, each waiting no longer than
// --timeout (mpi_wait_all), so a dead or stopped peer is a CommError on every other rank, never
// a hang, and both sides of a comparison wait alike.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

namespace ciera::tools {

// The link lab puts the ranks on one /24 beside its hub (scripts/linklab.sh).
constexpr int kLinkLabMaxRanks = 253;
// Ranks are processes on this machine; more than this many a core is a typo (--ranks 4000 for
// 4), which would start thousands of them (`ciera train` has the same bound).
constexpr int kMaxRanksPerCore = 16;

struct Links {
  double link_gbit = 0;  // 0: unshaped
  double delay_ms = 0;
  bool link_lab = false;  // in the lab even without shaping (TCP over veth)
  // Ranks n*R .. n*R+R-1 share node n, and in the lab its one uplink (the link shaped, per node
  // as the simulator's B_inter). Asked for: 0 is the flat lab, every rank its own node. As a rank
  // is told: the lab's (flat: W nodes of 1), or under plain mpirun one host (1 node of W).
  int nodes = 0;
  int ranks_per_node = 0;
};

// From the command line (not `child`, not under MPI): re-executes this command as `ranks` ranks
// with --child appended, under mpirun or, when `links` asks for the lab, under
// scripts/linklab.sh (two-level when links.nodes > 0, ranks = nodes x ranks_per_node); does not
// return. As one of those ranks: returns the links, which inside the link lab are what the lab
// says, whatever this rank was told. More ranks than kMaxRanksPerCore a core is a ConfigError.
Links launch_or_join(int ranks, Links links, bool child, int argc, char** argv);
// The links as a report names them; in the link lab with the TCP congestion control the lab gave
// the ranks' connections (CIERA_LINKLAB_CC, CUBIC when unset).
std::string describe_links(const Links& links);

// Inside the link lab: the bytes all nodes together have sent over their uplinks so far (Ethernet
// frames whole, ACKs included), read from the hub's end of each uplink in
// /proc/$CIERA_LINKLAB_HUB_PID/net/dev; the difference of two readings is the inter-node traffic
// between them. nullopt outside the lab, or where the counters cannot be read (needs root).
std::optional<uint64_t> uplink_bytes_sent();

// One rank's life: MPI up (MPI_THREAD_MULTIPLE), `body()` (everything MPI-backed gone before it
// returns), MPI down; returns body's status. An error is printed by the rank that sees it, and
// the job is aborted: peers may be gone or stopped, and MPI_Finalize could wait for them forever.
// No MPI call waits longer than `timeout_s` for the peers (--timeout): MPI's start-up and
// finalize under ciera::mpi_init's and mpi_shutdown's watchdogs, the rest polled (wait_all).
// Every rank must have been given the same options (argc/argv, --child aside): checked first, a
// UsageError (status 2 on every rank) naming the first that differs.
int run_mpi_rank(double timeout_s, int argc, char** argv, const std::function<int()>& body);

// run_mpi_rank's `timeout_s`, for the transports a rank makes.
std::chrono::milliseconds mpi_timeout();
void wait_all(std::span<MPI_Request> requests, const char* what);
void barrier();
double max_over_ranks(double mine);
uint64_t sum_over_ranks(uint64_t mine);
double sum_over_ranks(double mine);

}  // namespace ciera::tools
