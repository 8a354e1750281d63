# CTest docs.doxygen: runs Doxygen over the public headers, the guides and
# the README (build/docs/Doxyfile) and fails on any warning it writes to
# its log: an undocumented public name, a broken \ref or link, a documented
# parameter that does not exist. Skipped (SKIP_REGULAR_EXPRESSION on its
# message) when CMake found no doxygen.
#   cmake -DDOXYGEN=... -DDOXYFILE=... -DWARN_LOG=... -P check_doxygen.cmake
if(NOT DOXYGEN)
  message("docs.doxygen: doxygen was not found when CMake ran: skipped")
  return()
endif()
file(REMOVE ${WARN_LOG})
execute_process(COMMAND ${DOXYGEN} ${DOXYFILE} RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "doxygen failed (exit ${rc}):\n${out}\n${err}")
endif()
if(NOT EXISTS ${WARN_LOG})
  message(FATAL_ERROR "doxygen wrote no warning log ${WARN_LOG}")
endif()
file(READ ${WARN_LOG} warnings)
string(STRIP "${warnings}" warnings)
if(NOT warnings STREQUAL "")
  message(FATAL_ERROR "Doxygen warnings (${WARN_LOG}):\n${warnings}")
endif()
message("docs.doxygen: no warnings")
