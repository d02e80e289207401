// The lossless reduce-scatter of gradients over Open MPI (docs/collectives.md): each rank
// averages BF16 gradients twice, exponent-coded and raw (CollectiveCoding::kRaw, the same
// reduction order uncompressed), for 5 steps, and the two results must agree bit for bit. Run it
// with `mpirun -np 2 ./mpi_reduce_scatter` (any number of ranks). Rank 0 prints the byte ratio of
// the last call; the exit status is 1 on every rank if any result differed or a call failed.
#include <mpi.h>

#include <ciera/collectives.hpp>
#include <ciera/error.hpp>
#include <ciera/mpi.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace {

uint16_t bf16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// One collective each: the coded one and its raw twin, on transports of their own.
ciera::LosslessCollectives collectives(ciera::CollectiveCoding coding) {
  ciera::CollectivesConfig config;
  config.coding = coding;
  return ciera::LosslessCollectives(ciera::make_mpi_transport(MPI_COMM_WORLD), config);
}

}  // namespace

int main(int argc, char** argv) {
  ciera::mpi_init(&argc, &argv);
  int status = 0;
  try {
    auto coded = collectives(ciera::CollectiveCoding::kExponent);
    auto twin = collectives(ciera::CollectiveCoding::kRaw);
    const int rank = coded.rank(), world = coded.size();
    constexpr uint64_t part_values = 1 << 18;  // each rank's share of the gradient
    std::mt19937 random(rank + 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> gradient(part_values * world), mine(part_values), reference(part_values);

    int differing = 0;
    ciera::CollectiveStats last;
    const int steps = 5;
    for (int step = 0; step < steps; ++step) {
      for (uint16_t& g : gradient) g = bf16_bits(1e-3f * normal(random));
      const auto in = std::as_bytes(std::span(gradient));
      last = coded.reduce_scatter(ciera::DType::kBF16, ciera::ReduceOp::kAvg, in,
                                  std::as_writable_bytes(std::span(mine)));
      twin.reduce_scatter(ciera::DType::kBF16, ciera::ReduceOp::kAvg, in,
                          std::as_writable_bytes(std::span(reference)));
      if (std::memcmp(mine.data(), reference.data(), part_values * sizeof(uint16_t)) != 0)
        ++differing;
    }
    MPI_Allreduce(MPI_IN_PLACE, &differing, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf(
          "%d ranks, %d reduce-scatters of %llu BF16 values: %s; the last one sent %llu of "
          "%llu bytes (%.2fx fewer)\n",
          world, steps, static_cast<unsigned long long>(gradient.size()),
          differing == 0 ? "every one identical to the raw twin" : "SOME DIFFERED",
          static_cast<unsigned long long>(last.wire_bytes),
          static_cast<unsigned long long>(last.raw_bytes),
          static_cast<double>(last.raw_bytes) / static_cast<double>(last.wire_bytes));
    }
    status = differing == 0 ? 0 : 1;
  } catch (const ciera::Error& e) {
    std::fprintf(stderr, "mpi_reduce_scatter: %s\n", e.what());
    status = 1;
  }
  ciera::mpi_shutdown();
  return status;
}
