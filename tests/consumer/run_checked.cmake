# run(COMMAND...): runs a command in a CTest script (cmake -P) and stops
# the test with the command and its exit status when it fails. Included by
# the consumer scripts (run_consumer_test.cmake, run_pkg_config_test.cmake)
# and check_sources_alone.cmake.
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()
