// GoogleTest under mpirun: every rank runs every test (tests are collective); only rank 0
// prints progress, every rank prints its own failures, and all ranks exit with the worst status.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

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
