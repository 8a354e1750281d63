# CTest docs.doxygen: runs Doxygen over the public headers, the guides and
# the README (build/docs/Doxyfile) and fails on any warning it writes to
# its log: an undocumented public name, a broken \ref or link, a documented
# parameter that does not exist. Then every local link of the generated
# site must name a file of the site or, for the README's and guides' links
# into the source tree (examples/), one there.
# Skipped (SKIP_REGULAR_EXPRESSION on its message) when CMake found no
# doxygen.
#   cmake -DDOXYGEN=... -DDOXYFILE=... -DWARN_LOG=... -DHTML_DIR=...
#         -DSOURCE_DIR=... -P check_doxygen.cmake
cmake_minimum_required(VERSION 3.21)

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

file(GLOB pages ${HTML_DIR}/*.html)
set(broken "")
foreach(page IN LISTS pages)
  file(READ ${page} html)
  string(REGEX MATCHALL "href=\"[^\"]*\"" links "${html}")
  list(REMOVE_DUPLICATES links)
  foreach(link IN LISTS links)
    string(REGEX REPLACE "^href=\"([^\"#]*).*$" "\\1" target "${link}")
    if(target STREQUAL "" OR target MATCHES "^[a-z]+:")
      continue()  # same-page anchor, URL, mailto:, javascript:
    endif()
    get_filename_component(resolved "${HTML_DIR}/${target}" ABSOLUTE)
    # README.md sits in SOURCE_DIR, the guides in SOURCE_DIR/docs.
    get_filename_component(from_readme "${SOURCE_DIR}/${target}" ABSOLUTE)
    get_filename_component(from_guide "${SOURCE_DIR}/docs/${target}" ABSOLUTE)
    if(NOT EXISTS "${resolved}" AND NOT EXISTS "${from_readme}"
       AND NOT EXISTS "${from_guide}")
      get_filename_component(page_name ${page} NAME)
      string(APPEND broken "${page_name}: ${target}\n")
    endif()
  endforeach()
endforeach()
if(NOT broken STREQUAL "")
  message(FATAL_ERROR "Links of the site that lead nowhere:\n${broken}")
endif()
list(LENGTH pages count)
message("docs.doxygen: no warnings; the local links of ${count} pages resolve")
