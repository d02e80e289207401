// ciera_thread_tests: the suites the ThreadSanitizer stage runs (tests/CMakeLists.txt), with
// their filter as the default; a --gtest_filter on the command line replaces it.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  GTEST_FLAG_SET(filter, CIERA_THREAD_TEST_FILTER);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
