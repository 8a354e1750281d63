# Lists the test suites of a GoogleTest executable and writes one CTest test
# per suite (`<executable> --gtest_filter=Suite.*`) into CTEST_FILE, which
# the test directory includes (tests/CMakeLists.txt: mha_add_gtest_suites).
# Run after each build of the executable, as gtest_discover_tests runs its
# listing, but one process per suite instead of one per test: every test
# process loads LibTorch first (0.65 s here), which for 460 tests was about
# 270 s of CTest's 1120 s of test time on a 2-core machine.
# Variables: TEST_EXECUTABLE, CTEST_FILE, TEST_TIMEOUT (seconds, per suite).
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_VARIABLE err
                TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests: exit ${rc}\n"
                      "${listing}${err}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(content "# Written by tests/gtest_suites.cmake: one test per suite.\n")
set(count 0)
foreach(line IN LISTS lines)
  # A suite's line starts in column 0 and ends with "." (a parameterized
  # one has a comment after it); its tests' lines are indented.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content
      "add_test([=[${suite}]=] [==[${TEST_EXECUTABLE}]==] "
      "[=[--gtest_filter=${suite}.*]=])\n"
      "set_tests_properties([=[${suite}]=] PROPERTIES TIMEOUT ${TEST_TIMEOUT}"
      " LABELS gtest)\n")
    math(EXPR count "${count} + 1")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite:\n${listing}")
endif()
file(WRITE "${CTEST_FILE}" "${content}")
