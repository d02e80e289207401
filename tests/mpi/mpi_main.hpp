// GoogleTest under mpirun: every rank runs every test (tests are collective); only rank 0
// prints progress, every rank prints its own failures, and all ranks exit with the worst status.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "ciera/mpi.hpp"

inline int run_all_tests_under_mpi(int argc, char** argv) {
  ciera::mpi_init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int status = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

// Whether every rank of MPI_COMM_WORLD holds the same text (an error that must read alike on
// every rank): compared by hash, the lowest against the highest. Collective.
inline bool same_on_every_rank(const std::string& text) {
  const uint64_t mine = std::hash<std::string>{}(text);
  uint64_t low = 0, high = 0;
  MPI_Allreduce(&mine, &low, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine, &high, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return low == high;
}
