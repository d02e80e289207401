// Reliability tests 10 and 14 over Open MPI: the last rank exits, is killed (SIGKILL) or stops
// (SIGSTOP) in the middle of training; every other rank must fail with a CommError within the
// timeout and then end the job through ciera::mpi_shutdown() (which aborts: MPI_Finalize would
// wait for the stopped peer forever). Run by ctest as
//   mpirun -np 3 --mca orte_abort_on_non_zero_status 0 mpi_dead_peer exit|kill|stop
//   [reduce-scatter]
// (so that mpirun leaves the survivors to notice by themselves); passes when each survivor
// prints "survivor <rank> failed cleanly" and mpirun exits non-zero within the test's TIMEOUT,
// with nothing killing leftovers before that. With `reduce-scatter` the ranks run coded
// reduce-scatters of many rounds back to back instead of the engine's allgather, and the last
// rank's fault comes from a timer 2 ms into step 5's call, so that it strikes inside a call, with
// round exchanges in flight (two at a time: collectives.cpp).
//
// Reliability row 22, a peer stopped outside any collective, where MPI itself would wait forever:
//   mpi_dead_peer stop-in-start-up|stop-in-set-up|stop-in-split|stop-before-finalize
// The last rank stops (SIGSTOP) before MPI_Init_thread, before the transport's communicator is
// made (MPI_Comm_idup, polled: the survivors' CommError as above), before the split of a
// sub-group transport, or after the last step, before MPI_Finalize. Start-up, split and finalize
// cannot be polled: each survivor's watchdog must end it with one line naming the call, "...
// did not return within 3000 ms", and mpirun end the stopped rank (after the split's MPI_Abort;
// after start-up and finalize, run with its default, which ends the job when a rank exits
// non-zero). MPI's start-up is given 3 s only where a rank stops in it, a minute otherwise.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ciera/collectives.hpp"
#include "ciera/engine.hpp"
#include "ciera/mpi.hpp"

namespace {

// Every collective's deadline, and MPI's start-up's and finalize's.
constexpr std::chrono::milliseconds kTimeout{3000};

void fail_now(int rank, const std::string& fault) {
  std::fprintf(stderr, "rank %d: %s\n", rank, fault.c_str());
  std::fflush(stderr);
  if (fault == "stop") raise(SIGSTOP);
  if (fault == "kill") raise(SIGKILL);
  _exit(3);
}

// Steps of the engine's allgather; the last rank fails between steps.
void allgathers(ciera::Transport& transport, int rank, int world, const std::string& fault) {
  ciera::EngineConfig config;
  config.timeout = kTimeout;
  const auto layout = ciera::BucketLayout::fsdp_split("b", ciera::DType::kBF16, {100000}, world);
  ciera::CompressedAllgather engine(transport, config, {layout});
  std::vector<std::byte> in(layout.rank_bytes(rank), std::byte{1}), out(layout.total_bytes());
  for (int step = 0; step < 100; ++step) {
    if (rank == world - 1 && step == 5 && fault != "none") fail_now(rank, fault);
    in[0] = static_cast<std::byte>(step);
    engine.run(0, in, out);
  }
}

// Coded reduce-scatters of 16 rounds each; the last rank fails from a timer 2 ms into step 5's.
void reduce_scatters(const std::shared_ptr<ciera::Transport>& transport, int rank, int world,
                     const std::string& fault) {
  transport->set_timeout(kTimeout);
  ciera::LosslessCollectives collectives(
      transport, {.coding = ciera::CollectiveCoding::kExponent, .slice_values = 1 << 14});
  const size_t part = size_t{1} << 18;
  std::vector<uint16_t> in(part * static_cast<size_t>(world)), out(part);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<uint16_t>(0x3C00 + (i * 2654435761u) % 512);
  for (int step = 0; step < 100; ++step) {
    if (rank == world - 1 && step == 5) {
      std::thread([rank, fault] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        fail_now(rank, fault);
      }).detach();
    }
    collectives.reduce_scatter(ciera::DType::kBF16, ciera::ReduceOp::kSum,
                               std::as_bytes(std::span(in)),
                               std::as_writable_bytes(std::span(out)));
  }
}

// Whether this process is the world's last rank, before MPI can say (mpirun's environment).
bool last_rank_of_the_launch() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  return rank && size && std::atoi(rank) == std::atoi(size) - 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string fault = argc > 1 ? argv[1] : "exit";
  const bool reduce_scatter = argc > 2 && std::string(argv[2]) == "reduce-scatter";
  const bool stop_in_start_up = fault == "stop-in-start-up";
  if (stop_in_start_up && last_rank_of_the_launch()) raise(SIGSTOP);
  ciera::mpi_init(&argc, &argv, stop_in_start_up ? kTimeout : std::chrono::minutes(1));
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const auto begin = std::chrono::steady_clock::now();
  try {
    if ((fault == "stop-in-set-up" || fault == "stop-in-split") && rank == world - 1)
      raise(SIGSTOP);
    std::vector<int> everyone(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) everyone[static_cast<size_t>(r)] = r;
    std::shared_ptr<ciera::Transport> transport =
        fault == "stop-in-split" ? ciera::make_mpi_transport(MPI_COMM_WORLD, everyone, kTimeout)
                                 : ciera::make_mpi_transport(MPI_COMM_WORLD, kTimeout);
    if (fault == "stop-before-finalize") {
      allgathers(*transport, rank, world, "none");  // every step completes
      if (rank == world - 1) raise(SIGSTOP);
      ciera::mpi_shutdown(4, kTimeout);
      std::printf("rank %d: MPI_Finalize returned although a peer stopped before it\n", rank);
      return 1;
    }
    if (reduce_scatter) {
      reduce_scatters(transport, rank, world, fault);
    } else {
      allgathers(*transport, rank, world, fault);
    }
    std::printf("rank %d: no error although a peer died\n", rank);
    return 1;
  } catch (const ciera::CommError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::printf("survivor %d failed cleanly after %.1f s: %s\n", rank, s, e.what());
    std::fflush(stdout);
    // Test only: let the other survivor print its line before the first abort ends the job. Its
    // deadline can run up to one timeout behind this one's: a wait of its that completes just
    // before this rank gives up (its peer still progressing) is followed by a fresh one. Twice
    // that, for a loaded machine.
    std::this_thread::sleep_for(2 * kTimeout + std::chrono::seconds(1));
    ciera::mpi_shutdown(4);  // aborts the job: a communication failed
    std::printf("survivor %d: mpi_shutdown returned after a failure\n", rank);
    return 1;
  }
}
