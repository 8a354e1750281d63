# Included by the check_*_tool.cmake scripts: expect_exit(CODE ARGS...) runs
# ${TOOL} with ARGS, fails unless it exits with CODE, and leaves its stdout
# and stderr in last_output.
get_filename_component(tool_name ${TOOL} NAME)

function(expect_exit code)
  execute_process(COMMAND ${TOOL} ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL code)
    message(FATAL_ERROR "${tool_name} ${ARGN}: exit ${rc}, expected ${code}\n${out}${err}")
  endif()
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()
