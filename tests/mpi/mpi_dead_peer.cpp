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
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ciera/collectives.hpp"
#include "ciera/engine.hpp"
#include "ciera/mpi.hpp"

namespace {

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
  config.timeout = std::chrono::seconds(3);
  const auto layout = ciera::BucketLayout::fsdp_split("b", ciera::DType::kBF16, {100000}, world);
  ciera::CompressedAllgather engine(transport, config, {layout});
  std::vector<std::byte> in(layout.rank_bytes(rank), std::byte{1}), out(layout.total_bytes());
  for (int step = 0; step < 100; ++step) {
    if (rank == world - 1 && step == 5) fail_now(rank, fault);
    in[0] = static_cast<std::byte>(step);
    engine.run(0, in, out);
  }
}

// Coded reduce-scatters of 16 rounds each; the last rank fails from a timer 2 ms into step 5's.
void reduce_scatters(const std::shared_ptr<ciera::Transport>& transport, int rank, int world,
                     const std::string& fault) {
  transport->set_timeout(std::chrono::seconds(3));
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

}  // namespace

int main(int argc, char** argv) {
  const std::string fault = argc > 1 ? argv[1] : "exit";
  const bool reduce_scatter = argc > 2 && std::string(argv[2]) == "reduce-scatter";
  ciera::mpi_init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::shared_ptr<ciera::Transport> transport = ciera::make_mpi_transport(MPI_COMM_WORLD);
  const auto begin = std::chrono::steady_clock::now();
  try {
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
    // Test only: let the other survivor print its line before the first abort ends the job.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    ciera::mpi_shutdown(4);  // aborts the job: a communication failed
    std::printf("survivor %d: mpi_shutdown returned after a failure\n", rank);
    return 1;
  }
}
