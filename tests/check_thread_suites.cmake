# ctest thread_tests_hold_their_suites: ciera_thread_tests (its default filter) must list exactly
# the tests that ciera_unit_tests lists under the same filter, so that a new suite the filter
# selects, written into a source only ciera_unit_tests compiles, cannot miss the ThreadSanitizer
# stage unnoticed. Run with -DUNIT=<ciera_unit_tests> -DTHREAD=<ciera_thread_tests> -DFILTER=<f>.
execute_process(COMMAND ${UNIT} --gtest_list_tests --gtest_filter=${FILTER}
                OUTPUT_VARIABLE unit RESULT_VARIABLE unit_status)
execute_process(COMMAND ${THREAD} --gtest_list_tests
                OUTPUT_VARIABLE thread RESULT_VARIABLE thread_status)
if(NOT unit_status EQUAL 0 OR NOT thread_status EQUAL 0)
  message(FATAL_ERROR "listing the tests failed: ciera_unit_tests ${unit_status}, ciera_thread_tests ${thread_status}")
endif()
# gtest_main prints where main() runs from, and a parameterised test its parameter's bytes
# (padding included, which differs from run to run): the lists are the rest.
foreach(list unit thread)
  string(REGEX REPLACE "Running main\\(\\) from[^\n]*\n" "" ${list} "${${list}}")
  string(REGEX REPLACE "  # Get(Param|TypeParam)\\(\\) = [^\n]*" "" ${list} "${${list}}")
endforeach()
string(REGEX MATCHALL "\n  [^\n]+" unit_tests "\n${unit}")
list(LENGTH unit_tests count)
if(count EQUAL 0)
  message(FATAL_ERROR "the filter '${FILTER}' selects no test of ciera_unit_tests")
endif()
if(NOT unit STREQUAL thread)
  message(FATAL_ERROR "ciera_thread_tests does not hold the same tests as ciera_unit_tests under "
                      "'${FILTER}' (add the source that defines them to ciera_thread_test_objects "
                      "in tests/CMakeLists.txt):\n--- ciera_unit_tests\n${unit}\n--- ciera_thread_tests\n${thread}")
endif()
message(STATUS "ciera_thread_tests holds the ${count} tests the filter selects")
